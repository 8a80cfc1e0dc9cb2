"""Nothing aborts at exit: every command and API that starts the batch's thread stops and joins it
before the interpreter finalizes (a daemon thread still inside a C++ call at that point is ended
mid-call, and the process aborts after all its output: "terminate called without an active
exception"). The processes run beside a CPU-hogging one, which is how the abort showed in CI."""

from __future__ import annotations

import gc
import json
import multiprocessing
import subprocess
import sys
import textwrap
import threading

import pytest

from specextend.api import load

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own

RUNS = 6
PROMPTS = ["hello the world", "the budget of the agency", "def parse(s):", "one two three four"]


def _hog(stop) -> None:  # a busy core, as another xdist worker's test is
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture
def busy():
    stop = multiprocessing.Event()
    proc = multiprocessing.Process(target=_hog, args=(stop,), daemon=True)
    proc.start()
    yield
    stop.set()
    proc.join(10)


def _batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specextend-batch" and t.is_alive()]


def _assert_clean(out: subprocess.CompletedProcess, what: str) -> None:
    assert out.returncode == 0, f"{what}: exit {out.returncode}\n{out.stderr[-3000:]}"
    assert "terminate called" not in out.stderr and "Fatal Python error" not in out.stderr, out.stderr[-3000:]


def test_the_prompts_file_exits_0_every_time(folders, tmp_path, busy):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cmd = [sys.executable, "-m", "specextend.cli", "generate", "--target", str(folders["target"]), "--draft",
           str(folders["draft"]), "--method", "sd", "--max-new-tokens", "6", "--prompts-file", str(path),
           "--json", "-q"]
    for i in range(RUNS):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        _assert_clean(out, f"run {i + 1} of {RUNS}")
        assert len(out.stdout.splitlines()) == len(PROMPTS)


def test_a_script_that_never_closes_its_pair_exits_0_every_time(folders, busy):
    """The README's snippet as a user copies it: a list of prompts, then the end of the script
    with the pair still open (atexit stops the batch)."""
    script = textwrap.dedent(f"""
        import specextend
        pair = specextend.load({str(folders['target'])!r}, {str(folders['draft'])!r}, progress=False)
        for res in pair.generate({PROMPTS!r}, max_new_tokens=6, method="sd"):
            print(len(res.token_ids))
    """)
    for i in range(RUNS):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        _assert_clean(out, f"run {i + 1} of {RUNS}")
        assert out.stdout.split() == ["6"] * len(PROMPTS)


def test_an_exception_in_the_script_still_exits_cleanly(folders):
    script = textwrap.dedent(f"""
        import specextend
        pair = specextend.load({str(folders['target'])!r}, {str(folders['draft'])!r}, progress=False)
        pair.generate({PROMPTS!r}, max_new_tokens=4, method="sd")
        raise SystemExit(3)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 3 and "terminate called" not in out.stderr, out.stderr[-3000:]


def test_close_and_collection_join_the_batch_thread(folders):
    before = set(_batch_threads())
    with load(folders["target"], folders["draft"], progress=False) as pair:
        first = pair.generate(PROMPTS[:2], max_new_tokens=4, method="sd")
        assert len(set(_batch_threads()) - before) == 1
    assert set(_batch_threads()) - before == set()
    # Usable after close: a later list starts a new batch, with the same tokens.
    again = pair.generate(PROMPTS[:2], max_new_tokens=4, method="sd")
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert len(set(_batch_threads()) - before) == 1
    del pair, first, again
    gc.collect()
    assert set(_batch_threads()) - before == set()
