"""The K-quants' activations with one scale per 256 values (`SPECEXTEND_K256=1`, csrc/core/qlinear.h).

Quantized like llama.cpp's Q8_K (int8 codes, one float scale a 256-value block, integer sums of 16
and 32 codes), the K-quant products sum each super-block in integers and close it with one float
step. These tests check the codes against a Python reference, the products against the float64
product of those codes, and that every path gives the portable bits for every row count, each row
what it gets alone; 32-weight types keep their per-32 activations.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specextend.runtime import kernels, quant
from test_kernel_paths import PATHS, product, weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

ext = kernels.load()
K_QUANTS = [("Q4_K", 48, 512), ("Q6_K", 35, 768), ("Q5_K", 48, 512), ("IQ4_XS", 33, 768), ("Q3_K", 40, 512),
            ("Q2_K", 48, 512), (4, 40, 256)]


@pytest.fixture
def k256() -> Iterator[None]:
    ext.set_k256(sum(1 << b for b in kernels.K256_FORMATS.values()))
    try:
        yield
    finally:
        ext.set_k256(kernels.k256())


def codes256(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantization: per block of 256, d = max|x| / 127, codes round(x * (1 / d))."""
    xb = x.reshape(x.shape[0], -1, 256)
    d = xb.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv.unsqueeze(-1)).to(torch.int8).reshape(x.shape), d


@pytest.mark.parametrize("path", PATHS)
def test_activations_per_256_match_the_reference(path: str) -> None:
    x = torch.randn(7, 768) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[0, :256] = 0  # a zero block
    q, d, s16, s32 = ext.quantize_activations256(x, kernels.path_index(path))
    ref_q, ref_d = codes256(x)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    assert torch.equal(s16.long(), q.long().reshape(7, -1, 16).sum(-1))
    assert torch.equal(s32.long(), q.long().reshape(7, -1, 32).sum(-1))


@pytest.mark.parametrize(("kind", "n", "k"), K_QUANTS)
def test_k_quant_products_are_the_per_256_arithmetic(k256: None, kind, n: int, k: int) -> None:
    """The product is the float64 product of the per-256 codes with the weights (up to float32
    rounding), not the per-32 one; Q8_0 keeps its per-32 activations."""
    w = weight(kind, n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)) * 3
    q, d = codes256(x)
    ref = (q.double().reshape(5, -1, 256) * d.double().unsqueeze(-1)).reshape(5, k) @ w.dequantize().double().T
    y = product(w, x, "portable")
    scale = ref.abs().max()
    assert (y.double() - ref).abs().max() <= 1e-5 * scale
    ext.set_k256(0)
    per32 = product(w, x, "portable")
    assert not torch.equal(per32, y)
    q8 = quant.QWeight(k, [quant.quantize_int8(torch.randn(n, k))])
    before = product(q8, x, "portable")
    ext.set_k256(sum(1 << b for b in kernels.K256_FORMATS.values()))
    assert torch.equal(product(q8, x, "portable"), before)


ROWS = (1, 2, 5, 9, 12, 17, 65, 130)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("kind", "n", "k"), K_QUANTS)
def test_every_path_gives_the_portable_bits_each_row_its_own(k256: None, path: str, kind, n: int, k: int) -> None:
    w = weight(kind, n, k)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(max(ROWS), k, generator=g) * 2
    res = torch.randn(max(ROWS), n, generator=g)
    alone = torch.cat([product(w, x[r : r + 1], "portable", residual=res[r : r + 1]) for r in range(max(ROWS))])
    for m in ROWS:
        assert torch.equal(product(w, x[:m], path, residual=res[:m]), alone[:m]), m
    fused = dict(bias=torch.randn(n, generator=g), norm=torch.rand(k, generator=g) + 0.5)
    assert torch.equal(product(w, x[:9], path, **fused), product(w, x[:9], "portable", **fused))
    gate_up = torch.cat([x[:9], torch.randn(9, k, generator=g)], dim=1)
    assert torch.equal(product(w, gate_up, path, silu=True), product(w, gate_up, "portable", silu=True))


def test_the_prefix_cache_fingerprint_names_the_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    from specextend.requests.prefix_cache import fingerprint

    monkeypatch.delenv(kernels.K256_ENV, raising=False)
    before = fingerprint([(None, None)])
    monkeypatch.setenv(kernels.K256_ENV, "1")
    every = fingerprint([(None, None)])
    monkeypatch.setenv(kernels.K256_ENV, "q6k")
    assert kernels.k256() == 1 << kernels.K256_FORMATS["q6k"]
    assert len({before, every, fingerprint([(None, None)])}) == 3


def test_only_the_chosen_formats_change(k256: None) -> None:
    """`SPECEXTEND_K256=q6k`: Q6_K's products take the per-256 activations, Q4_K's keep per 32."""
    q4, q6 = weight("Q4_K", 32, 512), weight("Q6_K", 32, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    every = product(q4, x, "portable"), product(q6, x, "portable")
    ext.set_k256(0)
    none = product(q4, x, "portable"), product(q6, x, "portable")
    ext.set_k256(1 << kernels.K256_FORMATS["q6k"])
    assert torch.equal(product(q4, x, "portable"), none[0]) and torch.equal(product(q6, x, "portable"), every[1])


def test_a_bad_format_name_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from specextend.common.errors import UserError

    monkeypatch.setenv(kernels.K256_ENV, "q4k,q8")
    with pytest.raises(UserError, match="not a K-quant format: q8"):
        kernels.k256()
