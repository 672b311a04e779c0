"""The SGLang launch for a workbench ``SpecConfig``: flags, the adaptive config file, notes.

Flag table (docs/REFERENCE.md §6) — what :func:`launch_plan` emits for SGLang 0.5.23:

==========================================  ================================================
workbench                                   ``python -m sglang.launch_server``
==========================================  ================================================
``target``                                  ``--model-path T``
``draft`` (spec on)                         ``--speculative-algorithm EAGLE3``
                                            ``--speculative-draft-model-path D``
``SpecConfig.num_steps`` (S)                ``--speculative-num-steps S``
``SpecConfig.topk`` (K)                     ``--speculative-eagle-topk K``
``SpecConfig.num_draft_tokens`` (N)         ``--speculative-num-draft-tokens N``
``BatchThreshold(n)`` / ``StepTable``       ``--speculative-adaptive --speculative-adaptive-config
                                            FILE`` (tiers, :mod:`~workbench.remote.adaptive`)
``max_running_requests=``                   ``--max-running-requests M`` (set automatically when
                                            a tier lies above EAGLE-3's default of 48)
``export_metrics_dir=``                     ``--export-metrics-to-file
                                            --export-metrics-to-file-dir DIR``
``tp`` / ``host`` / ``port``                ``--tp 8 --host H --port P``
``**extra`` (``mem_fraction_static=0.8``)   ``--mem-fraction-static 0.8`` (True → bare flag;
                                            False/None → omitted; a list → several values)
``SpecConfig.simulate_accept_length`` a     environment ``SGLANG_SIMULATE_ACC_LEN=a``
==========================================  ================================================

Policies: ``Always()`` is static speculation. ``BatchThreshold(n)`` (no drafting when the
decode batch exceeds n) is the adaptive config ``{"1": [S], "n+1": [0]}``: a ``[0]`` tier decodes
plainly, upstream, no patch. ``StepTable`` maps tier by tier. Adaptive tiers run chains only:
the plan refuses ``topk != 1`` (SGLang would turn adaptive off with only a warning and speculate
at every batch size). ``Never()`` and ``BatchThreshold(0)`` launch without speculation. Goodput
controllers and random flips decide at run time and have no upstream equivalent: noted, launched
as ``Always()``. ``sglang_version`` older than 0.5.23 (the seeds' box ran 0.5.9) has no adaptive
tiers: the plan runs static speculation and its notes say to upgrade.

``expert_distribution="per_pass"`` (and ``expert_distribution_dir=``) adds SGLang's expert
distribution recorder (``--expert-distribution-recorder-mode``, the dump directory's environment
variable): the box's expert coverage, read by :mod:`workbench.remote.experts`.

``cuda_graph_max_bs=`` / ``cuda_graph_bs=`` become ``--cuda-graph-max-bs-decode`` /
``--cuda-graph-bs-decode``: 0.5.23 rejects the short names as ambiguous and exits.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config import SpecConfig
from workbench.errors import ConfigError
from workbench.policy.policies import Always, BatchThreshold, Never, StepTable
from workbench.remote.adaptive import (
    EAGLE3_DEFAULT_MAX_RUNNING,
    VERIFIED_VERSION,
    Tiers,
    auto_max_running,
    has_adaptive_tiers,
    nearest_exact_thresholds,
    parse_version,
    routing_rows,
    threshold_n,
    tiers_for_policy,
)

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_SPEC = SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
SIMULATE_ACC_LEN_ENV = "SGLANG_SIMULATE_ACC_LEN"
ADAPTIVE_CONFIG = "sglang-adaptive.json"
RENAMED = {"cuda_graph_max_bs": "cuda_graph_max_bs_decode", "cuda_graph_bs": "cuda_graph_bs_decode"}


@dataclass(frozen=True)
class LaunchPlan:
    """A launch command, its environment, the files it reads, and what it means.

    ``files`` maps a path to the content the launch expects there (the adaptive config);
    :meth:`write_files` writes them, :meth:`script` is a shell snippet doing both.
    ``capture_bs`` is the list SGLang's adaptive router pads batch sizes to (the explicit
    ``--cuda-graph-bs-decode``; None routes raw batch sizes). ``differ`` lists the batch sizes
    where SGLang decides otherwise than the policy; ``proposed_thresholds`` the nearest
    thresholds it follows exactly.
    """

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    sglang_version: str = VERIFIED_VERSION
    spec: SpecConfig | None = None
    tiers: Tiers | None = None
    num_steps: int = 0  # --speculative-num-steps launched (0: no speculation)
    capture_bs: tuple[int, ...] | None = None
    max_running_requests: int | None = None  # what the server will run with (None: unknown)
    export_dir: str | None = None
    differ: tuple[int, ...] = ()
    proposed_thresholds: tuple[int, ...] = ()

    def shell(self) -> str:
        """One shell line: ``ENV=... python -m sglang.launch_server ...``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.command)

    def script(self) -> str:
        """A shell snippet that writes :attr:`files` (heredocs) and then launches."""
        parts = [f"cat > {shlex.quote(p)} <<'EOF'\n{text.rstrip()}\nEOF"
                 for p, text in self.files.items()]
        return "\n".join([*parts, self.shell()])

    @property
    def adaptive_config(self) -> dict[str, Any] | None:
        return None if self.tiers is None else self.tiers.config()

    @property
    def adaptive_config_path(self) -> str | None:
        if "--speculative-adaptive-config" not in self.command:
            return None
        return self.command[self.command.index("--speculative-adaptive-config") + 1]

    def write_files(self, root: str | Path | None = None) -> list[Path]:
        """Write :attr:`files`; relative paths resolve against ``root`` (default: cwd)."""
        out = []
        for p, text in self.files.items():
            path = Path(p) if root is None or Path(p).is_absolute() else Path(root) / p
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            out.append(path)
        return out

    def routing_rows(self, max_batch: int | None = None) -> list[dict[str, Any]]:
        """Per decode batch 1..max_batch (default: the server's max running requests, else
        64): SGLang's steps, tier and padded size beside the workbench policy's decision."""
        top = max_batch or self.max_running_requests or 64
        if self.spec is None:
            return routing_rows(None, 0, Never(), 0, top, None)
        return routing_rows(self.tiers, self.num_steps, self.spec.policy, self.spec.num_steps,
                            top, self.capture_bs)

    def routing_table(self, max_batch: int | None = None) -> pd.DataFrame:
        """:meth:`routing_rows` as a DataFrame (one row per batch size)."""
        import pandas as pd

        return pd.DataFrame(self.routing_rows(max_batch))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _extra_flags(extra: dict[str, Any], taken: set[str]) -> list[str]:
    out: list[str] = []
    for key, value in extra.items():
        flag = _flag(key)
        if flag in taken:
            raise ConfigError(f"{key}: {flag} is set from launch_plan's own arguments")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _capture_list(extra: dict[str, Any]) -> tuple[int, ...] | None:
    """The list ``EAGLEWorkerV2`` gives the adaptive router: ``--cuda-graph-bs-decode`` as
    given, None without it or with the decode CUDA graph disabled."""
    if extra.get("disable_decode_cuda_graph") or \
            extra.get("cuda_graph_backend_decode") == "disabled":
        return None
    bs = extra.get("cuda_graph_bs_decode")
    if bs is None or bs is False:
        return None
    sizes = [bs] if isinstance(bs, int) else list(bs)
    if not sizes or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes):
        raise ConfigError(f"cuda_graph_bs_decode: expected positive integers, got {bs!r}")
    return tuple(sorted(set(sizes)))


def launch_plan(target: str, draft: str | None = None, tp: int = 8,
                spec: SpecConfig | None = None, host: str = "0.0.0.0", port: int = 30000, *,
                python: str = "python", sglang_version: str = VERIFIED_VERSION,
                adaptive_config: str = ADAPTIVE_CONFIG, max_running_requests: int | None = None,
                export_metrics_dir: str | None = None, expert_distribution: str | None = None,
                expert_distribution_dir: str | None = None, **extra: Any) -> LaunchPlan:
    """The SGLang launch for ``target`` (+ EAGLE-3 ``draft``) on ``tp`` GPUs (module doc).

    ``draft=None`` launches the baseline (``spec`` must then be None). With a draft, ``spec=None``
    means :data:`DEFAULT_SPEC` (S=5, K=4, N=16). ``adaptive_config`` is where the launch reads
    the tiers file (relative to the launch's working directory); its content is in
    ``plan.files``.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp: must be a positive integer, got {tp!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"port: must be in 1..65535, got {port!r}")
    if draft is None and spec is not None:
        raise ConfigError("spec: given without a draft; pass draft= or spec=None for a baseline")
    if max_running_requests is not None and (not isinstance(max_running_requests, int)
                                             or max_running_requests < 1):
        raise ConfigError(f"max_running_requests: must be a positive integer, got "
                          f"{max_running_requests!r}")
    parse_version(sglang_version)  # validates
    adaptive_ok = has_adaptive_tiers(sglang_version)
    notes: list[str] = []
    if parse_version(sglang_version) != parse_version(VERIFIED_VERSION):
        notes.append(f"sglang_version {sglang_version}: flags were verified against SGLang "
                     f"{VERIFIED_VERSION}; check them with `python -m sglang.launch_server "
                     "--help` on the box")
    if adaptive_ok:
        for old, new in RENAMED.items():
            if old in extra:
                if new in extra:
                    raise ConfigError(f"{old}: given together with {new}; pass only {new}")
                extra = {(new if k == old else k): v for k, v in extra.items()}
                notes.append(f"{old}=: emitted as {_flag(new)}; SGLang {sglang_version} rejects "
                             f"{_flag(old)} as ambiguous and exits")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target)]
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    tiers: Tiers | None = None
    num_steps = 0
    running = max_running_requests
    policy: Any = None
    if draft is not None:
        spec = spec or DEFAULT_SPEC
        policy = spec.policy
        if getattr(policy, "needs_engine", False):
            raise ConfigError(f"spec.policy: {policy!r} is resolved by a local engine on its "
                              "machine; give SGLang a resolved policy (e.g. BatchThreshold(n))")
        runtime_only = not isinstance(policy, (Always, Never, BatchThreshold, StepTable))
        if runtime_only:
            notes.append(f"policy {policy!r}: decides at run time (workbench-only); SGLang's "
                         "adaptive tiers are a fixed table by batch size. Launched as Always()")
        elif adaptive_ok:
            if (isinstance(policy, BatchThreshold) and threshold_n(policy) > 0
                    and spec.topk != 1):
                raise ConfigError(
                    f"spec.topk: {spec.topk}, but SGLang's adaptive tiers (how BatchThreshold"
                    f"({policy.n}) runs upstream) need --speculative-eagle-topk 1; with topk "
                    f"{spec.topk} SGLang turns adaptive off with only a warning and speculates "
                    f"at every batch size. Use SpecConfig(num_steps={spec.num_steps}, topk=1)")
            tiers = tiers_for_policy(policy, spec.num_steps)
        elif isinstance(policy, (BatchThreshold, StepTable)):
            notes.append(f"policy {policy!r}: SGLang {sglang_version} is older than "
                         f"{VERIFIED_VERSION}, whose adaptive tiers run it upstream (adaptive "
                         "steps landed in PR #21599, per-batch-size tiers in PR #24055; 0.5.9 has "
                         f"neither): upgrade to >= {VERIFIED_VERSION}. This launch speculates at "
                         "every batch size")
        off = isinstance(policy, Never) or (
            adaptive_ok and isinstance(policy, (BatchThreshold, StepTable)) and tiers is None)
        if off:
            notes.append(f"policy {policy!r}: never speculates: launched without speculation "
                         "(the plain baseline; upstream cannot load a draft and leave it idle)")
        else:
            num_steps, topk, n_tokens = spec.num_steps, spec.topk, spec.num_draft_tokens
            if tiers is not None:
                nonzero = [s for s in tiers.candidate_steps if s > 0]
                if num_steps not in nonzero:
                    notes.append(f"--speculative-num-steps {max(nonzero)} (the StepTable's "
                                 f"largest chain); SpecConfig.num_steps {num_steps} is in no tier")
                    num_steps = max(nonzero)
                topk, n_tokens = 1, num_steps + 1  # SGLang forces N = steps + 1 under adaptive
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                    str(draft), "--speculative-num-steps", str(num_steps),
                    "--speculative-eagle-topk", str(topk),
                    "--speculative-num-draft-tokens", str(n_tokens)]
            if tiers is not None:
                cmd += ["--speculative-adaptive", "--speculative-adaptive-config",
                        adaptive_config]
                files[adaptive_config] = tiers.config_text()
                if running is None:
                    running = EAGLE3_DEFAULT_MAX_RUNNING
                    top = tiers.tiers[-1][0]
                    if top > running:
                        running = auto_max_running(tiers)
                        max_running_requests = running
                        notes.append(f"--max-running-requests {running}: EAGLE-3 caps running "
                                     f"requests at {EAGLE3_DEFAULT_MAX_RUNNING} by default, so "
                                     f"the tier from batch {top} would never run; pass "
                                     "max_running_requests= to choose another cap")
                elif tiers.tiers[-1][0] > running:
                    notes.append(f"max_running_requests {running}: the tier from batch "
                                 f"{tiers.tiers[-1][0]} is never reached")
            elif running is None and adaptive_ok:
                running = EAGLE3_DEFAULT_MAX_RUNNING
            if spec.draft_state != "warm":
                notes.append(f"draft_state={spec.draft_state!r}: workbench-only; SGLang keeps "
                             "the draft KV current (warm), in [0] tiers too. "
                             "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 (experimental, not set "
                             "here) skips that extend with no catch-up window")
            if spec.simulate_accept_length is not None:
                env[SIMULATE_ACC_LEN_ENV] = repr(float(spec.simulate_accept_length))
                notes.append(f"simulate_accept_length: {SIMULATE_ACC_LEN_ENV} set; outputs are "
                             "NOT the target's (not lossless)")
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if export_metrics_dir is not None:
        cmd += ["--export-metrics-to-file", "--export-metrics-to-file-dir",
                str(export_metrics_dir)]
        if not extra.get("enable_metrics"):
            notes.append("export_metrics_dir: the records have no first_token_latency (TTFT) "
                         "without --enable-metrics; pass enable_metrics=True for it")
    if expert_distribution is not None:
        from workbench.remote.experts import recorder_launch

        flags, rec_env, rec_notes = recorder_launch(expert_distribution, expert_distribution_dir)
        cmd += flags
        env.update(rec_env)
        notes += rec_notes
    elif expert_distribution_dir is not None:
        raise ConfigError("expert_distribution_dir: given without expert_distribution (a "
                          "recorder mode, e.g. 'per_pass')")
    cmd += ["--tp", str(tp), "--host", host, "--port", str(port)]
    taken = {c for c in cmd if c.startswith("--")} | {"--speculative-adaptive",
                                                     "--speculative-adaptive-config"}
    cmd += _extra_flags(extra, taken)
    plan = LaunchPlan(cmd, env, notes, files, sglang_version, spec if draft else None, tiers,
                      num_steps, _capture_list(extra) if tiers is not None else None, running,
                      None if export_metrics_dir is None else str(export_metrics_dir))
    return _with_differences(plan, policy)


def _with_differences(plan: LaunchPlan, policy: Any) -> LaunchPlan:
    """Fill ``differ`` / ``proposed_thresholds`` and say so in the notes."""
    if plan.spec is None or not isinstance(policy, (BatchThreshold, StepTable)):
        return plan
    rows = plan.routing_rows()
    differ = tuple(r["batch_size"] for r in rows if r["policy_steps"] is not None
                   and not r["agree"])
    if not differ:
        return plan
    notes = list(plan.notes)
    proposed: tuple[int, ...] = ()
    if plan.tiers is not None:
        notes.append(f"batch sizes {_ranges(differ)}: SGLang pads them to the adaptive router's "
                     f"capture list {list(plan.capture_bs or [])} and runs another tier than "
                     f"{policy!r} asks for")
        if isinstance(policy, BatchThreshold):
            proposed = tuple(nearest_exact_thresholds(threshold_n(policy), plan.capture_bs,
                                                      len(rows)))
            exact = " or ".join(f"BatchThreshold({m})" for m in proposed)
            notes.append(f"exact with this capture list: {exact} — or drop "
                         "cuda_graph_bs_decode= (without a list raw batch sizes are routed)")
    return replace(plan, notes=notes, differ=differ, proposed_thresholds=proposed)


def _ranges(values: tuple[int, ...]) -> str:
    out, start, prev = [], values[0], values[0]
    for v in (*values[1:], None):
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}–{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


def launch_command(target: str, draft: str | None = None, tp: int = 8,
                   spec: SpecConfig | None = None, host: str = "0.0.0.0", port: int = 30000,
                   **extra: Any) -> list[str]:
    """``launch_plan(...).command``; read :func:`launch_plan`'s notes and ``files`` too (an
    adaptive launch reads its tiers file)."""
    return launch_plan(target, draft, tp, spec, host, port, **extra).command


def threshold_from(source: Any) -> tuple[int, int | None]:
    """(suggested_n, crossover) from what ``bench threshold`` produced: a ``Threshold``
    (``find_threshold(df)``), its saved results JSON (``{"threshold": {"suggested_n", …}}``),
    the ``--out`` folder holding it, or a plain int."""
    if isinstance(source, int) and not isinstance(source, bool):
        return source, None
    if hasattr(source, "suggested_n"):
        return int(source.suggested_n), getattr(source, "crossover", None)
    path = Path(source)
    if path.is_dir():  # threshold.json, else the newest results JSON that has a threshold
        cands = [path / "threshold.json"] if (path / "threshold.json").is_file() else sorted(
            (p for p in path.glob("*.json") if '"threshold"' in p.read_text()),
            key=lambda p: p.stat().st_mtime)
        path = cands[-1] if cands else path / "threshold.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"threshold: {path} not found (run `python -m workbench bench "
                          "threshold --out DIR` first)") from e
    th = doc.get("threshold") if isinstance(doc, dict) else None
    if not isinstance(th, dict) or not isinstance(th.get("suggested_n"), int):
        raise ConfigError(f"threshold: {path} has no threshold.suggested_n (a bench threshold "
                          "result with both the baseline and eagle3 arms)")
    return th["suggested_n"], th.get("crossover")


def plan_from_threshold(source: Any, target: str, draft: str, spec: SpecConfig | None = None,
                        **kwargs: Any) -> LaunchPlan:
    """The box launch for the threshold ``bench threshold`` chose (:func:`threshold_from`):
    ``spec`` (default: S=5 chain) with ``BatchThreshold(suggested_n)``; other arguments go to
    :func:`launch_plan`. A note records where the threshold came from."""
    n, crossover = threshold_from(source)
    base = spec or SpecConfig(num_steps=5, topk=1)
    plan = launch_plan(target, draft, spec=replace(base, policy=BatchThreshold(n)), **kwargs)
    why = ("eagle3 won at every measured level: the threshold is the highest level measured"
           if crossover is None and not isinstance(source, int) else
           f"baseline caught up at concurrency {crossover}" if crossover is not None else
           "threshold given directly")
    return replace(plan, notes=[f"BatchThreshold({n}) from bench threshold ({why})",
                                *plan.notes])
