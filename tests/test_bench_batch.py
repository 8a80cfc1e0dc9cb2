"""The Python batch bench (bench/batch.py) on tiny float64 models: both ways run, every batched
answer is compared with the same prompt's answer alone, and bad options are refused before any
model loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specextend.api import Pair, load
from specextend.bench import batch
from specextend.bench.concurrent import SHORT_PROMPTS

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batchbench")
    p = load(save_tiny_model(root / "target", seed=0), save_tiny_model(root / "draft", seed=1, layers=1),
             dtype="float64", progress=False)
    return Pair(replace(p.spec, eos_ids=()), p.target, p.draft)  # random weights: every answer runs its length


@pytest.mark.parametrize("method", ["ar", "specextend"])
def test_both_ways_run_and_the_answers_are_compared(pair, method):
    row = batch.measure(pair, list(SHORT_PROMPTS[:3]), method, max_new=6, rounds=2)
    assert row["equal_to_alone"] == 3 and row["generated_tokens"] == 18
    assert len(row["one_at_a_time_s"]) == len(row["batched_s"]) == 2
    assert row["speedup"] == pytest.approx(min(row["one_at_a_time_s"]) / min(row["batched_s"]))
    assert f"| {method} | 3 | 18 |" in batch.table([row])


class _Recording:
    """A pair that records each generate call (a prompt or a list) and when it came."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, prompts, **_):
        self.calls.append("list" if isinstance(prompts, list) else "one")
        out = type("R", (), {"token_ids": [1, 2]})
        return [out() for _ in prompts] if isinstance(prompts, list) else out()


def test_each_way_is_used_once_before_the_timed_rounds():
    # the batch's first use measures the step costs (tens of seconds on a fresh machine): a timed
    # round must not pay it
    fake = _Recording()
    batch.measure(fake, list(SHORT_PROMPTS[:2]), "ar", max_new=2, rounds=1)
    assert fake.calls == ["one", "list", "one", "one", "list"]


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--prompts", "99"], ["--methods", "ar,nope"],
                                  ["--rounds", "0"]])
def test_bad_options_are_refused_before_loading(argv, capsys):
    with pytest.raises(SystemExit) as e:
        batch.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
