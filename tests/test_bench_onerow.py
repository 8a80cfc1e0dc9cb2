"""The one-row product bench (bench/onerow.py): its random weights are real packed matrices (the
kernel's product equals the dequantized matrix's), both ways are timed and reported, and bad
options are refused in one line; and the side-by-side A/B of two builds (bench/kernel_ab.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specextend.bench import kernel_ab, onerow
from specextend.runtime import kernels, quant

fast = pytest.mark.skipif(not kernels.has_fast_path(), reason="needs the quantized kernels on a vector path")


@fast
@pytest.mark.parametrize("fmt", onerow.FORMATS)
def test_the_random_weight_is_a_real_matrix_in_its_format(fmt):
    w = onerow.random_weight(fmt, 32, 512)
    x = torch.randn(1, 512, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ w.dequantize().double().T
    got = quant.qlinear(x, w)
    # The kernel quantizes the row to int8 (per 32 values): close to the float product, not equal.
    assert torch.allclose(got.double(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


@fast
def test_cold_and_hot_are_timed_and_reported(tmp_path, capsys):
    out = tmp_path / "onerow.json"
    assert onerow.main(["--shape", "64x512", "--threads", "1", "--stream-mb", "2", "--repeats", "1",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == list(onerow.FORMATS)
    for r in rows:
        assert r["cold_us"] > 0 and r["hot_us"] > 0 and r["read_bandwidth_gbs"] > 0
        assert r["hot_of_floor"] == pytest.approx(r["read_bandwidth_gbs"] / r["hot_gbs"])
    assert "| q4k | 64x512 | 1 | 1 |" in capsys.readouterr().out


@fast
def test_a_few_rows_are_timed_against_one_row_s_cold_product(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert onerow.main(["--formats", "q4k", "--shape", "64x512", "--threads", "1", "--rows", "1,9",
                        "--stream-mb", "2", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 9]
    assert rows[1]["gmacs_hot"] == pytest.approx(9 * 64 * 512 / rows[1]["hot_us"] / 1e3)
    text = capsys.readouterr().out
    assert "product of 1,9 rows" in text and "| q4k | 64x512 | 1 | 9 |" in text
    assert f"| {rows[1]['cold_us'] / rows[0]['cold_us']:.2f}x |" in text


@pytest.mark.parametrize("argv", [["--formats", "q4k,q5"], ["--shape", "100x512"], ["--shape", "64"],
                                  ["--shape", "64xabc"], ["--threads", "0"],
                                  ["--rows", "0"], ["--rows", "1,x"]])
def test_bad_options_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        onerow.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


@fast
def test_kernel_ab_compares_two_builds_bit_for_bit(tmp_path, capsys):
    # this checkout against itself: the same build on both sides, its bits equal, both sides timed
    src = Path(kernel_ab.__file__).resolve().parents[2]
    out = tmp_path / "ab.json"
    assert kernel_ab.main(["--against", str(src), "--formats", "q4k,f16", "--rows", "1,4", "--shapes", "64x512",
                           "--rounds", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["rows"]) for r in rows] == [("q4k", 1), ("q4k", 4), ("f16", 1), ("f16", 4)]
    for r in rows:
        assert r["bits_equal"] and r["before_gmacs_best"] > 0 and r["after_gmacs_best"] > 0
        assert r["speedup_min"] <= r["speedup_median"] <= r["speedup_max"]
    assert "| q4k | 1 | 64x512 | 1 |" in capsys.readouterr().out


def test_kernel_ab_refuses_a_folder_that_is_no_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        kernel_ab.main(["--against", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a checkout's src folder" in err


@pytest.mark.parametrize("argv", [[], ["--against", ".", "--shapes", "100x512"], ["--against", ".", "--rounds", "0"],
                                  ["--against", ".", "--formats", "q9"]])
def test_kernel_ab_bad_options_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        kernel_ab.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err
