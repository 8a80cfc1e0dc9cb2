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
writes quantize and attention reads them back (`bf16_rows` is the same conversion in torch). Keys
are stored less one vector per layer and KV head (`Block.k_offset`, the keys' mean over a fixed
text: `Transformer.calibrate_key_offset`): the part every key shares (large in the first layers)
would otherwise take each group's scale, and it shifts all of a query's scores by one amount, which
softmax ignores, so a q8 cache's keys are read as they are stored (`keys` too: retrieval takes
softmax probabilities of them). The offsets are the model's, the same for every cache it fills.
Moving slots never looks inside a row, so every slot operation below serves both kinds.

Sliding-window layers (Gemma 2/3, gpt-oss, Phi-3's windowed files) see only the last `window`
tokens, so a cache keeps them apart: `k`/`v` hold the other layers ([global layers, ...]) and
`wk`/`wv` the windowed ones ([windowed layers, kv_heads, window slots, ...]), whose slot 0 is the
token at position `woffset`. A cache made with `room` keeps `window + room` slots there and slides
them (drops the tokens no new row can see) when a forward would run past: a long document then
costs the windowed layers only their window, not every token. Without `room` they have the
capacity and `woffset` stays 0 (the draft's store and working cache, whose slots retrieval copies
around). Only the windowed layers' oldest tokens are ever dropped, and only those more than a
window before every row to come, so what each row attends to, and its bits, stay as they were.

LFM2's short convolutions keep their state in the same place (`conv_width`): a convolution over the
last `kernel` tokens is, for the cache, a windowed layer of window `kernel` whose slot holds one
float32 row (the token's B * x) instead of K and V, so every slot operation above serves it too.
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


def first_head(first: int, window: int) -> int:
    """The fewest leading tokens whose next rows see only what windowed layers holding the tokens
    from `first` on keep (a row at position n sees keys after n - window): 1 when they keep all."""
    return 1 if first == 0 else first + window - 1


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

    k, v: [layers, kv_heads, length, head_dim] (with windowed layers: the others'). Slot i depends
    only on tokens 0..i (attention is causal), so the first n slots of a snapshot are the snapshot
    of the first n tokens (`head`). wk, wv: the windowed layers' tokens [wfirst, length) (None: the
    model has no windowed layers); a head needs the last `window - 1` tokens before its end.
    """

    k: torch.Tensor
    v: torch.Tensor
    wk: torch.Tensor | None = None
    wv: torch.Tensor | None = None
    wfirst: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if (self.wk is None) != (self.wv is None) or (self.wk is not None and (
                self.wk.shape[2] != self.length - self.wfirst or self.wfirst < 0 or self.window < 1)):
            raise ValueError("a snapshot's windowed part must hold its tokens from wfirst to the end")

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        parts = [self.k, self.v] + ([self.wk, self.wv] if self.wk is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def first_head(self) -> int:
        """The fewest tokens a head can take (the windowed layers keep only their last ones)."""
        return 1 if self.wk is None else first_head(self.wfirst, self.window)

    def can_head(self, n: int) -> bool:
        """Whether the first n tokens' K/V are all here."""
        return self.first_head <= n <= self.length

    def head(self, n: int) -> KVSnapshot:
        """The first n tokens' K/V (views, no copy)."""
        if not self.can_head(n):
            held = f" (its windowed layers hold tokens {self.wfirst} on)" if self.wfirst else ""
            raise IndexError(f"cannot take {n} tokens of a {self.length}-token snapshot{held}")
        if self.wk is None or self.wv is None:
            return KVSnapshot(self.k[:, :, :n], self.v[:, :, :n])
        return KVSnapshot(self.k[:, :, :n], self.v[:, :, :n], self.wk[:, :, : n - self.wfirst],
                          self.wv[:, :, : n - self.wfirst], self.wfirst, self.window)


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

    @property
    def first_head(self) -> int:
        """The fewest tokens `head` can take (windowed layers keep only their last tokens)."""
        return max(self.target_kv.first_head, self.draft_kv.first_head if self.draft_kv is not None else 1)

    def can_head(self, n: int) -> bool:
        """Whether `head(n)` holds every layer's KV of those tokens."""
        return self.first_head <= n <= self.length

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
        windowed: Sequence[bool] = (),
        window: int = 0,
        room: int | None = None,
        conv_width: int = 0,
    ) -> None:
        """`windowed` (per layer) and `window`: the layers that attend through a sliding window, kept
        apart; `room`: slots beyond the window they keep (None: the capacity, never sliding).
        `conv_width`: the windowed layers are short convolutions (LFM2) whose slot holds one float32 row of that
        many values (their input of the token), `wk` [layers, 1, slots, conv_width], and `wv` no values."""
        if dtype == torch.int8 and head_dim % Q8_GROUP:
            raise ValueError(f"a q8 KV cache needs a head_dim that is a multiple of {Q8_GROUP}, not {head_dim}")
        flags = tuple(bool(w) for w in windowed) if window > 0 and any(windowed) else ()
        if flags and len(flags) != n_layers:
            raise ValueError(f"{len(flags)} window flags for {n_layers} layers")
        self.windowed, self.window = flags, window if flags else 0
        # Each layer's index in its buffer (k/v, or wk/wv for a windowed layer).
        counts = [0, 0]
        self.index: list[int] = []
        for w in flags or (False,) * n_layers:
            self.index.append(counts[w])
            counts[w] += 1
        width = row_width(head_dim, dtype)
        self.head_dim = head_dim
        self.k = torch.zeros((counts[0], n_kv_heads, capacity, width), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.wcapacity = capacity if room is None or not flags else min(capacity, self.window + max(room, 1))
        self.wk, self.wv = None, None
        if flags and conv_width:  # float32 whatever the kind: the state is read back exactly as it was computed
            wdtype = torch.float64 if dtype == torch.float64 else torch.float32
            self.wk = torch.zeros((counts[1], 1, self.wcapacity, conv_width), dtype=wdtype, device=device)
            self.wv = torch.zeros((counts[1], 1, self.wcapacity, 0), dtype=wdtype, device=device)
        elif flags:
            self.wk = torch.zeros((counts[1], n_kv_heads, self.wcapacity, width), dtype=dtype, device=device)
            self.wv = torch.zeros_like(self.wk)
        self.woffset = 0  # the position of the windowed layers' slot 0
        self.capacity = capacity
        self.length = 0
        self.pending = 0
        # The token ids of the prompt whose KV the first slots hold (set by the prefill that fills
        # the cache; None: unknown), so a batch can hand one sequence's prompt KV to another whose
        # prompt starts the same way (batching/prompt_share.py).
        self.prompt: np.ndarray | None = None

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(k, v, position of slot 0) of each buffer: the full layers', then the windowed layers'."""
        out = [(self.k, self.v, 0)]
        if self.wk is not None and self.wv is not None:
            out.append((self.wk, self.wv, self.woffset))
        return out

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer `layer`'s keys and values [kv_heads, slots, row] and the position of their slot 0."""
        i = self.index[layer]
        if self.windowed and self.windowed[layer]:
            assert self.wk is not None and self.wv is not None
            return self.wk[i], self.wv[i], self.woffset
        return self.k[i], self.v[i], 0

    # --- used by the model -------------------------------------------------------------------
    def begin(self, t: int) -> None:
        """Open T pending slots for a forward (previous pending slots are dropped)."""
        if self.length + t > self.capacity:
            raise CacheFullError(f"KV cache full: {self.length} + {t} > capacity {self.capacity}")
        if self.wk is not None and self.length + t - self.woffset > self.wcapacity:
            self._slide(t)
        self.pending = t

    def _slide(self, t: int) -> None:
        """Make room for T new tokens in the windowed layers' slots: keep only the last `window`
        committed tokens (a new row at position p >= length sees keys after p - window)."""
        assert self.wk is not None and self.wv is not None
        keep = max(self.woffset, self.length - self.window)
        if self.length - keep + t > self.wcapacity:  # a forward wider than the room: more slots, never fewer tokens
            self._grow(self.length - keep + t)
        self._drop_before(keep)

    def _drop_before(self, first: int) -> None:
        """The windowed layers keep the tokens from `first` on (their slot 0 becomes `first`'s)."""
        assert self.wk is not None and self.wv is not None
        n = self.length - first
        if n > 0 and first != self.woffset:
            src = slice(first - self.woffset, self.length - self.woffset)
            self.wk[:, :, :n] = self.wk[:, :, src].clone()
            self.wv[:, :, :n] = self.wv[:, :, src].clone()
        self.woffset = first

    def _grow(self, slots: int) -> None:
        assert self.wk is not None and self.wv is not None
        n = self.length - self.woffset
        k = self.wk.new_zeros((*self.wk.shape[:2], slots, self.wk.shape[3]))
        v = self.wv.new_zeros((*self.wv.shape[:2], slots, self.wv.shape[3]))  # a convolution's: no values
        k[:, :, :n], v[:, :, :n] = self.wk[:, :, :n], self.wv[:, :, :n]
        self.wk, self.wv, self.wcapacity = k, v, slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store the pending tokens' K/V of one layer; return views over its committed + pending
        slots and the position of their first (a windowed layer's oldest kept token)."""
        if self.q8:
            raise TypeError("a q8 KV cache is written by the CPU kernels' forward only")
        kl, vl, base = self.layer(layer)
        start, end = self.length - base, self.length + self.pending - base
        kl[:, start:end] = k
        vl[:, start:end] = v
        return kl[:, :end], vl[:, :end], base

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
            for k, v, base in self.buffers():
                start = self.length - base
                src = start + idx[in_place:].to(k.device)
                dst = slice(start + in_place, start + n)
                k[:, :, dst] = k[:, :, src]
                v[:, :, dst] = v[:, :, src]
        self.length += n
        self.pending = 0

    def discard(self) -> None:
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Forget everything after `length` committed tokens."""
        if not 0 <= length <= self.length:
            raise IndexError(f"cannot truncate a cache of {self.length} tokens to {length}")
        if length and length < first_head(self.woffset, self.window):
            raise IndexError(f"cannot truncate to {length} tokens: the windowed layers keep tokens "
                             f"{self.woffset} on")
        if length == 0:
            self.woffset = 0
        self.length = length
        self.pending = 0

    def reset(self) -> None:
        self.truncate(0)

    # --- building one cache out of another ----------------------------------------------------
    def _whole(self, other: KVCache) -> None:
        if self.woffset or other.woffset:
            raise ValueError("slots are copied between caches whose windowed layers keep every token")

    def copy_slots_from(self, other: KVCache, src: torch.Tensor, dst_start: int) -> None:
        """Copy committed slots `src` of `other` into this cache at [dst_start, dst_start + n)."""
        n = int(src.numel())
        if dst_start + n > min(self.capacity, self.wcapacity):
            raise CacheFullError(f"KV cache full: {dst_start} + {n} > capacity {self.capacity}")
        self._whole(other)
        src = src.to(other.k.device)
        for (k, v, _), (ok, ov, _) in zip(self.buffers(), other.buffers(), strict=True):
            k[:, :, dst_start : dst_start + n] = ok[:, :, src]
            v[:, :, dst_start : dst_start + n] = ov[:, :, src]

    def put_slots(self, other: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots `src` of `other` into this cache's slots `dst` (any order; lengths unchanged)."""
        if int(src.numel()) != int(dst.numel()):
            raise ValueError("put_slots needs as many destination slots as source slots")
        if dst.numel() and int(dst.max()) >= min(self.capacity, self.wcapacity):
            raise CacheFullError(f"KV cache slot {int(dst.max())} beyond capacity {self.capacity}")
        self._whole(other)
        src, dst = src.to(other.k.device), dst.to(self.k.device)
        for (k, v, _), (ok, ov, _) in zip(self.buffers(), other.buffers(), strict=True):
            k[:, :, dst] = ok[:, :, src]
            v[:, :, dst] = ov[:, :, src]

    def can_take(self, other: KVCache, reach: int) -> bool:
        """Whether `other` still holds what `take(other, reach)` copies: its windowed layers' tokens
        from the later of this cache's end and `reach - window` on."""
        return other.woffset <= max(self.length, reach - self.window)

    def take(self, other: KVCache, reach: int) -> None:
        """Extend the committed tokens to `reach` with `other`'s slots [length, reach) (its prompt
        starts as this one's does): all of the full layers', and of the windowed layers' what
        rows after `reach` can see."""
        start = self.length
        if not self.can_take(other, reach) or reach > other.length:
            raise IndexError(f"another cache holds no KV of tokens {start} to {reach} to take")
        self.k[:, :, start:reach] = other.k[:, :, start:reach]
        self.v[:, :, start:reach] = other.v[:, :, start:reach]
        if self.wk is not None and self.wv is not None and other.wk is not None and other.wv is not None:
            first = max(self.woffset, reach - self.window)  # this cache's oldest windowed token after
            if reach - first > self.wcapacity:
                self._grow(reach - first)
            self._drop_before(first)  # its own tokens [first, start) stay, at the front
            lo = max(first, start)
            self.wk[:, :, lo - first : reach - first] = other.wk[:, :, lo - other.woffset : reach - other.woffset]
            self.wv[:, :, lo - first : reach - first] = other.wv[:, :, lo - other.woffset : reach - other.woffset]
        self.length = reach

    def snapshot(self, length: int | None = None) -> KVSnapshot:
        """A compact copy of the first `length` committed slots (default: all of them)."""
        n = self.length if length is None else length
        if not first_head(self.woffset, self.window) <= n <= self.length:
            raise IndexError(f"cannot snapshot {n} tokens of a cache holding {self.length}"
                             + (f" (its windowed layers from {self.woffset})" if self.woffset else ""))
        if self.wk is None or self.wv is None:
            return KVSnapshot(self.k[:, :, :n].clone(), self.v[:, :, :n].clone())
        w = n - self.woffset
        return KVSnapshot(self.k[:, :, :n].clone(), self.v[:, :, :n].clone(), self.wk[:, :, :w].clone(),
                          self.wv[:, :, :w].clone(), self.woffset, self.window)

    def load(self, snap: KVSnapshot) -> None:
        """Make the snapshot's tokens this cache's whole committed content (slots [0, n))."""
        fits = [(theirs, ours) for theirs, ours in ((snap.k, self.k), (snap.wk, self.wk))
                if theirs is not None or ours is not None]
        if any(theirs is None or ours is None or theirs.shape[:2] != ours.shape[:2]
               or theirs.shape[3] != ours.shape[3] or theirs.dtype != ours.dtype for theirs, ours in fits) \
                or snap.window != self.window:
            theirs, ours = kind_of(snap.k.dtype), kind_of(self.k.dtype)
            kinds = f" (KV kinds {theirs} and {ours})" if theirs != ours else ""
            raise ValueError(f"a snapshot of shape {tuple(snap.k.shape)} {snap.k.dtype} does not fit a cache of "
                             f"{tuple(self.k.shape)} {self.k.dtype}{kinds}")
        n = snap.length
        if n > self.capacity:
            raise CacheFullError(f"KV cache full: {n} > capacity {self.capacity}")
        self.k[:, :, :n] = snap.k.to(self.k.device)
        self.v[:, :, :n] = snap.v.to(self.v.device)
        self.woffset = 0
        if snap.wk is not None and snap.wv is not None:
            # what the rows to come can see, at most, of what the snapshot holds
            first = max(snap.wfirst, n - self.wcapacity) if self.wcapacity < self.capacity else snap.wfirst
            if n - first > self.wcapacity:
                raise CacheFullError(f"KV cache full: {n - first} windowed tokens > {self.wcapacity} slots")
            assert self.wk is not None and self.wv is not None
            self.wk[:, :, : n - first] = snap.wk[:, :, first - snap.wfirst :].to(self.wk.device)
            self.wv[:, :, : n - first] = snap.wv[:, :, first - snap.wfirst :].to(self.wv.device)
            self.woffset = first
        self.length = n
        self.pending = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, v, _ in self.buffers() for t in (k, v))

    @property
    def q8(self) -> bool:
        """Whether rows are q8 (int8 values and bfloat16 scales) rather than plain values."""
        return self.k.dtype == torch.int8

    def keys(self, layer: int, n: int) -> torch.Tensor:
        """Layer `layer`'s keys of slots [0, n) as values [kv_heads, n, head_dim] (q8: as bfloat16)."""
        kl, _, base = self.layer(layer)
        if base:
            raise IndexError(f"layer {layer} keeps only its window's keys (tokens {base} on)")
        k = kl[:, :n]
        return bf16_rows(k) if self.q8 else k
