"""The server's step budget (batching/budget.py) on synthetic curves: alone, chunks of the efficient
size; beside decoding streams, smaller ones, smaller still at a longer context or on a slower
machine; and the prefill curve's measurement and cache."""

from __future__ import annotations

import torch

from specextend.batching.budget import StepBudget
from specextend.models.loader import load_model
from specextend.runtime import costmodel
from specextend.runtime.costmodel import ForwardCurve

PREFILL_ROWS = [16, 32, 64, 128, 256, 512]


def prefill_curve(ms_per_token: list[float]) -> ForwardCurve:
    return ForwardCurve(PREFILL_ROWS, [0], [[n * ms / 1e3 for n, ms in zip(PREFILL_ROWS, ms_per_token, strict=True)]])


# 16 rows: 4 ms a token ... from 128 on, 1 ms (the many-row kernels are busy); 512 a little slower
PREFILL = prefill_curve([4.0, 2.5, 1.5, 1.0, 0.997, 1.01])
# One-row to 32-row steps: attending to 8K tokens adds 0.5 ms a row over 256 tokens.
STEPS = ForwardCurve([1, 32], [256, 8192], [[0.02, 0.05], [0.024, 0.066]])


def test_alone_the_chunk_is_the_smallest_within_reach_of_the_best_cost_per_token():
    b = StepBudget(PREFILL, STEPS)
    assert b.efficient_rows() == 128 and b.alone_rows == 128 and b.rows(0, 4096) == 128


# The same chunks after 4K cached tokens: attention's per-chunk work makes small chunks dearer
# (512 rows still the best there, 256 within half a percent of it).
LONG = ForwardCurve(PREFILL_ROWS, [0, 4096], [PREFILL.seconds[0], [n * ms / 1e3 for n, ms in zip(
    PREFILL_ROWS, [9.0, 6.0, 4.0, 3.0, 2.47, 2.46], strict=True)]])


def test_alone_the_chunk_grows_with_the_context_within_a_newcomer_s_wait():
    b = StepBudget(LONG, STEPS)
    assert b.alone_rows == 128 and b.rows(0, 0) == 128  # an empty cache: as before
    assert b.rows(0, 4096) == 256 and b.efficient_rows(4096) == 256  # 2.47 ms within 0.5% of 2.46
    assert b.rows(0, 2048) == 256  # halfway: 256 the best there
    slow = StepBudget(LONG, STEPS)
    slow.scale = 20.0  # a step of 256 rows now predicted past NEWCOMER_WAIT_S: back to smaller chunks
    assert slow.predict(256, 4096) > 2.0 and slow.rows(0, 4096) == 128
    assert StepBudget(LONG, STEPS, gap_goal_s=100.0).rows(1, 4096) == 1 + 256  # beside a stream: at most it


def test_beside_streams_chunks_fit_the_gap_goal_and_shrink_with_context_and_load():
    b = StepBudget(PREFILL, STEPS, gap_goal_s=0.2, refresh=True)  # 0.1 s a step
    near, far = b.rows(1, 256), b.rows(1, 8192)
    assert 16 < near < b.alone_rows and far < near  # a longer context costs every row more
    assert b.predict(near, 256) <= 0.1 < b.predict(near + 16, 256)
    assert b.rows(4, 256) - 4 <= near - 1  # more streams' rows leave less for the prompt
    slow = StepBudget(PREFILL, STEPS, gap_goal_s=0.2, refresh=True)
    for _ in range(20):  # the steps take twice what was predicted: a busier machine
        slow.observe(near, 256, 2 * slow.predict(near, 256) / slow.scale)
    assert 1.8 < slow.scale < 2.2 and slow.rows(1, 256) < near
    assert StepBudget(PREFILL, STEPS, gap_goal_s=1e-6).rows(1, 256) == 17  # a prompt always progresses
    assert StepBudget(PREFILL, STEPS, gap_goal_s=100.0).rows(1, 256) == 1 + 128  # never past the efficient size


def test_health_says_the_budgets_and_why():
    s = StepBudget(PREFILL, STEPS).stats()
    assert s["alone_rows"] == s["efficient_rows"] == 128 and s["decoding_rows"] <= 129
    assert s["alone_rows_by_context"]["0"] == 128
    assert StepBudget(LONG, STEPS).stats()["alone_rows_by_context"]["4096"] == 256
    assert "128 prompt tokens" in s["why"] and s["prefill_ms_per_token"]["16"] == 4.0


def test_the_prefill_curve_is_measured_without_logits_and_cached_apart(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXTEND_COST_CACHE", str(tmp_path))
    model = load_model(tiny_dir("qwen2", 0), torch.float64)
    calls = []
    forward = type(model).__call__

    def spy(self, tokens, positions, cache, tree_mask=None, backend="efficient", logits_rows=None, keep_q=None):
        calls.append((int(tokens.shape[0]), tree_mask, logits_rows))
        return forward(self, tokens, positions, cache, tree_mask, backend, logits_rows, keep_q)

    monkeypatch.setattr(type(model), "__call__", spy)
    curve = costmodel.cached_curve(model, "efficient", quiet=True, kind="prefill")
    room = int(model.cfg.max_position) - max(costmodel.PREFILL_ROWS)  # contexts cut to fit the model
    assert curve.rows == list(costmodel.PREFILL_ROWS)
    assert curve.contexts == sorted({max(0, min(c, room)) for c in costmodel.PREFILL_CONTEXTS})
    assert all(mask is None and rows == slice(0, 0) for _, mask, rows in calls)  # causal chunks, no logits
    n = len(calls)
    costmodel.cached_curve(model, "efficient", quiet=True, kind="prefill")
    assert len(calls) == n  # read back
    assert [p.name.endswith("-prefill.json") for p in tmp_path.glob("*.json")] == [True]


def test_a_context_bucket_has_one_chunk_whichever_context_asks_first():
    """Contexts are bucketed by 256 tokens; a bucket's rows are its start's, so /health's chunk alone
    (the empty cache's) is the one the steps use, even when a cached prefix asked first."""
    b = StepBudget(LONG, STEPS)
    assert b.efficient_rows(200) != b.efficient_rows(0)  # inside the bucket another chunk would win
    assert b.rows(0, 200) == b.rows(0, 0) == b.alone_rows == b.stats()["alone_rows"]
