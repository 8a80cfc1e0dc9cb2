"""A GGUF's text becomes the token ids llama.cpp gives it (`models/pretokenize.py`): a byte-level
vocabulary's words split by its `tokenizer.ggml.pre` (StarCoder-style ones digit by digit), whole words
before merges and BOS by default for Llama 3-style ones, a file naming no pre-tokenizer by llama.cpp's
default, the SentencePiece space prefix the file says; folders converted before these rules are
converted again. Checked against `tokenizers`' own splits here and llama.cpp's `llama-tokenize` where
the peer is built."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer

from specextend.cli.main import main
from specextend.models import pretokenize
from specextend.models.gguf import COMPLETE_MARKER, FORMAT, is_current, write_tokenizer
from test_gguf import SPECIALS, byte_alphabet
from test_llamacpp import real_peer

# Merges that join digits, digits after a space, a contraction and punctuation runs: each split
# under test leaves some of them unusable, so a wrong split gives other ids.
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "w o", "wo r", "l d", "1 2", "12 3", "2 0", "20 2",
          "202 4", "Ġ 1", "Ġ1 2", "Ġ 2", "Ġ2 0", "' s", "Ġ '", "9 9", "99 9", ". .", ".. .", "! !", "Ġ Ġ", "ĠĠ Ġ",
          "Ċ Ċ", "$ 1", "i t", "it 's"]
TEXTS = ["In 2024 we had 12345 items, 999999 of them; it's 1.23 x 20! hello world",
         "hello   world...  ok!!\n\n$12 + 3 = 15",
         "Café déjà vu 東京 2023年", "  leading spaces and trailing   ", "it's 'quoted' -- x<=y || a^b ~ `c`"]


# Whole words that are tokens no merge reaches ("wor" + "ld" is as far as the merges go): taken whole
# where llama.cpp ignores the merges for a word in the vocabulary (`pretokenize.IGNORE_MERGES`).
UNMERGED = ["world", "Ġworld"]


def vocab() -> list[str]:
    return byte_alphabet() + [m.replace(" ", "") for m in MERGES] + UNMERGED + SPECIALS


def vocab_writer(path: Path, arch: str) -> gguf.GGUFWriter:
    """A writer for a vocabulary-only GGUF: a one-layer shape and (`finish`) one tensor, so that llama.cpp
    reads the file."""
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, 8), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 8), (w.add_head_count, 1), (w.add_head_count_kv, 1)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    return w


def finish(w: gguf.GGUFWriter, path: Path, tokens: int) -> Path:
    w.add_tensor("token_embd.weight", np.zeros((tokens, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_vocab(path: Path, pre: str | None, add_bos: bool | None = False) -> Path:
    """A byte-level BPE as llama.cpp's converter writes one."""
    tokens = vocab()
    w = vocab_writer(path, "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:  # files converted before llama.cpp named pre-tokenizers have none
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    return finish(w, path, len(tokens))


SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "a", "n", "1", "2", ".", "he", "ll", "llo", "hello",
              "▁hello", "▁w", "or", "ld", "world", "▁world", "▁1", "12", "▁12", "▁t", "th", "the", "▁the", "▁▁"]


def write_spm(path: Path, space_prefix: bool | None, arch: str = "llama") -> Path:
    """A SentencePiece vocabulary as llama.cpp's converter writes a Llama 2 / Mistral one (scores for
    the merges, byte pieces, two control tokens inside the text), with or without its space flag."""
    toks = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)] + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    toks += [(p, -1.0 - i, 1) for i, p in enumerate(SPM_PIECES)] + [("[INST]", 0.0, 3), ("[/INST]", 0.0, 3)]
    w = vocab_writer(path, arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _, _ in toks])
    w.add_token_scores([sc for _, sc, _ in toks])
    w.add_token_types([k for _, _, k in toks])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    return finish(w, path, len(toks))


SPM_TEXTS = ["hello world", " hello  world", "[INST] hello world [/INST] the end", "[INST]hello[/INST] 12."]


def spm_converted(tmp_path: Path, flag: bool | None, arch: str = "llama") -> tuple[Path, object]:
    folder = tmp_path / f"spm-{arch}-{flag}"
    folder.mkdir()
    path = write_spm(folder / "v.gguf", flag, arch)
    write_tokenizer(path, folder, None, arch)
    return path, AutoTokenizer.from_pretrained(str(folder))


SPM_CASES = [(arch, flag) for arch in ("llama", "phi3") for flag in (None, True, False)]


@pytest.mark.parametrize(("arch", "flag"), SPM_CASES)
def test_a_sentencepiece_file_gets_the_space_prefix_its_file_says(tmp_path, arch, flag):
    """`tokenizer.ggml.add_space_prefix` (true where absent): a "▁" before the text and before the
    text after each special token, as llama.cpp and the original Llama 2 tokenizer put them (transformers'
    Llama tokenizer put one before the text alone, and whatever the file said); none where it is false
    (transformers' Phi-3 tokenizer put one there all the same)."""
    _, tok = spm_converted(tmp_path, flag, arch)
    first = tok.convert_ids_to_tokens(ids(tok, "hello world"))[0]
    after_control = tok.convert_ids_to_tokens(ids(tok, "[INST]hello[/INST]"))
    leading = tok.convert_ids_to_tokens(ids(tok, " hello"))
    if flag is False:
        assert (first, after_control, leading) == ("hello", ["[INST]", "hello", "[/INST]"], ["▁hello"])
        for text in SPM_TEXTS:  # and the text decodes back whole
            assert tok.decode(ids(tok, text)) == text, text
    else:
        assert (first, after_control, leading) == ("▁hello", ["[INST]", "▁hello", "[/INST]"], ["▁", "▁hello"])


def converted(tmp_path: Path, pre: str) -> object:
    folder = tmp_path / pre
    folder.mkdir()
    write_tokenizer(write_vocab(folder / "v.gguf", pre), folder, None, "llama")
    return AutoTokenizer.from_pretrained(str(folder))


def ids(tokenizer: object, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


def with_split(tokenizer: object, split: object) -> Tokenizer:
    """The same vocabulary and merges under another split (`tokenizers`' own pre-tokenizers)."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # type: ignore[attr-defined]
    backend.pre_tokenizer = split
    return backend


# The split a StarCoder-family tokenizer.json states (Granite's, SmolLM's, Refact's): digits alone,
# then GPT-2's byte-level word pattern; and GPT-2's own.
DIGITS_THEN_GPT2 = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
GPT2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
GPT2_STATE = json.loads(GPT2.__getstate__())


@pytest.mark.parametrize("pre", ["refact", "starcoder", "smollm", "command-r"])
def test_a_starcoder_style_vocabulary_puts_every_digit_alone(tmp_path, pre):
    tok = converted(tmp_path, pre)
    own, gpt2 = with_split(tok, DIGITS_THEN_GPT2), with_split(tok, GPT2)
    for text in TEXTS:
        assert ids(tok, text) == own.encode(text, add_special_tokens=False).ids, text
    # The test can fail: GPT-2's split alone (what these files got before) joins the digits.
    assert any(ids(tok, t) != gpt2.encode(t, add_special_tokens=False).ids for t in TEXTS)
    assert ids(tok, "2024") == [tok.convert_tokens_to_ids(c) for c in "2024"]


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2"])
def test_a_llama3_style_vocabulary_takes_a_whole_word_before_its_merges(tmp_path, pre):
    tok = converted(tmp_path, pre)
    pieces = tok.convert_ids_to_tokens(ids(tok, "hello world"))
    assert pieces == (["hello", "Ġworld"] if pre in pretokenize.IGNORE_MERGES else ["hello", "Ġwor", "ld"])


BOS_CASES = [("llama-bpe", None, True), ("llama-bpe", False, False), ("tekken", None, True), ("qwen2", None, False),
             ("refact", True, True)]


@pytest.mark.parametrize(("pre", "flag", "bos"), BOS_CASES)
def test_the_text_starts_with_bos_where_llama_cpp_starts_it(tmp_path, pre, flag, bos):
    """`tokenizer.ggml.add_bos_token` where the file says it; where it does not, llama.cpp's default
    for the vocabulary (BOS first for Llama 3- and Tekken-style ones)."""
    write_tokenizer(write_vocab(tmp_path / "v.gguf", pre, add_bos=flag), tmp_path, None, "llama")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    bos_id = vocab().index("<|endoftext|>")
    assert (tok.encode("hello world")[0] == bos_id) == bos
    assert tok.encode("hello world", add_special_tokens=False)[0] != bos_id


@pytest.mark.skipif(real_peer() is None, reason="llama.cpp peer not installed (run `make peers`)")
@pytest.mark.parametrize(("pre", "flag", "bos"), BOS_CASES)
def test_the_bos_rule_gives_llama_cpps_ids(tmp_path, pre, flag, bos):
    path = write_vocab(tmp_path / "v.gguf", pre, add_bos=flag)
    write_tokenizer(path, tmp_path, None, "llama")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    binary = real_peer().binary.with_name("llama-tokenize")
    out = subprocess.run([str(binary), "-m", str(path), "-p", TEXTS[0], "--ids", "--log-disable"], capture_output=True,
                         text=True, timeout=60)
    assert tok.encode(TEXTS[0]) == json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pre", ["gpt-2", "olmo", "mpt"])
def test_a_gpt2_style_vocabulary_keeps_gpt2s_split(tmp_path, pre):
    tok = converted(tmp_path, pre)
    gpt2 = with_split(tok, GPT2)
    for text in TEXTS:
        assert ids(tok, text) == gpt2.encode(text, add_special_tokens=False).ids, text


def test_a_file_naming_no_pre_tokenizer_is_split_as_llama_cpps_default_and_says_so(tmp_path, capsys):
    folder = tmp_path / "none"
    folder.mkdir()
    write_tokenizer(write_vocab(folder / "v.gguf", None), folder, None, "llama")
    assert "the file names no pre-tokenizer (tokenizer.ggml.pre)" in capsys.readouterr().err
    tok, default = AutoTokenizer.from_pretrained(str(folder)), converted(tmp_path, "default")
    for text in TEXTS:
        assert ids(tok, text) == ids(default, text), text
    assert ids(tok, "it's") == [tok.convert_tokens_to_ids(c) for c in ("it", "'", "s")]  # punctuation alone first


def test_an_unknown_pre_tokenizer_is_named_at_conversion(tmp_path, capsys):
    tok = converted(tmp_path, "some-future-vocab")
    err = capsys.readouterr().err
    assert "tokenizer.ggml.pre 'some-future-vocab' is not a pre-tokenizer this version knows" in err
    assert len(err.strip().splitlines()) == 1
    gpt2 = with_split(tok, GPT2)
    assert ids(tok, TEXTS[0]) == gpt2.encode(TEXTS[0], add_special_tokens=False).ids
    converted(tmp_path, "qwen2")  # a name transformers knows: nothing to say
    assert capsys.readouterr().err == ""


def test_a_folder_split_as_gpt2_before_this_version_is_converted_again(tmp_path):
    """A marker without the rules' stamp over a tokenizer the rules may change (GPT-2's split alone,
    merges always for a Llama 3 split, the Llama prefix): not current, so it is converted again from
    its file; with the stamp, or over a tokenizer they leave as it is, current (a Qwen 2 folder is not
    converted again for nothing, and is stamped so that the check runs once)."""

    def folder(pre: str, stamp: bool, old_split: bool = False, old_merges: bool = False) -> Path:
        tok_dir = tmp_path / f"{pre}-{stamp}-{old_split}"
        tok_dir.mkdir()
        write_tokenizer(write_vocab(tok_dir / "v.gguf", pre), tok_dir, None, "llama")
        saved = json.loads((tok_dir / "tokenizer.json").read_text())
        if old_split:
            saved["pre_tokenizer"] = GPT2_STATE
        if old_merges:  # as transformers built it before: merges always
            saved["model"]["ignore_merges"] = False
        (tok_dir / "tokenizer.json").write_text(json.dumps(saved))
        stamps = f"{FORMAT}\n{pretokenize.RULES_VERSION}\n" if stamp else f"{FORMAT}\n"
        (tok_dir / COMPLETE_MARKER).write_text(f"converted from v.gguf\n{stamps}")
        return tok_dir

    assert not is_current(folder("refact", stamp=False, old_split=True))
    llama3 = folder("llama-bpe", stamp=False, old_merges=True)
    assert not is_current(llama3)
    assert not is_current(folder("some-future-vocab", stamp=False))
    assert is_current(folder("some-future-vocab", stamp=True))  # this version's best: not converted again
    assert is_current(folder("refact", stamp=False))  # already split digits first
    qwen = folder("qwen2", stamp=False)
    assert is_current(qwen)  # transformers' own split: right then too
    # checked once: the marker is stamped, so the next look reads no tokenizer
    assert (qwen / COMPLETE_MARKER).read_text().split()[-1] == pretokenize.RULES_VERSION
    (qwen / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}, "pre_tokenizer": GPT2_STATE}))
    assert is_current(qwen)
    spm = tmp_path / "spm"
    spm.mkdir()
    write_tokenizer(write_spm(spm / "v.gguf", None), spm, None, "llama")
    saved = json.loads((spm / "tokenizer.json").read_text())
    saved["normalizer"] = None  # as transformers' Llama tokenizer had it: a prefix before the text alone
    saved["pre_tokenizer"] = json.loads(pre_tokenizers.Metaspace(prepend_scheme="first", split=False).__getstate__())
    (spm / "tokenizer.json").write_text(json.dumps(saved))
    (spm / COMPLETE_MARKER).write_text(f"converted from v.gguf\n{FORMAT}\n")
    assert not is_current(spm)
    (spm / COMPLETE_MARKER).write_text(f"converted from v.gguf\n{FORMAT}\n{pretokenize.RULES_VERSION}\n")
    assert is_current(spm)
    phi3 = tmp_path / "phi3"
    phi3.mkdir()
    write_tokenizer(write_spm(phi3 / "v.gguf", None, "phi3"), phi3, None, "phi3")  # a prefix before each stretch
    (phi3 / COMPLETE_MARKER).write_text(f"converted from v.gguf\n{FORMAT}\n")
    assert not is_current(phi3)  # the Phi-3 build put it there whatever the file said


def llama_cpp_ids(binary: Path, gguf_path: Path, text: str) -> list[int]:
    out = subprocess.run([str(binary), "-m", str(gguf_path), "-p", text, "--ids", "--log-disable", "--no-bos"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    return [int(x) for x in out.stdout.strip().splitlines()[-1].strip("[]").split(",")]


@pytest.mark.skipif(real_peer() is None, reason="llama.cpp peer not installed (run `make peers`)")
@pytest.mark.parametrize("pre", [*sorted(pretokenize.NAMES), "qwen2", "gpt-4o", "llama-bpe", "llama3", "tekken",
                                 "falcon3", "pixtral", None])
def test_every_named_split_gives_llama_cpps_ids(tmp_path, pre):
    """llama.cpp's own tokenizer (the peer's `llama-tokenize`) on the same file: the same ids for
    every name this version splits itself, and for a few transformers splits as a control."""
    binary = real_peer().binary.with_name("llama-tokenize")
    folder = tmp_path / str(pre)
    folder.mkdir()
    path = write_vocab(folder / "v.gguf", pre)
    write_tokenizer(path, folder, None, "llama")
    tok = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ids(tok, text) == llama_cpp_ids(binary, path, text), (pre, text)


@pytest.mark.skipif(real_peer() is None, reason="llama.cpp peer not installed (run `make peers`)")
@pytest.mark.parametrize(("arch", "flag"), SPM_CASES)
def test_a_sentencepiece_file_gives_llama_cpps_ids(tmp_path, arch, flag):
    binary = real_peer().binary.with_name("llama-tokenize")
    path, tok = spm_converted(tmp_path, flag, arch)
    for text in [*SPM_TEXTS, "a\n\nthe end ", "\n hello"]:
        assert ids(tok, text) == llama_cpp_ids(binary, path, text), text


@pytest.mark.parametrize(("pre", "line"), [
    ("refact", "byte-level BPE, {n} tokens; words split as llama.cpp splits 'refact'"),
    ("llama-bpe", "byte-level BPE, {n} tokens; words split as llama.cpp splits 'llama-bpe'; a word that is a token "
                  "taken whole"),
    ("some-future-vocab", "byte-level BPE, {n} tokens; pre-tokenizer 'some-future-vocab' unknown: words split as "
                          "GPT-2's (ids may differ from llama.cpp's)"),
])
def test_inspect_says_how_the_text_becomes_tokens(tmp_path, capsys, pre, line):
    path = write_vocab(tmp_path / "v.gguf", pre)
    line = line.format(n=len(vocab()))
    assert main(["models", "inspect", str(path)]) == 0
    assert f"tokenizer     {line}\n" in capsys.readouterr().out
    assert main(["models", "inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] == line
    spm = write_spm(tmp_path / "spm.gguf", False)
    assert main(["models", "inspect", str(spm)]) == 0
    spm_tokens = 3 + 256 + len(SPM_PIECES) + 2
    assert f"tokenizer     SentencePiece, {spm_tokens} tokens; no space prefix\n" in capsys.readouterr().out


@pytest.mark.skipif(real_peer() is None, reason="llama.cpp peer not installed (run `make peers`)")
def test_the_default_drafts_real_file_gives_llama_cpps_ids(tmp_path):
    """The real vocabulary (the default draft's Q4_K_M file, where it is pulled): a chat turn, code,
    numbers and a long report excerpt, the same ids as llama.cpp's with the file's own BOS rule."""
    from specextend.models.pull import gguf_file

    path = gguf_file("qwen2.5-coder-0.5b")
    if not path.is_file():
        pytest.skip("the default pair is not pulled (specextend models pull)")
    write_tokenizer(path, tmp_path, None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    report = (Path(__file__).parents[1] / "docs" / "design.md").read_text()[:4000]
    texts = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "def f(n):\n    return n * 12345",
             " Café déjà 東京 2023年 — 99 bottles!", report]
    binary = real_peer().binary.with_name("llama-tokenize")
    for i, text in enumerate(texts):
        text_file = tmp_path / f"t{i}.txt"
        text_file.write_text(text)
        out = subprocess.run([str(binary), "-m", str(path), "-f", str(text_file), "--ids", "--log-disable"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-500:]
        assert tok.encode(text) == json.loads(out.stdout.strip().splitlines()[-1]), text[:60]


@pytest.mark.parametrize("batch", [1, 3])
def test_a_sentencepiece_answer_streams_whole_through_the_detokenizers_window(tmp_path, batch):
    """The streaming detokenizer decodes a window of the last tokens (requests/detokenize.py): on a
    SentencePiece vocabulary, whose decode drops a window's leading "▁", the pieces still add up to
    the whole answer's decode, its spaces included."""
    from specextend.requests.detokenize import Detokenizer

    _, tok = spm_converted(tmp_path, True)
    answer = ids(tok, " hello world  the 12. the world" * 8)
    whole = tok.decode(answer, skip_special_tokens=True)
    pieces: list[str] = []
    d = Detokenizer(lambda i: tok.decode(i, skip_special_tokens=True), pieces.append)
    for at in range(0, len(answer), batch):
        d.push(answer[at:at + batch])
    d.finish(whole)
    assert len(answer) > 4 * Detokenizer.WINDOW and "".join(pieces) == whole and "  " in whole
