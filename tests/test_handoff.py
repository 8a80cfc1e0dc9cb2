"""Calls into event loops from a batch step reach each loop in one hand-over at the step's end, in
order with calls made outside a step; a closed loop drops them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specextend.batching import loop_handoff


class FakeLoop:
    """Records each `call_soon_threadsafe` (a hand-over); runs them when told."""

    def __init__(self, closed: bool = False) -> None:
        self.handovers: list[tuple] = []
        self.closed = closed

    def call_soon_threadsafe(self, fn, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.handovers.append((fn, args))

    def run(self) -> None:
        for fn, args in self.handovers:
            fn(*args)
        self.handovers.clear()


def test_a_step_hands_each_loop_its_calls_once_at_its_end_in_order():
    a, b, seen = FakeLoop(), FakeLoop(), []
    with loop_handoff.held():
        for i in range(16):
            loop_handoff.call_soon(a, seen.append, ("a", i))
            loop_handoff.call_soon(b, seen.append, ("b", i))
        assert a.handovers == [] and b.handovers == []  # nothing reaches a loop mid-step
    assert len(a.handovers) == 1 and len(b.handovers) == 1
    a.run()
    b.run()
    assert seen == [("a", i) for i in range(16)] + [("b", i) for i in range(16)]


def test_calls_inside_and_outside_a_step_keep_their_order():
    loop, seen = FakeLoop(), []
    loop_handoff.call_soon(loop, seen.append, 1)
    with loop_handoff.held():
        loop_handoff.call_soon(loop, seen.append, 2)
        loop_handoff.call_soon(loop, seen.append, 3)
    loop_handoff.call_soon(loop, seen.append, 4)  # e.g. the scheduler's "error" after the step's text
    loop.run()
    assert seen == [1, 2, 3, 4]


def test_nested_blocks_hand_over_at_the_outermost_end():
    loop, seen = FakeLoop(), []
    with loop_handoff.held():
        with loop_handoff.held():
            loop_handoff.call_soon(loop, seen.append, 1)
        assert loop.handovers == []
        loop_handoff.call_soon(loop, seen.append, 2)
    loop.run()
    assert seen == [1, 2]


def test_an_exception_still_hands_the_calls_over():
    loop, seen = FakeLoop(), []
    with pytest.raises(ValueError), loop_handoff.held():
        loop_handoff.call_soon(loop, seen.append, "error event")
        raise ValueError("the step failed")
    loop.run()
    assert seen == ["error event"]


def test_a_closed_loop_drops_the_calls_and_the_others_still_get_theirs():
    closed, open_, seen = FakeLoop(closed=True), FakeLoop(), []
    loop_handoff.call_soon(closed, seen.append, 0)
    with loop_handoff.held():
        loop_handoff.call_soon(closed, seen.append, 1)
        loop_handoff.call_soon(open_, seen.append, 2)
    open_.run()
    assert seen == [2]


def test_another_threads_calls_are_not_held():
    loop = FakeLoop()
    with loop_handoff.held():
        t = threading.Thread(target=lambda: loop_handoff.call_soon(loop, print))
        t.start()
        t.join()
        assert len(loop.handovers) == 1


def test_a_real_loop_runs_the_calls_it_was_handed():
    async def main() -> list[int]:
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def step() -> None:
            with loop_handoff.held():
                for i in range(5):
                    loop_handoff.call_soon(loop, q.put_nowait, i)

        await asyncio.to_thread(step)
        return [await asyncio.wait_for(q.get(), 10) for _ in range(5)]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
