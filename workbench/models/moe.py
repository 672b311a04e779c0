"""Routed-expert MLPs (Mixtral, Qwen3-MoE, DeepSeek-V3): the router, the experts, the optional
shared expert, and what each forward routed (expert coverage, as data).

Parameter names match the HF checkpoints (``gate.weight``, ``experts.{e}.w1/w3/w2`` for Mixtral
or ``experts.{e}.gate_proj/up_proj/down_proj``, ``gate.e_score_correction_bias``,
``shared_experts.*``), so ``save_pretrained`` folders load without renaming.

The forward runs only the experts some token was routed to: tokens are sorted by expert, and
each touched expert runs one gate/up GEMM and one down GEMM over its rows (a decode step at
bs=1 and top-k touches k experts per layer; a verify of N tokens up to min(E, N·k)); the
outputs are weighted and scattered back to their tokens once per layer. One token (a bs=1
decode step) takes a shorter path: its k experts in turn, each down GEMM accumulating into the
residual with the routing weight as the GEMM's scale, and no bincount unless the coverage
record is read. After :meth:`SparseMoe.fuse`, the experts' weights live in two stacked tensors
(the per-expert parameters are views of them) so one expert's GEMM is a plain ``mm`` on a
view, not a module call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.gemm import fuse_linears
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

    softmax: top-k of softmax(logits), renormalised if ``norm_topk_prob`` (computed as the
    softmax of the top-k logits: the same values, 3 ops instead of 5). sigmoid (DeepSeek-V3):
    s = sigmoid(logits); choice = s + bias; groups ranked by the sum of their top-2 choices,
    experts chosen among the best ``topk_group`` groups; weights are s at the chosen experts,
    renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``."""
    if spec.scoring == "softmax" and spec.norm_topk_prob:
        # renormalised top-k of softmax(logits) == softmax of the top-k logits (3 ops, not 5)
        top, idx = torch.topk(logits if logits.dtype == torch.float32 else logits.float(),
                              spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), idx
    if spec.scoring == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        return torch.topk(probs, spec.top_k, dim=-1)  # type: ignore[return-value]
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
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None  # fused (2I', D), (D, I')
        self.mm_weights: list[tuple[torch.Tensor, torch.Tensor]] = []  # after fuse()
        self._idx: torch.Tensor | None = None  # expert ids of the last forward (T, k)
        self._counts: torch.Tensor | None = None  # their bincount, when read (last_counts)

    @property
    def last_counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert in the last forward (E,) int64 (None before any):
        counted when first read (a bs=1 decode step skips the bincount unless a trace or the
        coverage frame asks)."""
        if self._counts is None and self._idx is not None:
            self._counts = torch.bincount(self._idx.flatten(), minlength=self.spec.num_experts)
        return self._counts

    def fuse(self) -> None:
        """Stack the experts' weights (gate/up as one (E, 2I, D) tensor, down (E, D, I)); each
        expert's parameters become views of them (one copy; training updates stay in sync).

        On CPU the storage is per expert (in, out) contiguous — (E, D, 2I) and (E, I, D), the
        (out, in) tensors transposed views — the layout MKL reads fastest at small M, as
        ``gemm.fuse_linears`` for the dense GEMMs. The router's weight and the shared
        expert's are re-laid out the same way."""
        if self.gate_up is not None:
            return
        lins = [ex.linears() for ex in self.experts if isinstance(ex, ExpertMLP)]
        cpu = lins[0][0].weight.device.type == "cpu"
        with torch.no_grad():
            if cpu:  # (E, in, out) storage; the (E, out, in) weights are transposed views
                gu = torch.stack([torch.cat([g.weight.t(), u.weight.t()], dim=1)
                                  for g, u, _ in lins]).transpose(1, 2)
                dn = torch.stack([d.weight.t() for _, _, d in lins]).transpose(1, 2)
                r = self.gate.weight
                r.data = r.detach().t().contiguous().t()
            else:
                gu = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in lins])
                dn = torch.stack([d.weight for _, _, d in lins])
        inter = self.spec.moe_intermediate_size
        for e, (g, u, d) in enumerate(lins):
            g.weight.data = gu[e, :inter]
            u.weight.data = gu[e, inter:]
            d.weight.data = dn[e]
        self.gate_up, self.down = gu, dn
        # per expert, the (in, out) operands of x @ W (views): one mm/addmm each, no select
        self.mm_weights = [(gu[e].t(), dn[e].t()) for e in range(len(lins))]
        if self.shared_experts is not None:
            g, u, d = self.shared_experts.linears()
            self.shared = fuse_linears([g, u])[0], fuse_linears([d])[0]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, D) → (T, D): Σ_k w_k · expert_k(x) (+ shared expert) (+ ``residual``)."""
        if x.shape[0] == 1 and self.mm_weights:
            return self._one_token(x, residual)
        w, idx = route(F.linear(x, self.gate.weight), self.spec, self.gate.e_score_correction_bias)
        e = self.spec.num_experts
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=e)
        self._idx, self._counts = idx, counts
        order = torch.argsort(flat, stable=True)  # (T·k,) grouped by expert
        tok = order // self.spec.top_k
        xs = x.index_select(0, tok)
        ys = torch.empty_like(xs)  # expert outputs, rows grouped by expert
        start = 0
        for ex, n in enumerate(counts.tolist()):  # the one host sync per layer
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            if self.mm_weights:
                gu, dn = self.mm_weights[ex]
                g, u = torch.mm(xs[rows], gu).chunk(2, dim=-1)
                torch.mm(F.silu(g) * u, dn, out=ys[rows])
            else:
                ys[rows] = self.experts[ex](xs[rows])
        # weighted, then summed per token (one scale and one scatter per layer, not per expert)
        out = torch.zeros_like(x).index_add_(0, tok, ys * w.flatten()[order].to(x.dtype)[:, None])
        if self.shared_experts is not None:
            out = out + self._shared(x)
        return out if residual is None else residual + out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            assert self.shared_experts is not None
            return self.shared_experts(x)  # type: ignore[no-any-return]
        g, u = F.linear(x, self.shared[0]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.shared[1])

    def _one_token(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """One token (a bs=1 decode step): its k experts in turn, each down GEMM accumulating
        into the output with its routing weight as the GEMM's scale (``addmm``'s alpha); no
        sort, gather or scatter, and no bincount (``last_counts`` counts when read)."""
        logits = F.linear(x, self.gate.weight)
        w, idx = route(logits, self.spec, self.gate.e_score_correction_bias)
        self._idx, self._counts = idx, None
        if self.shared_experts is not None:
            out = self._shared(x)
            out = out if residual is None else residual + out
        else:
            out = torch.zeros_like(x) if residual is None else residual
        mm = self.mm_weights
        for ex, wk in zip(idx.tolist()[0], w.tolist()[0], strict=True):  # k host reads
            gu, dn = mm[ex]
            g, u = torch.mm(x, gu).chunk(2, dim=-1)
            out = torch.addmm(out, F.silu(g) * u, dn, alpha=wk)
        return out
