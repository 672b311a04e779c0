"""The MoE layer's one-token path (a bs=1 decode step: top-k of the logits then softmax, each
expert's down GEMM accumulating into the residual with its routing weight as the GEMM's
scale, no bincount until ``last_counts`` is read) agrees with the sorted dispatch every longer
forward takes, token by token, and with a plain reference built from the unfused experts;
its coverage record counts exactly the experts the router chose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from workbench.models.loader import load_target
from workbench.models.moe import SparseMoe, route
from workbench.models.moe_model import MoeForCausalLM
from workbench.models.synthetic_moe import write_random_moe

pytest.importorskip("transformers")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral (renormalised softmax top-k)": ("mixtral", dict(num_local_experts=8,
                                                             num_experts_per_tok=3)),
    "qwen3moe norm_topk_prob=False": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                                        norm_topk_prob=False)),
    "qwen3moe norm_topk_prob=True": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4,
                                                       norm_topk_prob=True)),
    "dsv3 groups + shared experts": ("deepseek_v3", dict(n_routed_experts=16, n_group=4,
                                                         topk_group=2, num_experts_per_tok=4,
                                                         n_shared_experts=2,
                                                         first_k_dense_replace=1,
                                                         num_hidden_layers=2)),
}


def reference(moe: SparseMoe, x: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · expert_k(x) (+ shared) from the expert modules, one token at a time."""
    w, idx = route(F.linear(x, moe.gate.weight), moe.spec, moe.gate.e_score_correction_bias)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            out[t] += w[t, j] * moe.experts[int(idx[t, j])](x[t : t + 1])[0]
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_token_path_matches_sorted_dispatch_and_counts(tmp_path: Path, case: str) -> None:
    family, kw = CASES[case]
    model, _, _ = load_target(write_random_moe(tmp_path, family, **kw))
    assert isinstance(model, MoeForCausalLM)
    model.fuse()
    moes = [f for f in (layer.ffn for layer in model.model.decoder_layers())
            if isinstance(f, SparseMoe)]
    assert moes and all(m.mm_weights for m in moes)
    g = torch.Generator().manual_seed(0)
    for moe in moes:
        e, d = moe.spec.num_experts, moe.gate.weight.shape[1]
        x, res = torch.randn(6, d, generator=g), torch.randn(6, d, generator=g)
        with torch.no_grad():
            ref = reference(moe, x) + res
            batch = moe(x, res)  # the sorted dispatch (T = 6)
            torch.testing.assert_close(batch, ref, atol=1e-5, rtol=1e-5)
            counts = moe.last_counts
            assert counts is not None and int(counts.sum()) == 6 * moe.spec.top_k
            total = torch.zeros(e, dtype=torch.int64)
            for t in range(6):
                one = moe(x[t : t + 1], res[t : t + 1])
                assert moe._counts is None  # no bincount unless the record is read
                torch.testing.assert_close(one, batch[t : t + 1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(moe(x[t : t + 1]), ref[t : t + 1] - res[t : t + 1],
                                           atol=1e-5, rtol=1e-5)  # no residual: the sum alone
                _, idx = route(F.linear(x[t : t + 1], moe.gate.weight), moe.spec,
                               moe.gate.e_score_correction_bias)
                read = moe.last_counts
                assert read is not None
                assert read.tolist() == torch.bincount(idx.flatten(), minlength=e).tolist()
                total += read
            assert total.tolist() == counts.tolist()
