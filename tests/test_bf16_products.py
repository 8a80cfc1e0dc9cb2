"""BF16 weights on bfloat16 dot products (the quant format bf16d, `SPECEXTEND_BF16_PRODUCTS`).

The arithmetic is VDPBF16PS's lane, written out in numpy here and compared bit for bit with every
kernel path: activations rounded to bfloat16 (nearest even, a subnormal to zero), one chain a row
and channel over pairs of inputs, the odd input's product first. The load turns a stored bf16
matrix into bf16d where the setting says so; a stored file and the exact bf16 products (an expert
router's) never change."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specextend.common.errors import UserError
from specextend.runtime import experts, kernels, quant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

ext = kernels.load()
PATHS = [*kernels.cpu_paths(), kernels.EMULATED_AMX]


def product(w: quant.QWeight, x: torch.Tensor, path: str, **kw) -> torch.Tensor:
    args = (w.blobs, w.formats, w.widths, w.offsets, w.groups)
    return ext.qlinear(x, *args, kw.get("bias"), None, 1e-6, False, kw.get("residual"), kernels.path_index(path))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 values (as float32): nearest even, a subnormal to a zero of its sign."""
    u = x.astype(np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    r = np.where((u & 0x7F800000) == 0, u & 0x80000000, r).astype(np.uint32)
    return r.view(np.float32)


def daz(x: np.ndarray) -> np.ndarray:
    """Subnormal float32 values as zeros of their sign (VDPBF16PS's inputs and outputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return np.where((u & 0x7F800000) == 0, u & 0x80000000, u).astype(np.uint32).view(np.float32)


def chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The reference: per row and channel, pairs in order, odd input first; each step one rounding
    (a product of two bfloat16 values is exact, so float64's sum rounded once is the fma)."""
    xb, wb = daz(bf16_round(x)).astype(np.float64), daz(w).astype(np.float64)
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for j in range(x.shape[1] // 2):
        for i in (2 * j + 1, 2 * j):
            acc = daz((acc.astype(np.float64) + xb[:, i : i + 1] * wb[None, :, i]).astype(np.float32))
    return acc


def bf16d_weight(w: torch.Tensor) -> quant.QWeight:
    n, k = w.shape
    return quant.QWeight(k, [quant.pack_float("BF16", w.bfloat16().view(torch.int16).numpy(), n, k, dot=True)])


@pytest.mark.parametrize("path", PATHS)
def test_every_path_computes_the_pair_chain_bit_for_bit(path: str) -> None:
    g = torch.Generator().manual_seed(11)
    n, k = 48, 320
    w = torch.randn(n, k, generator=g).bfloat16()
    qw = bf16d_weight(w)
    for m in (1, 2, 9, 16, 17, 70):
        x = torch.randn(m, k, generator=g) * 3
        ref = chain(x.numpy(), w.float().numpy())
        assert np.array_equal(product(qw, x, path).numpy(), ref), m
        bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
        y = product(qw, x, path, bias=bias, residual=residual).numpy()
        assert np.array_equal(y, residual.numpy() + (ref + bias.numpy())), m


def test_the_chain_is_not_the_float32_products() -> None:
    """The pair chain differs from the exact float32 arithmetic (bf16) on ordinary inputs: rounded
    activations and another order; both stay close to float64."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 512, generator=g).bfloat16()
    x = torch.randn(4, 512, generator=g)
    exact = quant.QWeight(512, [quant.pack_float("BF16", w.view(torch.int16).numpy(), 32, 512)])
    dot, flt = quant.qlinear(x, bf16d_weight(w.float())), quant.qlinear(x, exact)
    ref = x.double() @ w.double().T
    assert not torch.equal(dot, flt)
    assert (dot.double() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_subnormal_weights_and_activations_count_as_zero(path: str) -> None:
    n, k = 16, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    w[:, 3] = 1e-39  # a bfloat16 subnormal (float32's too)
    w[:, 8] = -3e-40
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    x[:, 0] = 0.0
    x[:, 5] = 2e-39
    x[:, 3] = 1e30  # a subnormal weight times a large activation: zero, not 1e-9
    qw = bf16d_weight(w)
    y = product(qw, x, path)
    assert np.array_equal(y.numpy(), chain(x.numpy(), w.bfloat16().float().numpy()))
    w0 = w.clone()
    w0[:, 3] = 0.0
    w0[:, 8] = 0.0
    assert torch.equal(y, product(bf16d_weight(w0), x, "portable"))


def test_pairs_keep_the_weights_and_gather_alike() -> None:
    """bf16_pairs only moves bytes: the same weights, row by row, and a stored bf16 segment of an odd
    row count (a partial panel) keeps its padding."""
    n, k = 35, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    seg = quant.pack_float("BF16", w.view(torch.int16).numpy(), n, k)
    pairs = quant.bf16_pairs(seg)
    assert pairs.fmt == "bf16d" and pairs.nbytes == seg.nbytes
    assert torch.equal(pairs.dequantize(), w.float())
    assert torch.equal(pairs.dequantize(torch.tensor([34, 0, 17])), w.float()[[34, 0, 17]])
    blob = seg.blob.clone()
    assert quant.bf16_pairs(quant.Segment("bf16", n, blob, 0, k, 1), in_place=True).blob.data_ptr() == blob.data_ptr()
    assert torch.equal(blob, pairs.blob)
    with pytest.raises(ValueError, match="bf16 segment"):
        quant.bf16_pairs(pairs)
    with pytest.raises(ValueError, match="BF16 weights"):
        quant.pack_float("F16", w.view(torch.int16).numpy(), n, k, dot=True)


def test_the_setting(monkeypatch) -> None:
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, "1")
    assert kernels.bf16_products() and kernels.arithmetic_version().endswith("-bf16dot")
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, "0")
    assert not kernels.bf16_products() and "bf16dot" not in kernels.arithmetic_version()
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, "fast")
    with pytest.raises(UserError, match="expected auto, 1 or 0"):
        kernels.bf16_products()
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, "auto")
    cpuinfo = Path("/proc/cpuinfo")
    amd = cpuinfo.exists() and "AuthenticAMD" in cpuinfo.read_text()
    expected = amd and "avx512" in kernels.cpu_paths() and bool(ext.has_avx512_bf16())
    assert kernels.bf16_products() == expected


def test_exact_products_stay_exact(monkeypatch) -> None:
    """An expert router's exact bf16 parts are not the file's BF16 weights: never bfloat16 products."""
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, "1")
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    qw = experts.exact_bf16(w)
    assert {s.fmt for s in qw.segments} == {"bf16"}


def test_the_roofline_holds_bf16d_layers_to_the_bf16_peak() -> None:
    from specextend.bench import runtime

    class Lin(torch.nn.Module):
        def __init__(self, qw: quant.QWeight) -> None:
            super().__init__()
            self.qweight = qw

    model = torch.nn.Sequential(Lin(bf16d_weight(torch.randn(16, 64))), Lin(bf16d_weight(torch.randn(32, 64))))
    assert runtime.linear_peak_kind(model) == "bf16"
    model.append(Lin(quant.quantize(torch.randn(16, 64), 8)))
    assert runtime.linear_peak_kind(model) == "int8"
