"""What a rule for quantizing the linear layers' activations would cost, measured before a kernel is
built: the float32 model (a GGUF's weights dequantized exactly) with each linear layer's input
fake-quantized (quantized to int8 and back) as the rule says for the GGUF type of each slice of its
output, so that `bench.quality` scores the activations' rounding alone.

    python -m specextend.bench.quality --data ../shared/data/govreport/govreport_16K.jsonl --chunks 8 \\
        --weights act-p32,act-k256,act-k256s:Q4_K+Q6_K --out results/act-rules

A scheme is `act-<rule>[:<types>]`, the types joined by `+` (default: the K-quant family, which the
project's decision lets take activations per 256). The rule applies to those types' slices; every
other slice keeps the kernels' per-32 activations:
- `p32`: one scale per 32 values (the kernels' arithmetic for every type today);
- `k256`: one scale per 256 values (llama.cpp's Q8_K; the kernels' `SPECEXTEND_K256`);
- `k256s`: one scale per 256 values with each 32 values' codes on a power-of-two finer step, d / 2^e
  with e = min(3, floor(log2(256-max / 32-max))): a small group keeps its precision, and every integer
  sum still closes with one float step a super-block (a shift of the codes, not a second scale).
A scale is the group's largest magnitude over 127, each value rounded to the nearest code.

A scheme may end in `@scores-q8` (`float32@scores-q8`, `act-p32@scores-q8`): attention's scores from int8
queries and keys, each with one scale per 32 of a head's dimensions, the keys less the layer's offset (a q8 KV
cache's, measured on the model as `--kv-cache q8` does) before they are quantized; the values as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..common.errors import UserError

K_FAMILY = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
RULES = ("p32", "k256", "k256s")
MAX_STEP = 3  # k256s: at most 2^3 finer than the block's step (exponents 0-3: 2 bits a group; docs/log/2026-12-q8k.md)


def per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, n] with one scale per `group` values along each row, quantized to int8 and back."""
    g = x.reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).reshape(x.shape)


def stepped(x: torch.Tensor, max_step: int = MAX_STEP) -> torch.Tensor:
    """x [rows, n] per 256 values with each 32 values' codes on the step d / 2^e (the module's `k256s`)."""
    blocks = x.reshape(x.shape[0], -1, 8, 32)
    group_max = blocks.abs().amax(-1, keepdim=True)  # [rows, blocks, 8, 1]
    block_max = group_max.amax(-2, keepdim=True)  # [rows, blocks, 1, 1]
    ratio = torch.where(group_max > 0, block_max / group_max, torch.ones_like(group_max))
    e = torch.clamp(torch.floor(torch.log2(ratio)), 0, max_step)  # group max * 2^e <= block max
    step = block_max / 127.0 / torch.pow(2.0, e)
    inv = torch.where(step != 0, 1.0 / step, torch.zeros_like(step))
    return (torch.clamp(torch.round(blocks * inv), -127, 127) * step).reshape(x.shape)


SCORES_Q8 = "@scores-q8"


def split_scores(scheme: str) -> tuple[str, bool]:
    """(the scheme without `@scores-q8`, whether it ended in it)."""
    if scheme.endswith(SCORES_Q8):
        return scheme[: -len(SCORES_Q8)], True
    return scheme, False


def scores_q8(block: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's attention inputs as int8 scores see them (`Block.score_inputs`): q [heads, rows, head_dim]
    and k [kv_heads, keys, head_dim] per 32 dimensions, k less the layer's offset first; all three in the
    query's dtype (a float32 model's keys and values come from a bfloat16 cache)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    c = block.k_offset.to(q.dtype).unsqueeze(1)  # [kv_heads, 1, head_dim]
    return _along_dims(q), _along_dims(k - c) + c, v


def _along_dims(x: torch.Tensor) -> torch.Tensor:
    return per_group(x.reshape(-1, x.shape[-1]), 32).reshape(x.shape)


def apply_scores_q8(model: nn.Module, calibration_tokens: list[int]) -> None:
    """Give every block of `model` (a float Transformer's: attention in Python) the int8 scores, with the
    key offsets a q8 cache would use measured on these tokens (models/calibration.py's text)."""
    if model.rowwise_attention:
        raise UserError(f"{SCORES_Q8} is emulated on float models only (float32, float64, act- schemes)")
    offsets = model.measure_key_offsets(calibration_tokens, dtype=None)
    if offsets is None:
        raise UserError(f"{SCORES_Q8}: this model keeps no key offsets (soft-capped scores or attention sinks)")
    model.set_key_offsets(offsets)
    for blk in model.layers:
        blk.score_inputs = scores_q8


_RULE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "p32": lambda x: per_group(x, 32), "k256": lambda x: per_group(x, 256), "k256s": stepped}


def parse(scheme: str) -> tuple[str, tuple[str, ...]] | None:
    """(rule, types) of an `act-` scheme, None for any other scheme; UserError if malformed."""
    if not scheme.startswith("act-"):
        return None
    rule, _, types = scheme[4:].partition(":")
    if rule not in RULES:
        raise UserError(f"unknown activation rule in {scheme!r}; choose from {', '.join(RULES)}")
    chosen = tuple(t for t in types.split("+") if t) if types else K_FAMILY
    bad = [t for t in chosen if t not in K_FAMILY]
    if bad:
        raise UserError(f"{scheme!r}: {', '.join(bad)} is not a K-quant type ({', '.join(K_FAMILY)}); "
                        "32-weight types keep per-32 activations")
    return rule, chosen


class Emulated(nn.Module):
    """A linear layer whose input is fake-quantized per slice of its output: each distinct rule's
    input goes through the layer once and each slice takes its columns (a packed weight stays packed)."""

    def __init__(self, inner: nn.Module, parts: list[tuple[int, str]]) -> None:
        super().__init__()
        self.inner, self.parts = inner, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return self.inner(x)
        outs = {r: self.inner(_RULE[r](x)) for r in dict.fromkeys(r for _, r in self.parts)}
        if len(outs) == 1:
            return next(iter(outs.values()))
        cols, start = [], 0
        for n, r in self.parts:
            cols.append(outs[r][..., start:start + n])
            start += n
        return torch.cat(cols, -1)


def gguf_types(path: Path) -> dict[str, str]:
    """Each tensor's GGUF type name (`Q4_K`, `F32`, ...) by its GGUF name."""
    from ..models.gguf import open_gguf, type_name

    return {t.name: type_name(t) for t in open_gguf(path).tensors}


def apply(model: nn.Module, scheme: str, types: dict[str, str]) -> None:
    """Wrap `model`'s (a float32 Transformer's) linear layers to fake-quantize their inputs by the
    `act-` scheme, for the GGUF tensor types `types` its weights came from."""
    rule, chosen = parse(scheme)  # type: ignore[misc]
    cfg = model.cfg
    if cfg.experts:
        raise UserError(f"{scheme}: the activation rules are emulated on dense models only")

    def kind(name: str) -> str:
        if name not in types:
            raise UserError(f"{scheme}: the GGUF has no tensor {name}; is it the model's own file?")
        return rule if types[name] in chosen else "p32"

    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, blk in enumerate(model.layers):
        t = f"blk.{i}."
        qkv = ([(q_out + 2 * kv_out, kind(t + "attn_qkv.weight"))] if t + "attn_qkv.weight" in types else
               [(q_out, kind(t + "attn_q.weight")), (kv_out, kind(t + "attn_k.weight")),
                (kv_out, kind(t + "attn_v.weight"))])
        gate_up = ([(2 * cfg.intermediate_size, kind(t + "ffn_up.weight"))] if t + "ffn_gate.weight" not in types
                   else [(cfg.intermediate_size, kind(t + "ffn_gate.weight")),
                         (cfg.intermediate_size, kind(t + "ffn_up.weight"))])
        blk.qkv = Emulated(blk.qkv, qkv)
        blk.o = Emulated(blk.o, [(cfg.hidden_size, kind(t + "attn_output.weight"))])
        blk.gate_up = Emulated(blk.gate_up, gate_up)
        blk.down = Emulated(blk.down, [(cfg.hidden_size, kind(t + "ffn_down.weight"))])
    head = "output.weight" if "output.weight" in types else "token_embd.weight"  # tied: the embeddings' type
    model.output_head = EmulatedHead(model.norm, Emulated(model.lm_head, [(cfg.vocab_size, kind(head))]))


class EmulatedHead:
    """The model's own output layer with its input fake-quantized (a `Transformer.OutputHead`). It
    holds the final norm, not the model: a cycle would keep a dropped model's weights until a collection."""

    def __init__(self, norm: nn.Module, linear: Emulated) -> None:
        self.norm, self.linear = norm, linear

    @property
    def head(self) -> nn.Module:
        return self.linear

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))
