"""Prompt KV shared inside a batch: a sequence whose prompt starts the way another's does takes the
slots that one has computed instead of computing them again.

Requests that arrive together often share the beginning of their prompts: a chat template's
system turn, or one document asked several questions. The prefix cache (requests/prefix_cache.py) serves a
prompt that an *earlier* request prefilled and remembered; these sequences prefill at the same
time. On the row-independent runtime (`Transformer.batches_rows`) slot i of a prompt's KV depends
only on tokens 0..i: not on which forward computed the row, how the prompt was cut into chunks or
what else shared that forward (tests/test_batch.py). So another cache of the same model holding
the same first tokens holds the same slots, and a copy gives a sequence the bits it would compute
alone.

Each step, before the target's forward (`Batch.step`), every sequence prefilling its prompt, the
first in the batch's order first:
1. copies the longest run of its next slots that another sequence's cache already holds;
2. sits the step out (takes no prompt tokens) if a sequence before it in that order runs in this
   step and will compute at least `MIN_WAIT` more of the tokens their prompts share: the next step
   copies them instead of computing them twice.
The order puts the sequence furthest into its prompt first, then the one admitted first, so the
first of every group of alike prompts never waits and every step it progresses. A prompt's last
token is always computed (its logits start the decode; its queries, retrieval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from ..runtime.kv_cache import common_prefix
from ..runtime.layers import Rows

if TYPE_CHECKING:
    from ..runtime.kv_cache import KVCache


class Pending(Protocol):
    """A forward a sequence waits on: its rows (a prefill call's: the prompt's remaining tokens)."""

    rows: Rows


class Prefilling(Protocol):
    """What sharing reads and writes of a sequence (batch.Sequence): its pending forward, and how
    many prompt tokens it has taken from other sequences' caches."""

    call: Pending | None
    shared: int


Seq = TypeVar("Seq", bound=Prefilling)

# Shared prompt tokens worth a step's wait. A follower that waits loses one step of its prefill,
# and a chat template's system turn alone is ~25 tokens; below this, computing them again beside
# the leader costs about what the wait would.
MIN_WAIT = 16


def _reach(holder: KVCache, c: KVCache) -> int:
    """How far into c's prompt the holder's computed slots are c's too (its prompt's last token is
    always c's own to compute; 0: nothing shared)."""
    if holder is c or holder.prompt is None or c.prompt is None or holder.k.shape[:2] != c.k.shape[:2] \
            or holder.k.dtype != c.k.dtype or holder.windowed != c.windowed:
        return 0
    reach = min(common_prefix(c.prompt, holder.prompt), holder.length, len(c.prompt) - 1)
    # a holder whose windowed layers have slid past what c still needs holds nothing for it
    return reach if c.can_take(holder, reach) else 0


def wanted(cache: KVCache, prefilling: list[KVCache]) -> bool:
    """Whether one of the `prefilling` caches would copy slots from `cache`."""
    return any(_reach(cache, c) > c.length for c in prefilling)


def _prompt(rows: Rows) -> np.ndarray | None:
    """The prompt of a prefill call's cache, if the call's rows are that prompt's next tokens."""
    c = rows.cache
    ids = c.prompt
    if ids is None or rows.tree_mask is not None or c.pending or rows.size < 1:
        return None
    start = c.length
    if int(rows.positions[0]) != start or start + rows.size > len(ids):
        return None
    if not np.array_equal(rows.tokens.numpy(), ids[start : start + rows.size]):
        return None
    return ids


def _copy_held(seq: Prefilling, holders: list[KVCache]) -> None:
    """Copy into the sequence's cache the longest run of its next prompt slots that one of the
    holders has computed, and take those tokens off its pending prefill call."""
    assert seq.call is not None
    rows = seq.call.rows
    c = rows.cache
    start = c.length
    reach, best = max(((_reach(d, c), d) for d in holders), key=lambda p: p[0], default=(0, None))
    if best is None or reach <= start:
        return
    c.take(best, reach)
    m = reach - start
    seq.call.rows = Rows(rows.tokens[m:], rows.positions[m:], c, None, rows.logits_rows, rows.keep_q, rows.backend)
    seq.shared += m


def share(prefilling: list[Seq], holders: list[KVCache], admitted: dict[int, int]) -> list[Seq]:
    """Give each prefilling sequence what the holders' caches (every target cache of the batch) hold
    of its prompt; the sequences that run in this step's forward, in the order given (the others
    wait for a sequence computing their shared tokens). `admitted`: id(sequence) -> its place in
    the batch (earlier admitted, lower)."""
    prompts = {}
    for s in prefilling:
        assert s.call is not None
        ids = _prompt(s.call.rows)
        if ids is not None:
            prompts[id(s)] = ids

    def lead(s: Seq) -> tuple[int, int]:
        assert s.call is not None
        return -s.call.rows.cache.length, admitted.get(id(s), 0)

    running: list[Seq] = []
    waiting: set[int] = set()
    for s in sorted((s for s in prefilling if id(s) in prompts), key=lead):
        ids = prompts[id(s)]
        _copy_held(s, holders)
        assert s.call is not None
        start, last = s.call.rows.cache.length, len(ids) - 1
        if any(min(common_prefix(ids, prompts[id(e)]), last) - start >= MIN_WAIT for e in running):
            waiting.add(id(s))
        else:
            running.append(s)
    return [s for s in prefilling if id(s) not in waiting]
