"""Grammars that constrain what a generation may say: JSON (any object, or one schema), a regular
expression, or a Lark / GBNF grammar, compiled by llguidance for a tokenizer.

`compile_grammar` turns a request's `response_format` into a `Grammar` (compiled once per grammar
text and tokenizer, then served from a small cache); `Grammar.start` gives a request its own
`GrammarState`, the matcher that follows the tokens generated so far. A state can consume tokens
and roll them back, which is how one state walks every node of a speculative tree (logits_process.py).

JSON is compiled with fixed separators (", " and ": ", as `json.dumps` writes them) and no
optional whitespace: then the grammar itself forces the keys of a schema and its punctuation, and
those forced tokens are free proposals for speculation. Whatever the rule, `ar` and the
speculative methods decode under the same grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..common.errors import UserError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "grammar")
CACHE_SIZE = 64  # compiled grammars kept (per process), least recently used dropped first
FORCED_MAX = 16  # forced tokens proposed per step, at most

_lock = threading.Lock()  # guards both caches and the template matchers (deep-copied across threads)
_tokenizers: dict[tuple[str, int], Any] = {}
_compiled: OrderedDict[tuple[str, int, str], Any] = OrderedDict()


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover - a pinned main dependency
        raise UserError("structured outputs need llguidance: pip install -e . (it is a pinned dependency)") from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to, as a request states it: `kind` one of GRAMMAR_KINDS, `text` the JSON
    schema (serialised), the regular expression or the grammar (Lark or GBNF)."""

    kind: str
    text: str = ""

    @classmethod
    def parse(cls, response_format: Any) -> GrammarSpec | None:
        """A spec from an OpenAI-style `response_format` (a dict, or the kind's name for
        json_object/text), or None for plain text; UserError naming what is wrong otherwise.

        Accepted: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}, "strict": ...}}, and the extensions {"type": "regex",
        "regex": "..."} and {"type": "grammar", "grammar": "..."} (Lark or GBNF)."""
        if response_format is None or response_format == "text":
            return None
        if isinstance(response_format, GrammarSpec):
            return response_format
        if response_format == "json_object":
            response_format = {"type": "json_object"}
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise UserError('response_format must be an object with a "type" (text, json_object, json_schema, '
                            'regex or grammar)')
        kind = response_format["type"]
        extra = set(response_format) - {"type", {"json_object": "", "text": ""}.get(kind, kind)}
        if kind not in ("text", *GRAMMAR_KINDS):
            raise UserError(f"response_format type {kind!r} is not one of text, {', '.join(GRAMMAR_KINDS)}")
        if extra:
            raise UserError(f"response_format of type {kind} has an unknown field {sorted(extra)[0]!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", json.dumps({"type": "object"}))
        value = response_format.get(kind)
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise UserError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
            unknown = set(value) - {"name", "schema", "strict", "description"}
            if unknown:
                raise UserError(f"response_format.json_schema has an unknown field {sorted(unknown)[0]!r}")
            schema = value.get("schema", {})
            if not isinstance(schema, dict | bool):
                raise UserError("response_format.json_schema.schema must be a JSON schema object")
            return cls("json_schema", json.dumps(schema, sort_keys=False))
        if not isinstance(value, str) or (kind == "grammar" and not value.strip()):
            raise UserError(f'response_format of type {kind} needs "{kind}": a non-empty string')
        return cls(kind, value)

    def llguidance_grammar(self) -> str:
        lg = _llguidance()
        if self.kind in ("json_object", "json_schema"):
            try:
                return lg.LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)
            except ValueError as e:
                raise UserError(f"the JSON schema cannot be compiled: {e}") from None
        if self.kind == "regex":
            return lg.LLMatcher.grammar_from_regex(self.text)
        try:
            return lg.grammar_from("grammar", self.text)
        except ValueError as e:
            raise UserError(f"the grammar cannot be read: {_first_line(str(e))}") from None


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"


def _tokenizer_key(hf_tokenizer: Any, vocab: int) -> tuple[str, int]:
    # By the folder it was read from: the server's two copies of one tokenizer (one per thread)
    # share their compiled grammars. A tokenizer made in memory is known by its object.
    name = getattr(hf_tokenizer, "name_or_path", "") or f"object:{id(hf_tokenizer)}"
    return name, vocab


def tokenizer_for(hf_tokenizer: Any, vocab: int) -> Any:
    """llguidance's view of a (fast) Hugging Face tokenizer, with the model's vocabulary size
    (which may exceed the tokenizer's: padding rows that no grammar allows). Built once (about a
    second at 150K tokens) per tokenizer."""
    lg = _llguidance()
    key = _tokenizer_key(hf_tokenizer, vocab)
    with _lock:
        tok = _tokenizers.get(key)
    if tok is None:
        try:
            tok = lg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        except ValueError as e:
            raise UserError(f"structured outputs need a fast tokenizer: {e}") from None
        with _lock:
            _tokenizers[key] = tok
    return tok


def compile_grammar(spec: GrammarSpec, hf_tokenizer: Any, vocab: int) -> Grammar:
    """The compiled grammar of `spec` for this tokenizer, from the cache when compiled before.
    UserError (one line) if it does not compile, or if it admits no output at all."""
    lg = _llguidance()
    tok = tokenizer_for(hf_tokenizer, vocab)
    key = (*_tokenizer_key(hf_tokenizer, vocab), f"{spec.kind}\0{spec.text}")
    with _lock:
        template = _compiled.get(key)
        if template is not None:
            _compiled.move_to_end(key)
            return Grammar(spec, template, tok, vocab)
    text = spec.llguidance_grammar()
    template = lg.LLMatcher(tok, text, log_level=0)
    if template.is_error():
        raise UserError(f"the {_what(spec)} cannot be compiled: {_first_line(template.get_error())}")
    grammar = Grammar(spec, template, tok, vocab)
    state = grammar.start()
    first = state.allowed()  # computing the first mask is what finds a grammar without a way in
    if first is not None:
        first = first.clone()
        first[grammar.eos] = False
    if not state.accepting and (first is None or not bool(first.any())):
        raise UserError(f"the {_what(spec)} admits no output")
    with _lock:
        _compiled[key] = template
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    return grammar


def _what(spec: GrammarSpec) -> str:
    return {"json_object": "JSON grammar", "json_schema": "JSON schema", "regex": "regular expression"}.get(
        spec.kind, "grammar")


class Grammar:
    """A compiled grammar for one tokenizer; `start` gives each generation its own state."""

    def __init__(self, spec: GrammarSpec, template: Any, tokenizer: Any, vocab: int) -> None:
        self.spec, self._template, self.tokenizer, self.vocab = spec, template, tokenizer, vocab
        self.eos = int(tokenizer.eos_token)

    def start(self) -> GrammarState:
        with _lock:
            matcher = self._template.deep_copy()
        return GrammarState(matcher, self.vocab, self.eos)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens: their text)."""
        return bytes(self.tokenizer.decode_bytes([token]))


class GrammarState:
    """One generation's place in a grammar: which tokens may come next, consume and roll back.

    The state follows the tokens consumed so far; a speculative tree is walked by consuming a
    node's token, reading the state there and rolling it back (llguidance keeps the history)."""

    def __init__(self, matcher: Any, vocab: int, eos: int) -> None:
        self.m, self.vocab, self.eos = matcher, vocab, eos

    def allowed(self) -> torch.Tensor | None:
        """[vocab] bool: the tokens the grammar admits next (the end-of-sequence token once it is
        complete); None if it admits none (after an error)."""
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        if not bits.any():
            return None
        # llguidance's bitmask is little-endian within each byte; unpacking it is ~10 us at 150K.
        return torch.from_numpy(np.unpackbits(bits, bitorder="little").view(np.bool_))[: self.vocab]

    def consume(self, token: int) -> bool:
        """Advance by one token the grammar admits (check `allowed` first: a token it does not
        admit leaves the matcher in an error state for good)."""
        return bool(self.m.consume_token(token))

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar state: cannot roll back {n} tokens")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar admits from here (the state is unchanged)."""
        return int(self.m.validate_tokens(tokens)) if tokens else 0

    def forced(self, limit: int = FORCED_MAX) -> list[int]:
        """The tokens the grammar forces from here (a fixed key, closing punctuation), at most `limit`."""
        return [int(t) for t in self.m.compute_ff_tokens()[:limit]]

    @property
    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    @property
    def stopped(self) -> bool:
        """Complete: nothing but the end-of-sequence token may follow (or an error)."""
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str:
        return str(self.m.get_error()) if self.m.is_error() else ""
