"""`python -m specextend.bench.lookup_replay`: lookup tokens counted as the sizer counts them."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from specextend.bench import lookup_replay
from specextend.cli import main as cli

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


def counted(prompt: list[int], answer: list[int]) -> dict:
    counts: dict = defaultdict(lambda: [0, 0])
    lookup_replay.replay(prompt, answer, 4, 2, 8, counts)
    return dict(counts)


def test_a_token_counts_only_when_its_parent_was_right():
    # Step 0: [5, 6] occurred before, followed by 7 8 5 6 (a 2-token match): 7 is right, 8 is
    # wrong (9 came), and nothing below 8 is counted. Step 1: [5, 6, 7] now occurs, followed by 8.
    assert counted([5, 6, 7, 8, 5, 6], [7, 9]) == {(2, 1, False): [1, 1], (2, 2, False): [0, 1],
                                                  (3, 1, False): [0, 1]}


def test_a_second_branch_is_counted_as_an_alternative():
    # [1] occurred twice: its newer continuation (3 1) is the first branch, the older (2 1 3 1)
    # the alternative; the answer's 3 makes the first right and the alternative wrong, and the
    # answer ends before depth 2.
    assert counted([1, 2, 1, 3, 1], [3]) == {(1, 1, False): [1, 1], (1, 1, True): [0, 1]}


def test_replays_a_bench_runs_answers_and_refuses_a_mismatched_prompt(tmp_path, capsys):
    target = save_tiny_model(tmp_path / "target", seed=0)
    out = tmp_path / "run"
    assert cli.main(["bench", "--target", str(target), "--lengths", "160", "--samples", "2", "--max-new-tokens",
                     "12", "--methods", "ar", "--out", str(out), "-q", "--weights", "float32"]) == 0
    capsys.readouterr()
    assert lookup_replay.main([str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["answers"] == 2
    offered = sum(b["offered"] for b in report["buckets"])
    assert offered > 0 and all(0 <= b["right"] <= b["offered"] for b in report["buckets"])
    # The run used the chat template: rebuilt without it, the prompts differ and it says so.
    assert lookup_replay.main([str(out), "--no-chat"]) == 2
    assert "rebuilt prompt is not the run's" in capsys.readouterr().err
    assert lookup_replay.main([str(tmp_path / "nothing")]) == 2
    assert "no ar rows" in capsys.readouterr().err
    # A row without its answer: refused in one line, not a KeyError.
    rows = (out / "results.jsonl").read_text().splitlines()
    broken = tmp_path / "broken"
    broken.mkdir()
    row = json.loads(rows[0])
    del row["token_ids"]
    (broken / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert lookup_replay.main([str(broken)]) == 2
    assert "lacks token_ids" in capsys.readouterr().err

