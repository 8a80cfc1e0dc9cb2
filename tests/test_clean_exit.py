"""Nothing aborts at exit: every command and API that starts the batch's thread stops and joins it
before the interpreter finalizes (a daemon thread still inside a C++ call at that point is ended
mid-call, and the process aborts after all its output: "terminate called without an active
exception"). The abort showed in CI with another process hogging the CPU: each check runs its
processes six at once, so each runs beside five CPU-bound others."""

from __future__ import annotations

import gc
import json
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


def _batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specextend-batch" and t.is_alive()]


def _run_at_once(cmd: list[str], runs: int = RUNS) -> list[subprocess.CompletedProcess]:
    """`cmd` run `runs` times at once (each beside the others: a busy CPU), every one to its end."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(runs)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return outs


def _assert_clean(out: subprocess.CompletedProcess, what: str) -> None:
    assert out.returncode == 0, f"{what}: exit {out.returncode}\n{out.stderr[-3000:]}"
    assert "terminate called" not in out.stderr and "Fatal Python error" not in out.stderr, out.stderr[-3000:]


@pytest.mark.long
def test_the_prompts_file_exits_0_every_time(folders, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cmd = [sys.executable, "-m", "specextend.cli", "generate", "--target", str(folders["target"]), "--draft",
           str(folders["draft"]), "--method", "sd", "--max-new-tokens", "6", "--prompts-file", str(path),
           "--json", "-q"]
    for i, out in enumerate(_run_at_once(cmd)):
        _assert_clean(out, f"run {i + 1} of {RUNS}")
        assert len(out.stdout.splitlines()) == len(PROMPTS)


@pytest.mark.long
def test_a_script_that_never_closes_its_pair_exits_0_every_time(folders):
    """The README's snippet as a user copies it: a list of prompts, then the end of the script
    with the pair still open (atexit stops the batch)."""
    script = textwrap.dedent(f"""
        import specextend
        pair = specextend.load({str(folders['target'])!r}, {str(folders['draft'])!r}, progress=False)
        for res in pair.generate({PROMPTS!r}, max_new_tokens=6, method="sd"):
            print(len(res.token_ids))
    """)
    for i, out in enumerate(_run_at_once([sys.executable, "-c", script])):
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
