"""`bench.quality`'s paired comparisons: two arithmetics judged position by position, with errors over chunks,
and per-position scores saved by one run for another to pair with."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specextend.bench import quality
from specextend.common.errors import UserError
from test_emulate import quality_inputs


def _scored(top1: list[int], logprob: list[float], name: str) -> quality.Scored:
    return quality.Scored(torch.tensor(logprob, dtype=torch.float64), torch.tensor(top1), name)


def test_a_paired_difference_and_its_error_come_from_the_chunks() -> None:
    ref = torch.tensor([1, 1, 1, 1, 1, 1])
    a = _scored([1, 1, 1, 1, 0, 1], [-1.0, -2.0, -1.0, -1.0, -1.0, -1.0], "a")
    base = _scored([1, 0, 1, 1, 1, 1], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0], "b")
    got = quality.paired(a, base, ref, chunks=2)
    # a gains a position in chunk 1 and loses one in chunk 2: chunk means +1/3 and -1/3
    assert got["top1_delta"] == 0.0
    assert got["top1_delta_stderr"] == pytest.approx(torch.tensor([1 / 3, -1 / 3]).std().item() / math.sqrt(2))
    assert got["top1_changed"] == pytest.approx(2 / 6)
    assert got["perplexity_ratio"] == pytest.approx(math.exp(1 / 6))  # one position 1 nat worse
    assert got["perplexity_ratio"] == pytest.approx(math.exp(-float(a.logprob.mean())) /
                                                    math.exp(-float(base.logprob.mean())))
    assert got["baseline"] == "b"
    # One short chunk: a mean but no error to give; a long one: runs of ~512 positions give it.
    assert quality.chunk_mean(torch.tensor([1.0, 0.0]), 1) == (0.5, None)
    long = torch.cat([torch.ones(512), torch.zeros(512)])
    assert quality.chunk_mean(long, 1) == (0.5, pytest.approx(torch.tensor([1.0, 0.0]).std().item() / math.sqrt(2)))
    with pytest.raises(UserError, match="different positions"):
        quality.paired(a, _scored([1], [-1.0], "c"), ref, 2)


def test_saved_scores_come_back_only_for_the_same_chunks(tmp_path) -> None:
    chunks = [torch.arange(8), torch.arange(8, 16)]
    digest = quality.chunks_digest(chunks)
    assert digest != quality.chunks_digest([torch.arange(8), torch.arange(1, 9)])
    sc = _scored([3, 4], [-0.5, -0.25], "gguf@kv-q8")
    path = quality.save_scores(tmp_path / "scores", sc, digest)
    assert path.name == "gguf@kv-q8.pt" and not list((tmp_path / "scores").glob(".*.tmp"))
    back = quality.load_scores(path, digest)
    assert torch.equal(back.top1, sc.top1) and torch.equal(back.logprob, sc.logprob)
    assert back.name.startswith("gguf@kv-q8 (") and "arithmetic" in back.name
    with pytest.raises(UserError, match="scored other chunks"):
        quality.load_scores(path, "0" * 16)
    path.write_bytes(path.read_bytes()[:40])  # a half-written file is refused, not read
    with pytest.raises(UserError, match="not a scores file"):
        quality.load_scores(path, digest)
    with pytest.raises(UserError, match="not a scores file"):
        quality.load_scores(tmp_path / "missing.pt", digest)


def test_a_later_run_pairs_with_an_earlier_runs_scores(tmp_path, capsys) -> None:
    target, data = quality_inputs(tmp_path)
    common = ["--target", str(target), "--data", str(data), "--ctx", "64", "--chunks", "2"]
    first = tmp_path / "first"
    assert quality.main([*common, "--weights", "float32,gguf,act-p32", "--baseline", "gguf", "--out", str(first)]) == 0
    rows = {r["weights"]: r for r in json.loads((first / "quality.json").read_text())["rows"]}
    assert "paired" not in rows["gguf"] and rows["act-p32"]["paired"]["baseline"] == "gguf"
    assert {p.name for p in (first / "scores").iterdir()} == {"float32.pt", "gguf.pt", "act-p32.pt"}
    assert "top-1 vs baseline" in (first / "quality.md").read_text()

    # The same arithmetic read back against itself: nothing moves, and the reference is not scored again.
    second = tmp_path / "second"
    argv = [*common, "--weights", "gguf", "--reference", str(first / "scores" / "float32.pt"),
            "--baseline", str(first / "scores" / "gguf.pt"), "--out", str(second)]
    assert quality.main(argv) == 0
    out = json.loads((second / "quality.json").read_text())
    got = out["rows"][0]
    assert got["paired"]["top1_delta"] == 0.0 and got["paired"]["top1_changed"] == 0.0
    assert got["paired"]["perplexity_ratio"] == 1.0
    assert got["top1_agreement"] == rows["gguf"]["top1_agreement"]
    assert out["meta"]["reference"].startswith("float32 (") and {p.name for p in (second / "scores").iterdir()} == {
        "gguf.pt"}
    # Saved scores compared again without a model: the first run's emulated row against its gguf row.
    again = tmp_path / "again"
    saved = first / "scores"
    assert quality.main([*common, "--weights", str(saved / "act-p32.pt"), "--reference", str(saved / "float32.pt"),
                         "--baseline", str(saved / "gguf.pt"), "--out", str(again)]) == 0
    row = json.loads((again / "quality.json").read_text())["rows"][0]
    assert row["paired"] == rows["act-p32"]["paired"] | {"baseline": row["paired"]["baseline"]}
    assert not (again / "scores").exists()
    # Other chunks, a baseline that is neither a scheme nor a file: one clear error each.
    capsys.readouterr()
    other = [*common[:-1], "1", *argv[len(common):-1], str(tmp_path / "third")]  # one chunk, not two
    assert quality.main(other) == 2
    assert "scored other chunks" in capsys.readouterr().err
    assert quality.main([*common, "--weights", "gguf", "--baseline", "int8", "--out", str(tmp_path / "x")]) == 2
    assert "not one of --weights" in capsys.readouterr().err
