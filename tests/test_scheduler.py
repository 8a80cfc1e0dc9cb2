"""Continuous batching on tiny quantized models: each request's tokens inside a batch are the ones
it gets alone (every method, prompts prefilled in chunks beside other requests' decoding), a short
request that arrives during a long prefill finishes first, a withdrawn request frees its slot and
its caches, and the KV budget makes requests wait instead of allocating past it."""

from __future__ import annotations

import asyncio
import copy
import gc
import time
import weakref
from typing import ClassVar

import pytest
import torch

from specextend.batching.batch import Batch, Sequence, StepCosts, StepReport
from specextend.batching.budget import StepBudget
from specextend.batching.scheduler import Limits, QueueFull, Scheduler, TooLarge
from specextend.common.settings import Settings
from specextend.runtime import kernels
from specextend.runtime.costmodel import ForwardCurve
from specextend.runtime.kv_cache import KVCache
from specextend.serve.jobs import Job, run_job

from tiny_tokenizer import quantized_pair

pytestmark = [pytest.mark.usefixtures("isolated_home"),
              pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
SMALL = dict(chunk_size=4, top_k_chunks=2, cmr_min_ratio=0.0, tree_budget=6, tree_depth=3)
METHODS = [dict(method="ar"), dict(method="lookup"), dict(method="sd"), dict(method="specextend", draft_gate=False),
           dict(method="specextend")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return quantized_pair(tmp_path_factory.mktemp("sched"), **SHAPE)


def prompt(i: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(i)).tolist()


def settings(**kw) -> Settings:
    return Settings(**{"max_new_tokens": 20, **SMALL, **kw}).resolved()


@pytest.mark.parametrize("path", kernels.cpu_paths())
def test_requests_in_a_batch_get_the_tokens_they_get_alone(pair, monkeypatch, path):
    monkeypatch.setenv(kernels.CPU_ENV, path)
    requests = [(prompt(i, n), settings(**m)) for i, (n, m) in enumerate(zip((70, 9, 33, 120, 15), METHODS,
                                                                                strict=True))]
    requests.append((prompt(9, 50), settings(method="sd", temperature=0.8, seed=3)))
    alone = [pair.generate(ids, settings=s).token_ids for ids, s in requests]
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    results: dict[int, list[int]] = {}
    for i, (ids, s) in enumerate(requests):
        def run(i=i, ids=ids, s=s):
            results[i] = pair.generation(ids, settings=s).run(engine).token_ids
        batch.add(Sequence(run))
    steps = 0
    rows = []
    while batch.sequences:
        report = batch.step(16)  # prompts of 33 to 120 tokens prefill in chunks beside decoding ones
        rows.append(report.decode_rows + report.prefill_rows)
        for s in batch.reap():
            assert s.error is None, s.error
        steps += 1
    assert max(rows) > 16 or steps > 10  # several requests shared the steps
    greedy = range(len(requests) - 1)
    assert [results[i] for i in greedy] == [alone[i] for i in greedy]
    assert len(results[len(requests) - 1]) == 20  # sampling: its own generator, the target's distribution


def test_in_a_shared_batch_a_proposer_with_nothing_to_propose_rests(pair):
    """Others wait on each step's proposing, so a sequence whose trees are the bare root takes plain
    steps for a while (tokens unchanged); alone it never does."""
    requests = [(prompt(20 + i, 12), settings(method="specextend", max_new_tokens=40)) for i in range(4)]
    alone = [pair.generate(ids, settings=s) for ids, s in requests]
    assert all(r.extra["rested_steps"] == 0 for r in alone)
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    results = {}
    for i, (ids, s) in enumerate(requests):
        def run(i=i, ids=ids, s=s):
            results[i] = pair.generation(ids, settings=s).run(engine)
        batch.add(Sequence(run))
    while batch.sequences:
        batch.step(64)
        assert all(s.error is None for s in batch.reap())
    assert [results[i].token_ids for i in range(4)] == [r.token_ids for r in alone]
    assert sum(results[i].extra["rested_steps"] for i in range(4)) > 0


def test_a_lone_sequence_teaches_the_pairs_cost_model_and_a_shared_one_does_not(pair):
    base = copy.deepcopy(pair.step_costs())
    base.refresh = True
    base.scale = dict.fromkeys(base.scale, 1.0)  # what the module's earlier steps taught it (at its clamp on a
    # busy machine) would leave no room to learn more
    batch = Batch(pair.target, pair.draft)
    costs = StepCosts(base, batch)
    seen = dict(base.scale)
    for sequences, last, learns in (([1], StepReport(decoding=1), True),  # alone: as generate
                                    ([1, 2], StepReport(decoding=2), False),  # others' work in its timings
                                    ([1], StepReport(decoding=1, prefill_rows=8), False)):  # a chunk rode along
        batch.sequences, batch.last = sequences, last
        costs.observe_verify(4, 100, 10.0)  # far slower than the curve says
        assert (base.scale["target"] > seen["target"]) is learns
        seen = dict(base.scale)


def test_a_prompts_last_chunk_does_not_price_its_first_tree(pair):
    """The step that ran a prompt's last chunk is not what its first tree rides on: with nothing
    left to prefill the next step is the sequence's alone (priced as generate prices it); with
    another prompt still prefilling, the tree rides on a chunk as large as the one just run."""
    base = copy.deepcopy(pair.step_costs())
    batch = Batch(pair.target, pair.draft)
    costs = StepCosts(base, batch)
    alone = base.verify_costs(300, 8)
    batch.sequences, batch.last = [1], StepReport(decoding=0, prefill_rows=64, prompt_left=0)
    assert batch.last.next_prefill_rows == 0
    assert costs.verify_costs(300, 8) == pytest.approx(alone)
    batch.sequences, batch.last = [1, 2], StepReport(decoding=0, prefill_rows=64, prompt_left=500)
    assert batch.last.next_prefill_rows == 64
    riding = costs.verify_costs(300, 8)
    ahead = base.verify_costs(300, 64 + 8)
    assert riding[3] == pytest.approx(alone[1] + ahead[64 + 3] - ahead[65])


def test_a_step_reports_the_prompt_tokens_left(pair):
    """A 20-token prompt prefilled 8 tokens a step: 12, then 4, then none left (its decode steps
    carry none either)."""
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    s = settings(method="ar", max_new_tokens=3)
    batch.add(Sequence(lambda: pair.generation(prompt(3, 20), settings=s).run(engine)))
    left = []
    while batch.sequences:
        report = batch.step(8)
        left.append((report.prefill_rows, report.prompt_left))
        batch.reap()
    assert left[:3] == [(8, 12), (8, 4), (4, 0)] and all(r == (0, 0) for r in left[3:])


# --------------------------------------------------------------------------- the scheduler


def serve(pair, limits: Limits, submit, poll=None, batch_cls=Batch, **scheduler):
    """Run a scheduler over the pair while `submit(scheduler, loop)` (a coroutine) sends jobs; `poll`
    is called on the event loop every few milliseconds (to watch the scheduler)."""
    batch = batch_cls(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())

    async def main():
        sched = Scheduler(batch, lambda job: run_job(pair, engine, job),
                          lambda job: pair.kv_bytes(len(job.ids), job.settings), limits, **scheduler)
        try:
            task = asyncio.ensure_future(submit(sched, asyncio.get_running_loop()))
            while not task.done():
                if poll is not None:
                    poll(sched)
                await asyncio.sleep(0.002)
            return task.result()
        finally:
            sched.shutdown()

    return asyncio.run(main())


async def finish(job: Job) -> tuple[str, float]:
    while True:
        kind, value = await job.events.get()
        if kind in ("done", "cancelled", "error"):
            return kind if kind != "error" else f"error: {value}", time.perf_counter()


LIMITS = Limits(max_batch=8, max_queue=8, step_tokens=8, kv_bytes=2**30)


def test_a_short_request_during_a_long_prefill_finishes_first(pair):
    async def submit(sched, loop):
        long = Job(prompt(1, 400), settings(method="ar", max_new_tokens=4), [], loop)
        sched.submit(long)
        while sched.batch.last.prefill_rows == 0:  # the long prompt is prefilling, a chunk per step
            await asyncio.sleep(0.001)
        short = Job(prompt(2, 5), settings(method="ar", max_new_tokens=4), [], loop)
        sched.submit(short)
        return await asyncio.gather(finish(long), finish(short))

    (k1, t_long), (k2, t_short) = serve(pair, LIMITS, submit)
    assert k1 == k2 == "done" and t_short < t_long


def test_the_heap_goes_back_once_per_idle_spell_after_steps(pair, monkeypatch):
    """After a burst, once nothing has come for a poll, the scheduler's thread gives the freed heap
    back (once: not again while it stays idle, nor between requests that keep it busy)."""
    from specextend.batching import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "IDLE_POLL_S", 0.05)
    released = []

    async def submit(sched, loop):
        await asyncio.sleep(0.3)  # idle from the start: no steps, nothing to give back
        seen = [len(released)]
        jobs = [Job(prompt(i, 30), settings(method="ar", max_new_tokens=4), [], loop) for i in range(3)]
        for job in jobs:
            sched.submit(job)
        assert [k for k, _ in await asyncio.gather(*map(finish, jobs))] == ["done"] * 3
        await asyncio.sleep(0.4)  # eight polls idle
        seen.append(len(released))
        job = Job(prompt(9, 30), settings(method="ar", max_new_tokens=4), [], loop)
        sched.submit(job)
        await finish(job)
        await asyncio.sleep(0.4)
        seen.append(len(released))
        return seen, sched.stats()["heap_releases"]

    seen, reported = serve(pair, LIMITS, submit, release_heap=lambda: released.append(time.perf_counter()))
    assert seen == [0, 1, 2] and reported == 2


def test_steps_are_larger_only_while_no_request_decodes(pair):
    limits = Limits(max_batch=8, max_queue=8, step_tokens=8, kv_bytes=2**30, idle_step_tokens=64)
    steps = []  # (the step's budget, whether a request was decoding, prompt tokens it ran)

    class Recording(Batch):
        def step(self, budget, prefill_order=list):
            decoding = any(not s.prefilling for s in self.sequences)
            report = super().step(budget, prefill_order)
            steps.append((budget, decoding, report.prefill_rows))
            return report

    async def submit(sched, loop):
        long = Job(prompt(1, 400), settings(method="ar", max_new_tokens=4), [], loop)
        sched.submit(long)
        while sched.batch.last.prefill_rows == 0:
            await asyncio.sleep(0.001)
        short = Job(prompt(2, 5), settings(method="ar", max_new_tokens=30), [], loop)
        sched.submit(short)
        return await asyncio.gather(finish(long), finish(short))

    assert [k for k, _ in serve(pair, limits, submit, batch_cls=Recording)] == ["done", "done"]
    assert all(budget == (8 if decoding else 64) for budget, decoding, _ in steps)
    assert any(rows == 64 for _, decoding, rows in steps if not decoding)  # the long prompt alone: big chunks
    assert any(decoding for _, decoding, _ in steps)
    assert all(rows <= 8 for _, decoding, rows in steps if decoding)  # beside a stream: small ones


# The measured rule (batching/budget.py) on a synthetic machine: chunks of 64 prompt tokens are the
# efficient size (cost per token flat from there), and beside a stream a step may take 0.05 s.
RULE_PREFILL = ForwardCurve([16, 32, 64, 128], [0], [[16 * 4e-3, 32 * 2e-3, 64 * 1e-3, 128 * 1e-3]])
RULE_STEPS = ForwardCurve([1, 32], [256, 8192], [[2e-3, 4e-3], [2e-3, 4e-3]])


class StepLog(Batch):
    """Records every step: its rows, how many sequences decoded, and the prompt tokens (target
    and draft) each prefilling sequence ran in it."""

    log: ClassVar[list[tuple[int, int, list[int]]]] = []

    def step(self, budget, prefill_order=list):
        before = {id(s): s.prefilled for s in self.sequences if s.prefilling}
        decoders = sum(1 for s in self.sequences if not s.prefilling)
        report = super().step(budget, prefill_order)
        ran = [s.prefilled - before[id(s)] for s in self.sequences if id(s) in before]
        type(self).log.append((budget, decoders, [n for n in ran if n]))
        return report


def rule_limits(gap_goal_s: float) -> Limits:
    rule = StepBudget(RULE_PREFILL, RULE_STEPS, gap_goal_s=gap_goal_s, refresh=False)
    return Limits(max_batch=8, max_queue=8, step_tokens=rule.rows(1, 0), kv_bytes=2**30,
                  idle_step_tokens=rule.alone_rows, rule=rule)


@pytest.mark.parametrize("method", ["ar", "specextend"])
def test_a_lone_request_prefills_in_chunks_of_the_efficient_size(pair, method):
    s = settings(method=method, max_new_tokens=12, draft_gate=False)
    ids = prompt(3, 300)
    alone = pair.generate(ids, settings=s).token_ids
    StepLog.log = []

    async def submit(sched, loop):
        job = Job(ids, s, [], loop)
        sched.submit(job)
        return await outcome(job)

    kind, out = serve(pair, rule_limits(gap_goal_s=0.1), submit, batch_cls=StepLog)
    assert kind == "done" and out.result.token_ids == alone
    chunks = [n for budget, decoders, ran in StepLog.log for n in ran]
    assert all(budget == 64 for budget, decoders, ran in StepLog.log if ran)  # alone: the efficient size
    assert chunks[:4] == [64, 64, 64, 64] and sum(chunks[:5]) == 300  # the target's prompt: 5 steps
    if method == "specextend":
        assert len(chunks) > 5  # the draft's prompt pass, mid-answer, had the same budget


async def outcome(job: Job) -> tuple[str, object]:
    while True:
        kind, value = await job.events.get()
        if kind in ("done", "cancelled", "error"):
            return kind, value


def test_beside_a_decoding_stream_chunks_shrink_and_answers_stay_the_same(pair):
    short_s = settings(method="ar", max_new_tokens=40)
    long_s = settings(method="sd", max_new_tokens=8)
    short_ids, long_ids = prompt(4, 6), prompt(5, 400)
    alone = [pair.generate(short_ids, settings=short_s).token_ids, pair.generate(long_ids, settings=long_s).token_ids]
    limits = rule_limits(gap_goal_s=0.1)  # 0.05 s a step: 2 ms a row, so about 24 rows beside a stream
    beside = limits.rule.rows(1, 0)
    assert 16 < beside < 64
    StepLog.log = []
    results = {}

    async def submit(sched, loop):
        short = Job(short_ids, short_s, [], loop)
        sched.submit(short)
        while sched.batch.last.decode_rows == 0:  # the short one decodes
            await asyncio.sleep(0.001)
        long = Job(long_ids, long_s, [], loop)
        sched.submit(long)
        results["short"], results["long"] = await asyncio.gather(outcome(short), outcome(long))

    serve(pair, limits, submit, batch_cls=StepLog)
    assert results["short"][0] == results["long"][0] == "done"
    assert [results["short"][1].result.token_ids, results["long"][1].result.token_ids] == alone
    shared = [(budget, ran) for budget, decoders, ran in StepLog.log if decoders and ran]
    # small chunks beside the stream: the target's within the rows the stream leaves, a draft's
    # prompt pass (in the draft's rounds) within the step's rows
    assert shared and all(sum(ran) <= budget < 64 for budget, ran in shared)


def test_a_withdrawn_request_frees_its_slot_and_caches(pair):
    limits = Limits(max_batch=1, max_queue=4, step_tokens=8, kv_bytes=2**30)

    async def submit(sched, loop):
        first = Job(prompt(1, 30), settings(method="sd", max_new_tokens=400), [], loop)
        second = Job(prompt(2, 10), settings(method="ar", max_new_tokens=4), [], loop)
        sched.submit(first)
        sched.submit(second)
        while not sched.running or sched.batch.last.decode_rows == 0:
            await asyncio.sleep(0.001)
        assert sched.waiting == 1 and sched.kv_in_use > 0
        first.cancel.set()  # the client went away mid-answer
        out = await asyncio.gather(finish(first), finish(second))
        while sched.running:
            await asyncio.sleep(0.001)
        return out, sched.kv_in_use, sched.admitted

    ((k1, _), (k2, _)), kv, admitted = serve(pair, limits, submit)
    assert (k1, k2) == ("cancelled", "done") and kv == 0 and admitted == 0


def test_an_ended_requests_caches_are_freed_when_it_ends_not_by_the_cyclic_collector(pair):
    """The KV budget is given back when a request ends, so its caches must go then too: held in a
    reference cycle they waited for Python's cyclic collector, and a busy server's memory grew past
    its budget by the ended requests' KV (a soak's RSS: +1.5 GB over 2 minutes)."""
    async def submit(sched, loop):
        jobs = [Job(prompt(i, 40), settings(**m), [], loop) for i, m in enumerate(METHODS)]
        for j in jobs:
            sched.submit(j)
        out = await asyncio.gather(*(finish(j) for j in jobs))
        while sched.running:
            await asyncio.sleep(0.001)
        return [k for k, _ in out], [o for o in gc.get_objects() if isinstance(o, KVCache) and o not in before]

    gc.collect()
    before = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, KVCache))  # other tests' live ones
    gc.disable()  # what only the collector would free stays, and gc.get_objects() still lists it
    try:
        kinds, caches = serve(pair, LIMITS, submit)
    finally:
        gc.enable()
    assert kinds == ["done"] * len(METHODS) and caches == []


def test_the_kv_budget_makes_requests_wait_instead_of_allocating_past_it(pair):
    s = settings(method="specextend", max_new_tokens=30)
    one = pair.kv_bytes(60, s)
    limits = Limits(max_batch=8, max_queue=8, step_tokens=16, kv_bytes=int(1.5 * one))  # room for one at a time
    seen = []

    async def submit(sched, loop):
        with pytest.raises(TooLarge):
            sched.submit(Job(prompt(0, 200), settings(max_new_tokens=30), [], loop))
        jobs = [Job(prompt(i, 60), s, [], loop) for i in range(3)]
        for j in jobs:
            sched.submit(j)
        return await asyncio.gather(*(finish(j) for j in jobs))

    out = serve(pair, limits, submit, poll=lambda sched: seen.append((sched.running, sched.kv_in_use)))
    assert [k for k, _ in out] == ["done"] * 3
    assert max(r for r, _ in seen) == 1 and max(kv for _, kv in seen) <= limits.kv_bytes


def test_past_the_queue_requests_are_refused(pair):
    limits = Limits(max_batch=1, max_queue=1, step_tokens=8, kv_bytes=2**30)

    async def submit(sched, loop):
        jobs = [Job(prompt(i, 10), settings(method="ar", max_new_tokens=50), [], loop) for i in range(3)]
        sched.submit(jobs[0])
        sched.submit(jobs[1])
        with pytest.raises(QueueFull) as e:
            sched.submit(jobs[2])
        assert e.value.retry_after >= 1
        return await asyncio.gather(finish(jobs[0]), finish(jobs[1]))

    assert [k for k, _ in serve(pair, limits, submit)] == ["done", "done"]


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(pair, monkeypatch):
    real = pair.target.forward_many
    calls = {"n": 0}

    def flaky(parts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the kernel fell over")
        return real(parts)

    monkeypatch.setattr(pair.target, "forward_many", flaky)

    async def submit(sched, loop):
        first = Job(prompt(1, 10), settings(method="ar", max_new_tokens=8), [], loop)
        sched.submit(first)
        out = [await finish(first)]
        second = Job(prompt(2, 10), settings(method="ar", max_new_tokens=8), [], loop)
        sched.submit(second)
        out.append(await finish(second))
        while sched.running:  # the answer is out; the request ends once its prompt is remembered
            await asyncio.sleep(0.001)
        return out, sched.kv_in_use

    (first, second), kv = serve(pair, LIMITS, submit)
    assert first[0] == "error: the kernel fell over" and second[0] == "done" and kv == 0
