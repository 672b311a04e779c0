"""A serving box as data: GPUs, interconnect, parallel layout, the model's geometry from its HF
config, the draft head, the server's rules by version, the workload and the two constants the
step model fits (:mod:`workbench.lab.boxmodel`).

A box is a dict of sections (``gpu``, ``link``, ``layout``, ``model``, ``draft``, ``server``,
``workload``, ``fit``) plus ``provenance`` (where every given value comes from). Presets live in
``data/boxes/*.json``; :func:`load_box` reads one by name or path, :func:`set_field`
overrides any field by a dotted key (``link.paths.nccl.latency_us=9``), and :func:`geometry`
turns the HF-style ``model`` section into the bytes, KV bytes and FLOPs the step model uses.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workbench
from workbench.errors import ConfigError
from workbench.lab.collectives import paths

REPO_ROOT = Path(workbench.__file__).resolve().parents[1]
BOX_DIR = REPO_ROOT / "data" / "boxes"
SECTIONS = ("gpu", "link", "layout", "model", "draft", "server", "workload", "fit")

# The server's rules by SGLang version, read from the PyPI wheels' srt/server_args.py (0.5.9:
# ServerArgs._handle_speculative_decoding, _handle_gpu_memory_settings,
# _generate_cuda_graph_batch_sizes, the flashinfer all-reduce fusion auto-enable; 0.5.23: the
# same rules in srt/arg_groups/speculative_hook.py, memory_hook.py, overrides.py).
SGLANG_RULES: dict[str, dict[str, Any]] = {
    "0.5.9": {
        "spec_max_running_requests": 48,  # EAGLE/EAGLE3 without --max-running-requests
        "spec_overlap": False,  # spec v1: overlap scheduler off unless SGLANG_ENABLE_SPEC_V2
        "plain_overlap": True,
        "fusion_auto_archs": ["sm90", "sm100"],  # DeepseekV3/KimiK25 on one node
        "adaptive_tiers": False,
        "cuda_graph_max_bs_tp4_over_60gb": 512,  # 60..160 GB GPUs at TP >= 4
        "source": "sglang-0.5.9 wheel: srt/server_args.py",
    },
    "0.5.23": {
        "spec_max_running_requests": 48,  # _handle_eagle_family
        "spec_overlap": True,  # spec v2 is the eagle path; synchronous only when disabled
        "plain_overlap": True,
        "fusion_auto_archs": ["sm90", "sm100"],
        "adaptive_tiers": True,
        "cuda_graph_max_bs_tp4_over_60gb": 512,
        "source": "sglang-0.5.23 wheel: srt/arg_groups/{speculative,memory}_hook.py, "
                  "overrides.py",
    },
}


def capture_sizes(max_bs: int, spec: bool) -> list[int]:
    """SGLang's default CUDA-graph batch sizes up to ``max_bs`` (0.5.9's
    ``_generate_cuda_graph_batch_sizes``): a decode batch pads up to the next one."""
    if spec:
        bs = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
              + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    else:
        bs = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
              + list(range(512, max_bs + 1, 32)))
    return [b for b in bs if b <= max_bs]


def rules(box: dict[str, Any]) -> dict[str, Any]:
    """The server section resolved: explicit fields win, the rest from the version's rules."""
    srv = box["server"]
    ver = str(srv.get("version", "0.5.9"))
    if ver not in SGLANG_RULES:
        raise ConfigError(f"server.version: {ver!r} not one of {sorted(SGLANG_RULES)}")
    r = SGLANG_RULES[ver]
    out = {"version": ver, "source": r["source"], "adaptive_tiers": r["adaptive_tiers"]}
    out["spec_max_running_requests"] = int(srv.get("spec_max_running_requests")
                                           or r["spec_max_running_requests"])
    out["max_running_requests"] = int(srv.get("max_running_requests") or 1 << 20)
    for key, rule in (("spec_overlap", "spec_overlap"), ("plain_overlap", "plain_overlap")):
        v = srv.get(key)
        out[key] = bool(r[rule] if v is None else v)
    out["cuda_graph_max_bs"] = int(srv.get("cuda_graph_max_bs")
                                   or r["cuda_graph_max_bs_tp4_over_60gb"])
    fused = srv.get("allreduce_fusion")
    out["allreduce_fusion"] = (box["gpu"].get("arch") in r["fusion_auto_archs"]
                               if fused is None else bool(fused))
    custom = srv.get("custom_allreduce")  # SGLang: refused on more than two PCIe-only GPUs
    out["custom_allreduce"] = (bool(box["link"].get("nvlink")) or int(box["layout"]["tp"]) <= 2
                               if custom is None else bool(custom))
    out["host_ms"] = float(srv.get("host_ms", 0.0))
    out["host_ms_per_req"] = float(srv.get("host_ms_per_req", 0.0))
    return out


@dataclass(frozen=True)
class Geometry:
    """What a forward reads and computes, per TP rank: bytes every rank holds whole
    (``replicated``), dense bytes it holds 1/tp of (``dense``), one routed expert's bytes
    (``expert``; 1/tp of it per rank under TP, whole under EP), KV bytes per context token per
    rank, FLOPs per token (2 x active parameters), the layers and the all-reduces per forward."""

    name: str
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    replicated_bytes: float
    dense_bytes: float
    expert_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    allreduces: int


def _attn_params(m: dict[str, Any]) -> tuple[float, float, float]:
    """(replicated, sharded, kv elements per token per layer) of one attention block."""
    d, h = int(m["hidden_size"]), int(m["num_attention_heads"])
    if m.get("kv_lora_rank"):
        nope, rope = int(m["qk_nope_head_dim"]), int(m["qk_rope_head_dim"])
        v, r, q_r = int(m["v_head_dim"]), int(m["kv_lora_rank"]), m.get("q_lora_rank")
        qk = nope + rope
        # SGLang runs q_a and kv_a as one replicated projection (fused_qkv_a_proj_with_mqa)
        replicated = d * ((q_r or 0) + r + rope)
        sharded = (q_r * h * qk if q_r else d * h * qk) + r * h * (nope + v) + h * v * d
        return replicated, sharded, float(r + rope)
    hd = int(m.get("head_dim") or d // h)
    kv = int(m.get("num_key_value_heads") or h)
    return 0.0, float(d * hd * (2 * h + 2 * kv)), float(2 * kv * hd)


def geometry(box: dict[str, Any], which: str = "model") -> Geometry:
    """The geometry of the box's ``model`` (or ``draft``) section, per TP rank."""
    m = box[which]
    try:
        tp, ep = int(box["layout"]["tp"]), int(box["layout"].get("ep", 1))
        d, n = int(m["hidden_size"]), int(m["num_hidden_layers"])
        bits = float(m.get("dense_bits", 16))
        rep, attn, kv = _attn_params(m)
        experts = int(m.get("n_routed_experts") or 0)
        first_dense = int(m.get("first_k_dense_replace", 0)) if experts else n
        moe_layers = n - first_dense
        dense_mlp = 3 * d * int(m["intermediate_size"]) * first_dense
        inter = int(m.get("moe_intermediate_size") or 0)
        shared = 3 * d * inter * int(m.get("n_shared_experts") or 0) * moe_layers
        router = d * experts * moe_layers  # the gate: replicated on every rank
        vocab = int(m.get("draft_vocab_size") or m["vocab_size"])
        head = d * vocab
        fc = 3 * d * d if which == "draft" else 0  # EAGLE-3's fusion of three target layers
        q = m.get("quant") or {}
        ebits = (float(q["bits"]) + float(q.get("scale_bits", 16)) / float(q["group_size"])
                 if q else bits)
        expert = 3 * d * inter * ebits / 8
        top_k = int(m.get("num_experts_per_tok") or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{which}: HF-style config lacks a field ({type(e).__name__}: {e})") \
            from None
    b = bits / 8
    active = n * (rep + attn) + dense_mlp + shared + router + head + fc + \
        moe_layers * top_k * 3 * d * inter
    kv_heads = int(m.get("num_key_value_heads") or m["num_attention_heads"])
    # MLA's latent is one per token: every TP rank holds it whole; GQA splits the KV heads
    kv_rank = kv * n * b / (1 if m.get("kv_lora_rank") else min(tp, kv_heads))
    return Geometry(
        name=str(m.get("name", which)), layers=n, moe_layers=moe_layers,
        num_experts=max(experts, 1), top_k=max(top_k, 1), hidden=d,
        replicated_bytes=(n * rep + router) * b,
        dense_bytes=(n * attn + dense_mlp + shared + head + fc) * b / tp,
        expert_bytes=expert / (tp if ep == 1 else 1) if experts else 0.0,
        kv_bytes_per_token=kv_rank, flops_per_token=2.0 * active / tp,
        allreduces=2 * n + 1)


def expert_shards(box: dict[str, Any]) -> int:
    """Experts a rank holds (all of them, 1/tp each, under TP; E/ep under EP)."""
    ep = int(box["layout"].get("ep", 1))
    return max(1, int(box["model"].get("n_routed_experts") or 1) // ep)


# -- presets and overrides -------------------------------------------------------------------
def preset_names() -> list[str]:
    return sorted(p.stem for p in BOX_DIR.glob("*.json"))


def load_box(name_or_path: str | Path) -> dict[str, Any]:
    """A box from ``data/boxes/NAME.json`` or a JSON file; every section checked present."""
    p = Path(name_or_path)
    if not p.is_file():
        p = BOX_DIR / f"{name_or_path}.json"
    if not p.is_file():
        raise ConfigError(f"--preset: no box {name_or_path!r} (presets: "
                          f"{', '.join(preset_names())})")
    try:
        box = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"box {p}: not JSON ({e})") from None
    return check_box(box, str(p))


def check_box(box: dict[str, Any], where: str = "box") -> dict[str, Any]:
    missing = [s for s in SECTIONS if not isinstance(box.get(s), dict)]
    if missing:
        raise ConfigError(f"{where}: missing section(s) {', '.join(missing)}")
    for key in ("count", "hbm_gbps", "mem_gb"):
        if float(box["gpu"].get(key, 0)) <= 0:
            raise ConfigError(f"{where}: gpu.{key} must be > 0")
    rules(box)
    paths(box["link"], int(box["layout"]["tp"]))
    geometry(box)
    geometry(box, "draft")
    memory_check(box, where)
    return box


def weights_per_rank_gb(box: dict[str, Any]) -> float:
    """GB of target weights one rank holds: ``model.checkpoint_gb`` / tp plus what every rank
    replicates, when the checkpoint's size is given; else from the geometry."""
    g = geometry(box)
    tp = int(box["layout"]["tp"])
    ckpt = box["model"].get("checkpoint_gb")
    if ckpt:
        return (float(ckpt) * 1e9 / tp + g.replicated_bytes * (tp - 1) / tp) / 1e9
    return (g.replicated_bytes + g.dense_bytes + g.moe_layers * g.num_experts
            * g.expert_bytes) / 1e9


def memory_check(box: dict[str, Any], where: str = "box") -> None:
    """Refuse a box whose weights do not fit its GPUs, with the numbers."""
    per = weights_per_rank_gb(box)
    mem = float(box["gpu"]["mem_gb"])
    if per > mem:
        tp = int(box["layout"]["tp"])
        raise ConfigError(
            f"{where}: the target's weights do not fit: {per:.1f} GB per rank "
            f"({per * tp:,.0f} GB over {tp} ranks) on {mem:.0f} GB GPUs "
            f"({mem * tp:,.0f} GB in all)")


def _coerce(old: Any, text: str, key: str) -> Any:
    if text.lower() in ("null", "none"):  # back to the version's rule / no value
        return None
    try:
        if isinstance(old, bool) or text.lower() in ("true", "false"):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if isinstance(old, int) and not isinstance(old, bool):
            return int(text)
        if isinstance(old, float) or old is None:
            try:
                return int(text) if old is None and text.lstrip("-").isdigit() else float(text)
            except ValueError:
                if old is None:
                    return text
                raise
        if isinstance(old, (list, dict)):
            return json.loads(text)
        return text
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"{key}: {text!r} is not a {type(old).__name__}") from None


def set_field(box: dict[str, Any], assignment: str, flag: str = "--set") -> dict[str, Any]:
    """A copy of ``box`` with ``SECTION.FIELD[.SUB]=VALUE`` applied (the value parsed as the
    field's type; a new field of an existing section is allowed, a new section is not)."""
    key, eq, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not eq or len(parts) < 2 or parts[0] not in SECTIONS:
        raise ConfigError(f"{flag} {assignment!r}: expected SECTION.FIELD=VALUE, SECTION one of "
                          f"{', '.join(SECTIONS)}")
    out = copy.deepcopy(box)
    node = out[parts[0]]
    for p in parts[1:-1]:
        if not isinstance(node.get(p), dict):
            raise ConfigError(f"{flag} {key}: {p!r} is not a section of {parts[0]}")
        node = node[p]
    node[parts[-1]] = _coerce(node.get(parts[-1]), text.strip(), f"{flag} {key}")
    out.setdefault("provenance", {})[key] = f"{flag} {text.strip()}"
    return check_box(out, f"{flag} {key}")


def with_sets(box: dict[str, Any], sets: list[str] | tuple[str, ...] = (),
              flag: str = "--set") -> dict[str, Any]:
    for s in sets:
        box = set_field(box, s, flag)
    return box
