"""The whole-step C++ forward (runtime/fused_step.py, csrc/core/step.h) gives the Python-driven forward's bits:
logits, every K/V slot and the queries kept for retrieval, on every kernel path this CPU runs,
for one row, a draft tree's level and a small verification, after a prompt prefilled in chunks
(chunks small enough to take the whole-step call themselves), on Llama, Qwen2 (a QKV bias) and
Qwen3 (per-head query/key norms)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from specextend.models.loader import load_model
from specextend.runtime import fused_step, kernels

from conftest import make_tiny_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab=96,
             layers=2)
PROMPT = torch.randint(0, 95, (45,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for arch in ("qwen2", "llama", "qwen3"):
        d = tmp_path_factory.mktemp(f"step{arch}")
        make_tiny_hf(arch, 0, dtype=torch.float32, **SHAPE).save_pretrained(d)
        out[arch] = d
    return out


def tree_mask(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    n = len(parents)
    mask, depth = torch.zeros(n, n, dtype=torch.bool), [0] * n
    for i in range(1, n):
        mask[i] = mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    mask |= torch.eye(n, dtype=torch.bool)
    return mask, depth


def run(model, step_rows: int, room: int | None = None) -> list[torch.Tensor]:
    """Prefill in chunks of 7, three one-row steps, a 9-node tree level, then a 16-row causal forward:
    every logit row and the caches (with `room`, windowed layers keep their window and that many
    more: their last tokens)."""
    model.step_rows = step_rows
    cache = model.new_cache(len(PROMPT) + 40, room=room)
    out = [model.prefill(PROMPT, cache, chunk=7)]
    g = torch.Generator().manual_seed(5)
    for i in range(3):
        tok = torch.randint(0, 95, (1,), generator=g)
        keep = {i % 2: None}  # retrieval's layers, as the engine asks for them
        out.append(model(tok, torch.tensor([cache.length]), cache, keep_q=keep))
        out.append(keep.get(i % 2, torch.empty(0)))  # none where the layer keeps no query (a convolution)
        cache.commit()
    mask, depth = tree_mask([-1, 0, 0, 1, 1, 2, 3, 3, 5])
    keep = {0: None, 1: None}
    out.append(model(torch.randint(0, 95, (9,), generator=g), cache.length + torch.tensor(depth), cache, mask,
                     keep_q=keep))
    out.extend(keep.values())
    cache.commit([0, 1, 3])
    out.append(model(torch.randint(0, 95, (16,), generator=g), cache.length + torch.arange(16), cache))
    cache.commit()
    kept = [t[:, :, : cache.length - base] for k, v, base in cache.buffers() for t in (k, v)]
    return [*out, *kept]


@pytest.mark.parametrize("path", kernels.cpu_paths())
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_whole_step_equals_the_python_driven_step(folders, monkeypatch, path, arch, weights):
    monkeypatch.setenv(kernels.CPU_ENV, path)
    model = load_model(folders[arch], torch.float32, weights=weights)
    assert model.fused
    python, whole = run(model, 0), run(model, 16)
    assert len(python) == len(whole)
    for i, (a, b) in enumerate(zip(python, whole, strict=True)):
        assert torch.equal(a, b), i


def test_the_whole_step_is_what_runs(folders, monkeypatch):
    """A one-row forward and a small verification keeping queries take the whole-step call, a
    prefill chunk of 20 rows and a clocked
    forward (the runtime bench's split) the per-layer calls."""
    model = load_model(folders["qwen2"], torch.float32, weights="int4")
    calls = []
    run_step = fused_step.run
    monkeypatch.setattr(fused_step, "run", lambda *a: calls.append(a[1].shape[0]) or run_step(*a))
    cache = model.new_cache(64)
    model(PROMPT[:1], torch.tensor([0]), cache)
    model(PROMPT[:2], torch.arange(2), cache, keep_q={1: None})  # a verification that retrieval scores
    model(PROMPT[:20], torch.arange(20), cache)
    with kernels.clocked() as clock:
        model(PROMPT[:1], torch.tensor([0]), cache)
    assert calls == [1, 2] and clock.attention_calls == 2


def test_the_step_refuses_bad_kept_queries(folders):
    model = load_model(folders["qwen2"], torch.float32, weights="int4")
    plan, cache = fused_step.plan(model.cfg, model.layers), model.new_cache(8)
    x, (cos, sin) = model.embed(PROMPT[:1]), model.rope(torch.tensor([0]))
    ext = kernels.load()

    def part(layers, queries):
        return [(cache.k, cache.v, 1, 0, None, layers, queries)]

    with pytest.raises(RuntimeError, match="out of range"):
        ext.forward_batch(plan, x, cos, sin, part([5], [torch.empty(4, 1, 64)]), kernels.path_id())
    with pytest.raises(RuntimeError, match="heads, t, head_dim"):
        ext.forward_batch(plan, x, cos, sin, part([0], [torch.empty(4, 2, 64)]), kernels.path_id())
    with pytest.raises(RuntimeError, match="add up"):
        ext.forward_batch(plan, torch.cat([x, x]), model.rope(torch.arange(2))[0], model.rope(torch.arange(2))[1],
                          part([], []), kernels.path_id())


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_a_thread_frees_its_idle_openmp_team_and_a_later_region_makes_a_new_one():
    """fused_step.release_thread_team: the calling thread's idle team goes (a thread fewer), the next
    parallel region on it starts one again, and a thread with no team has nothing to free."""
    out: dict[str, int | bool] = {}

    def on_a_thread() -> None:  # a thread of its own: the test runner's main thread is left as it is
        out["none"] = fused_step.release_thread_team()  # nothing opened here yet
        out["before"] = _threads()
        torch.ones(1 << 24).sum()  # a parallel region: this thread's team
        out["with"] = _threads()
        out["freed"] = fused_step.release_thread_team()
        out["after"] = _threads()
        torch.ones(1 << 24).sum()
        out["again"] = _threads()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two whatever the test run set (its workers run one thread each)
    try:
        th = threading.Thread(target=on_a_thread)
        th.start()
        th.join()
    finally:
        torch.set_num_threads(threads)
    if out["with"] == out["before"]:
        pytest.skip("PyTorch ran the sum on one thread here: no team to free")
    assert out["freed"] is True and out["none"] is True
    assert out["after"] < out["with"] and out["again"] == out["with"]
