"""The Python API on tiny random models: load, generate, stream, results and refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import specextend
from specextend.api import load
from specextend.common.errors import UserError
from specextend.models import resolve
from specextend.models.resolve import same_tokenizer_files
from specextend.requests.detokenize import Detokenizer

from tiny_tokenizer import TINY_VOCAB, save_tiny_model, tiny_tokenizer

CONTRACT_FIELDS = {
    "method", "target", "draft", "dtype", "device", "config", "prompt_tokens", "new_tokens",
    "token_ids", "text", "prefill_s", "decode_s", "total_s", "decode_tokens_per_s", "steps",
    "accepted_per_step", "phases",
}  # fmt: skip
PROMPT = "hello the world, héllo 日本 "


pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "other": save_tiny_model(root / "other", seed=1),
        "swapped": save_tiny_model(root / "swapped", seed=1, tokenizer=tiny_tokenizer(swap=(10, 11))),
        "bigger": save_tiny_model(root / "bigger", seed=1, vocab=TINY_VOCAB + 8),
    }


@pytest.fixture(scope="module")
def pair(folders):
    # The target is its own draft: every draft token is accepted, so τ > 0 is checkable.
    return load(folders["target"], folders["target"], dtype="float64", progress=False)


def test_generate_result_and_json(pair):
    r = pair.generate(PROMPT, method="ar", max_new_tokens=10)
    assert r.new_tokens == len(r.token_ids) == 10 and r.stop_reason == "length"
    assert r.prompt_tokens == len(pair.encode(PROMPT))
    assert r.text == pair.detokenize(r.token_ids)
    d = r.to_json()
    assert set(d) >= CONTRACT_FIELDS
    assert d["method"] == "ar" and d["draft"] is None and d["accepted_per_step"] == 0
    assert d["config"]["max_new_tokens"] == 10 and d["config"]["method"] == "ar"
    assert set(d["phases"]) == {"draft_s", "verify_s", "retrieval_s", "other_s"}
    assert d["decode_tokens_per_s"] == pytest.approx(d["new_tokens"] / d["decode_s"])
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize("method", ["sd", "specextend"])
def test_greedy_speculative_equals_ar(pair, method):
    ar = pair.generate(PROMPT, method="ar", max_new_tokens=12)
    # Cost model off: with it, whether any draft token is verified depends on this machine's
    # step times (a loaded machine may judge no draft pays over 12 tokens).
    spec = pair.generate(PROMPT, method=method, max_new_tokens=12, chunk_size=4, top_k_chunks=2, cost_model=False)
    assert spec.token_ids == ar.token_ids
    assert spec.accepted_per_step > 0
    assert spec.to_json()["draft"] is not None


def test_stream_concatenates_to_text(pair):
    pieces = list(pair.stream(PROMPT, method="sd", max_new_tokens=16))
    final = pair.last_result
    assert final is not None and final.new_tokens == 16
    assert "".join(pieces) == final.text
    assert pair.generate(PROMPT, method="sd", max_new_tokens=16).text == final.text
    # on_text gives the same pieces' concatenation
    got: list[str] = []
    r = pair.generate(PROMPT, method="ar", max_new_tokens=16, on_text=got.append)
    assert "".join(got) == r.text


def test_stream_closed_early_stops_the_worker(pair):
    it = pair.stream(PROMPT, method="ar", max_new_tokens=64)
    next(it)
    it.close()  # must not hang, and the engine stops at its next batch
    assert pair.generate(PROMPT, method="ar", max_new_tokens=3).new_tokens == 3


def test_detokenizer_holds_back_split_characters():
    tok = tiny_tokenizer()
    text = "héllo → 日本語 ✓ the end"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens

    def decode(i):
        return tok.decode(i, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    pieces: list[str] = []
    d = Detokenizer(decode, pieces.append)
    for i in ids:
        d.push([i])
    d.finish(decode(ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_detokenizer_decodes_a_window_and_gives_the_whole_text(batch):
    """A long answer pushed in batches: the pieces add up to the whole text's decode, characters
    never split, and no push decodes more than the window's tokens (not the whole answer)."""
    tok = tiny_tokenizer()
    text = " ".join(["héllo → 日本語 ✓ the end of a line"] * 12)
    ids = tok.encode(text)
    seen: list[int] = []

    def decode(i):
        seen.append(len(i))
        return tok.decode(i, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    pieces: list[str] = []
    d = Detokenizer(decode, pieces.append)
    for at in range(0, len(ids), batch):
        d.push(ids[at:at + batch])
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert len(ids) > 400 and max(seen) < 2 * Detokenizer.WINDOW + batch  # not the whole answer: a window
    d.finish(text)
    assert "".join(pieces) == text


def test_detokenizer_flushes_truly_invalid_bytes():
    tok = tiny_tokenizer()
    lone = tok.convert_tokens_to_ids(["Ã"])  # byte 0xC3 alone: never completes a character

    def decode(i):
        return tok.decode(i, skip_special_tokens=True)

    ids = tok.encode("ab") + lone
    pieces: list[str] = []
    d = Detokenizer(decode, pieces.append)
    d.push(ids)
    assert "".join(pieces) == "ab"
    d.finish(decode(ids))
    assert "".join(pieces) == decode(ids) and pieces[-1] == "\ufffd"


def test_chat_template_is_applied(pair):
    ids = pair.encode("hi", chat=True)
    user, assistant, end = pair.tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>", "<|endoftext|>"])
    assert ids[0] == user and ids[-1] == assistant and end in ids
    assert pair.generate("hi", chat=True, method="ar", max_new_tokens=2).prompt_tokens == len(ids)


@pytest.mark.parametrize("which, needle", [("swapped", "token 10"), ("bigger", "entries")])
def test_mismatched_tokenizer_refused(folders, which, needle):
    with pytest.raises(UserError, match="draft and target tokenizers differ") as e:
        load(folders["target"], folders[which], progress=False)
    assert needle in str(e.value)


def test_other_draft_with_same_vocabulary_is_accepted(folders):
    p = load(folders["target"], folders["other"], dtype="float64", progress=False)
    assert p.draft is not None and p.draft_path == folders["other"].resolve()


# A draft whose tokenizer files are the target's is accepted without its tokenizer being read;
# any other draft is compared token by token.


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _count_tokenizer_loads(monkeypatch):
    loaded = []
    real = resolve.load_tokenizer

    def counting(folder):
        loaded.append(folder)
        return real(folder)

    monkeypatch.setattr(resolve, "load_tokenizer", counting)
    return loaded


def test_same_files_are_the_same_tokenizer(folders, tmp_path):
    assert same_tokenizer_files(folders["target"], folders["other"])
    assert not same_tokenizer_files(folders["target"], folders["swapped"])


def test_a_chat_template_alone_does_not_count(folders, tmp_path):
    other = _copy(folders["other"], tmp_path / "other")
    path = other / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    path.write_text(json.dumps(config))
    assert same_tokenizer_files(folders["target"], other)
    config["model_max_length"] = 7
    path.write_text(json.dumps(config))
    assert not same_tokenizer_files(folders["target"], other)


@pytest.mark.parametrize("change", ["missing", "extra", "bytes", "config"])
def test_any_other_file_difference_counts(folders, tmp_path, change):
    other = _copy(folders["other"], tmp_path / "other")
    if change == "missing":
        (other / "tokenizer_config.json").unlink()
    elif change == "extra":
        (other / "added_tokens.json").write_text("{}")
    elif change == "bytes":
        tok = other / "tokenizer.json"
        tok.write_text(json.dumps(json.loads(tok.read_text()), indent=3))
    else:
        (other / "tokenizer_config.json").write_text("{not json")
    assert not same_tokenizer_files(folders["target"], other)


def test_a_draft_with_the_targets_files_is_not_loaded_twice(folders, monkeypatch):
    loaded = _count_tokenizer_loads(monkeypatch)
    p = load(folders["target"], folders["other"], dtype="float64", progress=False)
    assert p.draft is not None and loaded == [folders["target"].resolve()]


def test_other_files_with_the_same_vocabulary_are_compared_and_accepted(folders, tmp_path, monkeypatch):
    other = _copy(folders["other"], tmp_path / "other")
    tok = other / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=3))  # other bytes, the same tokens
    loaded = _count_tokenizer_loads(monkeypatch)
    p = load(folders["target"], other, dtype="float64", progress=False)
    assert p.draft is not None and len(loaded) == 2


def test_without_draft(folders):
    p = load(folders["target"], load_draft=False, progress=False)
    assert p.draft is None and p.draft_path is None
    assert p.generate("abc", method="ar", max_new_tokens=2).new_tokens == 2
    with pytest.raises(UserError, match="needs a draft"):
        p.generate("abc", method="sd")
    with pytest.raises(UserError, match="needs a draft"):
        p.stream("abc", method="specextend")


def test_bad_input_raises_user_error(pair):
    with pytest.raises(UserError, match="empty"):
        pair.generate("", method="ar")
    with pytest.raises(UserError, match="empty"):
        pair.generate([], method="ar")
    with pytest.raises(UserError, match="unknown setting 'max_tokens'"):
        pair.generate("abc", max_tokens=3)
    with pytest.raises(UserError, match="top-p"):
        pair.stream("abc", top_p=0.0)
    with pytest.raises(UserError, match=r"600 tokens.*context of 512"):
        pair.encode("x" * 600)
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        pair.generate([1, TINY_VOCAB + 5], method="ar")
    with pytest.raises(UserError, match="exceeds"):  # fits alone, not with the new tokens
        pair.generate("x" * 500, method="ar", max_new_tokens=100)


def test_load_refuses_bad_names(folders, tmp_path):
    with pytest.raises(UserError, match="unknown dtype"):
        load(folders["target"], dtype="float8")
    with pytest.raises(UserError, match="unknown device"):
        load(folders["target"], device="tpu")
    with pytest.raises(UserError, match="not found"):
        load(tmp_path / "missing", load_draft=False)


def test_import_is_cheap_and_exports():
    code = "import sys, specextend; assert 'torch' not in sys.modules; print(specextend.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "load" in out
    assert specextend.load is load
    assert specextend.Settings().method == "specextend"


def test_long_prompt_gives_only_our_error(folders):
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        p = load(folders["target"], load_draft=False, progress=False)
        p.tokenizer.model_max_length = 16  # transformers warns past this; the error line must stand alone
        with pytest.raises(UserError, match="600 tokens"):
            p.encode("x" * 600)
        assert p.encode("x" * 20, chat=True)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
