"""The side-by-side bench against llama-bench (bench/moe.py): a run on a windowed model reports our
half without the peer when told to skip it, and a missing file or peer is refused in one line before
the run, not after our half of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specextend.bench import gguf_files, moe
from specextend.runtime import kernels
from test_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("moe")
    write_tiny_gguf(folder / "tok.gguf")
    config = {**gguf_files.PRESETS["gemma3-4b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16}
    return gguf_files.write_random(folder / "g.gguf", config, "Q4_K_M", folder / "tok.gguf", progress=False)


@pytest.mark.skipif(not kernels.has_fast_path(), reason="needs the quantized kernels on a vector path")
def test_a_windowed_model_is_measured_without_the_peer_when_told(gemma3, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--target", str(gemma3), "--prefill", "32,80", "--decode", "4", "--rows", "1,4", "--repeats", "1",
            "--llama-bench", "", "--json", str(out)]
    assert moe.main(argv) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    ours = res["ours"]
    assert ours["prefill_32_tok_s"] > 0 and ours["prefill_80_tok_s"] > 0 and ours["decode_tok_s"] > 0
    assert set(ours["rows_vs_one"]) == {"1", "4"} and ours["peak_rss_gb"] > 0
    assert ours["one_row_read_gbs"] > 0 and res["read_gbs"] > 0 and ours["of_read_rate"] > 0
    assert "llama" not in res and "ratio" not in res


def test_a_missing_file_or_peer_is_refused_before_the_run(gemma3, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        moe.main(["--target", str(tmp_path / "none.gguf")])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        moe.main(["--target", str(gemma3), "--llama-bench", str(tmp_path / "llama-bench")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "make peers" in err and "Traceback" not in err


def test_the_read_share_pairs_each_step_with_the_read_beside_it():
    """Memory that slows to half its speed midway, and steps that slow with it, read a quarter of the
    machine's rate throughout: the pairs say 0.25; separate medians of steps and reads would not."""
    got = moe.read_share(5_000_000_000, [1.0, 1.0, 2.0, 2.0], [20.0, 20.0, 10.0, 10.0])
    assert got["of_read_rate"] == pytest.approx(0.25)
    assert got["read_gbs"] == pytest.approx(15.0) and got["one_row_read_gbs"] == pytest.approx(5 / 1.5)
    assert got["one_row_read_gbs"] / got["read_gbs"] != pytest.approx(0.25)


def test_a_peer_that_fails_is_a_result_not_a_lost_run(tmp_path):
    """llama-bench dying (a file it cannot load, an instruction this CPU lacks) leaves our half of the run
    and says why, instead of a traceback after minutes of measuring."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'llama_bench: error: failed to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    got = moe.llama(fake, tmp_path / "m.gguf", 2, [32], 4, 1)
    assert got["error"] == "exit 1: llama_bench: error: failed to load model" and "decode_tok_s" not in got
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    assert moe.llama(fake, tmp_path / "m.gguf", 2, [32], 4, 1)["error"].startswith("exit -4 (signal 4)")
