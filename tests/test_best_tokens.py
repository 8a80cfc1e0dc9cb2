"""Greedy choices read through NumPy on the CPU are torch's argmax: the first of equal maxima, a NaN
as the largest, any float dtype and layout."""

from __future__ import annotations

import pytest
import torch

from specextend.speculation.verify import best_token, best_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rows_argmax_is_torchs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1000, generator=g).to(dtype)
    x[2, 10] = x[2, 900] = x[2].max() + 1  # a tie: the first
    x[3, 5] = float("nan")
    x[4] = float("-inf")
    assert best_tokens(x) == torch.argmax(x, dim=-1).tolist()
    cols = x[:, ::3]  # not contiguous
    assert best_tokens(cols) == torch.argmax(cols, dim=-1).tolist()
    assert [best_token(r) for r in x] == torch.argmax(x, dim=-1).tolist()


def test_one_row_and_a_tree_of_one():
    x = torch.tensor([0.5, 2.0, -1.0])
    assert best_token(x) == 1
    assert best_tokens(x[None]) == [1]
