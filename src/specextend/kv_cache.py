"""Static key/value cache: one preallocated buffer per model, no per-step reallocation.

Layout: k, v are [layers, kv_heads, capacity, head_dim]. Slots [0, length) hold committed
tokens. A forward writes its T new tokens into the *pending* slots [length, length + T) and
attends over [0, length + T); the caller then decides what to keep:

- `commit()` keeps all pending tokens (prefill, plain decoding),
- `commit(keep)` keeps a subset of them, in order (the accepted path of a verified tree),
- `discard()` keeps none (draft tokens that were only proposed).

Keeping a subset compacts in place, so the cache always holds exactly the committed tokens in
sequence order. `copy_slots_from` fills a cache with selected slots of another (the draft's
working cache made of retrieved chunks of its store).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CacheFullError(RuntimeError):
    pass


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
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.pending = 0

    # --- used by the model -------------------------------------------------------------------
    def begin(self, t: int) -> None:
        """Open T pending slots for a forward (previous pending slots are dropped)."""
        if self.length + t > self.capacity:
            raise CacheFullError(f"KV cache full: {self.length} + {t} > capacity {self.capacity}")
        self.pending = t

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the pending tokens' K/V of one layer; return views over committed + pending."""
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

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
