"""The parameter sweep on tiny float64 models: grid and point configurations, exactness, errors."""

from __future__ import annotations

import json

import pytest

from specextend.bench import sweep
from test_needle import govreport_text

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


def test_sweep_runs_grid_and_points_and_every_output_equals_ar(tmp_path, capsys):
    target = save_tiny_model(tmp_path / "target", seed=0, max_position_embeddings=4096)
    draft = save_tiny_model(tmp_path / "draft", seed=3, layers=1, max_position_embeddings=4096)
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps({"text": govreport_text(40, seed=i)}) + "\n" for i in range(2)))
    out = tmp_path / "rows.jsonl"
    argv = ["--target", str(target), "--draft", str(draft),
            "--dtype", "float64", "--data", str(data), "--samples", "2", "--max-new-tokens", "8",
            "--base", "chunk_size=8", "--grid", "top_k_chunks=2,4", "--point", "method=sd",
            "--point", "method=specextend,retrieve_every=2,adaptive_refresh=true", "--out", str(out)]
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    points = [r["point"] for r in rows if r["sample"] == 0]
    assert points == [{"method": "ar"}, {"top_k_chunks": 2}, {"top_k_chunks": 4}, {"method": "sd"},
                      {"method": "specextend", "retrieve_every": 2, "adaptive_refresh": True}]
    assert len(rows) == 10 and all(r["matches_ar"] for r in rows)
    table = capsys.readouterr().out
    assert "| method=sd |" in table and "| top_k_chunks=4 |" in table and "2/2 |" in table
    assert "min × best(ar, sd)" in table


def test_sweep_refuses_bad_points_before_loading(tmp_path, capsys):
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    for bad in (["--point", "tree_budget=0"], ["--point", "no_such=1"], ["--point", "max_new_tokens=3"]):
        assert sweep.main(["--target", str(tmp_path / "absent"), "--data", str(data), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specextend sweep: error:") and "Traceback" not in err


def test_a_cut_run_resumes_with_start_and_reports_from_its_rows(tmp_path, capsys):
    target = save_tiny_model(tmp_path / "target", seed=0, max_position_embeddings=4096)
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps({"text": govreport_text(20, seed=i)}) + "\n" for i in range(3)))
    out = tmp_path / "rows.jsonl"
    common = ["--target", str(target), "--dtype", "float64", "--data", str(data), "--max-new-tokens", "4",
              "--point", "method=lookup", "--out", str(out)]
    assert sweep.main([*common, "--samples", "1"]) == 0
    assert sweep.main([*common, "--start", "1", "--samples", "2"]) == 0  # the prompts the first run left
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["sample"] for r in rows] == [0, 0, 1, 1, 2, 2]
    capsys.readouterr()
    assert sweep.main(["--report", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("3 prompts, 6 runs") and "| method=lookup |" in table and "3/3 |" in table
    assert sweep.main(["--report", str(tmp_path / "absent.jsonl")]) == 2
