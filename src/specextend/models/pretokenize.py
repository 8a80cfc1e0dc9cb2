"""How a GGUF's text becomes its tokens, where transformers' rebuilt tokenizer would differ from
llama.cpp's (and from the model's own tokenizer).

transformers rebuilds a GGUF's tokenizer from its `tokenizer.ggml.*` keys. Its choices differ here:
- A byte-level BPE's split into words before its merges (`tokenizer.ggml.pre`): transformers knows the
  newer names (Llama 3, Qwen 2, GPT-4o, Tekken, ...) and gives every other GPT-2's split. llama.cpp
  splits StarCoder-style vocabularies (Granite, SmolLM, Command R, Refact) digit by digit first, so
  "2024" is four tokens where GPT-2's split lets merges join it; `default`, `falcon` and
  `deepseek-coder` have rules of their own. Each name below is llama.cpp's split, as a sequence of
  `tokenizers` splits (each cuts every piece the last one left into its matches and the text
  between them, as llama.cpp's regex list does). A file naming none gets llama.cpp's `default`.
- Whole words first (`IGNORE_MERGES`): for Llama 3- and Tekken-style vocabularies llama.cpp takes a
  word that is itself a token without merging.
- BOS first where the file does not say (`BOS_BY_DEFAULT`), as llama.cpp does for those vocabularies.
- A SentencePiece vocabulary built as Llama's or Phi-3's: llama.cpp puts its "▁" before every stretch
  of text between special tokens, or none where the file says `add_space_prefix = false`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

# GPT-2's word pattern as llama.cpp writes it (its trailing `\s+` alternative changes nothing
# when the text between matches is kept as pieces).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_RULES: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "digits then gpt2": (r"\p{N}", _GPT2),  # StarCoder's `Digits(individual_digits=True)` first
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}

# `tokenizer.ggml.pre` -> rule, for the names transformers leaves to GPT-2's split.
NAMES: dict[str, str] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-es",
                     "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe", "gigachat",
                     "a.x-4.0", "mellum", "modern-bert"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    "digits then gpt2"),
    "default": "default",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
}

# Where a whole word is a token, llama.cpp takes it without running the merges (as tiktoken does, and
# as these models' `tokenizer.json` say with "ignore_merges"): a merge order need not reach every token.
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "jina-v5-nano", "tekken", "youtu"})

# Where the file does not say (`tokenizer.ggml.add_bos_token`), llama.cpp starts these vocabularies' text
# with the BOS token; transformers' byte-level build never does.
BOS_BY_DEFAULT = IGNORE_MERGES - {"youtu"} | {"chameleon"}

RULES_VERSION = "pre-tokenizer-4"  # in a conversion's marker: folders converted before this are checked


class Vocabulary(NamedTuple):
    """A file's `tokenizer.ggml.*` keys the rules read (None where the file has no such key)."""

    model: str | None = None  # "gpt2" (byte-level BPE) or "llama" (SentencePiece), ...
    pre: str | None = None
    space_prefix: bool | None = None  # add_space_prefix
    add_bos: bool | None = None  # add_bos_token
    bos_id: int | None = None  # bos_token_id


def known_to_transformers(pre: str) -> bool:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return pre in GGUF_PRE_TOKENIZER_SPLITS


def apply(tokenizer: Any, v: Vocabulary) -> str | None:
    """Give a byte-level BPE `tokenizer` (transformers', rebuilt from the GGUF) llama.cpp's split for
    `v.pre`. Returns a notice where the name is unknown (the text is then split as GPT-2 splits it,
    and token ids may differ from llama.cpp's), else None. A SentencePiece vocabulary that transformers
    builds as Llama's gets the space prefix as llama.cpp (and the original Llama 2 and Mistral
    tokenizers) give it: a "▁" before the text and before the text after every special token, or none
    where the file says `tokenizer.ggml.add_space_prefix = false`. transformers puts
    one before the text alone, and whatever the file says: "[INST]hello" lost its "▁hello". The
    vocabularies llama.cpp reads whole words of before merging (`IGNORE_MERGES`) get that too, and
    those it starts with BOS where the file does not say get the BOS."""
    if v.model == "llama":
        _space_prefix(tokenizer, v.space_prefix is not False)
        return None
    if v.model != "gpt2":
        return None
    if v.pre in IGNORE_MERGES:
        tokenizer.backend_tokenizer.model.ignore_merges = True
    if v.add_bos is None and v.pre in BOS_BY_DEFAULT and v.bos_id is not None:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(int(v.bos_id))
        tokenizer.add_bos_token = True
    pre, notice = v.pre, None
    if not pre:  # an old conversion: llama.cpp splits it by its default rule (and warns)
        pre, notice = "default", ("the file names no pre-tokenizer (tokenizer.ggml.pre): its text is split as "
                                  "llama.cpp's default splits it, which may not be how the model's own tokenizer did")
    if known_to_transformers(pre):
        return None
    if pre not in NAMES:
        return (f"tokenizer.ggml.pre {pre!r} is not a pre-tokenizer this version knows: text is split into words "
                "as GPT-2 splits it, so token ids may differ from llama.cpp's")
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _RULES[NAMES[pre]]]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return notice


def describe(tokens: int, v: Vocabulary) -> str:
    """One line on how a file's text becomes its `tokens` tokens (`models inspect`)."""
    model, pre = v.model, v.pre
    if model == "gpt2":
        if not pre:
            return f"byte-level BPE, {tokens:,} tokens; no pre-tokenizer named: words split as llama.cpp's 'default'"
        whole = "; a word that is a token taken whole" if pre in IGNORE_MERGES else ""
        if known_to_transformers(pre) or pre in NAMES:
            return f"byte-level BPE, {tokens:,} tokens; words split as llama.cpp splits {pre!r}{whole}"
        return (f"byte-level BPE, {tokens:,} tokens; pre-tokenizer {pre!r} unknown: words split as GPT-2's "
                "(ids may differ from llama.cpp's)")
    if model == "llama":
        prefix = "no space prefix" if v.space_prefix is False else "a space before each stretch of text"
        return f"SentencePiece, {tokens:,} tokens; {prefix}"
    return f"{model}, {tokens:,} tokens"


def _space_prefix(tokenizer: Any, prefix: bool) -> None:
    """A "▁" before each stretch of text between special tokens (a normalizer runs on each stretch,
    as transformers builds Phi-3's), or before none, the decoder's removal of it with it: for the
    Llama build (a Metaspace) and the Phi-3 build (that normalizer). Gemma's build has no prefix."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    norm = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    if not (_prepends(norm) or isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace)):
        return
    backend.pre_tokenizer = None
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    if prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="\u2581"), backend.normalizer])
    else:
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])


def _prepends(norm: Any) -> bool:
    """Whether a normalizer (its JSON) puts "▁" before each stretch of text: the Phi-3 build's."""
    return isinstance(norm, dict) and norm.get("type") == "Sequence" and \
        any(n.get("type") == "Prepend" for n in norm.get("normalizers", []))


def cut_otherwise(tokenizer_file: Path) -> bool:
    """Whether a saved tokenizer (`tokenizer.json`) may have been cut otherwise than llama.cpp cuts it
    by a conversion from before `RULES_VERSION`: a byte-level BPE with GPT-2's split alone (what
    transformers gives a name it does not know), a SentencePiece with the Llama build's "▁" before the
    text alone or the Phi-3 build's before every stretch (`_space_prefix`: each may not be what the
    file says), or a Llama 3 or Tekken split that always merges. Reads the small parts only: `tokenizers`
    writes them before the vocabulary (a 150K-token one is megabytes of JSON), so the file's head has
    them (else the whole file is read)."""
    model_at, pre_at = re.compile(r'"model":\s*\{\s*"type":\s*"(\w+)"'), re.compile(r'"pre_tokenizer":\s*')
    try:
        with open(tokenizer_file, "rb") as f:
            text = f.read(1 << 16).decode("utf-8", errors="ignore")
            if model_at.search(text) is None:
                text += f.read().decode("utf-8", errors="ignore")
        model, at, norm_at = model_at.search(text), pre_at.search(text), re.search(r'"normalizer":\s*', text)
        if model is None or at is None or model.group(1) != "BPE":
            return False
        pre, _ = json.JSONDecoder().raw_decode(text, at.end())
        norm = json.JSONDecoder().raw_decode(text, norm_at.end())[0] if norm_at else None
    except (OSError, ValueError):
        return False
    if _prepends(norm):
        return True  # the Phi-3 build's prefix, wrong where the file says none
    if not isinstance(pre, dict):
        return False
    gpt2_alone = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is not False
    if gpt2_alone or (pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first"):
        return True
    merges_always = re.search(r'"ignore_merges":\s*false', text[model.end():model.end() + 4096]) is not None
    return merges_always and _split_of(pre) in _ignore_merges_splits()


def _split_of(pre: dict[str, Any]) -> str | None:
    """The regex of a saved `Split` (alone or first in a sequence), or None."""
    first = (pre.get("pretokenizers") or [None])[0] if pre.get("type") == "Sequence" else pre
    if not isinstance(first, dict) or first.get("type") != "Split":
        return None
    pattern = first.get("pattern") or {}
    return pattern.get("Regex")


def _ignore_merges_splits() -> set[str]:
    """The splits transformers gives the `IGNORE_MERGES` names (a conversion before the rules kept
    their merges always: converted again)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return {GGUF_PRE_TOKENIZER_SPLITS[n] for n in IGNORE_MERGES if n in GGUF_PRE_TOKENIZER_SPLITS}
