"""The quantized CPU kernels: GGUF grids kept exactly, products against a float64 reference of the
same quantized weights, and rows that do not depend on which other rows share the call."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from specextend.runtime import kernels, quant

ext = kernels.load()


# Where each type's float16 scales sit in its block (the rest of a block is any bytes: every
# code and sub-scale is valid), and whether they may be negative (ggml's quantizers make negative
# d for the symmetric legacy types and m of either sign).
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q4_1": (0, 2), "Q5_1": (0, 2),
              "Q2_K": (80, 82), "TQ2_0": (64,), "TQ1_0": (52,)}
SIGNED = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_XXS",
          "IQ1_S", "IQ2_XS", "IQ2_S", "IQ1_M"}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw GGUF blocks of `kind` for an [n, k] tensor, with sane float16 scales (F16 and
    BF16: the bytes of normal weights of either sign, some exact zeros)."""
    rng = np.random.default_rng(seed)
    if kind in quant.FLOAT_KINDS:
        w = torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        w[rng.random((n, k)) < 0.01] = 0
        return w.to(torch.float16 if kind == "F16" else torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    size, per = quant.GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    if kind == "MXFP4":  # exponents of weights near 2^-8, and a few of the subnormal scales (e < 2)
        e = rng.integers(112, 128, (n, k // per))
        raw[..., 0] = np.where(rng.random(e.shape) < 0.05, rng.integers(0, 3, e.shape), e)
        return raw.reshape(n, -1)
    for lo in F16_FIELDS.get(kind, (0,)):
        vals = rng.random((n, k // per)) * 0.01 + 0.001
        if kind in SIGNED:
            vals *= rng.choice([-1.0, 1.0], vals.shape)
        bits = vals.astype(np.float16).view(np.uint8).reshape(n, k // per, 2)
        if kind == "IQ1_M":  # d's bits in the top nibbles of the block's last four uint16
            words = np.ascontiguousarray(raw[..., 48:56]).view("<u2") & 0x0FFF
            d = bits.view("<u2")  # [n, blocks, 1]
            words |= ((d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 15) << 12
            raw[..., 48:56] = words.view(np.uint8)
        else:
            raw[..., lo : lo + 2] = bits
    return raw.reshape(n, -1)


def gguf_dequant(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k)


def qw(seg: quant.Segment) -> quant.QWeight:
    return quant.QWeight(seg.k, [seg])


def reference(x: torch.Tensor, w: torch.Tensor, kind: str = "Q8_0") -> torch.Tensor:
    """float64 product of the activations as the kernel sees them (int8-quantized; F16 and BF16
    weights: float32 as they are) with w."""
    if kind in quant.FLOAT_KINDS:
        return x.double() @ w.double().T
    q8, d8, _ = ext.quantize_activations(x, kernels.PATHS.index("portable"))
    xq = q8.double().view(x.shape[0], -1, 32) * d8.double().unsqueeze(-1)
    return xq.view(x.shape) @ w.double().T


KINDS = [("Q4_K", 48, 512), ("Q6_K", 40, 256), ("Q8_0", 35, 96), ("Q5_0", 33, 64), ("Q4_0", 35, 96),
         ("Q4_1", 33, 160), ("Q3_K", 40, 512), ("IQ4_NL", 17, 64), ("Q5_K", 40, 512), ("IQ4_XS", 33, 256),
         ("Q5_1", 35, 96), ("Q2_K", 35, 768), ("F16", 40, 512), ("BF16", 35, 160), ("MXFP4", 35, 96),
         ("IQ3_S", 35, 512), ("IQ3_XXS", 33, 512), ("IQ2_XXS", 35, 256), ("IQ1_S", 40, 768), ("IQ2_XS", 35, 512),
         ("IQ2_S", 33, 256), ("IQ1_M", 40, 768), ("TQ2_0", 35, 512), ("TQ1_0", 33, 768)]


@pytest.mark.parametrize(("kind", "n", "k"), KINDS)
def test_gguf_blocks_are_kept_exactly(kind: str, n: int, k: int) -> None:
    raw = random_blocks(kind, n, k)
    seg = quant.from_gguf_blocks(kind, raw, n, k)
    assert seg.blob.numel() == quant.blob_bytes(seg.fmt, n, k, seg.groups) == quant.kept_bytes(kind, n, k)
    assert (seg.fmt, seg.groups) == quant.KEPT_AS[kind]
    assert_same_weights(kind, seg.dequantize().numpy(), gguf_dequant(kind, raw, n, k))
    rows = torch.tensor([n - 1, 0, 7])
    assert np.array_equal(seg.dequantize(rows).numpy(), gguf_dequant(kind, raw, n, k)[rows.numpy()])


def assert_same_weights(kind: str, ours: np.ndarray, ref: np.ndarray) -> None:
    """Bit for bit in float32, the sign of a zero weight included (Q4_0's d * (q - 8) as gguf's)."""
    assert np.array_equal(ours, ref)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), kind


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1", "MXFP4", "TQ2_0", "TQ1_0"])
def test_blocks_from_ggufs_quantizer_are_kept_exactly(kind: str) -> None:
    """Real blocks from `gguf`'s own quantizer, edge rows included (zeros, a single spike, constants)."""
    n, k = 20, 256
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
    w[0] = 0
    w[1, 3] = 1e3
    w[2] = -1.5
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)
    seg = quant.from_gguf_blocks(kind, raw, n, k)
    assert_same_weights(kind, seg.dequantize().numpy(), gguf_dequant(kind, raw, n, k))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # gguf's 2^127 * 12, an infinity as ours
def test_mxfp4_keeps_every_exponent_and_code_exactly() -> None:
    """MXFP4's scale is 2^(e - 128) for every byte e (past float16's range both ways, subnormal
    floats below e = 2, infinities where 2^127 * 12 overflows): every (exponent, code) pair in the
    file dequantizes to `gguf`'s float32 bits, on the kernels' own unpacking."""
    n, k = 256, 512  # row e holds exponent e in every block; each block holds all 16 codes twice
    raw = np.zeros((n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = np.arange(256, dtype=np.uint8)[:, None]
    codes = (np.arange(32)[None, None, :] + np.arange(k // 32)[None, :, None]) % 16  # rotated a block
    raw[..., 1:] = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    raw = raw.reshape(n, -1)
    seg = quant.from_gguf_blocks("MXFP4", raw, n, k)
    assert seg.nbytes == n * k * 17 // 32  # the file's bytes: one exponent and 16 code bytes a block
    assert_same_weights("MXFP4", seg.dequantize().numpy(), gguf_dequant("MXFP4", raw, n, k))


def test_iq3_s_keeps_every_grid_entry_and_sign_exactly() -> None:
    """Each of IQ3_S's 512 grid entries (an index's ninth bit included), with its signs clear and set,
    under every scale code, dequantizes to `gguf`'s float32 bits on the kernels' own unpacking."""
    n, k = 16, 256  # row r: grid indices 64 * (r % 8) .. + 63, every sign bit r // 8
    raw = np.zeros((n, 1, 110), dtype=np.uint8)
    raw[..., 0:2] = np.array([0.0123], dtype=np.float16).view(np.uint8)
    idx = np.arange(64)[None, :] + 64 * (np.arange(n) % 8)[:, None]  # [n, 64]
    raw[:, 0, 2:66] = idx & 255
    raw[:, 0, 66:74] = np.packbits((idx >> 8).astype(np.uint8).reshape(n, 8, 8), axis=2, bitorder="little")[..., 0]
    raw[:, 0, 74:106] = np.where(np.arange(n) // 8 == 1, 255, 0)[:, None]
    raw[:, 0, 106:110] = np.array([0x10, 0x32, 0x54, 0xF6], dtype=np.uint8)  # scale codes 0, 1, .., 6 and 15
    raw = raw.reshape(n, -1)
    seg = quant.from_gguf_blocks("IQ3_S", raw, n, k)
    assert_same_weights("IQ3_S", seg.dequantize().numpy(), gguf_dequant("IQ3_S", raw, n, k))


@pytest.mark.parametrize(("kind", "n", "k"), KINDS)
def test_product_matches_float64_reference(kind: str, n: int, k: int) -> None:
    raw = random_blocks(kind, n, k, seed=1)
    w = qw(quant.from_gguf_blocks(kind, raw, n, k))
    bias = torch.randn(n)
    x = torch.randn(5, k)
    y = quant.qlinear(x, w, bias)
    ref = reference(x, torch.from_numpy(gguf_dequant(kind, raw, n, k)), kind) + bias.double()
    assert y.shape == (5, n)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_float_weights_are_multiplied_within_float32_rounding(kind: str) -> None:
    """F16 and BF16: the file's weights exactly (their float32 values), float32 activations as they
    are; each output within float32 rounding of two chains of k/2 products of the float64 sum."""
    n, k = 35, 1536
    raw = random_blocks(kind, n, k, seed=4)
    w = qw(quant.from_gguf_blocks(kind, raw, n, k))
    exact = torch.from_numpy(gguf_dequant(kind, raw, n, k))
    assert torch.equal(w.dequantize(), exact) and w.nbytes == 2 * 48 * k  # 16 bits a weight, 3 panels
    x = torch.randn(9, k) * 3
    y = quant.qlinear(x, w).double()
    ref = x.double() @ exact.double().T
    bound = (k / 2 + 1) * 2.0**-24 * (x.double().abs() @ exact.double().abs().T)  # |error| of a chain of fmas
    assert ((y - ref).abs() <= bound).all()


def test_bf16_on_bfloat16_products_keeps_the_files_weights() -> None:
    """bf16d (the load's layout for bfloat16 products) holds gguf's own weights, in the file's bytes."""
    n, k = 35, 160
    raw = random_blocks("BF16", n, k, seed=3)
    seg = quant.bf16_pairs(quant.from_gguf_blocks("BF16", raw, n, k))
    assert seg.fmt == "bf16d" and seg.nbytes == quant.kept_bytes("BF16", n, k)
    assert_same_weights("BF16", seg.dequantize().numpy(), gguf_dequant("BF16", raw, n, k))
    rows = torch.tensor([n - 1, 0, 7])
    assert np.array_equal(seg.dequantize(rows).numpy(), gguf_dequant("BF16", raw, n, k)[rows.numpy()])


@pytest.mark.parametrize(("kind", "n", "k"), KINDS)
def test_a_row_alone_equals_the_same_row_in_a_batch(kind: str, n: int, k: int) -> None:
    w = qw(quant.from_gguf_blocks(kind, random_blocks(kind, n, k, seed=2), n, k))
    x = torch.randn(33, k)  # more than one tile of 16 rows
    batch = quant.qlinear(x, w)
    for rows in (1, 4, 9, 16, 17):
        part = quant.qlinear(x[:rows], w)
        assert torch.equal(part, batch[:rows]), rows
    for i in (0, 8, 16, 32):
        assert torch.equal(quant.qlinear(x[i : i + 1], w)[0], batch[i])


def test_activation_quantization_rounds_half_to_even_per_block() -> None:
    x = torch.randn(3, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    q8, d8, s16 = ext.quantize_activations(x, kernels.path_id())
    blocks = x.view(3, 2, 32)
    d = blocks.abs().amax(-1) / 127
    assert torch.equal(d8, d)
    expected = torch.round(blocks * (1 / d).unsqueeze(-1)).to(torch.int8).view(3, 64)  # torch.round: half to even
    assert torch.equal(q8, expected)
    assert torch.equal(s16, expected.view(3, 4, 16).int().sum(-1))


def test_zero_block_has_zero_scale() -> None:
    x = torch.zeros(1, 64)
    x[0, 40] = 2.0
    q8, d8, s16 = ext.quantize_activations(x, kernels.path_id())
    assert d8[0, 0] == 0 and not q8[0, :32].any() and s16[0, :2].eq(0).all()  # no 0/0 scale for the zero block
    assert d8[0, 1] == torch.tensor(2.0) / 127 and q8[0, 40] == 127
    w = qw(quant.quantize(torch.randn(16, 64), 8).segments[0])
    y = quant.qlinear(x, w)
    ref = reference(x, w.dequantize())
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_stacked_segments_of_different_formats() -> None:
    """q (Q4_K) + k (Q4_K) + v (Q6_K), as a GGUF stores one layer: one call, every column right."""
    k = 256
    parts = [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)]
    raws = [random_blocks(kind, n, k, seed=i) for i, (kind, n) in enumerate(parts)]
    segs = [quant.from_gguf_blocks(kind, raw, n, k) for (kind, n), raw in zip(parts, raws, strict=True)]
    w = quant.QWeight.concat([qw(s) for s in segs])
    assert [s.fmt for s in w.segments] == ["q4k", "q6k"]  # the two Q4_K blocks merged
    full = np.concatenate([gguf_dequant(kind, raw, n, k) for (kind, n), raw in zip(parts, raws, strict=True)])
    assert np.array_equal(w.dequantize().numpy(), full)
    x = torch.randn(3, k)
    ref = reference(x, torch.from_numpy(full))
    assert torch.allclose(quant.qlinear(x, w).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [512, 896])  # 896: 4-bit super-blocks of 7 groups (the 0.5B's hidden size)
def test_float_weights_quantize_within_their_grid(bits: int, width: int) -> None:
    w = torch.randn(40, width)
    q = quant.quantize(w, bits)
    assert q.segments[0].groups == (8 if width == 512 else 7) or bits == 8
    deq = q.dequantize()
    g = w.view(40, -1, 32)
    span = g.amax(-1) - g.amin(-1).clamp(max=0) if bits == 4 else g.abs().amax(-1)
    step = span / (15 if bits == 4 else 127)
    err = (deq - w).view(40, -1, 32).abs().amax(-1)
    # Half a step, plus what the 6-bit scale codes (4-bit) or float16 scales (8-bit) add.
    assert (err <= step * (0.75 if bits == 4 else 0.51) + 1e-6).all()
    x = torch.randn(2, width)
    ref = reference(x, deq)
    assert torch.allclose(quant.qlinear(x, q).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tall_weight_quantized_in_runs_of_rows_is_each_rows_own(bits: int) -> None:
    """Tall weights (a vocabulary head) are quantized a run of rows at a time: every row, on both
    sides of a run's end and in the part-filled last panel, dequantizes as that row quantized alone."""
    n = 2 * quant._QUANTIZE_RUN + 21
    w = torch.randn(n, 96)
    w[quant._QUANTIZE_RUN - 1] *= 40  # a row unlike its neighbours, at a run's end
    deq = quant.quantize(w, bits).dequantize()
    for r in (0, quant._QUANTIZE_RUN - 1, quant._QUANTIZE_RUN, n - 21, n - 1):
        assert torch.equal(deq[r], quant.quantize(w[r : r + 1], bits).dequantize()[0]), r


def test_fused_norm_silu_and_residual_match_the_unfused_product() -> None:
    """RMSNorm / SiLU-gating before the product and a residual after it, all in the kernel call,
    give what the separate float32 steps give (within the steps' own float32 rounding)."""
    w = quant.quantize(torch.randn(48, 256), 8)
    x, norm, res = torch.randn(5, 256) * 3, torch.rand(256) + 0.5, torch.randn(5, 48)
    normed = norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = quant.qlinear(x, w, norm=norm, eps=1e-6, residual=res)
    assert torch.allclose(got, quant.qlinear(normed, w) + res, atol=2e-2 * got.abs().max().item())
    gu = torch.randn(5, 512)
    gated = torch.nn.functional.silu(gu[:, :256]) * gu[:, 256:]
    got = quant.qlinear(gu, w, silu_mul=True)
    assert torch.allclose(got, quant.qlinear(gated, w), atol=2e-2 * got.abs().max().item())


def test_bad_blob_size_is_refused() -> None:
    seg = quant.quantize(torch.randn(16, 64), 8).segments[0]
    with pytest.raises(RuntimeError, match="expected"):
        ext.qlinear(torch.randn(1, 64), [seg.blob[:-1]], [2], [16], [128], [1], None, None, 0.0, False, None,
                    kernels.path_id())


@pytest.mark.parametrize("fmt", ["q4k", "q6k", "q5k", "iq4", "q3k", "q2k", "q8", "q40", "q50", "iq4nl", "q41",
                                 "q51", "mxfp4", "iq3s", "iq3xxs", "iq2xxs", "iq1s", "iq2xs", "iq1m", "f16",
                                 "bf16"])
def test_a_whole_weight_dequantizes_to_each_rows_own_floats(fmt: str) -> None:
    """A whole weight (runs of rows unpacked together, a panel at a time) and any rows asked in any
    order give each row's floats as it gives them alone, written into `out` when one is given."""
    from specextend.bench.onerow import random_weight

    seg = random_weight(fmt, 45, 512, seed=3).segments[0]  # 45 rows: the last panel is partial
    alone = torch.stack([seg.dequantize(torch.tensor([r]))[0] for r in range(seg.n)])
    assert torch.equal(seg.dequantize(), alone)
    ids = torch.tensor([7, 8, 9, 0, 44, 43, 16, 17, 31, 32, 5, 5])
    assert torch.equal(seg.dequantize(ids), alone[ids])
    out = torch.full((seg.n + 3, seg.k), float("nan"))
    seg.dequantize(out=out[2 : 2 + seg.n])
    assert torch.equal(out[2 : 2 + seg.n], alone) and out[:2].isnan().all() and out[-1].isnan().all()


def test_a_stacked_weight_dequantizes_segment_by_segment_into_one_tensor() -> None:
    from specextend.bench.onerow import random_weight

    parts = [random_weight(f, n, 256, seed=i).segments[0] for i, (f, n) in enumerate([("q4k", 32), ("q6k", 16)])]
    w = quant.QWeight(256, parts)
    assert torch.equal(w.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_dequantize_refuses_an_out_of_the_wrong_shape() -> None:
    from specextend.bench.onerow import random_weight

    seg = random_weight("q8", 16, 256).segments[0]
    with pytest.raises(RuntimeError, match="out must be"):
        seg.dequantize(out=torch.empty(16, 128))
