"""Block-quantized weights for the CPU kernels: formats, conversion from GGUF and from floats.

A `QWeight` is a [n, k] matrix stored in one or more row *segments*, each in one format of
`csrc/qlinear.cpp` (see its header for the byte layout):

- ``q4k``: asymmetric 4-bit codes in groups of 32 with 6-bit scales and mins under a float16
  super-block scale: exactly GGUF's Q4_K grid (8 groups per super-block), Q4_0's and Q4_1's (one
  group a super-block: scale code 1, the minimum 8 * d or -m), and our own 4-bit format for float
  weights (up to 8 groups per super-block, so any width divisible by 32 fits).
- ``q6k``: 6-bit codes (a nibble plane and a 2-bit plane) in groups of 16 with signed 8-bit
  scales: exactly GGUF's Q6_K grid; ``q3k``, the same at three bits a code: GGUF's Q3_K;
  ``q2k``, 2-bit codes under a 4-bit scale and a 4-bit minimum per group of 16: GGUF's Q2_K, and
  the ternary TQ2_0 and TQ1_0 (scale and minimum codes 1, dmin = d) at 2.63 bits a weight;
  ``iq2xs`` and ``iq1m``, q3k's 3-bit codes indexing a table of six values (IQ2's ±8, 25, 43; IQ1_M's
  8 x (-1, 0, 1) ± 1) under a float32 d (the file's d over 8) and scale codes 2 ls + 1 per 16:
  GGUF's IQ2_XS, IQ2_S and IQ1_M exactly, at 3.63 bits a weight (the files' 2.31, 2.56, 1.75).
- ``q8``: byte codes in groups of 32 with one float16 scale and a fixed offset:
  GGUF's Q8_0 (offset 128) grid, and our 8-bit format for float weights.
- ``q5k`` and ``iq4``: q4k's header (signed scale codes; ``iq4`` without the minimum) over 5-bit
  codes (nibbles and a bit plane) or IQ4's 4-bit table indices, unpacked by the kernels into q8's
  byte codes: GGUF's Q5_K and IQ4_XS (8 groups a super-block), Q5_1 (one group); ``iq3s``, iq4's
  layout over a table of IQ3_S's 16 signed values (the odd integers -15..15) with the scale codes
  1 + 2 * its 4-bit scales: GGUF's IQ3_S exactly, at 4.31 bits a weight (the file's 3.44);
  ``iq3xxs``, ``iq2xxs`` and ``iq1s`` the same over tables of IQ3_XXS's, IQ2_XXS's and IQ1_S's values
  (4 or 8 times them) under a float32 d (the file's d over 4 or 8: float16 could not hold it), at
  4.38 bits a weight (the files' 3.06, 2.06 and 1.56).
- ``q40``, ``q50`` and ``iq4nl``: q8's header (one float16 scale a group of 32) over q4k's
  nibbles (Q4_0, offset 8), q5k's nibbles and bit plane (Q5_0, offset 16) or IQ4's table indices
  (IQ4_NL, offset 128): each at its file's bits a weight; ``q41`` and ``q51``, the same with a
  float16 minimum a group (Q4_1, Q5_1).
- ``mxfp4``: iq4nl's layout under a one-byte header, the file's E8M0 exponent a group (the scale
  2^(e - 128), past float16's range, built exactly by the kernels) over ggml's MXFP4 table
  (twice the E2M1 values) + 128: GGUF's MXFP4 at its file's 4.25 bits a weight.
- ``f16`` and ``bf16``: GGUF's F16 and BF16 weights as they are, 16 bits each (per input, a
  panel's 16 values); the kernels multiply them in float32 with float32 activations.
- ``bf16d``: a BF16 file's weights on bfloat16 dot products (llama.cpp's arithmetic for them: the
  activations rounded to bfloat16, one chain a channel over pairs of inputs, as VDPBF16PS adds
  them), per pair of inputs a panel's 16 channels' two values side by side; the file's BF16
  tensors take it where `kernels.bf16_products()` says so.

Segments exist because one fused projection can mix formats (a GGUF file may store a layer's
V projection in Q6_K and its Q and K in Q4_K); the kernel quantizes the input once and writes
every segment's columns. Converting a GGUF tensor keeps its grid: the weights the kernel
multiplies are exactly the ones `gguf`'s dequantiser returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..common.errors import UserError
from . import kernels

PANEL = 16
FORMATS = {"q4k": 0, "q6k": 1, "q8": 2, "q5k": 3, "iq4": 4, "q3k": 5, "q2k": 6, "f16": 7, "bf16": 8, "q40": 9,
           "q50": 10, "iq4nl": 11, "q41": 12, "q51": 13, "mxfp4": 14, "bf16d": 15, "iq3s": 16,
           "iq3xxs": 17, "iq2xxs": 18, "iq1s": 19, "iq2xs": 20, "iq1m": 21}
# The 16-bit float formats: GGUF type -> format (super-blocks of 32 inputs, 2 bytes a weight).
FLOAT_KINDS = {"F16": "f16", "BF16": "bf16"}
# Code bytes per group of 16 channels x 32 inputs of the formats with q4k's header (`pack_kgroups`).
K_CODE_BYTES = {"q5k": 320, "iq4": 256, "iq3s": 256, "iq3xxs": 256, "iq2xxs": 256, "iq1s": 256}
# The table formats whose d is float32 (16 a panel: 64 bytes), not float16: the byte-code ones (iq4's layout)
# and q3k's (Q3_TABLES); csrc/core/qlinear.h's f32_d.
F32_D = ("iq3xxs", "iq2xxs", "iq1s", "iq2xs", "iq1m")
# The GGUF types kept over a table of their values: (format, the power of two d carries, the signed
# values of the table in order); a weight is d * power * (2 ls + 1) * value.
SCALED_TABLES = {
    "IQ3_S": ("iq3s", 1.0, (-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15)),
    "IQ3_XXS": ("iq3xxs", 0.25, (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62)),
    "IQ2_XXS": ("iq2xxs", 0.125, (-43, -25, -8, 8, 25, 43)),
    "IQ1_S": ("iq1s", 0.125, (-9, -7, -1, 1, 7, 9)),
}
# The GGUF types whose scales are per 16 weights, kept in q3k's layout (`pack_q3k`) over a table of
# their values (csrc/core/qlinear.h's kIq2xsQ3, kIq1mQ3) under a float32 d: (format, the signed
# values in order); a weight is d / 8 * (2 ls + 1) * value.
Q3_TABLES = {
    "IQ2_XS": ("iq2xs", (-43, -25, -8, 8, 25, 43)),
    "IQ2_S": ("iq2xs", (-43, -25, -8, 8, 25, 43)),
    "IQ1_M": ("iq1m", (-9, -7, -1, 1, 7, 9)),
}
Q3_FORMATS = tuple(sorted({fmt for fmt, _ in Q3_TABLES.values()}))
# The same for the formats with q8's header (`pack_q8`): one group of 32 inputs a super-block.
Q8_CODE_BYTES = {"q8": 512, "q40": 256, "q50": 320, "iq4nl": 256, "q41": 256, "q51": 320, "mxfp4": 256}
MIN_FORMATS = ("q41", "q51")  # q8's header with a float16 minimum a group
Q8_HEADER_BYTES = {"q41": 64, "q51": 64, "mxfp4": 16}  # the others: 16 float16 scales (32 bytes)


def _superblock(fmt: str, groups: int) -> tuple[int, int]:
    """(inputs, bytes per panel) of one super-block; `groups` counts q4k's and q8k's groups of 32."""
    if fmt == "q4k":
        return 32 * groups, 64 + 288 * groups
    if fmt in K_CODE_BYTES:
        d_bytes = 64 if fmt in F32_D else 32
        header = 64 + 32 * groups if fmt == "q5k" else d_bytes + 16 * groups  # iq4 and the tables: no minimum
        return 32 * groups, header + K_CODE_BYTES[fmt] * groups
    if fmt in Q8_CODE_BYTES:
        return 32, Q8_HEADER_BYTES.get(fmt, 32) + Q8_CODE_BYTES[fmt]
    if fmt in ("q3k", *Q3_FORMATS):  # d, 16 scale codes a channel, 8 pairs of groups' three 64-byte planes
        return 256, (64 if fmt in F32_D else 32) + 256 + 8 * 192
    return {"q6k": (256, 3360), "q2k": (256, 1344), "f16": (32, 1024), "bf16": (32, 1024), "bf16d": (32, 1024)}[fmt]


def superblock_inputs(fmt: str, groups: int) -> int:
    """Inputs of one super-block of format `fmt` (`groups`: q4k's, q5k's and iq4's groups of 32)."""
    return _superblock(fmt, groups)[0]


def blob_bytes(fmt: str, n: int, k: int, groups: int = 8) -> int:
    """Bytes of an [n, k] weight in format `fmt` (rows padded to whole panels)."""
    inputs, size = _superblock(fmt, groups)
    return -(-n // PANEL) * (k // inputs) * size


def q4k_groups(k: int) -> int | None:
    """The most groups of 32 (up to Q4_K's 8) a super-block can hold for input width k."""
    return next((g for g in range(8, 0, -1) if k % (32 * g) == 0), None)


@dataclass
class Segment:
    fmt: str
    n: int  # output rows of this segment
    blob: torch.Tensor  # uint8, the kernel layout
    offset: int  # q8: the code that means zero
    k: int  # input width
    groups: int = 8  # q4k, q8k: groups of 32 per super-block

    def dequantize(self, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (all: None) in float32, into `out` (contiguous float32 [rows, k]) when given."""
        ids = torch.arange(self.n) if rows is None else rows
        return kernels.load().dequantize(self.blob, FORMATS[self.fmt], self.n, self.k, self.offset, self.groups, ids,
                                         out)

    @property
    def nbytes(self) -> int:
        return self.blob.numel()


@dataclass
class QWeight:
    k: int
    segments: list[Segment]

    def __post_init__(self) -> None:
        # The kernel's per-segment arguments, built once (a decode step makes ~150 calls).
        self.blobs = [s.blob for s in self.segments]
        self.formats = [FORMATS[s.fmt] for s in self.segments]
        self.widths = [s.n for s in self.segments]
        self.offsets = [s.offset for s in self.segments]
        self.groups = [s.groups for s in self.segments]

    @property
    def n(self) -> int:
        return sum(s.n for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole weight in float32 [n, k], into `out` when given (each segment writes its rows)."""
        out = torch.empty(self.n, self.k) if out is None else out
        r = 0
        for s in self.segments:
            s.dequantize(out=out[r : r + s.n])
            r += s.n
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup); only single-segment weights are looked up."""
        if len(self.segments) != 1:
            raise ValueError("row lookup needs a single-segment weight")
        return self.segments[0].dequantize(ids)

    @staticmethod
    def concat(parts: list[QWeight]) -> QWeight:
        """Stack row blocks (q, k, v -> qkv): adjacent segments of one format merge into one blob
        (`stacking_runs`)."""
        k = parts[0].k
        if any(p.k != k for p in parts):
            raise ValueError("cannot stack weights of different input widths")
        segs = [s for p in parts for s in p.segments]
        runs = stacking_runs([(s.fmt, s.offset, s.groups) for s in segs], [s.n for s in segs])
        return QWeight(k, [segs[r[0]] if len(r) == 1 else Segment(segs[r[0]].fmt, sum(segs[i].n for i in r),
                                                                  torch.cat([segs[i].blob for i in r]),
                                                                  segs[r[0]].offset, k, segs[r[0]].groups)
                           for r in runs])


def stacking_runs(kinds: list[tuple[object, ...]], rows: list[int]) -> list[list[int]]:
    """Which of a stack's parts (each its (format, grid offset, groups) and row count) share one
    segment: adjacent parts of one kind, while the rows before each fill whole panels."""
    runs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind and sum(rows[j] for j in runs[-1]) % PANEL == 0:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, *, norm: torch.Tensor | None = None,
            eps: float = 0.0, center: bool = False, silu_mul: bool = False, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """y = pre(x) W^T (+ bias) (+ residual) for a block-quantized W; x is float32 [rows, k].

    pre: RMSNorm with weight `norm` and `eps` (with `center`, a LayerNorm without bias: the row's
    mean subtracted first), or silu(gate) * up when `silu_mul` (x holds [gate | up]); each is
    applied in the same pass that quantizes the row. out: a contiguous float32 [rows, n] to write
    y into (and return) instead of a new tensor.
    """
    args = (x, w.blobs, w.formats, w.widths, w.offsets, w.groups, bias, norm, eps, silu_mul, residual,
            kernels.path_id(), out, center)
    return kernels.timed("linear", kernels.load().qlinear, args)


# --------------------------------------------------------------------------- layout


def _panels(a: np.ndarray) -> np.ndarray:
    """[n, ...] -> [n_pad, ...] with n_pad a multiple of the panel height (zero rows appended)."""
    pad = (-a.shape[0]) % PANEL
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return a


def _steps(codes: np.ndarray, group: int) -> np.ndarray:
    """codes [n_pad, k] -> [panels, k/group, group/4, 64]: byte 4c+j of step s = code[c, 4s+j]."""
    n, k = codes.shape
    c = codes.reshape(n // PANEL, PANEL, k // group, group // 4, 4)
    return np.ascontiguousarray(c.transpose(0, 2, 3, 1, 4)).reshape(n // PANEL, k // group, group // 4, 64)


def _by_panel(a: np.ndarray, per_sb: int) -> np.ndarray:
    """[n_pad, k/g] per-row values -> [panels, superblocks, per_sb, 16] (channel-minor)."""
    n, m = a.shape
    return np.ascontiguousarray(a.reshape(n // PANEL, PANEL, m // per_sb, per_sb).transpose(0, 2, 3, 1))


def _blob(parts: list[np.ndarray]) -> torch.Tensor:
    """Concatenate per-(panel, superblock) byte parts [P, S, bytes_i] into one blob."""
    flat = [p.reshape(p.shape[0], p.shape[1], -1).view(np.uint8) for p in parts]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(flat, axis=2)).reshape(-1))


def pack_q4k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, codes: np.ndarray,
             groups: int = 8) -> Segment:
    """d, dmin: [n, k/(32*groups)] float16; sc, mn: [n, k/32] uint8 (6-bit); codes [n, k] uint8 (0..15)."""
    n = codes.shape[0]
    st = _steps(_panels(codes), 32)  # [P, k/32, 8, 64]
    nib = st[:, :, :4] | (st[:, :, 4:] << 4)  # step i low, step i+4 high
    p, g = nib.shape[:2]
    parts = [
        _by_panel(_panels(d), 1),
        _by_panel(_panels(dmin), 1),
        _by_panel(_panels(sc), groups),
        _by_panel(_panels(mn), groups),
        nib.reshape(p, g // groups, groups * 4 * 64),
    ]
    return Segment("q4k", n, _blob(parts), 0, codes.shape[1], groups)


def pack_q6k(d: np.ndarray, sc: np.ndarray, codes: np.ndarray) -> Segment:
    """d: [n, k/256] float16; sc: [n, k/16] int8; codes [n, k] uint8 (0..63, 32 means zero).

    Six bits a code, as in the GGUF: per group of 16, the low nibbles of steps (0, 2) and (1, 3)
    share two 64-byte planes and the high two bits of all four steps one more."""
    n = codes.shape[0]
    st = _steps(_panels(codes), 16)  # [P, k/16, 4, 64]
    lo, hi = st & 15, st >> 4
    packed = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4),
                       hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)], axis=2)
    p, g = st.shape[:2]
    parts = [_by_panel(_panels(d), 1), _by_panel(_panels(sc), 16), packed.reshape(p, g // 16, 16 * 3 * 64)]
    return Segment("q6k", n, _blob(parts), 0, codes.shape[1])


def _check_d(fmt: str, d: np.ndarray) -> None:
    if d.dtype != (np.float32 if fmt in F32_D else np.float16):
        raise ValueError(f"{fmt}: d must be {'float32' if fmt in F32_D else 'float16'}, not {d.dtype}")


def pack_q3k(d: np.ndarray, sc: np.ndarray, codes: np.ndarray, fmt: str = "q3k") -> Segment:
    """d: [n, k/256] float16; sc: [n, k/16] int8; codes [n, k] uint8 (0..7, 4 means zero; w = d * sc * (code - 4)).

    q6k's grid at three bits a code: per pair of groups of 16, each group's low two bits of its 4
    steps (a 64-byte plane, step s at bits 2s), then both groups' third bits (one plane: the first
    group's step s at bit s, the second's at bit 4 + s). The kernels unpack a code as 28 + code, a
    q6k code. `fmt` iq2xs or iq1m (Q3_TABLES): the same codes index the format's table of values
    (w = d * sc * value), d float32."""
    _check_d(fmt, d)
    n = codes.shape[0]
    st = _steps(_panels(codes), 16)  # [P, k/16, 4, 64]
    low = sum((st[:, :, i] & 3) << (2 * i) for i in range(4)).astype(np.uint8)  # [P, k/16, 64]
    third = sum(((st[:, :, i] >> 2) & 1) << i for i in range(4)).astype(np.uint8)
    p, g = st.shape[:2]
    pairs = np.concatenate([low.reshape(p, g // 2, 128), third[:, 0::2] | (third[:, 1::2] << 4)], axis=2)
    parts = [_by_panel(_panels(d), 1), _by_panel(_panels(sc), 16), pairs.reshape(p, g // 16, 8 * 192)]
    return Segment(fmt, n, _blob(parts), 0, codes.shape[1])


def pack_q2k(d: np.ndarray, dmin: np.ndarray, sm: np.ndarray, codes: np.ndarray) -> Segment:
    """d, dmin: [n, k/256] float16; sm: [n, k/16] uint8 (scale | min << 4); codes [n, k] uint8 (0..3);
    w = d * (sm & 15) * code - dmin * (sm >> 4).

    GGUF's Q2_K bytes as they are, in q6k's family: per group of 16, one 64-byte plane holds the
    4 steps' codes (step s at bits 2s)."""
    n = codes.shape[0]
    st = _steps(_panels(codes), 16)  # [P, k/16, 4, 64]
    plane = sum((st[:, :, i] & 3) << (2 * i) for i in range(4)).astype(np.uint8)  # [P, k/16, 64]
    p, g = st.shape[:2]
    parts = [_by_panel(_panels(d), 1), _by_panel(_panels(dmin), 1), _by_panel(_panels(sm), 16),
             plane.reshape(p, g // 16, 16 * 64)]
    return Segment("q2k", n, _blob(parts), 0, codes.shape[1])


def _code_body(fmt: str, st: np.ndarray) -> np.ndarray:
    """A byte-code format's groups of steps [P, k/32, 8, 64] as the bytes the kernels unpack,
    [P, k/32, code bytes]: q8's bytes as they are; 4-bit codes as q4k's nibbles (step i low, step
    i + 4 high), and for q5k and q50 a plane of fifth bits (bit s of a plane byte belongs to step s
    of the nibble byte at the same place)."""
    p, g = st.shape[:2]
    if fmt == "q8":
        return st.reshape(p, g, 8 * 64)
    nib = ((st[:, :, :4] & 15) | ((st[:, :, 4:] & 15) << 4)).reshape(p, g, 256)
    if fmt not in ("q5k", "q50", "q51"):
        return nib
    plane = sum(((st[:, :, i] >> 4) & 1) << i for i in range(8)).astype(np.uint8)
    return np.concatenate([nib, plane], axis=2)


def pack_q8(d: np.ndarray, codes: np.ndarray, offset: int, fmt: str = "q8", dmin: np.ndarray | None = None) -> Segment:
    """q8's header over codes in groups of 32: d [n, k/32] float16; codes [n, k] uint8;
    w = d * (byte - offset), where the byte is the code (``q8``; ``q40``, ``q41``: codes 0..15;
    ``q50``, ``q51``: 0..31) or, for ``iq4nl``, IQ4's table value + 128 of the code 0..15 (offset
    128); ``q41`` and ``q51`` (dmin [n, k/32] float16) subtract dmin: w = d * byte - dmin;
    ``mxfp4``: d is the E8M0 exponent byte (uint8), the byte MXFP4's table value + 128 (offset 128)."""
    if (fmt in MIN_FORMATS) != (dmin is not None):
        raise ValueError(f"{fmt}: a minimum is for q41 and q51 only, and they need one")
    n = codes.shape[0]
    st = _steps(_panels(codes), 32)  # [P, k/32, 8, 64]
    head = [_by_panel(_panels(d), 1)] + ([] if dmin is None else [_by_panel(_panels(dmin), 1)])
    parts = [*head, _code_body(fmt, st)]
    return Segment(fmt, n, _blob(parts), offset, codes.shape[1])


def pack_kgroups(fmt: str, d: np.ndarray, dmin: np.ndarray | None, sc: np.ndarray, mn: np.ndarray | None,
                 codes: np.ndarray, offset: int, groups: int) -> Segment:
    """q4k's header (signed scale codes) over codes in groups of 32 that the kernels unpack into bytes:
    d, dmin [n, k/(32*groups)] float16; sc [n, k/32] int8; mn [n, k/32] uint8; codes [n, k] uint8;
    w = d * sc * (byte - offset) - dmin * mn, where the byte is

    - ``q5k``: the code 0..31, held as q4k's nibbles plus a plane of fifth bits (bit s of a plane
      byte belongs to step s of the nibble byte at the same place);
    - ``iq4``: IQ4's table value + 128 for the code 0..15, held as q4k's nibbles (offset 128), with
      no minimum (dmin and mn None: the header keeps d and the scale codes only); ``iq3s`` the same
      over IQ3_S's table (the odd integers -15..15 + 128 for the codes 0..15); ``iq3xxs``, ``iq2xxs``
      and ``iq1s`` the same over their tables with d float32 (F32_D).
    """
    if (fmt != "q5k") != (dmin is None and mn is None):
        raise ValueError("of these formats only q5k has a minimum")
    _check_d(fmt, d)
    n = codes.shape[0]
    st = _steps(_panels(codes), 32)  # [P, k/32, 8, 64]
    p, g = st.shape[:2]
    body = _code_body(fmt, st).reshape(p, g // groups, groups * K_CODE_BYTES[fmt])
    if dmin is None or mn is None:
        parts = [_by_panel(_panels(d), 1), _by_panel(_panels(sc), groups), body]
    else:
        parts = [_by_panel(_panels(d), 1), _by_panel(_panels(dmin), 1), _by_panel(_panels(sc), groups),
                 _by_panel(_panels(mn), groups), body]
    return Segment(fmt, n, _blob(parts), offset, codes.shape[1], groups)


# --------------------------------------------------------------------------- GGUF blocks

# Bytes per block and values per block of the GGUF types the kernels compute with as they are
# (each repacked by `from_gguf_blocks` into the format of its family; see docs/design.md).
GGUF_BLOCKS = {
    "Q4_K": (144, 256), "Q6_K": (210, 256), "Q8_0": (34, 32), "Q5_0": (22, 32),
    "Q4_0": (18, 32), "Q4_1": (20, 32), "Q3_K": (110, 256), "IQ4_NL": (18, 32), "MXFP4": (17, 32),
    "Q5_K": (176, 256), "IQ4_XS": (136, 256), "Q5_1": (24, 32), "Q2_K": (84, 256), "IQ3_S": (110, 256),
    "IQ3_XXS": (98, 256), "IQ2_XXS": (66, 256), "IQ1_S": (50, 256), "IQ2_XS": (74, 256), "IQ2_S": (82, 256),
    "IQ1_M": (56, 256), "TQ1_0": (54, 256), "TQ2_0": (66, 256),
    # 16-bit floats have no blocks; kept in runs of 32 (the kernels' super-block), so the width
    # must be a multiple of 32.
    "F16": (64, 32), "BF16": (64, 32),
}


# The kernel format and groups a super-block (`Segment.groups`) each of them is kept in.
KEPT_AS = {
    "Q4_K": ("q4k", 8), "Q6_K": ("q6k", 8), "Q8_0": ("q8", 8), "Q5_0": ("q50", 8), "Q4_0": ("q40", 8),
    "Q4_1": ("q41", 8), "Q3_K": ("q3k", 8), "IQ4_NL": ("iq4nl", 8), "Q5_K": ("q5k", 8), "IQ4_XS": ("iq4", 8),
    "Q5_1": ("q51", 8), "Q2_K": ("q2k", 8), "F16": ("f16", 1), "BF16": ("bf16", 1), "MXFP4": ("mxfp4", 8),
    "IQ3_S": ("iq3s", 8), "IQ3_XXS": ("iq3xxs", 8), "IQ2_XXS": ("iq2xxs", 8), "IQ1_S": ("iq1s", 8),
    "IQ2_XS": ("iq2xs", 8), "IQ2_S": ("iq2xs", 8), "IQ1_M": ("iq1m", 8), "TQ1_0": ("q2k", 8), "TQ2_0": ("q2k", 8),
}


def kept_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of an [n, k] GGUF tensor of a kept type once repacked (`from_gguf_blocks`)."""
    fmt, groups = KEPT_AS[kind]
    return blob_bytes(fmt, n, k, groups)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """The 16 code bytes of a legacy 32-weight block -> 32 codes (low nibbles first)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(b: np.ndarray, count: int, width: int = 1) -> np.ndarray:
    """Fields of `width` bits packed little-endian in the bytes b[..., :] -> [..., bytes, count] planes."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(*([1] * b.ndim), count)
    return (b[..., None] >> shifts) & ((1 << width) - 1)


def _legacy(kind: str, b: np.ndarray, n: int, k: int) -> Segment:
    """The 32-weight types under q8's header (a float16 scale a block): Q8_0 as q8 (offset 128),
    Q5_0 as q50 (16), Q4_0 as q40 (8), IQ4_NL as iq4nl (128); with a float16 minimum a block, Q4_1
    as q41 and Q5_1 as q51 (d * q + m = d * q - (-m)); MXFP4 as mxfp4 (its exponent byte as it is)."""
    if kind == "MXFP4":  # 2^(e - 128) * table[q] = scale * (byte - 128)
        return pack_q8(np.ascontiguousarray(b[..., 0]), _nibbles32(b[..., 1:17]).reshape(n, k), 128, "mxfp4")
    d = _f16(b[..., 0:2])
    if kind == "Q8_0":
        return pack_q8(d, (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k), 128)
    if kind == "IQ4_NL":  # d * table[q] = d * (byte - 128)
        return pack_q8(d, _nibbles32(b[..., 2:18]).reshape(n, k), 128, "iq4nl")
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        qh = np.ascontiguousarray(b[..., at : at + 4]).view(np.uint32)  # [n, blocks, 1]
        bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, blocks, 32]
        codes = (_nibbles32(b[..., at + 4 : at + 20]) | (bits << 4)).reshape(n, k)
        if kind == "Q5_0":
            return pack_q8(d, codes, 16, "q50")
        return pack_q8(d, codes, 0, "q51", dmin=-_f16(b[..., 2:4]))
    if kind == "Q4_0":  # d * (q - 8)
        return pack_q8(d, _nibbles32(b[..., 2:18]).reshape(n, k), 8, "q40")
    return pack_q8(d, _nibbles32(b[..., 4:20]).reshape(n, k), 0, "q41", dmin=-_f16(b[..., 2:4]))  # Q4_1


def _q3k(b: np.ndarray, n: int, k: int) -> Segment:
    """Q3_K as q3k: the same super-block scale and signed per-16 scales (six bits - 32) over its
    3-bit codes (the low two bits, and the bit ggml keeps in hmask: set means no -4)."""
    nb = b.shape[1]
    hmask, qs, s, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low = _bits(s[..., 0:8], 2, 4).transpose(0, 1, 3, 2).reshape(n, nb, 16)  # byte i: scales i, i + 8
    high = _bits(s[..., 8:12], 4, 2).transpose(0, 1, 3, 2).reshape(n, nb, 16)  # byte j, bits 2s: scale 4s + j
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    # 2-bit codes: weights 128h + 32s + i at bits 2s of byte 32h + i; their third bit at bit
    # 32h + s... of hmask: weight 32t + i's high bit is bit t of hmask[i] (set: no -4).
    lo2 = _bits(qs.reshape(n, nb, 2, 32), 4, 2).transpose(0, 1, 2, 4, 3).reshape(n, nb, 256)
    hi = _bits(hmask, 8).transpose(0, 1, 3, 2).reshape(n, nb, 256)
    return pack_q3k(d, sc.reshape(n, -1), (lo2 | (hi << 2)).reshape(n, k))


def _q2k(b: np.ndarray, n: int, k: int) -> Segment:
    """Q2_K as q2k: its per-16 scale/minimum bytes, 2-bit codes and d, dmin as they are."""
    nb = b.shape[1]
    sm, qs, d, dmin = b[..., 0:16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    # weights 128h + 32s + i at bits 2s of byte 32h + i (as Q3_K's low bits)
    codes = _bits(qs.reshape(n, nb, 2, 32), 4, 2).transpose(0, 1, 2, 4, 3).reshape(n, k)
    return pack_q2k(d, dmin, sm.reshape(n, -1), codes)


def _trits(b: np.ndarray, count: int) -> np.ndarray:
    """Base-3 digits packed in bytes as TQ1_0 packs them (a byte holds ceil(v * 256 / 3^count) of a value v of
    `count` digits, most significant first): digit t of byte x is the top of 3 * (x * 3^t mod 256), read in
    integers -> [..., bytes, count] planes of 0, 1 or 2."""
    powers = (3 ** np.arange(count)).astype(np.uint8).reshape(*([1] * b.ndim), count)
    return ((b[..., None] * powers).astype(np.uint16) * 3 >> 8).astype(np.uint8)


def _ternary(kind: str, b: np.ndarray, n: int, k: int) -> Segment:
    """TQ2_0 and TQ1_0, d * (q - 1) with q in 0..2 (TQ2_0's 2-bit fields may hold 3: 2 d), as q2k under
    every group's scale and minimum codes 1 and dmin = d: d * 1 * q - d * 1 is the file's weight exactly (a zero
    weight under a negative d, which ggml's quantizer never writes, is +0 where gguf's is -0)."""
    nb = b.shape[1]
    if kind == "TQ2_0":  # Q2_K's layout: weights 128h + 32s + i at bits 2s of byte 32h + i
        d = _f16(b[..., 64:66])
        codes = _bits(b[..., 0:64].reshape(n, nb, 2, 32), 4, 2).transpose(0, 1, 2, 4, 3).reshape(n, k)
    else:  # TQ1_0: weight 32t + i is digit t of byte i, 160 + 16t + i of byte 32 + i, 240 + 4t + i of byte 48 + i
        d = _f16(b[..., 52:54])
        parts = [_trits(b[..., lo:hi], digits).transpose(0, 1, 3, 2).reshape(n, nb, -1)
                 for lo, hi, digits in ((0, 32, 5), (32, 48, 5), (48, 52, 4))]
        codes = np.concatenate(parts, axis=2).reshape(n, k)
    return pack_q2k(d, d, np.full((n, k // 16), 0x11, dtype=np.uint8), codes)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight 6-bit scales and mins packed into 12 bytes (Q4_K, Q5_K; llama.cpp's get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _q5k(b: np.ndarray, n: int, k: int) -> Segment:
    """Q5_K as q5k: Q4_K's scales over its 5-bit codes (a nibble and a bit of qh)."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:176].reshape(n, -1, 4, 32)  # 4 chunks of 64: low nibbles, then high
    low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
    high = _bits(qh, 8).transpose(0, 1, 3, 2)  # group t's fifth bits: bit t of qh[i]
    codes = (low | (high << 4)).reshape(n, k)
    return pack_kgroups("q5k", d, dmin, sc.reshape(n, -1).view(np.int8), mn.reshape(n, -1), codes, 0, groups=8)


def _iq4xs(b: np.ndarray, n: int, k: int) -> Segment:
    """IQ4_XS as iq4: its per-32 scales (six bits - 32) under d, its 4-bit indices as they are."""
    nb = b.shape[1]
    d = _f16(b[..., 0:2])
    high = _bits(np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0], 8, 2).astype(np.uint8)  # [n, nb, 8]
    low = _bits(b[..., 4:8], 2, 4).reshape(n, nb, 8)  # byte i: groups 2i, 2i + 1
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    codes = _nibbles32(b[..., 8:136].reshape(n, nb, 8, 16)).reshape(n, k)
    return pack_kgroups("iq4", d, None, sc.reshape(n, -1), None, codes, 128, groups=8)


def _group_scales(kind: str, b: np.ndarray) -> np.ndarray:
    """The 4-bit (IQ1_S: 3-bit) scale ls of each group of 32 of a SCALED_TABLES type's blocks b [n, nb, bytes]."""
    if kind == "IQ3_S":  # 4 bytes at the end: groups 2j (low nibble) and 2j + 1
        return _bits(b[..., 106:110], 2, 4).reshape(*b.shape[:2], 8)
    if kind == "IQ3_XXS":  # the top 4 bits of 8 uint32 after the 64 grid index bytes
        return np.ascontiguousarray(b[..., 66:98]).view("<u4") >> 28
    if kind == "IQ2_XXS":  # per group two uint32: 4 grid indices, then signs and ls in the top 4 bits
        return np.ascontiguousarray(b[..., 2:66]).view("<u4")[..., 1::2] >> 28
    return (np.ascontiguousarray(b[..., 34:50]).view("<u2") >> 12) & 7  # IQ1_S: bits 12-14 of 8 uint16


def _scaled_table(kind: str, b: np.ndarray, n: int, k: int) -> Segment:
    """IQ3_S, IQ3_XXS, IQ2_XXS or IQ1_S: a weight is d * (2 ls + 1) * p * v, p the power of two and v
    one of the type's signed values (SCALED_TABLES); kept as d * p (float32, exact, where p is not 1:
    F32_D; else the file's float16 d), the scale code 2 ls + 1 and v's index in the table."""
    fmt, power, values = SCALED_TABLES[kind]
    d = _f16(b[..., 0:2])
    if fmt in F32_D:
        d = d.astype(np.float32) * np.float32(power)
    sc = (2 * _group_scales(kind, b).astype(np.int16) + 1).astype(np.int8)  # [n, nb, 8]
    idx = _table_index(kind, _table_values(kind, b), values)
    return pack_kgroups(fmt, d, None, sc.reshape(n, -1), None, idx.reshape(n, k), 128, groups=8)


def _table_index(kind: str, v: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    """Each signed value v's index in the table `values` (ascending); a value not in it is an error."""
    span = values[-1] - values[0]
    off = v.astype(np.int32) - values[0]  # 0 .. span within the table's range
    index = np.full(span + 1, 255, dtype=np.uint8)  # a value's table index, 255 for none
    index[np.asarray(values) - values[0]] = np.arange(len(values), dtype=np.uint8)
    idx = index[np.clip(off, 0, span)]
    if np.any(idx == 255) or np.any((off < 0) | (off > span)):
        raise ValueError(f"{kind} block with a value outside its grid's")
    return idx


def _q3_table(kind: str, b: np.ndarray, n: int, k: int) -> Segment:
    """IQ2_XS, IQ2_S or IQ1_M: a weight is d * (2 ls + 1) / 8 * v with a scale ls per 16 weights and
    v one of the type's six signed values (Q3_TABLES); kept as d / 8 (float32, exact), the scale code
    2 ls + 1 a group of 16 and v's index in the table, in q3k's layout."""
    fmt, values = Q3_TABLES[kind]
    nb = b.shape[1]
    if kind == "IQ1_M":  # d's float16 bits in the top nibbles of the four uint16 of scales
        sc16 = np.ascontiguousarray(b[..., 48:56]).view("<u2")  # [n, nb, 4]
        bits = (sc16 >> 12) << np.array([0, 4, 8, 12], dtype=np.uint16)
        d = np.bitwise_or.reduce(bits, axis=-1).astype(np.uint16).view(np.float16)
        ls = (sc16[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # [n, nb, 4, 4]
    else:  # a byte a group of 32: the first 16 weights' ls in its low nibble
        d = _f16(b[..., 0:2])
        ls = _bits(b[..., -8:], 2, 4)  # [n, nb, 8, 2]
    sc = (2 * ls.reshape(n, nb * 16).astype(np.int16) + 1).astype(np.int8)
    d = d.astype(np.float32) / np.float32(8)
    idx = _table_index(kind, _table_values16(kind, b), values)
    return pack_q3k(d.reshape(n, nb), sc, idx.reshape(n, k), fmt)


def _table_values(kind: str, b: np.ndarray) -> np.ndarray:
    """Each weight's signed integer v of a SCALED_TABLES type's blocks b [n, nb, bytes] -> [n, nb, 256]
    (gguf's dequantization, in integers): IQ3_S a grid entry of 4 (9-bit indices) and a sign bit each;
    IQ3_XXS and IQ2_XXS a grid entry (4 or 8 weights, from 8-bit indices) and a sign each, 8 signs from 7
    bits and their parity (ggml's ksigns); IQ1_S a grid entry of 8 in -1, 0, 1 (11-bit indices) times 8,
    plus or minus 1 by the group's delta bit."""
    n, nb = b.shape[:2]
    grid = _iq_grid(kind)
    if kind == "IQ3_S":  # index i's ninth bit: bit i % 8 of byte i // 8; weight i's sign likewise
        idx = b[..., 2:66].astype(np.uint16) | (_bits(b[..., 66:74], 8).reshape(n, nb, 64).astype(np.uint16) << 8)
        signs = _bits(b[..., 74:106], 8).reshape(n, nb, 256)
        return (grid[idx].reshape(n, nb, 256) * (1 - 2 * signs.astype(np.int16))).astype(np.int16)
    if kind == "IQ1_S":
        qh = np.ascontiguousarray(b[..., 34:50]).view("<u2")  # [n, nb, 8]
        high = (qh[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # [n, nb, 8, 4]
        idx = b[..., 2:34].reshape(n, nb, 8, 4).astype(np.uint16) | (high << 8)
        delta = np.where(qh >> 15 == 1, -1, 1).astype(np.int16)[..., None, None]
        return (8 * grid[idx] + delta).reshape(n, nb, 256)
    if kind == "IQ3_XXS":
        idx, packed = b[..., 2:66].reshape(n, nb, 8, 8), np.ascontiguousarray(b[..., 66:98]).view("<u4")
    else:  # IQ2_XXS: per group two uint32, 4 grid indices then the signs (and ls)
        words = np.ascontiguousarray(b[..., 2:66]).view("<u4").reshape(n, nb, 8, 2)
        idx, packed = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(n, nb, 8, 4), words[..., 1]
    seven = (packed[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127  # [n, nb, 8, 4]
    signs = _ksigns(seven).reshape(n, nb, 256)
    return (grid[idx].reshape(n, nb, 256) * (1 - 2 * signs.astype(np.int16))).astype(np.int16)


def _table_values16(kind: str, b: np.ndarray) -> np.ndarray:
    """_table_values of the Q3_TABLES types: a grid entry of 8 a 16-bit or 8-bit index and its
    signs (IQ2_XS: 9 index bits, 7 sign bits and their parity; IQ2_S: 10 index bits, a sign byte),
    or IQ1_M's entry of 8 in -1, 0, 1 (11-bit indices) times 8, plus or minus 1 by a delta bit a half."""
    n, nb = b.shape[:2]
    grid = _iq_grid(kind)
    if kind == "IQ1_M":
        qh = b[..., 32:48]  # per byte: entries 2i, 2i + 1's index bits 8-10 (bits 0-2, 4-6), delta (3, 7)
        high = _bits(qh, 2, 4).reshape(n, nb, 32).astype(np.uint16)
        idx = b[..., 0:32].astype(np.uint16) | ((high & 7) << 8)
        delta = np.where(high >> 3 == 1, -1, 1).astype(np.int16)[..., None]
        return (8 * grid[idx] + delta).reshape(n, nb, 256)
    if kind == "IQ2_XS":
        qs = np.ascontiguousarray(b[..., 2:66]).view("<u2")  # [n, nb, 32]
        idx, signs = qs & 511, _ksigns(qs >> 9)  # signs [n, nb, 32, 8]
    else:  # IQ2_S: low index bytes, sign bytes, then 2 high index bits of 4 entries a byte
        high = _bits(b[..., 66:74], 4, 2).reshape(n, nb, 32).astype(np.uint16)
        idx = b[..., 2:34].astype(np.uint16) | (high << 8)
        signs = _bits(b[..., 34:66], 8)
    return (grid[idx] * (1 - 2 * signs.astype(np.int16))).reshape(n, nb, 256).astype(np.int16)


def _ksigns(seven: np.ndarray) -> np.ndarray:
    """8 sign bits from 7 and their parity (ggml's ksigns), [...] -> [..., 8]."""
    parity = np.zeros(seven.shape, dtype=seven.dtype)
    for i in range(7):
        parity ^= (seven >> i) & 1
    return _bits((seven | (parity << 7)).astype(np.uint8), 8)


@functools.cache
def _iq_grid(kind: str) -> np.ndarray:
    """gguf's copy of ggml's grid of IQ3_S (512 x 4), IQ3_XXS (256 x 4), IQ2_XXS (256 x 8), IQ2_XS
    (512 x 8), IQ2_S (1024 x 8), IQ1_S or IQ1_M (2048 x 8) as int16."""
    from gguf import quants

    cls = getattr(quants, kind)
    cls.init_grid()
    grid = np.asarray(cls.grid).reshape(cls.grid_shape)
    if not np.array_equal(grid, np.rint(grid)):
        raise ValueError(f"gguf's {kind} grid holds a value that is not an integer")
    return grid.astype(np.int16)


def pack_float(kind: str, raw: np.ndarray, n: int, k: int, *, dot: bool = False) -> Segment:
    """F16 or BF16 values ([n, k] of 16-bit values, any dtype of that width, or their bytes) as the
    kernels' f16/bf16 layout: per panel, per input, the 16 channels' values. `dot` (BF16 only): as
    bf16d, on bfloat16 dot products: per panel, per pair of inputs, each channel's two values."""
    if dot and kind != "BF16":
        raise ValueError(f"bfloat16 dot products take BF16 weights, not {kind}")
    bits = _panels(np.ascontiguousarray(raw).view(np.uint16).reshape(n, k))
    blob = np.ascontiguousarray(bits.reshape(-1, PANEL, k).transpose(0, 2, 1))
    seg = Segment(FLOAT_KINDS[kind], n, torch.from_numpy(blob.reshape(-1).view(np.uint8)), 0, k, groups=1)
    return bf16_pairs(seg, in_place=True) if dot else seg


def bf16_pairs(seg: Segment, in_place: bool = False) -> Segment:
    """A bf16 segment as bf16d: the same weights, each pair of inputs' 16 channels side by side (the
    operand of bfloat16 dot products). The load applies it where `kernels.bf16_products()` says so,
    so a stored or converted file never depends on the CPU; `in_place`: into the segment's own blob
    (memory of its own, an arena's), else into a new one."""
    if seg.fmt != "bf16":
        raise ValueError(f"bf16_pairs takes a bf16 segment, not {seg.fmt}")
    panels = seg.blob.numel() // (32 * seg.k)
    # [panel][pair][input of the pair][channel][byte] -> [panel][pair][channel][input of the pair][byte]
    pairs = seg.blob.view(panels, seg.k // 2, 2, PANEL, 2).permute(0, 1, 3, 2, 4).contiguous().view(-1)
    return Segment("bf16d", seg.n, seg.blob.copy_(pairs) if in_place else pairs, seg.offset, seg.k, seg.groups)


def from_gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Segment:
    """Repack a GGUF tensor's raw blocks ([n, k/values*bytes] uint8) without changing a weight."""
    if kind in FLOAT_KINDS:
        return pack_float(kind, raw, n, k)
    size, per = GGUF_BLOCKS[kind]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // per, size)
    if kind == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 values: low nibbles, then high
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)
        return pack_q4k(d, dmin, sc.reshape(n, -1), mn.reshape(n, -1), codes)
    if kind == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8)
        d = _f16(b[..., 208:210])
        low = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        low = (low & 15).reshape(n, -1, 2, 128)
        high = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        high = (high & 3).reshape(n, -1, 2, 128)
        codes = (low | (high << 4)).reshape(n, k)
        return pack_q6k(d, sc.reshape(n, -1), codes)
    if kind == "Q3_K":
        return _q3k(b, n, k)
    if kind == "Q2_K":
        return _q2k(b, n, k)
    if kind in ("TQ1_0", "TQ2_0"):
        return _ternary(kind, b, n, k)
    if kind == "Q5_K":
        return _q5k(b, n, k)
    if kind == "IQ4_XS":
        return _iq4xs(b, n, k)
    if kind in SCALED_TABLES:
        return _scaled_table(kind, b, n, k)
    if kind in Q3_TABLES:
        return _q3_table(kind, b, n, k)
    if per == 32:
        return _legacy(kind, b, n, k)
    raise ValueError(f"GGUF type {kind} is not kept as is")


# --------------------------------------------------------------------------- float weights


# Rows quantized a run at a time: every row's codes depend on that row alone, and panels of PANEL rows
# lie one after the other in a blob, so the runs' blobs joined are the whole's; a run's temporaries
# stay in the caches (a 150K-row vocabulary head quantized whole took 5x as long).
_QUANTIZE_RUN = 64 * PANEL


def _in_runs(w: torch.Tensor, quantize_rows: Callable[[torch.Tensor], Segment]) -> Segment:
    n = w.shape[0]
    if n <= _QUANTIZE_RUN:
        return quantize_rows(w)
    runs = [quantize_rows(w[i : i + _QUANTIZE_RUN]) for i in range(0, n, _QUANTIZE_RUN)]
    first = runs[0]
    return Segment(first.fmt, n, torch.cat([r.blob for r in runs]), first.offset, first.k, first.groups)


def quantize_int8(w: torch.Tensor) -> Segment:
    """Symmetric 8-bit codes per group of 32, one float16 scale each (round to nearest)."""
    return _in_runs(w, _quantize_int8_rows)


def _quantize_int8_rows(w: torch.Tensor) -> Segment:
    n, k = w.shape
    g = w.detach().float().reshape(n, k // 32, 32)
    d = (g.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1.0 / d.float())
    q = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int16) + 128
    return pack_q8(d.numpy(), q.to(torch.uint8).reshape(n, k).numpy(), 128)


def quantize_int4(w: torch.Tensor) -> Segment:
    """Asymmetric 4-bit codes per group of 32 in Q4_K's structure: per-group scale and min as
    6-bit multiples of a float16 super-block scale. Each group maps [min, max] onto 0..15."""
    if q4k_groups(w.shape[1]) is None:
        raise ValueError(f"4-bit weights need an input width divisible by 32, not {w.shape[1]}")
    return _in_runs(w, _quantize_int4_rows)


def _quantize_int4_rows(w: torch.Tensor) -> Segment:
    n, k = w.shape
    groups = q4k_groups(k)
    assert groups is not None
    g = w.detach().float().reshape(n, k // 32, 32)
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1)
    scale = (hi - lo) / 15.0  # [n, groups]
    neg_min = -lo
    sb_scale, sb_min = scale.reshape(n, -1, groups), neg_min.reshape(n, -1, groups)
    d = (sb_scale.amax(-1) / 63).to(torch.float16)
    dmin = (sb_min.amax(-1) / 63).to(torch.float16)

    def code6(v: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        b = base.float().unsqueeze(-1)
        return torch.where(b > 0, torch.round(v / torch.where(b > 0, b, 1)), 0).clamp(0, 63)

    sc = code6(sb_scale, d).reshape(n, -1)
    mn = code6(sb_min, dmin).reshape(n, -1)
    eff_scale = (d.float().repeat_interleave(groups, 1) * sc).unsqueeze(-1)
    eff_min = (dmin.float().repeat_interleave(groups, 1) * mn).unsqueeze(-1)
    q = torch.where(eff_scale > 0, torch.round((g + eff_min) / torch.where(eff_scale > 0, eff_scale, 1)), 0)
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k)
    return pack_q4k(d.numpy(), dmin.numpy(), sc.to(torch.uint8).numpy(), mn.to(torch.uint8).numpy(), q.numpy(),
                    groups)


def quantize(w: torch.Tensor, bits: int) -> QWeight:
    n, k = w.shape
    if k % 32:
        raise UserError(f"cannot quantize a [{n}, {k}] weight to {bits} bits: input width not a multiple of 32")
    return QWeight(k, [quantize_int4(w) if bits == 4 else quantize_int8(w)])
