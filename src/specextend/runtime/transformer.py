"""A Llama-family decoder in plain PyTorch: Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3 and the families
whose differences are switches over the same block (families.py: Granite, SmolLM3, ...).

One sequence, a static KV cache, and a forward over *any* set of new tokens: their ids, their
position ids and (optionally) a [T, T] mask of which new tokens see which. That one signature
serves prefill, one-token decoding, a draft tree and the target's verification of that tree.
The layers are layers.py's; the sizes config.py's.

`forward_many` runs the new tokens of several sequences (`Rows`, each with its own positions,
cache and mask) in one forward: on the quantized runtime one C++ call (fused_step.py) whose linear
layers read each weight once for all rows and whose attention runs per sequence over its own
cache, and since every kernel there is row-independent each sequence's logits and KV are the
bits it gets alone (`batches_rows`).
Elsewhere (float weights, whose GEMMs may block differently by row count) it runs them one after
the other, which keeps the bits too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from . import fused_step
from .attention import Backend
from .config import ModelConfig
from .kv_cache import KVCache
from .layers import Block, Embedding, Linear, RMSNorm, Ropes, Rows, Workspace, apply_rope, rope_inv_freq
from .quant import QWeight, qlinear


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions x inv_freq in float32, both rotary halves (the reference's angles)."""
    freqs = positions.to(inv_freq.device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


PREFILL_CHUNK = 512  # prompt tokens a prefill forward takes at most (bounds its working memory)


class OutputHead(Protocol):
    """A head that replaces the model's own output layer (a draft's head over a subset of the
    vocabulary: speculation/draft_vocab.py). `head` is the weight the fused step computes the
    logits with; `widen` turns those logits into logits over the whole vocabulary; `logits`
    computes them from the last layer's rows on the per-layer path."""

    @property
    def head(self) -> QWeight | Any: ...

    def widen(self, logits: torch.Tensor) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor | None = None) -> None:
        """`inv_freq`: the RoPE frequencies, when computed already (a model built on the meta
        device is given them: computed there, they would be thrown away, and torch's meta
        arithmetic imports its compiler, a second and a half at every start)."""
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.workspace = Workspace()
        for layer in self.layers:
            layer.workspace = self.workspace
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg) if inv_freq is None else inv_freq, persistent=False)
        # The windowed layers' own rope (Gemma 3's local base), when the family has one.
        local = rope_inv_freq(cfg, local=True) if cfg.local_rope_theta is not None else None
        self.register_buffer("inv_freq_local", local, persistent=False)
        self.weights = "float"  # the loader's weight scheme (models.loader.WEIGHTS)
        # Quantized activations turn a last-bit difference into a different int8 code, so the
        # quantized runtime runs all attention through the row-independent kernel: a token's
        # logits are then the same bits whether it is decoded alone or verified inside a tree.
        self.rowwise_attention = False
        # Forwards of at most this many rows of one sequence run every layer in one C++ call
        # (fused_step.py) on the quantized runtime; 0 drives every layer from Python.
        self.step_rows = fused_step.STEP_ROWS
        # The KV cache's kind (kv_cache.KV_CACHES): "q8" (int8 rows, the fused runtime only) or "bf16".
        self.kv_cache = "bf16"
        self._step_plan: Any = None
        self._step_head: tuple[QWeight, Any] | None = None  # the head the step computes, as it takes it
        # A head in place of lm_head (a draft's over a subset of the vocabulary), or None: lm_head.
        self.output_head: OutputHead | None = None

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
        if self.kv_cache == "q8" and self.fused:
            return torch.int8  # q8 rows (kv_cache.py)
        return torch.bfloat16 if self.rowwise_attention else self.dtype

    @torch.no_grad()
    def calibrate_key_offset(self, tokens: Sequence[int]) -> None:
        """Give each layer the offset a q8 cache stores its keys less (`Block.k_offset`): their mean
        over `tokens` (a fixed text: models/calibration.py, which keeps them on disk), per KV head
        and channel (`measure_key_offsets`)."""
        self.set_key_offsets(self.measure_key_offsets(tokens))

    @torch.no_grad()
    def measure_key_offsets(self, tokens: Sequence[int], dtype: torch.dtype | None = torch.bfloat16
                            ) -> list[torch.Tensor] | None:
        """Each layer's keys' mean over `tokens` ([kv_heads, head_dim] float32), from a bfloat16
        prefill (`dtype` None: the model's own cache, which a float model's attention in Python reads).
        Keys share a large component (layer 0's most: Qwen2's key bias among it) that would otherwise
        take each 32-value group's scale; a query's scores then all shift by q.c, which softmax
        ignores, so only the write changes. None where a shift is not ignored (soft-capped scores,
        attention sinks) or with no tokens: keys are then stored as they are."""
        if not tokens or self.cfg.attn_softcap or self.cfg.attn_sinks:
            return None
        n = len(tokens)
        cache = self.new_cache(n, dtype=dtype)
        ids = torch.tensor(list(tokens), dtype=torch.long)
        self.forward(ids, torch.arange(n), cache, logits_rows=slice(n - 1, n))
        cache.commit()
        # in float64, where a sum of bfloat16 values is exact: the same offsets whatever the threads; a convolution
        # layer (LFM2) stores no keys: zeros
        none = torch.zeros(self.cfg.num_kv_heads, self.cfg.head_dim)
        return [none if self.cfg.conv(i) else cache.keys(i, n).double().mean(1).float().contiguous()
                for i in range(len(self.layers))]

    def set_key_offsets(self, offsets: Sequence[torch.Tensor] | None) -> None:
        """Set the layers' key offsets (`measure_key_offsets`' or read back from disk; None: none)."""
        if offsets is not None:
            shape = (self.cfg.num_kv_heads, self.cfg.head_dim)
            if len(offsets) != len(self.layers) or any(tuple(o.shape) != shape or o.dtype != torch.float32
                                                       for o in offsets):
                raise ValueError(f"key offsets must be {len(self.layers)} float32 tensors of shape {shape}")
        for i, layer in enumerate(self.layers):
            layer.k_offset = None if offsets is None else offsets[i].contiguous()
        self._step_plan, self._step_head = None, None  # the whole-step call takes them when planned

    @property
    def key_offset_digest(self) -> str | None:
        """A digest of the layers' key offsets (None: none), which a q8 cache's bits depend on."""
        parts = [layer.k_offset for layer in self.layers if layer.k_offset is not None]
        if not parts:
            return None
        return hashlib.sha256(b"".join(p.numpy().tobytes() for p in parts)).hexdigest()[:16]

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None, room: int | None = None) -> KVCache:
        """A KV cache of `capacity` tokens; with `room`, the windowed layers keep only their window
        and that many slots more (kv_cache.py), else every token."""
        c = self.cfg
        flags, window = c.cache_windows
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype or self.kv_dtype, self.device,
                       flags, window, room, c.hidden_size if c.conv_layers else 0)

    def rope(self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 then cast, exactly as the reference does, so float64 runs match it.
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        cos, sin = _angles(positions, inv_freq)
        sc = self.cfg.rope_scaling
        if inv_freq is self.inv_freq and sc is not None and sc.get("attention_factor", 1.0) != 1.0:
            # LongRoPE scales the rotation's magnitude (in float32, as the reference does)
            cos, sin = cos * sc["attention_factor"], sin * sc["attention_factor"]
        return cos.to(self.dtype), sin.to(self.dtype)

    def ropes(self, positions: torch.Tensor) -> Ropes:
        """(cos, sin) of every rope kind the layers apply (`ModelConfig.rope_kind`)."""
        out = [self.rope(positions)]
        if self.inv_freq_local is not None:
            out.append(self.rope(positions, self.inv_freq_local))
        return out

    def rotate_keys(self, cache: KVCache, n: int, delta: torch.Tensor) -> None:
        """The first n cached keys of every layer, in place, as if each had been written `delta` [n]
        positions later: each layer's own rope (none on a NoPE layer), a pure rotation (LongRoPE's
        magnitude factor is already in the keys). A rotation by a + b is the rotation by a, then b."""
        ropes = [tuple(a.to(self.dtype) for a in _angles(delta, inv))
                 for inv in (self.inv_freq, self.inv_freq_local) if inv is not None]
        for i, layer in enumerate(self.layers):
            if layer.rope_kind >= 0:
                k, _, base = cache.layer(i)
                if base:
                    raise ValueError("keys are rotated in a cache whose windowed layers keep every token")
                cos, sin = ropes[layer.rope_kind]
                k[:, :n] = apply_rope(k[:, :n].clone(), cos.to(k.device), sin.to(k.device))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.to(self.device))
        if self.cfg.embed_scale != 1.0:  # in the activations' dtype, as the reference multiplies
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

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
        self._attention_queries(keep_q)
        cache.begin(tokens.shape[0])
        if self.rowwise_attention:
            backend = "rowwise"
        ropes = self.ropes(positions)
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer(x, ropes, cache, tree_mask, backend, keep_q, positions)
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

    def _attention_queries(self, keep_q: dict[int, torch.Tensor] | None) -> None:
        """Drop the convolution layers (LFM2) from the layers whose queries a forward keeps: they have none, and
        retrieval scores with the attention layers (`draft_policy.seeing_everything`)."""
        if keep_q and self.cfg.conv_layers:
            for i in [i for i in keep_q if self.cfg.conv(i)]:
                del keep_q[i]

    def _forward_fused(self, parts: list[Rows]) -> list[torch.Tensor]:
        for p in parts:
            self._attention_queries(p.keep_q)
            p.cache.begin(p.size)
        one = len(parts) == 1
        positions = parts[0].positions if one else torch.cat([p.positions for p in parts])
        tokens = parts[0].tokens if one else torch.cat([p.tokens for p in parts])
        ropes = self.ropes(positions)
        x = self._embed(tokens)
        if self._takes_step(x, parts):
            return self._forward_step(x, *fused_step.rope_tables(self.cfg, ropes), parts)
        for layer in self.layers:
            x = layer.forward_rows(x, ropes, parts)
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
        """Whether a fused forward runs as one C++ call (fused_step.py): a lone sequence's few rows, or
        a batch's sequences whatever their rows. A family with switches the C++ step does not
        implement (`ModelConfig.stepped`) keeps the per-layer kernels, and so does an expert model's
        forward of more rows than a step's (a batch's prefill: there each expert's many rows take the
        many-row kernels through `Experts`) and a forward with rows past an attention temperature's first
        window (Ministral 3 beyond its original context)."""
        if not self.cfg.stepped or self.step_rows <= 0 or (len(parts) == 1 and parts[0].size > self.step_rows):
            return False
        c = self.cfg  # the call has no attention temperature: rows past its first window take the layers' kernels
        if c.attn_temperature and any(p.size and int(p.positions.max()) >= c.temperature_length for p in parts):
            return False
        if self.cfg.experts and x.shape[0] > self.step_rows:
            return False
        if self.output_head is not None and not isinstance(self.output_head.head, QWeight):
            return False
        return self.lm_head.qweight is not None and all(p.size > 0 and fused_step.fits(x, p.cache) for p in parts)

    def _forward_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[Rows]
                      ) -> list[torch.Tensor]:
        """Every layer and the head in one C++ call; each part's logits."""
        if self._step_plan is None:
            self._step_plan = fused_step.plan(self.cfg, self.layers)
        weight = self.lm_head.qweight if self.output_head is None else self.output_head.head
        if self._step_head is None or self._step_head[0] is not weight:
            self._step_head = (weight, fused_step.head(self._step_plan, self.norm, weight))
        rows, counts = fused_step.logit_rows(parts)
        window = self.cfg.sliding_window if any(self.cfg.window_layers) else 0
        logits = fused_step.run(self._step_plan, x.contiguous(), cos, sin, parts, self.cfg.num_heads,
                                self._step_head[1], rows, window, self.cfg.conv_kernel)
        if self.output_head is not None:
            logits = self.output_head.widen(logits)
        logits = self._scaled_logits(logits)
        return [logits] if len(parts) == 1 else list(torch.split(logits, counts))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_head is not None:
            return self._scaled_logits(self.output_head.logits(x))
        if self.lm_head.qweight is not None:  # the final norm folded into the head's quantized product
            logits = qlinear(x, self.lm_head.qweight, norm=self.norm.weight, eps=self.norm.eps, center=self.norm.center)
        else:
            logits = self.lm_head(self.norm(x))
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return self._scaled_logits(logits)

    def _scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's logit divisor (Granite) and final soft-capping (Gemma 2), if any."""
        c = self.cfg
        if c.logit_divisor != 1.0:
            logits = logits / c.logit_divisor
        if c.final_softcap is not None:  # a trimmed draft head's -inf stay -inf
            capped = torch.tanh(logits / c.final_softcap) * c.final_softcap
            logits = torch.where(torch.isinf(logits), logits, capped)
        return logits

    def prefill(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        backend: Backend = "efficient",
        chunk: int = PREFILL_CHUNK,
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
