"""Speculative sampling is lossless: the distribution of the first 3 generated tokens equals the
exact target distribution (enumerated over a 5-token vocabulary), chain and tree, 5 seeds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers import make_engine

import workbench as wb
from workbench.models.loader import load_target
from workbench.sampler import process_probs

stats = pytest.importorskip("scipy.stats")
transformers = pytest.importorskip("transformers")

V = 5
PROMPT = [1, 3, 2]
SP = dict(max_new_tokens=3, temperature=0.8, top_p=0.9, ignore_eos=True)
SAMPLES = 2000


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from workbench.models.synthetic import write_random_head

    folder = tmp_path_factory.mktemp("tiny_vocab")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    model.save_pretrained(str(folder / "target"))
    head = write_random_head(folder / "target", folder / "head", draft_vocab=4, std=0.5)
    return folder / "target", head


def exact_distribution(target: Path) -> dict[tuple[int, ...], float]:
    model, _, _ = load_target(target)
    sp = wb.SamplingParams(**SP)
    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=3):
            p = 1.0
            for i in range(3):
                logits, _ = model.forward_dense(torch.tensor([PROMPT + list(seq[:i])]))
                p *= float(process_probs(logits[0, -1:].float(), sp)[0, seq[i]])
            out[seq] = p
    return out


def chi_square_p(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float],
                 n: int) -> float:
    """Pool cells with expected count < 5 into one bin; samples in zero-probability cells are
    an immediate failure (the sampler produced something the target never would)."""
    impossible = sum(c for s, c in counts.items() if exact.get(s, 0.0) == 0.0)
    assert impossible == 0, f"{impossible} samples have target probability 0"
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for s, p in exact.items():
        if p == 0.0:
            continue
        if p * n >= 5:
            obs.append(counts.get(s, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(s, 0)
            rest_e += p * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    return float(stats.chisquare(obs, [e * scale for e in exp]).pvalue)


@pytest.mark.parametrize("spec", [
    wb.SpecConfig(num_steps=3, topk=1),
    wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4),
], ids=["chain S3", "tree S2 K2 N4"])
def test_spec_sampling_matches_exact_distribution(tiny_vocab_pair: tuple[Path, Path],
                                                  spec: wb.SpecConfig) -> None:
    target, head = tiny_vocab_pair
    exact = exact_distribution(target)
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    engine = make_engine(target, head, max_batch_size=256, kv_budget_tokens=256 * 16, page_size=4)
    pvalues = []
    for seed in range(5):
        sps = [wb.SamplingParams(seed=seed * 100_000 + i, **SP) for i in range(SAMPLES)]
        outs = engine.generate([PROMPT] * SAMPLES, sps, spec=spec)
        assert sum(o.metrics.verify_ct for o in outs) > 0
        assert sum(sum(o.from_draft) for o in outs) > 0, "no draft token was ever accepted"
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
        pvalues.append(chi_square_p(counts, exact, SAMPLES))
    assert min(pvalues) > 0.01, pvalues
    assert engine.kv_usage()["used_blocks"] == 0
    engine.close()
