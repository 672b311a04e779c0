"""EAGLE-3 draft training: the training-time test unroll, the trainer, the exported checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import micro_draft_cfg, write_random_llama
from safetensors import safe_open

from workbench.errors import ConfigError
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.loader import load_eagle3, load_target
from workbench.train.eagle3 import (
    TEMPERATURE_GRID,
    DraftTrainConfig,
    build_draft_vocab,
    target_features,
    train_draft,
    ttt_forward,
    ttt_mask,
    ttt_unroll,
)

VD = 128


def micro_cfg(tmp: Path, target: Path, corpus: Path, **kw: Any) -> DraftTrainConfig:
    return micro_draft_cfg(tmp, target, corpus, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, micro_target: Path,
            tiny_corpus: Path) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("draft")
    cfg = micro_cfg(tmp, micro_target, tiny_corpus, regenerate=True, regen_sequences=16,
                    regen_prompt_len=16, regen_batch=16)
    return tmp / "head", train_draft(cfg)


# -- pure pieces ------------------------------------------------------------------------------


def test_ttt_mask_is_the_diagonal_chain() -> None:
    assert torch.equal(ttt_mask(3, 0), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool())
    # Step 2, row 3: step-0 keys at <= 1, step-1 key at 2, own key at 3.
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert m[3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert bool(m.any(dim=1).all())  # no empty row, so attention never yields NaN


def test_unroll_equals_an_inference_chain() -> None:
    """Step j at row i must equal a draft run the inference way: step 0 causally over rows 0..s,
    then j single-token steps fed back from s = i - j, each attending to the keys so far."""
    cfg = Eagle3Config(hidden_size=16, target_hidden_size=24, intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=40,
                       draft_vocab_size=20)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg, embed=torch.nn.Embedding(40, 16)).eval()
    b, n, steps = 2, 9, 4
    tokens = torch.randint(0, 40, (b, n))
    hidden = draft.fuse_features(torch.randn(b, n, 72))
    with torch.no_grad():
        unrolled = list(ttt_unroll(draft, hidden, tokens, steps))
        causal = torch.ones(n, n).tril().bool()
        _, out0, k0, v0 = draft.forward_dense(tokens, hidden, torch.arange(n), causal)
        for j in range(1, steps):
            for s in range(n - j):
                kk, vv, h = k0[:, : s + 1], v0[:, : s + 1], out0[:, s : s + 1]
                for k in range(1, j + 1):
                    p = s + k
                    mask = torch.ones(1, kk.shape[1] + 1, dtype=torch.bool)
                    lg, h, kn, vn = draft.forward_dense(tokens[:, p : p + 1], h,
                                                        torch.tensor([p]), mask, kk, vv)
                    kk, vv = torch.cat([kk, kn], 1), torch.cat([vv, vn], 1)
                torch.testing.assert_close(unrolled[j][:, s + j], lg[:, 0], atol=1e-5, rtol=1e-5)


def test_ttt_loss_is_zero_for_a_perfect_draft() -> None:
    cfg = Eagle3Config(hidden_size=16, target_hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=30,
                       draft_vocab_size=30)
    draft = Eagle3Draft(cfg, embed=torch.nn.Embedding(30, 16))
    with torch.no_grad():
        draft.lm_head.weight.zero_()  # uniform draft
    tokens = torch.randint(0, 30, (2, 10))
    loss, kl, acc = ttt_forward(draft, torch.randn(2, 10, 48), torch.zeros(2, 10, 30), tokens,
                                ttt_steps=5, step_decay=0.8)
    assert kl.shape == acc.shape == (5,)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-5)


def test_draft_vocab_is_most_frequent_ids_sorted() -> None:
    data = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 0], dtype=np.uint16)
    d2t, t2d = build_draft_vocab([data], vocab_size=12, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9]  # target ids ascending
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    assert bool((d2t >= 0).all())
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        build_draft_vocab([data], vocab_size=12, draft_vocab_size=13)


def test_target_features_follow_aux_order(micro_target: Path) -> None:
    target, mcfg, _ = load_target(micro_target)
    x = torch.randint(0, mcfg.vocab_size, (1, 6))
    _, taps = target_features(target, x, (5, 2, 5))
    _, ref = target.forward_dense(x, (2, 5))
    d = mcfg.hidden_size
    assert taps.shape == (1, 6, 3 * d)
    torch.testing.assert_close(taps[..., :d], ref[..., d:])  # type: ignore[index]
    torch.testing.assert_close(taps[..., d : 2 * d], ref[..., :d])  # type: ignore[index]


# -- the trainer ------------------------------------------------------------------------------


def test_loss_falls_and_summary(trained: tuple[Path, dict[str, Any]]) -> None:
    head, s = trained
    hist = s["history"]
    assert [h["step"] for h in hist] == [20, 40, 60]
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"]
    assert hist[-1]["acc"][0] > hist[0]["acc"][0]
    assert s["steps"] == 60 and s["tokens"] == 60 * 4 * 47
    assert s["regenerated_windows"] == 16
    for split in ("train", "heldout", "heldout_regen"):
        assert len(s[split]["loss"]) == len(s[split]["acc"]) == 5
        assert all(0.0 <= a <= 1.0 for a in s[split]["acc"])
    assert s["tokens_per_second"] > 0 and s["seconds"] > 0
    assert json.loads((head / "training_summary.json").read_text())["steps"] == 60
    # greedy calibration: a grid temperature that does not fit worse than T=1, saved with the head
    t, cal = s["greedy_score_temperature"], s["calibration"]
    assert t in TEMPERATURE_GRID and cal["rows"] > 0
    assert cal["nll_best"] <= cal["nll_T=1"]
    config = json.loads((head / "config.json").read_text())
    assert config.get("workbench", {}).get("greedy_score_temperature", 1.0) == t
    assert Eagle3Config.from_folder(head).greedy_score_temperature == t


def test_calibration_temperature_is_validated_and_round_trips(tmp_path: Path) -> None:
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8,
            "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 32,
            "draft_vocab_size": 16}
    cfg = Eagle3Config.from_dict({**base, "workbench": {"greedy_score_temperature": 0.35}})
    assert cfg.greedy_score_temperature == 0.35
    assert Eagle3Config.from_dict(cfg.to_hf_dict()) == cfg
    assert "workbench" not in Eagle3Config.from_dict(base).to_hf_dict()  # 1.0: not written
    for bad in (0, -1.0, "sharp", True):
        with pytest.raises(ConfigError, match="greedy_score_temperature"):
            Eagle3Config.from_dict({**base, "workbench": {"greedy_score_temperature": bad}})


def test_checkpoint_has_the_standard_layout(trained: tuple[Path, dict[str, Any]],
                                            micro_target: Path) -> None:
    head, _ = trained
    target, mcfg, _ = load_target(micro_target)
    d, v = mcfg.hidden_size, mcfg.vocab_size
    h, kv, hd, inter = (mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim,
                        mcfg.intermediate_size)
    f32 = torch.float32
    expected = {
        "fc.weight": ([d, 3 * d], f32),
        "midlayer.input_layernorm.weight": ([d], f32),
        "midlayer.hidden_norm.weight": ([d], f32),
        "midlayer.post_attention_layernorm.weight": ([d], f32),
        "midlayer.self_attn.q_proj.weight": ([h * hd, 2 * d], f32),
        "midlayer.self_attn.k_proj.weight": ([kv * hd, 2 * d], f32),
        "midlayer.self_attn.v_proj.weight": ([kv * hd, 2 * d], f32),
        "midlayer.self_attn.o_proj.weight": ([d, h * hd], f32),
        "midlayer.mlp.gate_proj.weight": ([inter, d], f32),
        "midlayer.mlp.up_proj.weight": ([inter, d], f32),
        "midlayer.mlp.down_proj.weight": ([d, inter], f32),
        "norm.weight": ([d], f32),
        "lm_head.weight": ([VD, d], f32),
        "d2t": ([VD], torch.int64),
        "t2d": ([v], torch.bool),
    }
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        got = {k: (list(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    assert got == expected
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == VD and config["target_hidden_size"] == d
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(
        mcfg.aux_layer_ids())
    draft, layers = load_eagle3(head, target)
    assert layers == mcfg.aux_layer_ids()
    assert draft.embed is target.model.embed_tokens
    assert int(draft.t2d.sum()) == VD


def test_any_hf_llama_folder_with_regeneration(tmp_path: Path, tiny_corpus: Path) -> None:
    target = write_random_llama(tmp_path / "hf", vocab_size=300, hidden=32, layers=7,
                                corpus=tiny_corpus)
    cfg = micro_cfg(tmp_path, target, tiny_corpus, steps=4, ckpt_every=2, seq_len=24,
                    regenerate=True, regen_sequences=4, regen_prompt_len=8, regen_batch=4,
                    regen_greedy_frac=0.5, eval_batches=1, draft_vocab_size=64)
    s = train_draft(cfg)
    assert s["aux_layer_ids"] == [2, 3, 4]
    regen = np.load(tmp_path / "work" / "regen_train.npy")
    assert regen.shape == (4, 24)
    corpus = np.load(tmp_path / "work" / "corpus_train.npy")
    prompt = regen[0, :8]  # each window starts with a prompt cut from the corpus
    hits = [i for i in range(len(corpus) - 8) if np.array_equal(corpus[i : i + 8], prompt)]
    assert hits
    draft, _ = load_eagle3(tmp_path / "head", load_target(target)[0])
    assert draft.config.draft_vocab_size == 64


def test_resume_and_determinism(tmp_path: Path, micro_target: Path, tiny_corpus: Path) -> None:
    a = train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus, steps=6, ckpt_every=3))
    b = train_draft(micro_cfg(tmp_path / "b", micro_target, tiny_corpus, steps=6, ckpt_every=3))
    assert a["history"][-1]["loss"] == b["history"][-1]["loss"]
    with safe_open(str(tmp_path / "a" / "head" / "model.safetensors"), "pt") as fa, \
            safe_open(str(tmp_path / "b" / "head" / "model.safetensors"), "pt") as fb:
        for k in fa.keys():
            assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), k
    c = train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus, steps=9, ckpt_every=3))
    assert [h["step"] for h in c["history"]] == [3, 6, 9]
    assert c["history"][:2] == a["history"]  # loaded from the checkpoint, not re-run
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus, steps=12,
                              draft_vocab_size=VD // 2))


# -- errors name what differs -----------------------------------------------------------------


def test_head_refuses_another_target(trained: tuple[Path, dict[str, Any]], tmp_path: Path,
                                     micro_target: Path) -> None:
    head, _ = trained
    wider = write_random_llama(tmp_path / "wider", vocab_size=300, hidden=96)
    with pytest.raises(ConfigError, match="target_hidden_size"):
        load_eagle3(head, load_target(wider)[0])
    bigger = write_random_llama(tmp_path / "bigger", vocab_size=320, hidden=64)
    with pytest.raises(ConfigError, match="vocab_size"):
        load_eagle3(head, load_target(bigger)[0])
    bad = tmp_path / "bad_ids"
    shutil.copytree(head, bad)
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 99]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3(bad, load_target(micro_target)[0])


def test_config_errors_name_the_problem(tmp_path: Path, micro_target: Path,
                                        tiny_corpus: Path) -> None:
    with pytest.raises(ConfigError, match="draft_vocab_size 301 > target vocab_size 300"):
        train_draft(micro_cfg(tmp_path, micro_target, tiny_corpus, draft_vocab_size=301))
    with pytest.raises(ConfigError, match="no_such_target"):
        train_draft(micro_cfg(tmp_path, tmp_path / "no_such_target", tiny_corpus))
    with pytest.raises(ConfigError, match="no_such_corpus"):
        train_draft(micro_cfg(tmp_path, micro_target, tmp_path / "no_such_corpus"))
    (tmp_path / "empty_corpus").mkdir()
    with pytest.raises(ConfigError, match="empty_corpus"):
        train_draft(micro_cfg(tmp_path, micro_target, tmp_path / "empty_corpus"))
    no_tok = tmp_path / "no_tok"
    shutil.copytree(micro_target, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer.json"):
        train_draft(micro_cfg(tmp_path, no_tok, tiny_corpus))
    with pytest.raises(ConfigError, match="ttt_steps"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, ttt_steps=3)
    with pytest.raises(ConfigError, match="seq_len"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, seq_len=6)
    with pytest.raises(ConfigError, match="step_decay"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, step_decay=0.0)
    with pytest.raises(ConfigError, match="regen_prompt_len"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, regenerate=True, regen_prompt_len=48)


# -- answer-only loss -------------------------------------------------------------------------


def test_row_weights_are_the_predicted_tokens_mask() -> None:
    from workbench.train.eagle3.data import answer_starts, row_weights

    mask = np.zeros(40, dtype=np.float32)
    mask[[10, 11, 12, 30]] = 1
    # answer position index 3 (token 30) under row 5 of a 12-token window: start 30 - 2 - 5
    starts = answer_starts(mask, 12, np.array([3, 0]), np.array([5, 0]))
    assert starts == [23, 8]
    w = row_weights(mask, starts, 12)
    assert w.shape == (2, 11)
    assert w[0].tolist() == [float(i == 5) for i in range(11)]  # row i predicts token s + i + 2
    assert w[1].tolist()[:5] == [1, 1, 1, 0, 0]
    # clipped into the array, past-the-end rows weigh 0
    end = answer_starts(mask, 12, np.array([3]), np.array([0]))
    assert end == [28] and row_weights(mask, end, 12)[0].sum() == 1


def test_weighted_ttt_loss_is_the_mean_over_weighted_rows() -> None:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50,
                       draft_vocab_size=50)
    draft = Eagle3Draft(cfg, embed=torch.nn.Embedding(50, 32)).eval()
    b, t = 2, 12
    x = torch.randint(0, 50, (b, t))
    taps, logits = torch.randn(b, t, 96), torch.randn(b, t, 50)
    with torch.no_grad():
        plain = ttt_forward(draft, taps, logits, x, 5, 0.8)
        ones = ttt_forward(draft, taps, logits, x, 5, 0.8, torch.ones(b, t - 1))
        for u, v in zip(plain, ones, strict=True):
            torch.testing.assert_close(u, v)
        # window 1 weighted whole, window 0 not at all: window 1's own figures
        w = torch.zeros(b, t - 1)
        w[1] = 1
        torch.testing.assert_close(ttt_forward(draft, taps, logits, x, 5, 0.8, w),
                                   ttt_forward(draft, taps[1:], logits[1:], x[1:], 5, 0.8))
        # one row: agreement is 0 or 1 on every step that scores it
        w = torch.zeros(b, t - 1)
        w[1, 7] = 1
        _, kl, acc = ttt_forward(draft, taps, logits, x, 5, 0.8, w)
        assert ((acc == 0) | (acc == 1)).all() and (kl > 0).all()
        with pytest.raises(ConfigError, match="weights"):
            ttt_forward(draft, taps, logits, x, 5, 0.8, torch.ones(b, t))


def write_masked_corpus(path: Path, micro_target: Path) -> Path:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, 4000).astype(np.uint16)
    mask = (np.arange(4000) % 50 >= 30).astype(np.uint8)  # 20 answer tokens in every 50
    np.savez(path, train=ids[:3600], train_mask=mask[:3600], heldout=ids[3600:],
             heldout_mask=mask[3600:])
    return path


def test_answer_loss_trains_on_answers_and_reports_them(tmp_path: Path,
                                                        micro_target: Path) -> None:
    corpus = write_masked_corpus(tmp_path / "c.npz", micro_target)
    s = train_draft(micro_cfg(tmp_path, micro_target, corpus, steps=4, ckpt_every=2,
                              answer_loss=True, autocast="bfloat16"))
    assert s["config"]["answer_loss"] is True and s["config"]["autocast"] == "bfloat16"
    assert all(np.isfinite(h["loss"]) for h in s["history"])
    for k in ("train_answers", "heldout_answers"):
        assert len(s[k]["acc"]) == 5 and all(0 <= a <= 1 for a in s[k]["acc"])
    assert (tmp_path / "head" / "model.safetensors").is_file()


def test_answer_loss_refusals_name_the_field(tmp_path: Path, micro_target: Path,
                                             tiny_corpus: Path) -> None:
    with pytest.raises(ConfigError, match="autocast: must be"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, autocast="float16")
    with pytest.raises(ConfigError, match="answer_loss: needs a pre-tokenized .npz"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, answer_loss=True)
    bare = tmp_path / "bare.npz"
    np.savez(bare, train=np.zeros(400, np.uint16), heldout=np.zeros(100, np.uint16))
    with pytest.raises(ConfigError, match="'train_mask'"):
        train_draft(micro_cfg(tmp_path, micro_target, bare, answer_loss=True))
    blank = tmp_path / "blank.npz"
    np.savez(blank, train=np.zeros(400, np.uint16), train_mask=np.zeros(400, np.uint8),
             heldout=np.zeros(100, np.uint16), heldout_mask=np.ones(100, np.uint8))
    with pytest.raises(ConfigError, match="train_mask marks no answer token"):
        train_draft(micro_cfg(tmp_path, micro_target, blank, answer_loss=True))
