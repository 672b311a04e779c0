"""SGLang 0.5.23's own code as the oracle for launch plans (run in a subprocess: importing
sglang configures logging and globals we keep out of the test process).

Input (stdin): JSON ``{"plans": [{"cwd", "argv", "max_batch"}], "capture_max_bs": [ints]}``;
``argv`` is everything after ``python -m sglang.launch_server``. Output (last stdout line):
JSON with, per plan, ``exit`` (the parser's SystemExit code or None), the parsed fields, the
speculative fields after SGLang's own adaptive resolution (``_maybe_disable_adaptive`` then
``_init_adaptive_speculative_params``, the functions ``handle_speculative_decoding`` runs), any
ValueError they raise, and ``routes``: per batch size 1..max_batch the (padded, tier, steps) of
SGLang's ``AdaptiveSpeculativeParams`` built from the plan's config file with the capture list
``EAGLEWorkerV2`` hands it. Plus ``capture_sizes``: SGLang's default spec decode list per max_bs.

Not run here (needs torchvision, which pulls a CUDA torch, or a GPU): the rest of
``ServerArgs.resolve_once`` (model-config hooks such as EAGLE-3's max_running_requests=48
default), the request-metrics exporter module (imports ``io_struct`` → torchvision).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

FIELDS = ("model_path", "speculative_algorithm", "speculative_draft_model_path",
          "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
          "speculative_adaptive", "speculative_adaptive_config", "max_running_requests",
          "cuda_graph_bs_decode", "cuda_graph_max_bs_decode", "export_metrics_to_file",
          "export_metrics_to_file_dir", "tp_size", "host", "port", "mem_fraction_static")
RESOLVED = ("speculative_adaptive", "speculative_num_steps", "speculative_eagle_topk",
            "speculative_num_draft_tokens")


def check(plan: dict, sglang: dict) -> dict:
    prepare_server_args = sglang["prepare_server_args"]
    out: dict = {"exit": None, "parsed": {}, "resolved": {}, "error": None, "routes": None}
    os.chdir(plan["cwd"])
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            sa = prepare_server_args([*plan["argv"], "--device", "cuda"])
    except SystemExit as e:
        out["exit"] = e.code
        out["error"] = err.getvalue()[-2000:]
        return out
    out["parsed"] = {k: getattr(sa, k, None) for k in FIELDS}
    view = sglang["resolving_view"]
    try:
        if sa.speculative_adaptive:
            sglang["maybe_disable"](sa)
            if view(sa).speculative_adaptive:
                sglang["init_adaptive"](sa)
    except ValueError as e:
        out["error"] = str(e)
        return out
    out["resolved"] = {k: getattr(view(sa), k) for k in RESOLVED}
    if not out["resolved"]["speculative_adaptive"]:
        return out
    # EAGLEWorkerV2.init: AdaptiveSpeculativeParams(initial_steps=speculative_num_steps,
    # cfg_path=...), then init_states(cuda_graph_bs=None if the decode graph is disabled else
    # get_exec().graph.cuda_graph_bs_decode)
    sglang["parse_cuda_graph_config"](sa)
    disabled = view(sa).cuda_graph_config.decode.backend == sglang["DISABLED"]
    params = sglang["Params"](initial_steps=out["resolved"]["speculative_num_steps"],
                              cfg_path=sa.speculative_adaptive_config)
    params.set_cuda_graph_bs(None if disabled else sa.cuda_graph_bs_decode)
    routes = []
    for b in range(1, plan["max_batch"] + 1):
        padded = params._pad_to_cuda_graph_bs(b)
        routes.append([padded, params._find_closest_bs(padded), params.get_steps_for_batch(b)])
    out["routes"] = routes
    return out


def main() -> None:
    req = json.loads(sys.stdin.read())
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.cuda_graph_hook import (
        generate_decode_cuda_graph_batch_sizes,
        parse_cuda_graph_config,
    )
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    sglang = {"prepare_server_args": prepare_server_args, "resolving_view": resolving_view,
              "maybe_disable": speculative_hook._maybe_disable_adaptive,
              "init_adaptive": speculative_hook._init_adaptive_speculative_params,
              "parse_cuda_graph_config": parse_cuda_graph_config, "DISABLED": Backend.DISABLED,
              "Params": AdaptiveSpeculativeParams}
    results = [check(p, sglang) for p in req["plans"]]
    capture = {}
    if req.get("capture_max_bs"):
        sa = prepare_server_args(["--model-path", "/m/t", "--speculative-algorithm", "EAGLE3",
                                  "--speculative-draft-model-path", "/m/d", "--device", "cuda"])
        capture = {str(m): generate_decode_cuda_graph_batch_sizes(sa, m)
                   for m in req["capture_max_bs"]}
    print(json.dumps({"plans": results, "capture_sizes": capture}))


if __name__ == "__main__":
    main()
