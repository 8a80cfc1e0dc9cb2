"""The many-row product bench (bench/manyrow.py): every format and shape is timed and reported
against its peak, the JSON is written, and bad options are refused in one line."""

from __future__ import annotations

import json

import pytest

from specextend.bench import manyrow, onerow
from specextend.runtime import kernels


@pytest.mark.skipif(not kernels.has_fast_path(), reason="needs the quantized kernels on a vector path")
def test_every_format_and_shape_is_timed_against_its_peak(tmp_path, capsys):
    out = tmp_path / "manyrow.json"
    assert manyrow.main(["--rows", "20", "--shapes", "32x512,16x256", "--threads", "1", "--repeats", "1",
                         "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["format"], r["n"], r["k"]) for r in rows] == [(f, n, k) for f in onerow.FORMATS
                                                             for n, k in ((32, 512), (16, 256))]
    for r in rows:
        assert r["ms"] > 0 and r["gmac_per_s"] == pytest.approx(20 * r["n"] * r["k"] / r["ms"] / 1e6)
        assert r["peak_kind"] == ("bf16" if r["format"] in ("f16", "bf16", "bf16d") else "int8")
    assert doc["peaks_gmac_per_s"]["int8"] > 0 and doc["path"] == kernels.path()
    assert "| q4k | 20 | 32x512 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--formats", "q4k,q5"], ["--shapes", "100x512"], ["--shapes", "64"],
                                  ["--shapes", "64x500"], ["--rows", "0"], ["--threads", "0"]])
def test_bad_options_are_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        manyrow.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err
