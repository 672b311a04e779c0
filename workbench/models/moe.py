"""Routed-expert MLPs (Mixtral, Qwen3-MoE, DeepSeek-V3): the router, the experts, the optional
shared expert, and what each forward routed (expert coverage, as data).

Parameter names match the HF checkpoints (``gate.weight``, ``experts.{e}.w1/w3/w2`` for Mixtral
or ``experts.{e}.gate_proj/up_proj/down_proj``, ``gate.e_score_correction_bias``,
``shared_experts.*``), so ``save_pretrained`` folders load without renaming.

The forward runs only the experts some token was routed to: tokens are sorted by expert, and
each touched expert runs one gate/up GEMM and one down GEMM over its rows (a decode step at
bs=1 and top-k touches k experts per layer; a verify of N tokens up to min(E, N·k)). After
:meth:`SparseMoe.fuse`, the experts' weights live in two stacked tensors (the per-expert
parameters are views of them) so one expert's GEMM is a slice, not a module call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.moe_config import MoeSpec


class ExpertMLP(nn.Module):
    """One SwiGLU MLP under either naming: ``w1`` (gate), ``w3`` (up), ``w2`` (down), or
    ``gate_proj``/``up_proj``/``down_proj``."""

    def __init__(self, d: int, inter: int, naming: str) -> None:
        super().__init__()
        self.names = ("w1", "w3", "w2") if naming == "w" else ("gate_proj", "up_proj",
                                                                 "down_proj")
        for n, (i, o) in zip(self.names, ((d, inter), (d, inter), (inter, d)), strict=True):
            setattr(self, n, nn.Linear(i, o, bias=False))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        g, u, dn = (getattr(self, n) for n in self.names)
        return g, u, dn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, dn = self.linears()
        return dn(F.silu(g(x)) * u(x))


def route(logits: torch.Tensor, spec: MoeSpec,
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) → (weights (T, k) float32, expert ids (T, k)).

    softmax: top-k of softmax(logits), renormalised if ``norm_topk_prob``. sigmoid (DeepSeek-V3):
    s = sigmoid(logits); choice = s + bias; groups ranked by the sum of their top-2 choices,
    experts chosen among the best ``topk_group`` groups; weights are s at the chosen experts,
    renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``."""
    if spec.scoring == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        w, idx = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, idx
    s = logits.float().sigmoid()
    choice = s if bias is None else s + bias.float()
    t, e, g = s.shape[0], spec.num_experts, spec.n_group
    if g > 1:
        gs = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
        keep = torch.topk(gs, spec.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(e // g, dim=1), float("-inf"))
    idx = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
    w = s.gather(1, idx)
    if spec.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * spec.routed_scaling_factor, idx


class Router(nn.Module):
    """``gate.weight`` (E, D), and DeepSeek-V3's ``e_score_correction_bias`` (E,)."""

    def __init__(self, d: int, spec: MoeSpec, device: torch.device | str | None = None) -> None:
        """``device`` None: torch's current default device, as ``RMSNorm`` (the loader builds
        models under ``torch.device("meta")``)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, d, device=device))
        if spec.scoring == "sigmoid":
            self.e_score_correction_bias: torch.Tensor | None = nn.Parameter(
                torch.zeros(spec.num_experts, device=device), requires_grad=False)
        else:
            self.e_score_correction_bias = None


class SparseMoe(nn.Module):
    """The routed experts of one layer (plus the shared expert, when the spec has one).

    ``last_counts``: tokens routed to each expert in the last forward, (E,) int64 on the model's
    device (a token routed to k experts counts once at each) — the coverage record; read it
    after the forward, it is overwritten by the next."""

    def __init__(self, d: int, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Router(d, spec)
        self.experts = nn.ModuleList(ExpertMLP(d, spec.moe_intermediate_size, spec.naming)
                                     for _ in range(spec.num_experts))
        if spec.shared_intermediate_size:
            self.shared_experts: ExpertMLP | None = ExpertMLP(d, spec.shared_intermediate_size,
                                                              "proj")
        else:
            self.shared_experts = None
        self.gate_up: torch.Tensor | None = None  # (E, 2I, D) after fuse(); experts are views
        self.down: torch.Tensor | None = None  # (E, D, I)
        self.last_counts: torch.Tensor | None = None

    def fuse(self) -> None:
        """Stack the experts' weights (gate/up as one (E, 2I, D) tensor, down (E, D, I)); each
        expert's parameters become views of them (one copy; training updates stay in sync)."""
        if self.gate_up is not None:
            return
        lins = [ex.linears() for ex in self.experts if isinstance(ex, ExpertMLP)]
        with torch.no_grad():
            gu = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in lins]).contiguous()
            dn = torch.stack([d.weight for _, _, d in lins]).contiguous()
        inter = self.spec.moe_intermediate_size
        for e, (g, u, d) in enumerate(lins):
            g.weight.data = gu[e, :inter]
            u.weight.data = gu[e, inter:]
            d.weight.data = dn[e]
        self.gate_up, self.down = gu, dn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, D) → (T, D): Σ_k w_k · expert_k(x) (+ shared expert)."""
        w, idx = route(F.linear(x, self.gate.weight), self.spec, self.gate.e_score_correction_bias)
        e = self.spec.num_experts
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=e)
        if x.shape[0] == 1 and self.gate_up is not None and self.down is not None:
            # one token (a bs=1 decode step): its k experts in turn, no sort/gather/scatter
            self.last_counts = counts
            wx = w[0].to(x.dtype)
            out = None
            for j, ex in enumerate(flat.tolist()):
                g, u = F.linear(x, self.gate_up[ex]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.down[ex]) * wx[j]
                out = y if out is None else out + y
            assert out is not None
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out
        self.last_counts = counts
        order = torch.argsort(flat, stable=True)  # (T·k,) grouped by expert
        tok = order // self.spec.top_k
        wts = w.flatten()[order].to(x.dtype).unsqueeze(-1)
        xs = x.index_select(0, tok)
        out = torch.zeros_like(x)
        start = 0
        for ex, n in enumerate(counts.tolist()):  # the one host sync per layer
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            if self.gate_up is not None and self.down is not None:
                g, u = F.linear(xs[rows], self.gate_up[ex]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.down[ex])
            else:
                y = self.experts[ex](xs[rows])
            out.index_add_(0, tok[rows], y * wts[rows])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
