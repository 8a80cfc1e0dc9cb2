"""A windowed layer's keys keep the numbers their full lists give them (csrc/core/attention.h): its
blocks of 32 and chunks of 512 lie on the slots' grid whichever key a token's window starts at, so a
prefill chunk's tokens share them. What must hold, on windows longer than a chunk that start off the
grid: a token gets the same bits alone (a decode step), inside a prefill chunk, inside a draft tree,
with any thread count and on every kernel path, and its output is attention over its window."""

from __future__ import annotations

import pytest
import torch

from specextend.runtime import kernels
from specextend.runtime.attention import eager_attention, list_ends, window_mask
from test_kernel_paths import PATHS, tree_mask

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

ext = kernels.load() if kernels.available() else None
COMMITTED, WINDOW, D = 1300, 700, 64  # the window spans two chunk lines and starts off the block grid


def cache(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, n, D, generator=g).bfloat16()
    v = torch.randn(2, n, D, generator=g).bfloat16()
    q = torch.randn(6, n, D, generator=g) * 2  # a query for every slot: token i's is q[:, i]
    return q, k, v


def windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None, pid: int) -> torch.Tensor:
    """The new tokens (the last len(positions) slots of k, v) through a window of WINDOW, numbered."""
    keys, t = k.shape[1], positions.shape[0]
    first, wmask = window_mask(positions, keys, mask, WINDOW)
    return ext.attend(q, k[:, first:], v[:, first:], wmask, pid, ends=list_ends(keys, mask, t), lead=first)


def alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, pid: int) -> torch.Tensor:
    """One token decoded after the keys `seen` (its ancestors committed, in slot order)."""
    n = seen.shape[0]
    return windowed(q, k[:, seen].contiguous(), v[:, seen].contiguous(), torch.tensor([n - 1]), None, pid)


@pytest.mark.parametrize("path", PATHS)
def test_a_windowed_token_gets_the_same_bits_alone_in_a_chunk_and_in_a_tree(path: str) -> None:
    pid = kernels.path_index(path)
    t = 40
    q, k, v = cache(COMMITTED + t)
    chunk = windowed(q[:, COMMITTED:], k, v, torch.arange(COMMITTED, COMMITTED + t), None, pid)
    for i in (0, 5, 17, t - 1):  # tokens whose windows start at different places in a block
        one = alone(q[:, COMMITTED + i:COMMITTED + i + 1], k, v, torch.arange(COMMITTED + i + 1), pid)
        assert torch.equal(one, chunk[:, i:i + 1]), i
        lo, hi = COMMITTED + i + 1 - WINDOW, COMMITTED + i + 1  # its window, read right
        ref = eager_attention(q[:, hi - 1:hi].double(), k[:, lo:hi].double(), v[:, lo:hi].double())
        assert torch.allclose(one.double(), ref, atol=2e-2, rtol=0), i
    tree = tree_mask(9, seed=4)
    depth = tree.sum(1) - 1
    nodes = windowed(q[:, COMMITTED:COMMITTED + 9], k[:, :COMMITTED + 9], v[:, :COMMITTED + 9],
                     COMMITTED + depth, tree, pid)
    for j in range(9):
        seen = torch.cat([torch.arange(COMMITTED), COMMITTED + tree[j].nonzero().flatten()])
        assert torch.equal(alone(q[:, COMMITTED + j:COMMITTED + j + 1], k, v, seen, pid), nodes[:, j:j + 1]), j
    if path != "portable":
        portable = kernels.path_index("portable")
        assert torch.equal(windowed(q[:, COMMITTED:], k, v, torch.arange(COMMITTED, COMMITTED + t), None, portable),
                           chunk)


def test_a_windowed_decode_read_by_more_threads_and_its_attention_over_the_window() -> None:
    q, k, v = cache(COMMITTED + 1, seed=2)
    pid = kernels.path_index(kernels.cpu_paths()[-1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = alone(q[:, COMMITTED:], k, v, torch.arange(COMMITTED + 1), pid)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(alone(q[:, COMMITTED:], k, v, torch.arange(COMMITTED + 1), pid), one)
    finally:
        torch.set_num_threads(before)
    lo = COMMITTED + 1 - WINDOW
    ref = eager_attention(q[:, COMMITTED:].double(), k[:, lo:].double(), v[:, lo:].double())
    assert torch.allclose(one.double(), ref, atol=2e-2, rtol=0)
    outside = eager_attention(q[:, COMMITTED:].double(), k.double(), v.double())
    assert not torch.allclose(one.double(), outside, atol=2e-2, rtol=0)  # the window matters here


def test_a_full_list_numbered_from_zero_keeps_its_bits_and_bad_numbers_are_refused() -> None:
    t = 20
    q, k, v = cache(COMMITTED + t, seed=3)
    pid = kernels.path_index("portable")
    plain = ext.attend(q[:, COMMITTED:], k, v, None, pid)
    assert torch.equal(ext.attend(q[:, COMMITTED:], k, v, None, pid, ends=list_ends(COMMITTED + t, None, t)), plain)
    with pytest.raises(RuntimeError, match="more than its number"):
        ext.attend(q[:, COMMITTED:], k, v, None, pid, ends=list_ends(COMMITTED + t, None, t) - 5)
    with pytest.raises(RuntimeError, match="lead without ends"):
        ext.attend(q[:, COMMITTED:], k, v, None, pid, lead=3)


@pytest.mark.parametrize("path", ["portable", kernels.cpu_paths()[-1]])
def test_a_windowed_token_over_a_q8_cache_gets_the_same_bits_alone_and_in_a_chunk(path: str) -> None:
    """The same over int8 K/V rows (`--kv-cache q8`), whose blocks are converted before they are read."""
    from test_kv_q8 import q8_rows

    pid = kernels.path_index(path)
    t = 24
    q, k, v = cache(COMMITTED + t, seed=4)
    k8, v8 = q8_rows(k.float() * 3)[0], q8_rows(v.float())[0]  # q8_rows gives (keys, values)
    chunk = windowed(q[:, COMMITTED:], k8, v8, torch.arange(COMMITTED, COMMITTED + t), None, pid)
    for i in (0, 9, t - 1):
        one = alone(q[:, COMMITTED + i:COMMITTED + i + 1], k8, v8, torch.arange(COMMITTED + i + 1), pid)
        assert torch.equal(one, chunk[:, i:i + 1]), i
