"""`specextend bench` on tiny random models: artifacts, resume, interruption, refusals, data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specextend.bench import data as bench_data
from specextend.bench import report
from specextend.cli import main as cli
from specextend.common.errors import UserError
from specextend.speculation.decoder import SpecEngine

from tiny_tokenizer import save_tiny_model, tiny_tokenizer

CONTRACT_FIELDS = {
    "method", "target", "draft", "dtype", "device", "config", "prompt_tokens", "new_tokens",
    "token_ids", "text", "prefill_s", "decode_s", "total_s", "decode_tokens_per_s", "steps",
    "accepted_per_step", "phases",
}  # fmt: skip
BENCH_FIELDS = {"data", "sample", "input_tokens", "matches_ar", "settings_hash"}


pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "target", seed=0)


def bench(target: Path, out: Path, *extra: str, methods: str = "ar,sd,specextend", samples: int = 2) -> int:
    # The target drafts for itself: every draft token is accepted, so τ > 0 and outputs equal ar's.
    # A shallow tree keeps the tiny runs quick. float32 weights: the transformers baselines run the
    # same weights, so their outputs are comparable token for token.
    return cli.main(["bench", "--target", str(target), "--draft", str(target), "--lengths", "160",
                     "--samples", str(samples), "--max-new-tokens", "6", "--methods", methods, "--out", str(out),
                     "-q", "--set", "tree_depth=3", "--weights", "float32", "--draft-weights", "float32", *extra])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


class Counter:
    """Wraps SpecEngine.decode / prefill to count calls (and optionally fail on the n-th)."""

    def __init__(self, monkeypatch, name: str, fail_on: int | None = None) -> None:
        self.calls = 0
        real = getattr(SpecEngine, name)

        def wrapped(engine, *a, **kw):
            self.calls += 1
            if fail_on is not None and self.calls == fail_on:
                raise KeyboardInterrupt
            return real(engine, *a, **kw)

        monkeypatch.setattr(SpecEngine, name, wrapped)


def test_bench_writes_all_artifacts(target, tmp_path, monkeypatch, capsys):
    prefills = Counter(monkeypatch, "prefill")
    out = tmp_path / "out"
    methods = "ar,sd,specextend,sd+cmr,hf-ar,hf-assisted,hf-lookup"
    assert bench(target, out, methods=methods) == 0
    rows = rows_of(out)
    assert len(rows) == 2 * 7
    for r in rows:
        assert set(r) >= CONTRACT_FIELDS | BENCH_FIELDS, r["method"]
        assert r["data"] == "stdlib-160" and r["sample"] in (0, 1)
        assert r["input_tokens"] == r["prompt_tokens"] <= 160
        assert r["new_tokens"] == len(r["token_ids"]) == 6
        assert set(r["phases"]) == {"draft_s", "verify_s", "retrieval_s", "other_s"}
        # Greedy decoding is lossless, and HF runs the same weights on the same prompt tokens.
        assert r["matches_ar"] is True, r["method"]
    by = {(r["sample"], r["method"]): r for r in rows}
    assert by[(0, "sd")]["accepted_per_step"] > 0 and by[(0, "ar")]["accepted_per_step"] == 0
    assert by[(0, "sd+cmr")]["config"]["draft_cache"] == "cmr" and by[(0, "sd+cmr")]["config"]["attention"] == "eager"
    assert by[(0, "ar")]["draft"] is None and by[(0, "hf-assisted")]["draft"] == str(target)
    # One prefill per sample and attention backend: (ar, specextend) efficient, (sd, sd+cmr) eager.
    assert prefills.calls == 2 * 2
    # Each method's prefill is its own: the same target prefill, plus the prompt KV its draft computed.
    assert by[(0, "sd")]["prefill_target_s"] == by[(0, "sd+cmr")]["prefill_target_s"]
    assert by[(0, "sd")]["prefill_draft_s"] > 0 and by[(0, "sd+cmr")]["prefill_draft_s"] > 0
    summary = (out / "summary.md").read_text()
    for m in methods.split(","):
        assert f"| {m} |" in summary
    for png in ("speedup.png", "accepted.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "stdlib-160" in printed and "| specextend |" in printed


def test_resume_skips_finished_rows(target, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert bench(target, out, methods="ar,sd", samples=1) == 0
    assert len(rows_of(out)) == 2

    decodes = Counter(monkeypatch, "decode")
    # Everything done: no model is even loaded.
    from specextend.api import Prepared

    monkeypatch.setattr(Prepared, "load", lambda self: pytest.fail("models loaded although nothing was left"))
    assert bench(target, out, methods="ar,sd", samples=1) == 0
    assert decodes.calls == 0 and len(rows_of(out)) == 2
    monkeypatch.undo()

    # A new method runs only its own rows; other settings make new rows, not reuse.
    decodes = Counter(monkeypatch, "decode")
    assert bench(target, out, methods="ar,sd,specextend", samples=1) == 0
    assert decodes.calls == 1 and len(rows_of(out)) == 3
    assert bench(target, out, "--set", "tree_budget=4", methods="sd", samples=1) == 0
    assert decodes.calls == 2 and len(rows_of(out)) == 4


@pytest.mark.long
def test_shared_prefill_is_one_prefill_per_sample(target, tmp_path, monkeypatch):
    prefills = Counter(monkeypatch, "prefill")
    out = tmp_path / "out"
    methods = "ar,sd,specextend,specextend+retrieve_every=2"
    assert bench(target, out, "--prefill", "shared", methods=methods) == 0
    assert prefills.calls == 2  # one per sample, not one per sample and backend
    rows = rows_of(out)
    by = {(r["sample"], r["method"]): r for r in rows}
    assert len(rows) == 2 * 4 and all(r["matches_ar"] is True for r in rows)
    sd, se = by[(0, "sd")], by[(0, "specextend")]
    # sd decodes with its own (eager) kernel from the efficient prefill, and says so.
    assert sd["config"]["attention"] == "eager" and sd["prefill_attention"] == se["prefill_attention"] == "efficient"
    # Each row's prefill is its own: the shared target prefill, plus the prompt KV its draft read.
    assert sd["prefill_target_s"] == se["prefill_target_s"] == by[(0, "ar")]["prefill_s"]
    assert by[(0, "ar")]["prefill_draft_s"] == 0.0 and sd["prefill_draft_s"] > 0.0
    for r in rows:
        assert r["prefill_s"] == pytest.approx(r["prefill_target_s"] + r["prefill_draft_s"])
        assert r["total_s"] == pytest.approx(r["prefill_s"] + r["decode_s"])
    assert by[(0, "specextend+retrieve_every=2")]["config"]["retrieve_every"] == 2
    summary = (out / "summary.md").read_text()
    assert "bench --prefill shared" in summary
    assert [line for line in summary.splitlines() if "†" in line and line.startswith("| ")] != []

    # The per-backend rows are different measurements for sd only: those rerun, the rest resume.
    decodes = Counter(monkeypatch, "decode")
    assert bench(target, out, methods=methods) == 0
    assert decodes.calls == 2
    assert {r["prefill_attention"] for r in rows_of(out)[-2:]} == {"eager"}


@pytest.mark.long
def test_interrupted_run_resumes_to_the_same_rows(target, tmp_path, monkeypatch):
    out = tmp_path / "out"
    Counter(monkeypatch, "decode", fail_on=3)
    assert bench(target, out) == 130  # the CLI's status for Ctrl-C
    assert len(rows_of(out)) == 2
    assert "| ar |" in (out / "summary.md").read_text()  # the files written so far are valid
    monkeypatch.undo()
    # A writer killed mid-line leaves a partial last line: ignored, then cut off.
    with open(out / "results.jsonl", "a") as f:
        f.write('{"method": "sd", "data": "std')
    decodes = Counter(monkeypatch, "decode")
    assert bench(target, out) == 0
    assert decodes.calls == 6 - 2
    rows = rows_of(out)
    assert len(rows) == 6
    assert {(r["sample"], r["method"]) for r in rows} == {(s, m) for s in (0, 1) for m in ("ar", "sd", "specextend")}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--methods", "ar,fast"], "unknown method 'fast'"),
        (["--methods", "sd+turbo"], "unknown modifier +turbo"),
        (["--methods", "ar+cmr"], "ar uses no draft"),
        (["--methods", "sd+cmr+full"], "sets draft_cache twice"),
        (["--methods", " , "], "--methods is empty"),
        (["--methods", "specextend+bogus=1"], "unknown setting"),
        (["--methods", "specextend+retrieve_every=x"], "expected a int"),
        (["--methods", "specextend+attention=eager"], "use --methods"),
        (["--methods", "ar+retrieve_every=2"], "ar uses no draft"),
        (["--methods", "specextend+retrieve_every=0"], "--retrieve-every must be a positive integer"),
        (["--prefill", "twice"], "invalid choice"),
        (["--samples", "0"], "--samples must be a positive integer"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be a positive integer"),
        (["--lengths", "4X"], "bad length '4X'"),
        (["--lengths", "8K"], "exceeds"),  # longer than the tiny models' 512-token context
        (["--max-new-tokens", "600"], "exceeds"),
        (["--set", "chunk_size=abc"], "expected a int"),
        (["--set", "bogus=1"], "unknown setting"),
        (["--set", "attention=eager"], "use --methods"),
        (["--set", "tree_budget=0"], "--tree-budget must be a positive integer"),
        (["--dtype", "float8"], "unknown dtype"),
        (["--data", "/nonexistent/x.jsonl"], "data path not found"),
    ],
)
def test_bad_input_exits_2_before_loading(target, tmp_path, monkeypatch, capsys, args, needle):
    from specextend.api import Prepared

    monkeypatch.setattr(Prepared, "load", lambda self: pytest.fail("models loaded before the input was checked"))
    rc = cli.main(["bench", "--target", str(target), "--draft", str(target), "--out", str(tmp_path / "o"),
                   "--lengths", "160", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "holds no records"),
        ("\n\n", "holds no records"),
        ('{"text": "ok"}\n{"text": \n', "line 2 is not valid JSON"),
        ('{"prompt": "x"}\n', "has no string field 'text'"),
        ('{"text": "  "}\n', "empty 'text'"),
    ],
)
def test_bad_jsonl_exits_2(target, tmp_path, monkeypatch, capsys, content, needle):
    from specextend.api import Prepared

    monkeypatch.setattr(Prepared, "load", lambda self: pytest.fail("models loaded before the input was checked"))
    f = tmp_path / "bad_1K.jsonl"
    f.write_text(content)
    rc = cli.main(["bench", "--target", str(target), "--draft", str(target), "--out", str(tmp_path / "o"),
                   "--data", str(f)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_out_must_be_a_folder(target, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["bench", "--target", str(target), "--out", str(f), "--methods", "ar"]) == 2
    assert "not a folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- data


def test_jsonl_inputs_names_limits_and_folders(tmp_path, monkeypatch):
    folder = tmp_path / "gov"
    folder.mkdir()
    for n in ("1K", "4K"):
        (folder / f"govreport_{n}.jsonl").write_text("".join(json.dumps({"text": f"{n} doc {i}"}) + "\n"
                                                             for i in range(5)))
    samples = bench_data.load_jsonl_inputs([str(folder)], limit=2)
    assert [(s.data, s.sample, s.text) for s in samples] == [
        ("govreport-1K", 0, "1K doc 0"), ("govreport-1K", 1, "1K doc 1"),
        ("govreport-4K", 0, "4K doc 0"), ("govreport-4K", 1, "4K doc 1"),
    ]
    assert bench_data.data_length("govreport-4K") == 4096 and bench_data.data_family("govreport-4K") == "govreport"
    # A bare name is looked up under $SPECEXTEND_DATA.
    monkeypatch.setenv(bench_data.DATA_ENV, str(tmp_path))
    assert len(bench_data.load_jsonl_inputs(["gov"], limit=1)) == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no \.jsonl files"):
        bench_data.load_jsonl_inputs([str(tmp_path / "empty")])


def test_builtin_set_is_cut_to_length_and_deterministic():
    tok = tiny_tokenizer()
    a = bench_data.builtin_code_inputs(tok, [128, 192], samples=2)
    b = bench_data.builtin_code_inputs(tok, [128, 192], samples=2)
    assert [(s.data, s.sample, s.source) for s in a] == [
        ("stdlib-128", 0, "stdlib/argparse.py"), ("stdlib-128", 1, "stdlib/datetime.py"),
        ("stdlib-192", 0, "stdlib/argparse.py"), ("stdlib-192", 1, "stdlib/datetime.py"),
    ]
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    for s in a:
        length = bench_data.data_length(s.data)
        assert length // 2 < s.input_tokens <= length
        assert s.text.startswith(bench_data.INSTRUCTION) and "```python\n" in s.text
        # The chat template wraps the instruction as a user turn.
        assert s.prompt_ids == bench_data.encode_prompt(tok, s.text, chat=True) != tok.encode(s.text)
    assert bench_data.parse_lengths("2K,1k,512") == [512, 1024, 2048]
    assert bench_data.length_label(16384) == "16K" and bench_data.length_label(96) == "96"


# --------------------------------------------------------------------------- report


def test_report_ignores_a_partial_last_line_and_runs_standalone(tmp_path, capsys):
    row = {"data": "stdlib-1K", "sample": 0, "method": "ar", "input_tokens": 1000, "new_tokens": 10,
           "decode_s": 2.0, "steps": 9, "accepted_per_step": 0.0, "prefill_s": 5.0, "token_ids": [1, 2],
           "phases": {"retrieval_s": 0.0}, "matches_ar": True}
    sd = dict(row, method="sd", decode_s=1.0, steps=4, accepted_per_step=1.5, token_ids=[1, 3],
              matches_ar=None, phases={"retrieval_s": 0.1})
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(sd) + "\n" + '{"data": "stdlib-1K", "sam')
    assert len(report.read_rows(path)) == 2
    assert report.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    # sd: 2x ar's decode rate; end to end (prefill + decode, from the rows' fields since they have no
    # total_s) 10 tokens in 6 s against ar's 7 s; its tokens differ from ar's (recomputed although
    # its row said null).
    assert ("| sd | 1 | 10 | 10.00 | 2.00x | 1.00x | 5.0 | 6.0 | 1.67 | 1.17x | 1.167–1.167x | 1/1 | 1.50 | 10.0% | "
            "0/1 |") in printed
    assert (tmp_path / "speedup.png").is_file() and (tmp_path / "accepted.png").is_file()
    assert report.main([str(tmp_path / "missing")]) == 2


def test_report_shows_each_samples_end_to_end_ratio_to_ar():
    """A mean above ar can hide a prompt that lost end to end: the summary gives the per-sample
    range and how many samples were at least as fast as ar."""
    def row(method, sample, total):
        return {"data": "govreport-8K", "sample": sample, "method": method, "input_tokens": 8000, "new_tokens": 10,
                "decode_s": 1.0, "prefill_s": total - 1.0, "total_s": total, "steps": 10, "token_ids": [sample]}
    rows = [row("ar", 0, 100.0), row("ar", 1, 50.0), row("ar", 2, 40.0),
            row("specextend", 0, 80.0), row("specextend", 1, 50.0), row("specextend", 2, 41.0)]
    cells = {c.method: c for c in report.aggregate(rows)}
    lo, hi = cells["specextend"].e2e_range_ar
    assert math.isclose(lo, 40 / 41) and math.isclose(hi, 1.25)
    assert cells["specextend"].e2e_wins == (2, 3)  # an equal total counts as not slower
    assert cells["ar"].e2e_range_ar is None and cells["ar"].e2e_wins is None
    assert "| 0.976–1.250x | 2/3 |" in report.summary_tables(list(cells.values()))


def test_runtime_bench_times_a_short_prefill_and_refuses_bad_numbers(tiny_dir, capsys):
    """A prefill shorter than the warm-up's 512 tokens fits its cache (the two warm-ups used to
    share one cache and overflow it); bad numbers exit 2 before any model is loaded."""
    from specextend.bench import runtime
    from specextend.models.loader import load_model

    model = load_model(tiny_dir("qwen2", 0), torch.float64)
    out = runtime.prefill_speed(model, 100)
    assert out["prefill_tokens_per_s_efficient"] > 0 and out["prefill_tokens_per_s_eager"] > 0
    for bad in (["--rows", "1,x"], ["--rows", "0,2"], ["--prefill-tokens", "0"], ["--context", "-5"]):
        with pytest.raises(SystemExit) as e:
            runtime.main(["--target", "/nonexistent", *bad])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err
