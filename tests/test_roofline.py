"""The roofline: `specextend kernels --peak` (fields, numbers, paths this CPU cannot run, its
record of best peaks), the multiply-adds the runtime bench counts (against hand counts and the
model's own layers), the kernels' clock, and one-line errors for bad flags. Behaviour only: no
test depends on how fast anything runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specextend.bench import roofline, runtime
from specextend.cli import main as cli
from specextend.runtime import kernels
from specextend.runtime.config import ModelConfig

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

SHORT = ["--seconds", "0.04", "--repeats", "2"]  # the loops run, briefly


@pytest.fixture
def record(tmp_path, monkeypatch):
    """The record of best peaks in a temporary file (never the user's kernel cache)."""
    path = tmp_path / "peaks.json"
    monkeypatch.setattr(roofline, "record_path", lambda: path)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@needs_kernels
def test_peak_json_lists_every_path_with_positive_figures_or_why_not(capsys, record):
    code, out, err = run_cli(capsys, "kernels", "--peak", "--json", *SHORT)
    assert code == 0, err
    m = json.loads(out)
    threads = torch.get_num_threads()
    assert m["threads"] == threads and m["repeats"] == 2 and m["seconds_per_loop"] == 0.04
    assert m["cpu"] and m["kernel_build"] == kernels.source_key() and m["auto"] == kernels.auto_path()
    assert set(m["paths"]) == set(kernels.PATHS)
    runnable = kernels.cpu_paths()
    for path, entry in m["paths"].items():
        assert entry["runnable"] == (path in runnable)
        if not entry["runnable"]:
            assert entry["reason"].startswith(f"this CPU cannot run the {path} kernels") and "loops" not in entry
            if path == "amx":  # and why: the detection's first missing step
                assert entry["reason"].endswith(f": {kernels.amx_refusal()}")
            continue
        loops = entry["loops"]
        assert {"int8", "bf16"} <= set(loops) <= set(roofline.PEAK_KINDS)  # every path has a floor
        for kind, loop in loops.items():
            assert isinstance(loop["instruction"], str) and loop["instruction"]
            assert loop["gmac_per_s"] > 0 and len(loop["repeats_gmac_per_s"]) == 2
            assert loop["gmac_per_s"] == max(loop["repeats_gmac_per_s"])
            assert loop["gmac_per_s_per_thread"] == pytest.approx(loop["gmac_per_s"] / threads)
            assert loop["estimate"] == (path == "portable") and loop["in_floor"] == (kind in roofline.FLOOR_KINDS)
            assert loop["best_recorded_gmac_per_s"] >= loop["gmac_per_s"]
        if path == "portable":  # labelled as an estimate, not a limit
            assert all("estimate" in loop["note"] for loop in loops.values())
    assert m["record"] == str(record) and record.is_file()


@needs_kernels
def test_the_record_keeps_each_loops_best_figure(capsys, record):
    path = kernels.cpu_paths()[-1]
    record.write_text(json.dumps({"best": {f"{path}/int8": {"gmac_per_s": 1e9, "measured_at": "then"}}}))
    m = roofline.measure(paths=[path], seconds=0.04, repeats=2)
    int8, bf16 = m["paths"][path]["loops"]["int8"], m["paths"][path]["loops"]["bf16"]
    assert int8["best_recorded_gmac_per_s"] == 1e9 and bf16["best_recorded_gmac_per_s"] == bf16["gmac_per_s"]
    assert roofline.floor_peaks(m, path) == {"int8": 1e9, "bf16": bf16["gmac_per_s"]}
    kept = json.loads(record.read_text())["best"]
    assert kept[f"{path}/int8"] == {"gmac_per_s": 1e9, "measured_at": "then"}
    assert kept[f"{path}/bf16"]["gmac_per_s"] == bf16["gmac_per_s"]
    record.write_text("{torn")  # an unreadable record starts again
    m = roofline.measure(paths=[path], seconds=0.04, repeats=2)
    assert m["paths"][path]["loops"]["int8"]["best_recorded_gmac_per_s"] == m["paths"][path]["loops"]["int8"][
        "gmac_per_s"]
    assert json.loads(record.read_text())["best"][f"{path}/int8"]["gmac_per_s"] < 1e9


@needs_kernels
def test_peak_table_names_each_path_and_the_ones_this_cpu_cannot_run(capsys, record):
    code, out, _ = run_cli(capsys, "kernels", "--peak", *SHORT)
    assert code == 0
    assert out.splitlines()[0] == kernels.describe()  # what `specextend kernels` prints, then the table
    lines = out.splitlines()
    for path in kernels.PATHS:
        mine = [line for line in lines if line.startswith(path + " ")]
        if path in kernels.cpu_paths():
            assert any(" int8 " in line for line in mine) and any(" bf16 " in line for line in mine)
        else:
            assert len(mine) == 1 and f"not runnable: this CPU cannot run the {path} kernels" in mine[0]
    assert "(estimate)" in next(line for line in lines if line.startswith("portable "))


@needs_kernels
def test_kernels_without_peak_prints_what_make_setup_prints(capsys):
    code, out, _ = run_cli(capsys, "kernels")
    assert code == 0 and out == kernels.describe() + "\n"


@pytest.mark.parametrize("argv", [["--json"], ["--peak", "--seconds", "0"], ["--peak", "--seconds", "nan"],
                                  ["--peak", "--repeats", "0"], ["--peak", "--seconds", "x"],
                                  ["--peak", "--repeats", "1.5"], ["--peak", "--seconds", "100"]])
def test_bad_peak_flags_exit_2_with_one_line(capsys, argv):
    code, out, err = run_cli(capsys, "kernels", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "error:" in err


# --------------------------------------------------------------------------- counting multiply-adds

TINY = ModelConfig(arch="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position=512,
                   tie_word_embeddings=False, attention_bias=True, qk_norm=False)


def test_multiply_adds_of_a_forward_equal_a_hand_count():
    # per layer and token: q 64x64, k 64x32, v 64x32, o 64x64, gate 64x128, up 64x128, down 128x64
    per_layer = 4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192
    assert roofline.linear_macs_per_token(TINY) == 2 * per_layer == 73728
    # 3 new tokens after 5 cached see 6, 7 and 8 keys; each key costs 4 heads x 16 dims twice (QK^T, PV)
    m = roofline.forward_macs(TINY, new=3, context=5, logits=3)
    assert m.linear == 3 * 73728 + 3 * 64 * 100 and m.attention == 2 * (6 + 7 + 8) * 2 * 4 * 16
    assert m.total == m.linear + m.attention
    # prefill of 4 tokens: keys 1 + 2 + 3 + 4, logits for the last token only
    p = roofline.prefill_macs(TINY, 4)
    assert p == roofline.Macs(linear=4 * 73728 + 64 * 100, attention=2 * 10 * 2 * 4 * 16)


@pytest.mark.parametrize(("new", "context"), [(3, 5), (10, 0), (4, 20), (30, 2)])
def test_a_windowed_layer_counts_only_its_window(new, context):
    """A windowed layer's token sees at most its window (6 here): the count is each token's keys,
    min(its position + 1, window), summed, beside the global layer's causal count."""
    cfg = dataclasses.replace(TINY, sliding_window=6, window_layers=(True, False))
    per_key = 2 * 4 * 16
    want = sum(min(p + 1, 6) + (p + 1) for p in range(context, context + new)) * per_key
    assert roofline.forward_macs(cfg, new, context).attention == want
    every = 2 * sum(range(context + 1, context + new + 1)) * per_key
    assert roofline.forward_macs(TINY, new, context).attention == every


@pytest.mark.parametrize("tokens,chunk", [(10, 3), (512, 512), (1000, 512), (7, 1)])
def test_prefill_count_is_the_sum_of_its_chunks(tokens, chunk):
    """Transformer.prefill runs chunks, each causal within itself after the ones before."""
    parts = [roofline.forward_macs(TINY, min(chunk, tokens - s), s, logits=int(s + chunk >= tokens))
             for s in range(0, tokens, chunk)]
    assert roofline.prefill_macs(TINY, tokens) == roofline.Macs(sum(p.linear for p in parts),
                                                                sum(p.attention for p in parts))


def test_linear_count_matches_the_models_own_layers(tiny_dir):
    from specextend.models.loader import load_model
    from specextend.runtime.layers import Linear

    for arch in ("qwen2", "llama", "qwen3"):
        model = load_model(tiny_dir(arch, 0), torch.float64)
        layers = sum(m.weight.numel() for name, m in model.named_modules()
                     if isinstance(m, Linear) and name.startswith("layers."))
        assert roofline.linear_macs_per_token(model.cfg) == layers
        head = model.lm_head.weight.numel()
        assert roofline.forward_macs(model.cfg, 1, logits=1).linear == layers + head


def test_floor_puts_linear_at_the_int8_peak_and_attention_at_the_bf16_peak():
    macs = roofline.Macs(linear=3_000_000_000, attention=500_000_000)
    assert roofline.floor_s(macs, int8_gmac_per_s=1000, bf16_gmac_per_s=250) == pytest.approx(3e-3 + 2e-3)


# --------------------------------------------------------------------------- the runtime bench


@needs_kernels
def test_the_clock_times_the_linear_and_attention_kernels_of_a_quantized_prefill(tiny_dir):
    from specextend.models.loader import load_model

    d = tiny_dir("qwen2", 0, dtype=torch.float32, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, vocab=96)
    model = load_model(d, torch.float32, weights="int8")
    peaks = {"int8": 100.0, "bf16": 50.0}
    rows = runtime.prefill_roofline(model, [40, 9], peaks)
    assert [r["tokens"] for r in rows] == [40, 9]
    for r in rows:
        macs = roofline.prefill_macs(model.cfg, r["tokens"])
        assert r["linear_gmacs"] == macs.linear / 1e9 and r["attention_gmacs"] == macs.attention / 1e9
        assert r["linear_s"] > 0 and r["attention_s"] > 0 and r["other_s"] >= 0
        assert r["linear_s"] + r["attention_s"] + r["other_s"] == pytest.approx(r["seconds"])
        assert r["floor_s"] == pytest.approx(roofline.floor_s(macs, 100.0, 50.0))
        assert r["share_of_floor"] == pytest.approx(r["floor_s"] / r["seconds"])
        assert r["linear_share_of_peak"] == pytest.approx(macs.linear / r["linear_s"] / 1e9 / 100.0)
    with kernels.clocked() as clock:
        model.prefill(torch.arange(20), model.new_cache(20))
    # per layer: qkv, o, gate/up and down, then the head once; one attention call per layer
    assert clock.linear_calls == 4 * model.cfg.num_layers + 1 and clock.attention_calls == model.cfg.num_layers
    assert kernels._clock is None  # the hook is off again after the block


@needs_kernels
def test_the_step_costs_split_each_row_count_into_its_kernels(tiny_dir):
    """Each forward's linear-layer and attention kernel seconds beside its whole time, and the
    report's line per row count says them against one row's."""
    from specextend.models.loader import load_model

    d = tiny_dir("qwen2", 0, dtype=torch.float32, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, vocab=96)
    model = load_model(d, torch.float32, weights="int8")
    out = runtime.step_costs(model, 64, [1, 9], repeats=2, split=True)
    for r in ("1", "9"):
        assert out["linear_s_at_context"][r] > 0 and out["attention_s_at_context"][r] > 0
    assert "linear_s_at_context" not in runtime.step_costs(model, 64, [1], repeats=1)
    res = {"model": "m", "dtype": "float32", "weights": "int8", "cpu_kernels": kernels.path(), "threads": 2,
           "load_s": 0.1, "prefill_tokens_per_s_efficient": 1.0, "prefill_tokens_per_s_eager": 1.0,
           "weight_bytes": 1e9, "read_bandwidth_gbs": 10.0, "floor_s": 0.1, **out}
    line = runtime.report(res, 16).splitlines()[4]
    assert line.strip().startswith("9 new tokens:") and "kernels: linear layers" in line and "one row's" in line


@pytest.mark.parametrize("bad", [["--prefill-lengths", "512,x"], ["--prefill-lengths", "0"],
                                 ["--prefill-lengths", "2048,-1"], ["--rows", "1,,2"]])
def test_bad_runtime_flags_exit_2_with_one_line_before_loading(capsys, bad):
    with pytest.raises(SystemExit) as e:
        runtime.main(["--target", "/nonexistent", *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err
