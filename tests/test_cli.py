"""`specextend` command line on tiny random models: the contract's output and exit statuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from specextend.cli import main as cli
from specextend.cli.main import main
from specextend.common.settings import Settings

from conftest import make_tiny_hf
from tiny_tokenizer import TINY_VOCAB, copy_model, save_tiny_model, tiny_tokenizer

CONTRACT_FIELDS = {
    "method", "target", "draft", "dtype", "device", "config", "prompt_tokens", "new_tokens",
    "token_ids", "text", "prefill_s", "decode_s", "total_s", "decode_tokens_per_s", "steps",
    "accepted_per_step", "phases",
}  # fmt: skip
PROMPT = "hello the world, héllo 日本 "
ENTRY = Path(sys.executable).parent / "specextend"


pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", seed=0)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(result: tuple[int, str, str], needle: str) -> None:
    code, out, err = result
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert needle.lower() in err.lower(), err


# --------------------------------------------------------------------------- bad input


def _broken_folders(tiny: Path, tmp: Path) -> dict[str, Path]:
    empty = tmp / "empty"
    empty.mkdir()
    truncated = copy_model(tiny, tmp / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    gpt2 = copy_model(tiny, tmp / "gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    return {"empty": empty, "truncated": truncated, "gpt2": gpt2}


@pytest.mark.parametrize(
    "which, needle",
    [
        ("missing", "not found"),
        ("empty", "no config.json"),
        ("truncated", "truncated"),
        ("gpt2", "unsupported model architecture"),
    ],
)
def test_bad_model_reference(capsys, tiny, tmp_path, which, needle):
    folders = _broken_folders(tiny, tmp_path)
    target = folders.get(which, tmp_path / "no" / "such" / "model")
    assert_user_error(run(capsys, "generate", "--target", target, "--method", "ar", "--prompt", "hi"), needle)


def test_bad_draft_reference(capsys, tiny, tmp_path):
    r = run(capsys, "generate", "--target", tiny, "--draft", tmp_path / "nope", "--prompt", "hi")
    assert_user_error(r, "not found")


def _prompt_files(tmp: Path) -> dict[str, Path]:
    files = {
        "blank.txt": "  \n\n",
        "data.jsonl": '{"text": "first"}\n\n{"text": "second"}\n',
        "bad.jsonl": '{"text": "first"}\n{"text": oops}\n',
        "nofield.jsonl": '{"code": "x"}\n["text"]\n',
    }
    for name, body in files.items():
        (tmp / name).write_text(body)
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return {name: tmp / name for name in [*files, "latin1.txt"]}


# Settings and prompt errors are checked before any model is touched: the target given to these
# does not exist, so a wrong order would report the missing model instead.
BAD_INPUTS = [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", " \n\t"], "the prompt is empty"),
    ([], "or --prompts-file PATH"),
    (["--prompt-file", "{tmp}/nope.txt"], "prompt file not found"),
    (["--prompt-file", "{tmp}"], "not a file"),
    (["--prompt-file", "{tmp}/blank.txt"], "the prompt is empty"),
    (["--prompt-file", "{tmp}/latin1.txt"], "not UTF-8"),
    (["--jsonl", "{tmp}/nope.jsonl"], "JSONL file not found"),
    (["--jsonl", "{tmp}/bad.jsonl", "--index", "1"], "line 2 is not valid JSON"),
    (["--jsonl", "{tmp}/nofield.jsonl", "--index", "0"], "no string field 'text'"),
    (["--jsonl", "{tmp}/nofield.jsonl", "--index", "1"], "no string field 'text'"),
    (["--jsonl", "{tmp}/data.jsonl", "--index", "2"], "out of range: {tmp}/data.jsonl has 2 records"),
    (["--jsonl", "{tmp}/data.jsonl", "--index", "-1"], "--index must be >= 0"),
    (["--prompt", "x", "--index", "1"], "--index needs --jsonl"),
    (["--prompt", "x", "--prompt-file", "{tmp}/blank.txt"], "not allowed with argument"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--prompt", "x", "--max-new-tokens", "-5"], "--max-new-tokens must be a positive integer"),
    (["--prompt", "x", "--max-new-tokens", "ten"], "invalid int value"),
    (["--prompt", "x", "--chunk-size", "0"], "--chunk-size must be a positive integer"),
    (["--prompt", "x", "--top-k-chunks", "-1"], "--top-k-chunks must be a positive integer"),
    (["--prompt", "x", "--retrieve-every", "0"], "--retrieve-every must be a positive integer"),
    (["--prompt", "x", "--tree-budget", "0"], "--tree-budget must be a positive integer"),
    (["--prompt", "x", "--seed", "-1"], "--seed must be a non-negative integer"),
    (["--prompt", "x", "--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--top-p", "-1"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--tree-threshold", "1"], "--tree-threshold must be in [0, 1)"),
    (["--prompt", "x", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["--prompt", "x", "--draft-dtype", "int4"], "unknown dtype 'int4'"),
    (["--prompt", "x", "--device", "tpu"], "unknown device 'tpu'"),
    (["--prompt", "x", "--method", "fast"], "invalid choice: 'fast'"),
    (["--prompt", "x", "--draft-cache", "all"], "invalid choice: 'all'"),
    (["--prompt", "x", "--attention", "flash"], "invalid choice: 'flash'"),
    (["--prompt", "x", "--set", "novalue"], "--set wants KEY=VALUE"),
    (["--prompt", "x", "--set", "chunk_size=3"], "use the --chunk-size option"),
    (["--prompt", "x", "--no-such-option"], "--no-such-option (see specextend generate --help)"),
]


@pytest.mark.parametrize("args, needle", BAD_INPUTS, ids=[" ".join(a) or "none" for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, args, needle):
    _prompt_files(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in args]
    r = run(capsys, "generate", "--target", tmp_path / "no-model", *argv)
    assert_user_error(r, needle.format(tmp=tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_cuda_without_a_device(capsys, tmp_path):
    r = run(capsys, "generate", "--target", tmp_path / "no-model", "--prompt", "x", "--device", "cuda")
    assert_user_error(r, "no CUDA device")


@pytest.mark.parametrize("argv, where", [(["models", "pull", "--bogus"], "specextend models pull --help"),
                                         (["kernels", "--bogus"], "specextend kernels --help")])
def test_an_unknown_flag_points_at_its_commands_help(capsys, argv, where):
    assert_user_error(run(capsys, *argv), f"(see {where})")


def test_prompt_longer_than_context(capsys, tiny):
    # Byte-level tokens: 600 characters are 600 tokens; the tiny models hold 512 positions.
    r = run(capsys, "generate", "--target", tiny, "--method", "ar", "--prompt", "x" * 600)
    assert_user_error(r, "the prompt is 600 tokens, longer than the target's context of 512 tokens")
    r = run(capsys, "generate", "--target", tiny, "--method", "ar", "--prompt", "x" * 400)
    assert_user_error(r, "exceeds")  # 400 + 256 new tokens do not fit either


def test_mismatched_draft_refused(capsys, tiny, tmp_path):
    draft = save_tiny_model(tmp_path / "draft", seed=1, tokenizer=tiny_tokenizer(swap=(20, 30)))
    capsys.readouterr()  # drop the saving progress bar
    r = run(capsys, "generate", "--target", tiny, "--draft", draft, "--prompt", "hi")
    assert_user_error(r, "draft and target tokenizers differ")


# --------------------------------------------------------------------------- generate


def test_json_output_is_one_object_with_every_field(capsys, tiny):
    code, out, _ = run(capsys, "generate", "--target", tiny, "--method", "ar", "--prompt", PROMPT,
                       "--max-new-tokens", "12", "--json")
    assert code == 0
    assert out.endswith("\n") and out.count("\n") == 1
    d = json.loads(out)  # raises on anything but exactly one JSON document
    assert set(d) >= CONTRACT_FIELDS
    assert d["new_tokens"] == len(d["token_ids"]) == 12
    assert d["method"] == "ar" and d["draft"] is None and d["accepted_per_step"] == 0
    assert d["dtype"] == "float32" and d["device"] == "cpu" and d["target"] == str(tiny.resolve())
    assert {f.name for f in fields(Settings)} - {"labels"} <= set(d["config"])
    assert set(d["phases"]) == {"draft_s", "verify_s", "retrieval_s", "other_s"}
    assert d["total_s"] >= d["decode_s"] > 0 and d["prefill_s"] > 0


def test_json_stdout_stays_clean_when_something_prints(capsys, tiny, monkeypatch):
    import specextend.api as api

    real_prepare = api.prepare

    def noisy_prepare(*a, **kw):
        print("noise on stdout")
        return real_prepare(*a, **kw)

    monkeypatch.setattr(api, "prepare", noisy_prepare)
    code, out, err = run(capsys, "generate", "--target", tiny, "--method", "ar", "--prompt", "ab",
                         "--max-new-tokens", "3", "--json")
    assert code == 0 and json.loads(out)["new_tokens"] == 3
    assert "noise on stdout" in err


def test_speculative_json_from_the_cli(capsys, tiny):
    # The target as its own draft: greedy output equals ar's and draft tokens get accepted. The
    # cost model is off: it sizes each tree from this machine's step times, and on a loaded CI
    # machine it may judge that no draft pays over 10 tokens, so acceptance would be timing's.
    common = ["generate", "--target", tiny, "--draft", tiny, "--prompt", PROMPT, "--max-new-tokens", "10",
              "--dtype", "float64", "--json", "--chunk-size", "4", "--top-k-chunks", "2", "--no-cost-model"]
    _, out, _ = run(capsys, *common, "--method", "ar")
    ar = json.loads(out)
    code, out, _ = run(capsys, *common, "--method", "specextend", "--set", "note=1")
    d = json.loads(out)
    assert code == 0 and d["token_ids"] == ar["token_ids"]
    assert d["accepted_per_step"] > 0 and d["draft"] == str(tiny.resolve())
    assert d["config"]["draft_cache"] == "cmr" and d["config"]["chunk_size"] == 4 and d["config"]["note"] == 1
    assert d["config"]["cost_model"] is False


def test_greedy_ar_matches_transformers(capsys, tiny):
    n = 24
    code, out, _ = run(capsys, "generate", "--target", tiny, "--method", "ar", "--dtype", "float64",
                       "--prompt", PROMPT, "--max-new-tokens", n, "--json")
    assert code == 0
    ours = json.loads(out)
    ref = make_tiny_hf("qwen2", 0, vocab=TINY_VOCAB)
    ids = tiny_tokenizer().encode(PROMPT)
    assert ours["prompt_tokens"] == len(ids)
    with torch.no_grad():
        full = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=n, do_sample=False, eos_token_id=TINY_VOCAB - 1,
                            pad_token_id=TINY_VOCAB - 1)
    assert ours["token_ids"] == full[0, len(ids):].tolist()


def test_streaming_mode_prints_text(capsys, tiny, tmp_path):
    args = ["generate", "--target", tiny, "--method", "ar", "--max-new-tokens", "16"]
    _, out, _ = run(capsys, *args, "--prompt", PROMPT, "--json")
    expected = json.loads(out)["text"]
    code, out, err = run(capsys, *args, "--prompt", PROMPT)
    assert code == 0 and out == expected
    assert "16 tokens" in err and "tok/s" in err and "Traceback" not in err
    # The same prompt from a file and from a JSONL record.
    (tmp_path / "p.txt").write_text(PROMPT)
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "other"}) + "\n" + json.dumps({"text": PROMPT}) + "\n")
    assert run(capsys, *args, "--prompt-file", tmp_path / "p.txt", "-q")[1] == expected
    code, out, err = run(capsys, *args, "--jsonl", tmp_path / "p.jsonl", "--index", "1", "-q")
    assert code == 0 and out == expected and err == ""


def test_chat_prompt(capsys, tiny):
    code, out, _ = run(capsys, "generate", "--target", tiny, "--method", "ar", "--prompt", "hi", "--chat",
                       "--max-new-tokens", "2", "--json")
    # <|user|> h i <|endoftext|> <|assistant|>
    assert code == 0 and json.loads(out)["prompt_tokens"] == 5


# --------------------------------------------------------------------------- errors and delegation


def test_internal_error_exits_1(capsys, monkeypatch, tiny):
    import specextend.api as api

    def boom(*a, **kw):
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setattr(api, "prepare", boom)
    code, out, err = run(capsys, "generate", "--target", tiny, "--prompt", "x")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "specextend: internal error: RuntimeError: kaboom second line (run with SPECEXTEND_DEBUG=1 for the traceback)"
    ]
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    code, _, err = run(capsys, "generate", "--target", tiny, "--prompt", "x")
    assert code == 1 and "Traceback" in err and "kaboom" in err


def test_keyboard_interrupt_exits_130(capsys, monkeypatch, tiny):
    import specextend.api as api

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "prepare", interrupted)
    code, _, err = run(capsys, "generate", "--target", tiny, "--prompt", "x")
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_delegated_command(capsys, monkeypatch):
    fake = types.ModuleType("fake_demo")
    fake.add_arguments = lambda p: p.add_argument("--rounds", type=int, default=1)
    fake.run = lambda args: 7 if args.rounds == 3 else 0
    monkeypatch.setitem(sys.modules, "fake_demo", fake)
    monkeypatch.setitem(cli.DELEGATED, "demo", ("fake_demo", "fake"))
    assert run(capsys, "demo", "--rounds", "3")[0] == 7
    assert run(capsys, "demo", "--rounds", "x")[0] == 2


def test_missing_delegated_module(capsys, monkeypatch):
    monkeypatch.setitem(cli.DELEGATED, "needle", ("specextend._no_such_module", "missing"))
    assert_user_error(run(capsys, "needle"), "not available")


def test_usage_errors(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "required" in err and len(err.strip().splitlines()) == 1
    assert run(capsys, "frobnicate")[0] == 2
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0 and "--top-k-chunks" in out and "--retrieval-layers-mean" in out


# --------------------------------------------------------------------------- models


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["NAME", "ROLE", "PULLED", "SIZE", "DESCRIPTION"]
    # Known models only (no conversion cache), each with its published GGUF's size, pulled or not.
    assert len(lines) == 3 and any(line.startswith("qwen2.5-coder-1.5b") and " no " in line and "1.1 GB" in line
                                   for line in lines)
    code, out, _ = run(capsys, "models", "list", "--json")
    assert {r["name"] for r in json.loads(out)} >= {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}


def test_models_pull(capsys, monkeypatch, tmp_path):
    import specextend.models.pull as pull

    monkeypatch.setattr(pull, "pull", lambda name, progress=True: tmp_path / name)
    monkeypatch.setattr(pull, "pull_default_pair", lambda progress=True: (tmp_path / "t", tmp_path / "d"))
    assert run(capsys, "models", "pull", "x")[1].split() == [str(tmp_path / "x")]
    assert run(capsys, "models", "pull")[1].split() == [str(tmp_path / "t"), str(tmp_path / "d")]
    assert_user_error(run(capsys, "models", "fetch"), "invalid choice")


# --------------------------------------------------------------------------- the real entry point


def test_console_script(tiny, tmp_path):
    env = {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home")}
    env.pop(cli.DEBUG_ENV, None)
    ok = subprocess.run(
        [ENTRY, "generate", "--target", tiny, "--method", "ar", "--prompt", PROMPT, "--max-new-tokens", "5",
         "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["new_tokens"] == 5
    bad = subprocess.run(
        [ENTRY, "generate", "--target", tiny, "--method", "ar", "--prompt", "x", "--top-p", "7"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ["specextend: error: --top-p must be in (0, 1], got 7.0"]


def test_the_summary_line_counts_in_the_singular_for_one():
    from types import SimpleNamespace

    from specextend.cli.main import summary_line

    r = SimpleNamespace(new_tokens=1, prompt_tokens=5, method="sd", stop_reason="length", prefill_s=0.1, decode_s=0.1,
                        decode_tokens_per_s=10.0, accepted_per_step=1.0, steps=1)
    line = summary_line(r)
    assert "1 token after" in line and "over 1 step" in line and "tokens after" not in line
