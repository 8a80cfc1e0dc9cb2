"""A Llama-family decoder in plain PyTorch: Llama 2/3/3.x, Mistral, Qwen2/2.5 and Qwen3.

One sequence, a static KV cache, and a forward over *any* set of new tokens: their ids, their
position ids and (optionally) a [T, T] mask of which new tokens see which. That one signature
serves prefill, one-token decoding, a draft tree and the target's verification of that tree.

`forward_many` runs the new tokens of several sequences (`Rows`, each with its own positions,
cache and mask) in one forward: on the quantized runtime one C++ call (step.py) whose linear
layers read each weight once for all rows and whose attention runs per sequence over its own
cache, and since every kernel there is row-independent each sequence's logits and KV are the
bits it gets alone (`batches_rows`).
Elsewhere (float weights, whose GEMMs may block differently by row count) it runs them one after
the other, which keeps the bits too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, step
from .attention import Backend, attend
from .errors import UserError
from .kernels import qlinear
from .kv_cache import KVCache
from .quant import QWeight

if TYPE_CHECKING:
    from .vocab_trim import VocabTrim

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; refuse architectures we do not implement."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None and d.get("model_type") in SUPPORTED_ARCHS.values():
            arch = d["model_type"]
        if arch is None:
            name = ", ".join(archs) or d.get("model_type") or "unknown"
            raise UserError(
                f"unsupported model architecture {name}; supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        # transformers 5 folds rope settings into `rope_parameters`; older configs use top-level keys.
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise UserError(f"unsupported RoPE scaling {kind!r} (supported: default, linear, llama3)")
            if kind == "default":
                scaling = None
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        max_pos = int(d.get("max_position_embeddings", 4096))
        # Mistral v0.1 attends through a sliding window; we attend fully, so stay inside it.
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "mistral"):
            max_pos = min(max_pos, int(d["sliding_window"]))
        return cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies in float32, as Hugging Face computes them (so outputs match exactly)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [heads, T, D] by per-token angles (cos/sin: [T, D]), the rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class Rows:
    """One sequence's new tokens in a forward: `Transformer.forward`'s arguments as one value."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    tree_mask: torch.Tensor | None = None
    logits_rows: torch.Tensor | slice | None = None
    keep_q: dict[int, torch.Tensor] | None = None
    backend: Backend = "efficient"  # the attention of the float paths (the quantized runtime's is its own)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype (as the reference implementations do).
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) with the weight in one of three forms, chosen when the model is loaded:

    - a float weight (any device, any dtype): `F.linear`; float64 is what exactness tests use;
    - the same reordered by oneDNN (`pack()`, float32/bfloat16 on CPU): PyTorch's default GEMM
      for 1-16 rows runs at a fraction of memory bandwidth on this kind of CPU, and decoding and
      verification are exactly that case; fewer than 4 rows are padded to 4, its fastest shape;
    - a block-quantized weight (`quantize()`, a `quant.QWeight`): the C++ kernels quantize the
      input to int8 per block of 32 of each row and read each weight block once for all rows.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d_out), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.qweight: QWeight | None = None

    def pack(self) -> None:
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if not torch.backends.mkldnn.is_available():
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.data, None)
        self.weight = None  # type: ignore[assignment]

    def quantize(self, qweight: QWeight) -> None:
        """Compute with a block-quantized weight from now on (the float weight is dropped)."""
        self.qweight = qweight
        self.weight = None  # type: ignore[assignment]
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return qlinear(x, self.qweight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        t = x.shape[0]
        if t < 4:
            x = torch.cat([x, x.new_zeros(4 - t, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:t] if t < 4 else y


class Embedding(nn.Module):
    """Token embeddings: a float table, or a block-quantized one whose rows are dequantized on lookup."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)
        self.qweight: QWeight | None = None

    def quantize(self, qweight: QWeight) -> None:
        self.qweight = qweight
        self.weight = None  # type: ignore[assignment]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids)
        return F.embedding(ids, self.weight)


class Workspace:
    """A reusable output buffer for the quantized runtime's widest product (gate/up: 2 x the MLP
    width per token). A prefill chunk's is tens of MB; allocated anew for every layer, the C
    library maps fresh pages for it each time and the page faults cost a visible share of prefill
    (docs/benchmarks.md). One per model: its layers run one after another."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        if self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols)
        return self._buf[: rows * cols].view(rows, cols)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.o = Linear(q_out, cfg.hidden_size, bias=False)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.workspace = Workspace()  # the model gives all its layers one (Transformer.__init__)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None,
        backend: Backend,
        keep_q: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        qkv = self.qkv(self.attn_norm(x))
        q = qkv[:, : nh * hd].view(t, nh, hd).transpose(0, 1)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(t, nkv, hd).transpose(0, 1)
        v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd).transpose(0, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if keep_q is not None and self.index in keep_q:
            keep_q[self.index] = q
        k_all, v_all = cache.write(self.index, k, v)
        a = attend(q, k_all, v_all, tree_mask, backend)
        x = x + self.o(a.transpose(0, 1).reshape(t, nh * hd))
        gu = self.gate_up(self.mlp_norm(x))
        g, u = gu.chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)

    @property
    def quantized(self) -> bool:
        return all(m.qweight is not None for m in (self.qkv, self.o, self.gate_up, self.down))

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[Rows]
                     ) -> torch.Tensor:
        """The layer in five kernel calls over the rows of several sequences (x: their rows one
        after the other): a decode step is a few dozen microseconds of Python per layer instead of
        some forty small tensor operations (the norms, SiLU and residual adds are folded into the
        quantized products; RoPE and the cache write are one call). The products take every row at
        once; RoPE, the cache write and attention run per sequence, over its own cache."""
        qkv = kernels.qlinear(x, self.qkv.qweight, self.qkv.bias, norm=self.attn_norm.weight, eps=self.attn_norm.eps)
        ext = kernels.load()
        q_norm = self.q_norm.weight if self.q_norm is not None else None
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        outs = []
        off = 0
        for p in parts:
            t, cache = p.size, p.cache
            k_layer, v_layer = cache.k[self.index], cache.v[self.index]
            start = cache.length
            rows = slice(off, off + t)
            q = ext.rope_store(qkv[rows], cos[rows], sin[rows], self.n_heads, q_norm, k_norm, self.attn_norm.eps,
                               k_layer, v_layer, start)
            if p.keep_q is not None and self.index in p.keep_q:
                p.keep_q[self.index] = q
            end = start + cache.pending
            a = kernels.attend(q, k_layer[:, :end], v_layer[:, :end], p.tree_mask)
            outs.append(a.transpose(0, 1).reshape(t, -1))
            off += t
        a = outs[0] if len(outs) == 1 else torch.cat(outs)
        x = kernels.qlinear(a, self.o.qweight, residual=x)
        gu = kernels.qlinear(x, self.gate_up.qweight, norm=self.mlp_norm.weight, eps=self.mlp_norm.eps,
                             out=self.workspace.take(x.shape[0], self.gate_up.qweight.n))
        return kernels.qlinear(gu, self.down.qweight, silu_mul=True, residual=x)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.workspace = Workspace()
        for layer in self.layers:
            layer.workspace = self.workspace
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.weights = "float"  # the loader's weight scheme (models.loader.WEIGHTS)
        # Quantized activations turn a last-bit difference into a different int8 code, so the
        # quantized runtime runs all attention through the row-independent kernel: a token's
        # logits are then the same bits whether it is decoded alone or verified inside a tree.
        self.rowwise_attention = False
        # Forwards of at most this many rows of one sequence run every layer in one C++ call
        # (step.py) on the quantized runtime; 0 drives every layer from Python.
        self.step_rows = step.STEP_ROWS
        self._step_plan: Any = None
        self._step_head: tuple[QWeight, Any] | None = None  # the head the step computes, as it takes it
        # A draft's head over a subset of the vocabulary (vocab_trim.py), or None: all of it.
        self.vocab_trim: VocabTrim | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and KV cache's dtype (quantized weights compute in float32)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: bfloat16 for the row-wise attention kernel (half the bytes a long
        context reads per step, and bfloat16 dot products), else the activations' dtype."""
        return torch.bfloat16 if self.rowwise_attention else self.dtype

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype or self.kv_dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 then cast, exactly as the reference does, so float64 runs match it.
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def pack(self) -> Transformer:
        """Reorder every projection for the fast few-row CPU kernel (see `Linear`)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()
        return self

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,
        backend: Backend = "efficient",
        logits_rows: torch.Tensor | slice | None = None,
        keep_q: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run T new tokens through the model, writing their K/V into `cache`'s pending slots.

        tokens, positions: [T]; tree_mask: [T, M] bool, what each new token may see among the
        last M keys (see attention.py), or None for causal. The caller commits the pending slots
        afterwards (see `KVCache`). logits_rows picks the rows that need logits (prefill needs
        one, not T x vocab). keep_q: a dict whose keys are layer indices; each gets that layer's
        rotated queries [H, T, D].
        Returns logits [rows, vocab] (float32 or wider).
        """
        if self.fused:
            return self._forward_fused([Rows(tokens, positions, cache, tree_mask, logits_rows, keep_q, backend)])[0]
        cache.begin(tokens.shape[0])
        if self.rowwise_attention:
            backend = "rowwise"
        cos, sin = self.rope(positions)
        x = self.embed(tokens.to(self.device))
        for layer in self.layers:
            x = layer(x, cos, sin, cache, tree_mask, backend, keep_q)
        x = x if logits_rows is None else x[logits_rows]
        return self._logits(x)

    @property
    def fused(self) -> bool:
        """Whether forwards run the quantized kernels' fused layers (`Block.forward_rows`)."""
        return self.rowwise_attention and all(layer.quantized for layer in self.layers)

    @property
    def batches_rows(self) -> bool:
        """Whether `forward_many` stacks the sequences' rows into one forward: only where every
        kernel is row-independent (the quantized runtime, its head included)."""
        return self.fused and self.lm_head.qweight is not None

    @torch.no_grad()
    def forward_many(self, parts: list[Rows]) -> list[torch.Tensor]:
        """`forward` for several sequences at once: each part's logits, as `forward` returns them
        for that part alone (the same bits). Each part's cache gets its pending slots."""
        if self.batches_rows and len(parts) > 1:
            return self._forward_fused(parts)
        return [self(p.tokens, p.positions, p.cache, p.tree_mask, p.backend, p.logits_rows, p.keep_q) for p in parts]

    def _forward_fused(self, parts: list[Rows]) -> list[torch.Tensor]:
        for p in parts:
            p.cache.begin(p.size)
        one = len(parts) == 1
        positions = parts[0].positions if one else torch.cat([p.positions for p in parts])
        tokens = parts[0].tokens if one else torch.cat([p.tokens for p in parts])
        cos, sin = self.rope(positions)
        x = self.embed(tokens.to(self.device))
        if self._takes_step(x, parts):
            return self._forward_step(x, cos, sin, parts)
        for layer in self.layers:
            x = layer.forward_rows(x, cos, sin, parts)
        picked, counts, off = [], [], 0
        for p in parts:
            rows = x[off : off + p.size]
            rows = rows if p.logits_rows is None else rows[p.logits_rows]
            picked.append(rows)
            counts.append(int(rows.shape[0]))
            off += p.size
        logits = self._logits(picked[0] if one else torch.cat(picked))
        return [logits] if one else list(torch.split(logits, counts))

    def _takes_step(self, x: torch.Tensor, parts: list[Rows]) -> bool:
        """Whether a fused forward runs as one C++ call (step.py): a lone sequence's few rows, or
        a batch's sequences whatever their rows."""
        if self.step_rows <= 0 or (len(parts) == 1 and parts[0].size > self.step_rows):
            return False
        if self.vocab_trim is not None and not isinstance(self.vocab_trim.head, QWeight):
            return False
        return self.lm_head.qweight is not None and all(p.size > 0 and step.fits(x, p.cache) for p in parts)

    def _forward_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[Rows]
                      ) -> list[torch.Tensor]:
        """Every layer and the head in one C++ call; each part's logits."""
        if self._step_plan is None:
            self._step_plan = step.plan(self)
        weight = self.lm_head.qweight if self.vocab_trim is None else self.vocab_trim.head
        if self._step_head is None or self._step_head[0] is not weight:
            self._step_head = (weight, step.head(self._step_plan, self, weight))
        rows, counts = step.logit_rows(parts)
        logits = step.run(self._step_plan, x.contiguous(), cos, sin, parts, self.cfg.num_heads, self._step_head[1],
                          rows)
        if self.vocab_trim is not None:
            logits = self.vocab_trim.widen(logits)
        return [logits] if len(parts) == 1 else list(torch.split(logits, counts))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.vocab_trim is not None:
            return self.vocab_trim.logits(x)
        if self.lm_head.qweight is not None:  # the final norm folded into the head's quantized product
            logits = qlinear(x, self.lm_head.qweight, norm=self.norm.weight, eps=self.norm.eps)
        else:
            logits = self.lm_head(self.norm(x))
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return logits

    def prefill(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        backend: Backend = "efficient",
        chunk: int = 512,
        last_q: dict[int, torch.Tensor] | None = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Feed a prompt in chunks (bounded memory at any length); returns the last token's logits.

        last_q: if given, filled with every layer's query of the last prompt token ([H, 1, D]),
        so retrieval can score the prompt by what its last token attends to.
        on_chunk: called with the prompt tokens prefilled so far after each chunk (progress).
        """
        start = cache.length
        n = tokens.shape[0]
        logits = None
        for s in range(0, n, chunk):
            piece = tokens[s : s + chunk]
            pos = torch.arange(start + s, start + s + piece.shape[0])
            last = s + chunk >= n
            keep = dict.fromkeys(range(self.cfg.num_layers)) if last and last_q is not None else None
            out = self(piece, pos, cache, None, backend, logits_rows=slice(-1, None) if last else slice(0, 0),
                       keep_q=keep)
            cache.commit()
            if on_chunk is not None:
                on_chunk(s + piece.shape[0])
            if last:
                logits = out[-1]
                if keep is not None:
                    last_q.update({i: q[:, -1:].clone() for i, q in keep.items()})
        assert logits is not None, "prefill needs at least one token"
        return logits
