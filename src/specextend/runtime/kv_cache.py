"""Static key/value cache: one preallocated buffer per model, no per-step reallocation.

Layout: k, v are [layers, kv_heads, capacity, head_dim]. Slots [0, length) hold committed
tokens. A forward writes its T new tokens into the *pending* slots [length, length + T) and
attends over [0, length + T); the caller then decides what to keep:

- `commit()` keeps all pending tokens (prefill, plain decoding),
- `commit(keep)` keeps a subset of them, in order (the accepted path of a verified tree),
- `discard()` keeps none (draft tokens that were only proposed).

Keeping a subset compacts in place, so the cache always holds exactly the committed tokens in
sequence order. `copy_slots_from` fills a cache with selected slots of another (the draft's
working cache made of retrieved chunks of its store). `snapshot` copies the committed slots out
and `load` puts such a copy back as the first slots of a fresh cache. A `PrefixKV` is the pair of
snapshots one prompt's prefill leaves (target and draft): what the prefix cache stores.

Kinds (`KV_CACHES`, `--kv-cache`): "bf16" holds each K/V row as head_dim bfloat16 values (or the
activations' dtype without the CPU kernels); "q8" (the quantized CPU kernels only) holds it as
head_dim int8 values then head_dim/32 bfloat16 scales (csrc/core/kv_q8.h), dtype int8 and last
dimension head_dim + head_dim/16: about half the bytes a long context reads per step. The C++
writes quantize and attention reads them back (`bf16_rows` is the same conversion in torch).
Moving slots never looks inside a row, so every slot operation below serves both kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..common.settings import KV_CACHES

__all__ = ["KV_CACHES", "CacheFullError", "KVCache", "KVSnapshot", "PrefixKV"]


class CacheFullError(RuntimeError):
    pass


Q8_GROUP = 32  # values per bfloat16 scale in a q8 row


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension: head_dim values, or a q8 row's bytes (int8: head_dim + head_dim/16)."""
    return head_dim + head_dim // 16 if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one K or V row of one head."""
    return row_width(head_dim, dtype) * torch.empty(0, dtype=dtype).element_size()


def bf16_rows(rows: torch.Tensor) -> torch.Tensor:
    """q8 rows [..., head_dim + head_dim/16] (int8) as bfloat16 [..., head_dim]: each value times its
    group's scale (exact in float32), rounded to bfloat16, as the attention kernels read them."""
    d = rows.shape[-1] * 16 // 17
    q = rows[..., :d].float().unflatten(-1, (d // Q8_GROUP, Q8_GROUP))
    scales = rows[..., d:].contiguous().view(torch.bfloat16).float().unsqueeze(-1)
    return (q * scales).flatten(-2).to(torch.bfloat16)


@dataclass(frozen=True)
class KVSnapshot:
    """The K/V of a cache's first `length` committed tokens, copied out of it (or read from a file).

    k, v: [layers, kv_heads, length, head_dim]. Slot i depends only on tokens 0..i (attention is
    causal), so the first n slots of a snapshot are the snapshot of the first n tokens (`head`).
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def head(self, n: int) -> KVSnapshot:
        """The first n tokens' K/V (views, no copy)."""
        if not 0 < n <= self.length:
            raise IndexError(f"cannot take {n} tokens of a {self.length}-token snapshot")
        return KVSnapshot(self.k[:, :, :n], self.v[:, :, :n])


@dataclass(frozen=True)
class PrefixKV:
    """The KV of a prompt's first `length` tokens from an earlier prefill: the target cache, and the
    draft's store (None when the draft computed none of it, as under `ar`) with the mask of the
    slots it computed (the draft computes a prompt's KV where its policy reads it,
    speculation/draft_prefill.py; None: all of them)."""

    target_kv: KVSnapshot
    draft_kv: KVSnapshot | None
    draft_computed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.draft_kv is not None and self.draft_kv.length != self.target_kv.length:
            raise ValueError("a prefix's target and draft KV cover different token counts")
        if self.draft_computed is not None and (self.draft_kv is None
                                                or int(self.draft_computed.numel()) != self.target_kv.length):
            raise ValueError("a prefix's draft mask must come with draft KV of the same length")

    def draft_mask(self) -> torch.Tensor | None:
        """Which draft slots hold KV (None without draft KV)."""
        if self.draft_kv is None:
            return None
        if self.draft_computed is None:
            return torch.ones(self.length, dtype=torch.bool)
        return self.draft_computed.to(torch.bool)

    @property
    def length(self) -> int:
        return self.target_kv.length

    @property
    def nbytes(self) -> int:
        return self.target_kv.nbytes + (self.draft_kv.nbytes if self.draft_kv is not None else 0)

    def head(self, n: int) -> PrefixKV:
        """The first n tokens' KV (views)."""
        if self.draft_kv is None:
            return PrefixKV(self.target_kv.head(n), None)
        mask = self.draft_computed[:n] if self.draft_computed is not None else None
        return PrefixKV(self.target_kv.head(n), self.draft_kv.head(n), mask)

    @property
    def draft_slots(self) -> int:
        """How many slots hold draft KV."""
        mask = self.draft_mask()
        return 0 if mask is None else int(mask.sum())


def kind_of(dtype: torch.dtype) -> str:
    """The `--kv-cache` kind of a cache dtype ("q8" for int8 rows, else "bf16")."""
    return "q8" if dtype == torch.int8 else "bf16"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common leading run of two token arrays (their prompts' KV agrees that far)."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if dtype == torch.int8 and head_dim % Q8_GROUP:
            raise ValueError(f"a q8 KV cache needs a head_dim that is a multiple of {Q8_GROUP}, not {head_dim}")
        shape = (n_layers, n_kv_heads, capacity, row_width(head_dim, dtype))
        self.head_dim = head_dim
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.pending = 0
        # The token ids of the prompt whose KV the first slots hold (set by the prefill that fills
        # the cache; None: unknown), so a batch can hand one sequence's prompt KV to another whose
        # prompt starts the same way (batching/prompt_share.py).
        self.prompt: np.ndarray | None = None

    # --- used by the model -------------------------------------------------------------------
    def begin(self, t: int) -> None:
        """Open T pending slots for a forward (previous pending slots are dropped)."""
        if self.length + t > self.capacity:
            raise CacheFullError(f"KV cache full: {self.length} + {t} > capacity {self.capacity}")
        self.pending = t

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the pending tokens' K/V of one layer; return views over committed + pending."""
        if self.q8:
            raise TypeError("a q8 KV cache is written by the CPU kernels' forward only")
        end = self.length + self.pending
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    # --- used by the decoding loop -----------------------------------------------------------
    def commit(self, keep: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep all pending tokens (keep=None) or the given pending indices, in the given order."""
        if keep is None:
            self.length += self.pending
            self.pending = 0
            return
        if isinstance(keep, list) and len(keep) <= self.pending and keep == list(range(len(keep))):
            self.length += len(keep)  # a chain's path (a lone root's [0]): already in place
            self.pending = 0
            return
        idx = torch.as_tensor(keep, dtype=torch.long)
        n = int(idx.numel())
        if n == 0:
            self.pending = 0
            return
        if n > self.pending or int(idx.max()) >= self.pending or int(idx.min()) < 0:
            raise IndexError(f"keep indices {idx.tolist()} outside the {self.pending} pending slots")
        # Kept slots that are already in place (a prefix 0..m-1 of the pending block) need no copy.
        in_place = int((idx == torch.arange(n)).cumprod(0).sum())
        if in_place < n:
            src = self.length + idx[in_place:].to(self.k.device)
            dst = slice(self.length + in_place, self.length + n)
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
        self.length += n
        self.pending = 0

    def discard(self) -> None:
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Forget everything after `length` committed tokens."""
        if not 0 <= length <= self.length:
            raise IndexError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        self.pending = 0

    def reset(self) -> None:
        self.truncate(0)

    # --- building one cache out of another ----------------------------------------------------
    def copy_slots_from(self, other: KVCache, src: torch.Tensor, dst_start: int) -> None:
        """Copy committed slots `src` of `other` into this cache at [dst_start, dst_start + n)."""
        n = int(src.numel())
        if dst_start + n > self.capacity:
            raise CacheFullError(f"KV cache full: {dst_start} + {n} > capacity {self.capacity}")
        src = src.to(other.k.device)
        self.k[:, :, dst_start : dst_start + n] = other.k[:, :, src]
        self.v[:, :, dst_start : dst_start + n] = other.v[:, :, src]

    def put_slots(self, other: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots `src` of `other` into this cache's slots `dst` (any order; lengths unchanged)."""
        if int(src.numel()) != int(dst.numel()):
            raise ValueError("put_slots needs as many destination slots as source slots")
        if dst.numel() and int(dst.max()) >= self.capacity:
            raise CacheFullError(f"KV cache slot {int(dst.max())} beyond capacity {self.capacity}")
        src, dst = src.to(other.k.device), dst.to(self.k.device)
        self.k[:, :, dst] = other.k[:, :, src]
        self.v[:, :, dst] = other.v[:, :, src]

    def snapshot(self, length: int | None = None) -> KVSnapshot:
        """A compact copy of the first `length` committed slots (default: all of them)."""
        n = self.length if length is None else length
        if not 0 < n <= self.length:
            raise IndexError(f"cannot snapshot {n} tokens of a cache holding {self.length}")
        return KVSnapshot(self.k[:, :, :n].clone(), self.v[:, :, :n].clone())

    def load(self, snap: KVSnapshot) -> None:
        """Make the snapshot's tokens this cache's whole committed content (slots [0, n))."""
        if snap.k.shape[:2] != self.k.shape[:2] or snap.k.shape[3] != self.k.shape[3] or snap.k.dtype != self.k.dtype:
            theirs, ours = kind_of(snap.k.dtype), kind_of(self.k.dtype)
            kinds = f" (KV kinds {theirs} and {ours})" if theirs != ours else ""
            raise ValueError(f"a snapshot of shape {tuple(snap.k.shape)} {snap.k.dtype} does not fit a cache of "
                             f"{tuple(self.k.shape)} {self.k.dtype}{kinds}")
        n = snap.length
        if n > self.capacity:
            raise CacheFullError(f"KV cache full: {n} > capacity {self.capacity}")
        self.k[:, :, :n] = snap.k.to(self.k.device)
        self.v[:, :, :n] = snap.v.to(self.v.device)
        self.length = n
        self.pending = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def q8(self) -> bool:
        """Whether rows are q8 (int8 values and bfloat16 scales) rather than plain values."""
        return self.k.dtype == torch.int8

    def keys(self, layer: int, n: int) -> torch.Tensor:
        """Layer `layer`'s keys of slots [0, n) as values [kv_heads, n, head_dim] (q8: as bfloat16)."""
        k = self.k[layer, :, :n]
        return bf16_rows(k) if self.q8 else k
