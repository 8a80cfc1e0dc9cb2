"""A trimmed draft vocabulary: the draft's output layer over a subset of the tokens.

A draft's head multiplies every drafted row by the whole vocabulary (151,936 x 896 for Qwen2.5's
0.5B: 27% of its weights) although drafts propose a few thousand distinct tokens. As FR-Spec and
VocabTrim do, the draft here scores only the most frequent tokens plus every token of the
prompts it drafts for (a long document's own words); the others get a logit of -inf, so the
draft never proposes them. The target still scores the whole vocabulary and verifies every
token, so the output is the same bits with any subset (tests/test_vocab_trim.py); only the
draft's acceptance can change. Prompt lookup is not affected: it proposes any token.

Which tokens are frequent comes from the tokenizer itself: byte-level BPE vocabularies (Qwen,
Llama 3) number tokens in merge order, and a pair is merged earlier the more often it occurs in
the tokenizer's training corpus, so the lowest ids are the most frequent (their first 256 are the
bytes, which spell anything). No corpus, no download.

On the quantized runtime the subset's rows are copied out of the head's blob (their 16-row panels
regathered byte for byte, `gather_rows`), so a kept token's draft logit is the bits the full head
gives it. The frequent part is built once; the prompts' extra tokens are a second segment of the
same product, rebuilt when a prompt brings new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.quant import (
    F32_D,
    K_CODE_BYTES,
    MIN_FORMATS,
    PANEL,
    Q3_FORMATS,
    Q8_CODE_BYTES,
    QWeight,
    Segment,
    superblock_inputs,
)

if TYPE_CHECKING:
    from ..runtime.transformer import Transformer

# The frequent part's size (tokens of lowest id), chosen by measurement (docs/benchmarks.md, "Measured choices").
DRAFT_VOCAB = 32768
# The prompts' extra tokens kept at most; past it, the extras restart from the current prompt.
MAX_EXTRA = 16384


def _sections(fmt: str, groups: int) -> list[tuple[int, int]]:
    """A super-block of a panel as sections of (count, bytes per channel), each laid out
    [count][16 channels][bytes] (csrc/core/qlinear.h)."""
    if fmt in ("q4k", "q5k"):  # d, dmin (f16), scales, mins (1 byte), codes in 64-byte rows of 4 bytes a channel
        rows = 5 if fmt == "q5k" else 4  # q5k: a fifth row, the bit plane
        return [(1, 2), (1, 2), (groups, 1), (groups, 1), (rows * groups, 4)]
    d = (1, 4 if fmt in F32_D else 2)  # d: float16, or float32 for the table formats that carry a 1/4 or 1/8
    if fmt in K_CODE_BYTES:  # iq4 and the table formats: q5k's without the minimum: d, scales, codes
        return [d, (groups, 1), (4 * groups, 4)]
    if fmt == "q6k":  # d (f16), scales (i8), per group of 16: three 64-byte planes
        return [d, (16, 1), (48, 4)]
    if fmt in ("q3k", *Q3_FORMATS):  # the same with three 64-byte planes per pair of groups
        return [d, (16, 1), (24, 4)]
    if fmt == "q2k":  # d, dmin (f16), scale/min bytes, one 64-byte plane per group
        return [(1, 2), (1, 2), (16, 1), (16, 4)]
    if fmt in ("f16", "bf16"):  # per input, 16 channels' 16-bit values
        return [(32, 2)]
    if fmt == "bf16d":  # per pair of inputs, 16 channels' two 16-bit values
        return [(16, 4)]
    if fmt == "mxfp4":  # q8's header of one exponent byte a channel, codes in 64-byte rows
        return [(1, 1), (Q8_CODE_BYTES[fmt] // 64, 4)]
    if fmt in MIN_FORMATS:  # q8's header with a minimum: d, dmin (f16), codes in 64-byte rows
        return [(1, 2), (1, 2), (Q8_CODE_BYTES[fmt] // 64, 4)]
    return [(1, 2), (Q8_CODE_BYTES[fmt] // 64, 4)]  # q8's header: d (f16), codes in 64-byte rows


def _lane_map(fmt: str, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For each byte of a super-block: the channel (0..15) it belongs to and its bytes per channel."""
    lanes, widths = [], []
    for count, b in _sections(fmt, groups):
        lane = np.tile(np.repeat(np.arange(PANEL), b), count)
        lanes.append(lane)
        widths.append(np.full(lane.shape, b))
    return np.concatenate(lanes), np.concatenate(widths)


def gather_rows(seg: Segment, ids: np.ndarray) -> Segment:
    """Rows `ids` of a segment (a multiple of 16 of them) as a new segment, byte for byte."""
    if len(ids) % PANEL:
        raise ValueError("gather_rows takes whole panels of 16 rows")
    lane, width = _lane_map(seg.fmt, seg.groups)
    sb = lane.size
    blob = seg.blob.numpy().reshape(-1, seg.k // superblock_inputs(seg.fmt, seg.groups), sb)
    pos = np.arange(sb)
    src = ids.reshape(-1, PANEL)[:, lane]  # [new panels, byte]: the source row of each byte
    src_panel, src_pos = src // PANEL, pos + (src % PANEL - lane) * width
    out = blob[src_panel[:, None, :], np.arange(blob.shape[1])[None, :, None], src_pos[:, None, :]]
    return Segment(seg.fmt, len(ids), torch.from_numpy(np.ascontiguousarray(out).reshape(-1)), seg.offset, seg.k,
                   seg.groups)


def _padded(ids: np.ndarray) -> np.ndarray:
    """ids repeated at the end up to a multiple of 16 (a repeated id writes the same logit twice)."""
    pad = (-len(ids)) % PANEL
    return np.concatenate([ids, np.full(pad, ids[-1], dtype=ids.dtype)]) if pad else ids


class VocabTrim:
    """The draft head over the tokens `ids` plus the prompts' own (`cover`)."""

    def __init__(self, model: Transformer, ids: Iterable[int]) -> None:
        vocab = model.cfg.vocab_size
        base = np.unique(np.array([i for i in ids if 0 <= i < vocab], dtype=np.int64))
        if base.size == 0:
            raise ValueError("a trimmed vocabulary needs at least one token")
        self.vocab = vocab
        self._model = model
        self._base = _padded(base.astype(np.int64))
        self._in_base = np.zeros(vocab, dtype=bool)
        self._in_base[self._base] = True
        self._base_part = self._rows(self._base)
        self.extra = np.zeros(0, dtype=np.int64)
        self._build()

    @property
    def size(self) -> int:
        """Tokens the draft scores now (the frequent ones and the prompts' extras)."""
        return int(self.ids.numel())

    def cover(self, tokens: Sequence[int]) -> None:
        """Make sure the draft can propose every token of `tokens` (a prompt)."""
        t = np.asarray(tokens, dtype=np.int64)
        t = np.unique(t[(t >= 0) & (t < self.vocab)])
        new = np.setdiff1d(t[~self._in_base[t]], self.extra)
        if new.size == 0:
            return
        self.extra = np.union1d(self.extra, new) if self.extra.size + new.size <= MAX_EXTRA else t[~self._in_base[t]]
        self._build()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The draft's logits [rows, vocab] from its last hidden states: -inf outside the subset."""
        m = self._model
        if isinstance(self._head, QWeight):
            from ..runtime.quant import qlinear

            sub = qlinear(x, self._head, norm=m.norm.weight, eps=m.norm.eps, center=m.norm.center)
        else:
            sub = F.linear(m.norm(x), self._head)
        return self.widen(sub.float() if sub.dtype in (torch.bfloat16, torch.float16) else sub)

    @property
    def head(self) -> QWeight | torch.Tensor:
        """The head's rows of the subset (`ids`' order): a quantized weight, or a float one."""
        return self._head

    def widen(self, sub: torch.Tensor) -> torch.Tensor:
        """The subset's logits [rows, size] as the whole vocabulary's: -inf outside the subset."""
        out = torch.full((sub.shape[0], self.vocab), float("-inf"), dtype=sub.dtype)
        out[:, self.ids] = sub
        return out

    def _rows(self, ids: np.ndarray) -> QWeight | torch.Tensor:
        head = self._model.lm_head
        if head.qweight is not None:
            seg = head.qweight.segments
            if len(seg) != 1:
                raise ValueError("a trimmed head needs a single-segment output layer")
            return QWeight(seg[0].k, [gather_rows(seg[0], ids)])
        return head.weight.detach()[torch.from_numpy(ids)].contiguous()

    def _build(self) -> None:
        ids = self._base if self.extra.size == 0 else np.concatenate([self._base, _padded(self.extra)])
        self.ids = torch.from_numpy(ids)
        if self.extra.size == 0:
            self._head = self._base_part
            return
        extra = self._rows(_padded(self.extra))
        if isinstance(self._base_part, QWeight):
            self._head = QWeight(self._base_part.k, [*self._base_part.segments, *extra.segments])
        else:
            self._head = torch.cat([self._base_part, extra])


def enable(draft: Transformer | None, eos_ids: Iterable[int], size: int = DRAFT_VOCAB) -> None:
    """Trim `draft`'s head to `size` frequent tokens (and the end-of-sequence ones), if its
    vocabulary is larger than twice that; prompts are added as they are prefilled."""
    model = getattr(draft, "model", draft)  # a batch's Port wraps the model
    if model is None or getattr(model, "vocab_trim", None) is not None or model.cfg.vocab_size < 2 * size:
        return
    model.output_head = VocabTrim(model, [*range(size), *eos_ids])
