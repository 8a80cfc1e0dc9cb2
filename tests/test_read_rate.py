"""The memory floor against timings taken beside it: the read rate is sampled where a benchmark
times, each one-row ratio is a round's time over that round's floor, and a report says when the rate
moved during the run (bench/runtime.py `ReadRate`, bench/step_split.py `against_floors`)."""

from __future__ import annotations

import pytest

from specextend.bench.runtime import ReadRate, moved_note
from specextend.bench.step_split import against_floors


def test_each_ratio_is_a_rounds_time_over_its_own_rounds_floor() -> None:
    # The memory ran fast in two rounds and at half the rate in two, the step with it (1.5x its floor in each).
    rounds = [{"floor_s": 0.010, "step": 0.015}, {"floor_s": 0.020, "step": 0.030}] * 2
    # ... and in one round the rate fell after its sample was taken: a step at the slow level over a fast floor.
    rounds.append({"floor_s": 0.010, "step": 0.030})
    out = against_floors(rounds, ("step",))
    assert out["step_s"] == 0.015  # the best time
    # 1.5x: not 0.75x (the best time over the slow level's floor), and not the mixed round's 3x.
    assert out["step_of_floor"] == pytest.approx(1.5)


def test_a_floor_names_the_span_only_where_the_rate_moved() -> None:
    assert moved_note([36.0, 39.0]) == ""
    assert moved_note(None) == ""
    note = moved_note([36.6, 64.7])
    assert "36.6" in note and "64.7" in note and "1.77x" in note


def test_a_read_rate_keeps_every_sample() -> None:
    rate = ReadRate(mb=8)
    first, second = rate.sample(), rate.sample(passes=1)
    assert first > 0 and second > 0
    assert rate.span == (min(first, second), max(first, second))
