"""Mixture-of-experts MLP layers: a router picks each token's top-k experts, each a gated MLP of its
own, and their outputs are summed under the router's weights (plus, where the family has one, a
shared expert: under a sigmoid gate in Qwen2-MoE, as it is in ERNIE 4.5).

Two pluggable switches come from the family (`ModelConfig.router`, `ModelConfig.expert_act`):

- `WEIGHTINGS`: router logits [rows, experts] -> (the top-k experts, their weights), in float32 as
  the references compute them: softmax then top-k, renormalised or not; top-k then softmax.
- `ACTIVATIONS`: the experts' gated activation, act(gate, up); SiLU's runs inside the down
  product's kernel (`qlinear(silu_mul=True)`), any other as row-wise PyTorch between the kernels.

The experts' weights stay in the file's quantized types: llama.cpp stacks a layer's experts into
one 3-D tensor per projection, which the loader keeps as one `quant.Segment` of experts x rows
rows. In the kernels' layout rows come in panels of 16, so one expert's rows are a contiguous byte
range of that blob (`expert_views`): each expert is an ordinary `QWeight` over a slice, nothing is
copied, and any weight type the kernels compute with works here unchanged.

Exactness, as everywhere in the quantized runtime: a row's output does not depend on the other
rows of the step. The router runs through the kernels (its float32 weights as three bfloat16
matrices whose sum is exactly them: `exact_bf16`), and so does its weighting (`WEIGHTING_IDS`);
each used expert runs once over the rows that
chose it (the kernels quantize each row on its own); and a row's experts are summed in its own
top-k rank order, never in the order the step grouped them. So a token's bits are the same alone,
inside a verification tree and in a batch; a one-row step reads only its k experts' bytes.

A layer's quantized experts run in one C++ call (`kernels.experts_rows`, csrc/torch_ops.cpp; with
their biases and gpt-oss's clamped SwiGLU where the file has them): the same products over the same
rows, the same activation and rank-order sum, so the same bits as the call-per-product path, but all the experts' units
in two parallel regions (gate/up, down) instead of two kernel calls an expert from Python. A one-row
decode step's thread hand-overs and Python between them were the cost a bandwidth-bound step could
not hide (docs/log/2026-12-moe-speed.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import UserError
from . import kernels
from .config import ModelConfig
from .quant import FORMATS, PANEL, QWeight, Segment, blob_bytes, pack_float, qlinear


@dataclass(frozen=True)
class Activation:
    """An expert's gated activation. `fn(gate, up)` is elementwise (float paths, and the quantized
    path unless `fused_silu`); `fused_silu`: it is silu(gate) * up, which the down product's kernel
    applies in the pass that quantizes its input."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    fused_silu: bool = False
    kernel: int = 0  # its id among the kernels' activations (csrc/core/experts.h's ExpertAct)


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's (every config of it has these)


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gated activation (`swiglu_oai`): the gate clamped from above and the up projection on
    both sides at SWIGLU_LIMIT, glu = gate * sigmoid(SWIGLU_ALPHA * gate), out = (up + 1) * glu;
    elementwise, so row-independent on every path."""
    g = g.clamp(max=SWIGLU_LIMIT)
    u = u.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (u + 1) * (g * torch.sigmoid(g * SWIGLU_ALPHA))


# The quantized runtime computes each in the kernels: SiLU inside the down product's quantization, the
# clamped SwiGLU as their row operation (`swiglu_oai_row`: the kernels' exp), the same in the per-layer
# forward, the one-call experts and the whole-step call.
ACTIVATIONS: dict[str, Activation] = {"silu": Activation(lambda g, u: F.silu(g) * u, fused_silu=True, kernel=0),
                                      "swiglu_oai": Activation(clamped_swiglu, kernel=1)}

Routing = tuple[torch.Tensor, torch.Tensor]  # (experts [rows, k] int64, weights [rows, k] float32)


def _softmax_topk(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return experts, weights


def _softmax_topk_norm(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    experts, weights = _softmax_topk(logits, k)
    return experts, weights / weights.sum(dim=-1, keepdim=True)


def _topk_softmax(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    top, experts = torch.topk(logits.float(), k, dim=-1)
    return experts, torch.softmax(top, dim=-1)


NORM_MIN = 1e-12  # ERNIE 4.5's moe_norm_min: the least sum its weights are divided by


def _softmax_biased_topk_norm(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    """ERNIE 4.5's: the top k of the probabilities plus a learned selection bias, weighted by their
    probabilities alone, renormalised (the sum at least NORM_MIN)."""
    if bias is None:
        raise UserError("the biased expert weighting needs the router's selection bias")
    p = torch.softmax(logits.float(), dim=-1)
    experts = torch.topk(p + bias.float(), k, dim=-1)[1]
    weights = torch.gather(p, -1, experts)
    return experts, weights / weights.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)


SIGMOID_NORM_EPS = 1e-6  # what transformers' LFM2 MoE router adds to the sum of its top k's sigmoids


def _sigmoid_biased_topk_norm(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    """LFM2's MoE: the top k of the logits' sigmoids plus a learned selection bias, weighted by their sigmoids
    alone divided by their sum plus SIGMOID_NORM_EPS."""
    if bias is None:
        raise UserError("the biased expert weighting needs the router's selection bias")
    p = torch.sigmoid(logits.float())
    experts = torch.topk(p + bias.float(), k, dim=-1)[1]
    weights = torch.gather(p, -1, experts)
    return experts, weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)


# Router logits (and the router's selection bias, which only the biased weightings use) -> each row's experts (in
# descending weight: the row's rank order) and weights.
WEIGHTINGS: dict[str, Callable[[torch.Tensor, int, torch.Tensor | None], Routing]] = {
    "softmax_topk": _softmax_topk,  # Qwen2-MoE, OLMoE
    "softmax_topk_norm": _softmax_topk_norm,  # Qwen3-MoE, Mixtral
    "topk_softmax": _topk_softmax,  # gpt-oss
    "softmax_biased_topk_norm": _softmax_biased_topk_norm,  # ERNIE 4.5
    "sigmoid_biased_topk_norm": _sigmoid_biased_topk_norm,  # LFM2's MoE
}
# The same weightings in the kernels (csrc/core/experts.h's Weighting): the quantized runtime's, with
# bits of their own (fastexp.h's exp, fixed summation orders, ties to the lower index), so that the
# per-layer forward and the whole-step call (fused_step.py) route a row alike.
WEIGHTING_IDS = {"softmax_topk": 0, "softmax_topk_norm": 1, "topk_softmax": 2, "softmax_biased_topk_norm": 3,
                 "sigmoid_biased_topk_norm": 4}
# The weightings that take a selection bias.
BIASED = frozenset({"softmax_biased_topk_norm", "sigmoid_biased_topk_norm"})


def expert_views(seg: Segment, experts: int) -> list[Segment]:
    """The experts of a stacked [experts x rows, k] segment, each a segment over its slice of the blob."""
    rows = seg.n // experts
    if seg.n != rows * experts or rows % PANEL:
        raise UserError(f"an expert tensor of {seg.n} rows for {experts} experts: each expert's rows must be a "
                        f"multiple of {PANEL}")
    size = blob_bytes(seg.fmt, rows, seg.k, seg.groups)
    return [Segment(seg.fmt, rows, seg.blob[e * size : (e + 1) * size], seg.offset, seg.k, seg.groups)
            for e in range(experts)]


def exact_bf16(w: torch.Tensor) -> QWeight:
    """A float32 [n, k] matrix as three bfloat16 ones stacked [3n, k] whose sum is exactly it (each
    takes what the ones before left: 8 bits of the mantissa each, the remainders exact)."""
    rest, parts = w.detach().float(), []
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    stacked = torch.cat(parts)
    n, k = stacked.shape
    return QWeight(k, [pack_float("BF16", stacked.view(torch.int16).numpy(), n, k)])


class Experts(nn.Module):
    """A layer's mixture of experts. Float paths hold `gate`, `up` [experts, ff, hidden] and
    `down` [experts, hidden, ff] (and optional per-expert biases `gate_bias`, `up_bias`
    [experts, ff], `down_bias` [experts, hidden]); the quantized runtime holds each expert as
    `QWeight`s over slices of the stacked tensors (`quantize`). `linear(d_in, d_out, bias)` makes
    the router's and the shared expert's projections (layers.Linear)."""

    def __init__(self, cfg: ModelConfig, linear: Callable[[int, int, bool], Any]) -> None:
        super().__init__()
        if cfg.router not in WEIGHTINGS or cfg.expert_act not in ACTIVATIONS:
            raise UserError(f"unsupported expert router {cfg.router!r} or activation {cfg.expert_act!r}")
        self.count, self.used, self.ff, self.hidden = cfg.experts, cfg.experts_used, cfg.expert_ff, cfg.hidden_size
        self.weighting = WEIGHTINGS[cfg.router]
        self.weighting_id = WEIGHTING_IDS[cfg.router]
        self.act = ACTIVATIONS[cfg.expert_act]
        self.router = linear(self.hidden, self.count, False)  # the loader sets a bias where the file has one
        # ERNIE's selection bias [experts] (float32; the loader sets it), added to the probabilities that pick
        self.register_parameter("select_bias", None)
        self.shared = cfg.shared_ff > 0
        self.shared_gated = self.shared and cfg.shared_gate
        if self.shared_gated:
            self.shared_gate = linear(self.hidden, 1, False)
        if self.shared:
            self.shared_gate_up = linear(self.hidden, 2 * cfg.shared_ff, False)
            self.shared_down = linear(cfg.shared_ff, self.hidden, False)
        for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
            self.register_parameter(name, None)
        self.q_router: QWeight | None = None
        self.q_gate_up: list[QWeight] = []
        self.q_down: list[QWeight] = []
        self.q_gate_up_bias: list[torch.Tensor | None] = []
        self.q_down_bias: list[torch.Tensor | None] = []
        self.q_stacked: tuple[Segment, Segment, Segment] | None = None
        self.q_stacked_bias: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    @property
    def quantized(self) -> bool:
        shared = not self.shared or all(m.qweight is not None for m in (self.shared_gate_up, self.shared_down))
        return self.q_router is not None and bool(self.q_down) and shared

    def quantize(self, gate: Segment, up: Segment, down: Segment) -> None:
        """Compute with the stacked quantized experts from now on (each expert a view, nothing copied);
        the router (and the shared expert's gate) through the kernels, exactly (`exact_bf16`)."""
        gates, ups, downs = (expert_views(s, self.count) for s in (gate, up, down))
        self.q_stacked = (gate, up, down)
        self.q_gate_up = [QWeight(self.hidden, [g, u]) for g, u in zip(gates, ups, strict=True)]
        self.q_down = [QWeight(self.ff, [d]) for d in downs]

        def bias(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return None if t is None else t[e].detach().float().contiguous()

        self.q_gate_up_bias = [None if self.gate_bias is None else
                               torch.cat([bias(self.gate_bias, e), bias(self.up_bias, e)]) for e in range(self.count)]
        self.q_down_bias = [bias(self.down_bias, e) for e in range(self.count)]
        # The same biases stacked [experts, width] for the one call (None: the file has none).
        self.q_stacked_bias = (None if self.gate_bias is None else torch.stack(self.q_gate_up_bias),
                               None if self.down_bias is None else torch.stack(self.q_down_bias))
        rows = [self.router.weight] + ([self.shared_gate.weight] if self.shared_gated else [])
        self.q_router = exact_bf16(torch.cat([r.detach().float() for r in rows]))
        self.gate = self.up = self.down = None

    # ------------------------------------------------------------------ float paths

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's output for normed rows h [rows, hidden] in their dtype (PyTorch's kernels)."""
        experts, weights = self.weighting(self.router(h), self.used, self.select_bias)
        weights = weights.to(h.dtype)
        ys = h.new_zeros(h.shape[0], self.used, self.hidden)
        for e in torch.unique(experts).tolist():
            rows, rank = torch.where(experts == e)
            x = h[rows]
            g = F.linear(x, self.gate[e], None if self.gate_bias is None else self.gate_bias[e])
            u = F.linear(x, self.up[e], None if self.up_bias is None else self.up_bias[e])
            down_bias = None if self.down_bias is None else self.down_bias[e]
            ys[rows, rank] = F.linear(self.act.fn(g, u), self.down[e], down_bias)
        out = self._weighted(ys, weights)
        if self.shared:
            g, u = self.shared_gate_up(h).chunk(2, dim=-1)
            s = self.shared_down(self.act.fn(g, u))
            out = out + (torch.sigmoid(self.shared_gate(h)) * s if self.shared_gated else s)
        return out

    @staticmethod
    def _weighted(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * ys[:, j], added in each row's rank order (row-wise: no row's sum
        depends on another's, nor on how the step grouped the rows)."""
        out = ys[:, 0] * weights[:, :1]
        for j in range(1, ys.shape[1]):
            out = out + ys[:, j] * weights[:, j : j + 1]
        return out

    # ------------------------------------------------------------------ the quantized runtime

    def forward_rows(self, x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The layer's output for rows x [rows, hidden] (float32, before the MLP's RMSNorm of weight
        `norm`, which every product folds into its pass over a row): each used expert runs once over
        the rows that chose it."""
        kw: dict[str, Any] = {} if norm is None else {"norm": norm, "eps": eps}
        logits = self._router_rows(x, kw)
        experts, weights = kernels.load().route_rows(logits[:, : self.count], self.used, self.weighting_id,
                                                     self.kernel_select_bias)
        if self._one_call:
            out = self._experts_call(x, experts, weights, kw)
        else:
            out = self._experts_python(x, experts, weights, kw)
        if self.shared:
            gu = qlinear(x, self.shared_gate_up.qweight, **kw)
            s = self._down(gu, self.shared_down.qweight, None)
            # out + sigmoid(gate) * s, or out + s, as the whole-step call adds it (core/experts.h)
            out = kernels.load().shared_expert_add(out, logits[:, self.count], s) if self.shared_gated else out + s
        return out

    @property
    def kernel_select_bias(self) -> torch.Tensor | None:
        """The selection bias as the kernels take it (float32, contiguous), where the weighting has one."""
        return None if self.select_bias is None else self.select_bias.detach().float().reshape(-1).contiguous()

    @property
    def _one_call(self) -> bool:
        """Whether the experts run in one C++ call (`kernels.experts_rows`): the stacked quantized experts."""
        return self.q_stacked is not None

    def _experts_call(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                      kw: dict[str, Any]) -> torch.Tensor:
        """The routed experts' weighted sum in one call of the kernels: the bits of `_experts_python`
        (the same products, per row quantization and rank-order sum), two parallel regions a layer."""
        segs = self.q_stacked
        args = (x, kw.get("norm"), float(kw.get("eps", 0.0)), experts, weights.float().contiguous(),
                [s.blob for s in segs], [FORMATS[s.fmt] for s in segs], [s.offset for s in segs],
                [s.groups for s in segs], self.count, self.ff, kernels.path_id(), *self.q_stacked_bias, self.act.kernel)
        return kernels.timed("linear", kernels.load().experts_rows, args)

    def _experts_python(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        kw: dict[str, Any]) -> torch.Tensor:
        """The routed experts' weighted sum, a kernel call per product (biases, other activations)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, rank) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.count).tolist()
        ys = torch.empty(flat.shape[0], self.hidden)
        start = 0
        for e, c in enumerate(counts):
            if c:
                rows = order[start : start + c] // self.used
                self._expert_rows(e, x if x.shape[0] == 1 else x[rows], kw, ys[start : start + c])
                start += c
        slots = torch.empty_like(order)
        slots[order] = torch.arange(order.shape[0])
        return self._weighted(ys[slots].view(x.shape[0], self.used, self.hidden), weights)

    def _router_rows(self, x: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
        """Router logits [rows, experts (+ the shared expert's gate)] in float32: the three bfloat16
        parts' products, summed in a fixed order, and the router's bias."""
        parts = qlinear(x, self.q_router, **kw)
        m = parts.shape[1] // 3
        logits = (parts[:, :m] + parts[:, m : 2 * m]) + parts[:, 2 * m :]
        if self.router.bias is not None:
            logits[:, : self.count] += self.router.bias.detach().float()
        return logits

    def _expert_rows(self, e: int, x: torch.Tensor, kw: dict[str, Any], out: torch.Tensor) -> None:
        gu = qlinear(x, self.q_gate_up[e], self.q_gate_up_bias[e], **kw)
        self._down(gu, self.q_down[e], self.q_down_bias[e], out)

    def _down(self, gu: torch.Tensor, down: QWeight, bias: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if self.act.fused_silu:
            return qlinear(gu, down, bias, silu_mul=True, out=out)
        return qlinear(kernels.load().swiglu_oai(gu), down, bias, out=out)
