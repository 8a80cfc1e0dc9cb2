"""A pair's prompts: text and conversations to checked token ids (the chat template, tool
descriptions, the context limit), token ids back to text, and the grammars that constrain an
answer (`response_format`, or a call to one of the request's tools). `api.Prepared` (a pair not
yet loaded) and `api.Pair` both are `Prompts`, so bad input is refused before any weights are
read; nothing here loads a model or decodes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from jinja2 import TemplateError

from ..common.errors import ContextLengthExceeded, FieldError, PromptTooLong, UserError
from ..common.settings import Settings
from ..sampling.grammar import Grammar, GrammarSpec, compile_grammar, tokenizer_for
from ..speculation.decoder import check_fits
from . import callmarkup
from .toolcalls import ToolError, ToolSpec, template_messages

if TYPE_CHECKING:
    from ..models.resolve import ResolvedPair

# A Unicode normalizer (NFC, NFKC) can compose several code points into one before tokenizing
# (a Greek letter with three diacritics: four into one), so the characters of a text it changes
# over-count the normalized ones by up to this factor.
NORMALIZER_SHRINK = 4

_T = TypeVar("_T")


@dataclass(frozen=True)
class TokenRequest:
    """What a request asks of the tokens: its prompt ids, the grammar its answer follows (None:
    free text) and the tools it may call (its calls are parsed into `Result.tool_calls`)."""

    ids: list[int]
    grammar: Grammar | None
    tools: ToolSpec | None


class Prompts:
    """Prompt text <-> token ids and the context limit, shared by a prepared (not yet loaded) pair
    and a loaded one; both hold the pair's resolved description (`spec`)."""

    spec: ResolvedPair

    @property
    def tokenizer(self) -> Any:
        return self.spec.tokenizer

    @property
    def target_path(self) -> Path:
        return self.spec.target.path

    @property
    def draft_path(self) -> Path | None:
        return self.spec.draft.path if self.spec.draft is not None else None

    @property
    def dtype(self) -> str:
        return self.spec.target.dtype

    @property
    def draft_dtype(self) -> str | None:
        return self.spec.draft.dtype if self.spec.draft is not None else None

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def eos_ids(self) -> list[int]:
        return list(self.spec.eos_ids)

    @property
    def context(self) -> int:
        """Longest sequence (prompt + generated) the target accepts."""
        return int(self.spec.target.config.max_position)

    def check_fits(self, prompt_tokens: int, settings: Settings) -> None:
        """The engine's context limit (`engine.check_fits`), checkable before any weights are read."""
        draft_context = int(self.spec.draft.config.max_position) if self.spec.draft is not None else None
        check_fits(prompt_tokens, settings if settings.is_resolved else settings.resolved(), self.context,
                   draft_context, self.spec.target.config.context_note())

    # ----------------------------------------------------------------- text <-> tokens

    def encode(self, prompt: str, chat: bool = False, whole: bool = False) -> list[int]:
        """Prompt token ids; with `chat`, wrapped in the tokenizer's chat template as a user turn.
        `whole`: tokenize a text past the character bound too (a caller that bounds it itself and
        wants the count, such as the page's /v1/tokenize)."""
        if not isinstance(prompt, str):
            raise UserError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not prompt.strip():
            raise UserError("the prompt is empty")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}], whole=whole)
        if not whole:
            self._check_chars(prompt)
        _check_unicode(prompt, "the prompt")
        # verbose=False: our own length check below says it better than transformers' warning.
        ids = [int(i) for i in self.tokenizer.encode(prompt, verbose=False)]
        self._check_ids(ids)
        return ids

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    whole: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids of a conversation ({"role", "content"} dicts; an assistant's
        `tool_calls` and tool results as toolcalls.template_messages makes them) in the
        tokenizer's chat template, ending with the assistant's turn opened; `tools` (OpenAI's
        shape) are described as the template describes them; `whole` as in `encode`;
        `template_kwargs`: more of the template's variables (check_template_kwargs)."""
        check_template_kwargs(template_kwargs)
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer in {self.target_path} has no chat template; send a plain prompt")
        unread = callmarkup.unread(callmarkup.template_of(self.tokenizer))
        if tools and unread is not None:
            raise ToolError(f"this model's chat template shows {unread}, which this server does not read: constrained "
                            "to another family's markup the model would write what it never learned; send the "
                            "request without `tools`", "tools")
        if tools and not self.template_takes_tools():
            raise ToolError(f"this model's chat template does not describe tools (the {self.spec.target.config.arch} "
                            "family has no tool-call format), so the model would never see them offered; send the "
                            "request without `tools`", "tools")
        if "reasoning_effort" in (template_kwargs or {}) and not self.template_reads("reasoning_effort"):
            raise FieldError("this model's chat template takes no reasoning effort (gpt-oss's does); send the "
                             "request without `reasoning_effort` (a thinking model such as Qwen3 takes "
                             'chat_template_kwargs {"enable_thinking": false})', "reasoning_effort")
        # Render to text, then tokenize: the template already holds any special tokens.
        shown, extra = callmarkup.offer(callmarkup.template_of(self.tokenizer), messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False,
                                                      **(template_kwargs or {}), **extra)
        except (TemplateError, TypeError, ValueError) as e:  # its own raise_exception (an order of roles it
            # refuses), or a variable of chat_template_kwargs it cannot use
            raise UserError(f"the chat template cannot render these messages: {str(e).strip()[:300]}") from None
        if not whole:
            self._check_chars(text)
        _check_unicode(text, "a message")
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False, verbose=False)]
        self._check_ids(ids)
        return ids

    def _per_tokenizer(self, key: str, compute: Callable[[], _T]) -> _T:
        """`compute()`, once per tokenizer and key: the probes below cost a render or a pass over the
        vocabulary, and the tokenizer may be replaced (`ResolvedPair.with_own_tokenizer`)."""
        memo = getattr(self, "_memo", None)
        if memo is None or memo[0] is not self.tokenizer:
            memo = (self.tokenizer, {})
            self._memo = memo
        if key not in memo[1]:
            memo[1][key] = compute()
        return memo[1][key]

    def template_takes_tools(self) -> bool:
        """Whether the chat template describes a request's tools: a conversation rendered with a
        tool differs from it rendered without. Templates that have no tool-call format (Gemma's,
        OLMo 2's) ignore them."""
        if not getattr(self.tokenizer, "chat_template", None):
            return False
        probe = [{"type": "function", "function": {"name": "probe_tool", "description": "a probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "hi"}]

        def render(tools: list[dict[str, Any]] | None) -> str | None:
            shown, extra = callmarkup.offer(callmarkup.template_of(self.tokenizer), messages, tools)
            try:
                return self.tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False, **extra)
            except TemplateError:
                return None

        def probe_tools() -> bool:
            with_tools = render(probe)
            return with_tools is not None and "probe_tool" in with_tools and with_tools != render(None)

        return self._per_tokenizer("takes tools", probe_tools)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name`: a conversation rendered with it "low"
        differs from it rendered "high"."""
        messages = [{"role": "user", "content": "hi"}]

        def probe() -> bool:
            try:
                low, high = (self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                                **{name: v}) for v in ("low", "high"))
            except (TemplateError, TypeError, ValueError):  # a template that cannot render a lone question
                return False
            return low != high

        return self._per_tokenizer(f"reads {name}", probe)

    def max_prompt_chars(self) -> int:
        """The most characters a text may have and still fit the context (as the tokenizer's
        normalizer, if any, leaves it): a token stands for at most as many characters as its
        longest vocabulary entry spells (a byte-level entry spells one character per byte, a
        special token its own text), so a longer text is more tokens than the context."""
        def longest() -> int:
            return max((len(t) for t in self.tokenizer.get_vocab()), default=1)

        return self.context * max(1, self._per_tokenizer("longest entry", longest))

    def _check_chars(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens
        (`max_prompt_chars`): tokenizing megabytes would hold the caller for seconds and memory."""
        shrink = _normalized_shrink(self.tokenizer, text)
        if shrink is None:
            return  # a normalizer that may drop characters: only the tokens can tell
        limit = self.max_prompt_chars() * shrink
        if len(text) > limit:
            raise ContextLengthExceeded(
                f"the prompt is {len(text)} characters, more than the {limit} that the target's context of "
                f"{self.context} tokens could hold")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens skipped but the markers an answer's parser reads:
        callmarkup.decode)."""
        return callmarkup.decode(self.tokenizer, token_ids)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("the prompt is empty")
        vocab = int(self.spec.target.config.vocab_size)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the target's vocabulary of {vocab}")
        if len(ids) >= self.context:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens, longer than the target's context of {self.context} tokens",
                len(ids))

    # ----------------------------------------------------------------- structured outputs

    def grammar(self, response_format: Any) -> Grammar | None:
        """The compiled grammar of a `response_format` (see the module's docstring) for this pair's
        tokenizer, None for plain text; UserError (one line) for one that is malformed, does not
        compile or admits nothing. Compiled grammars are cached per grammar and tokenizer."""
        if isinstance(response_format, Grammar):
            return response_format
        spec = GrammarSpec.parse(response_format)
        if spec is None:
            return None
        return compile_grammar(spec, self.tokenizer, int(self.spec.target.config.vocab_size))

    def warm_grammars(self) -> None:
        """Build the grammar engine's view of the tokenizer now (about 1.5 s at 150K tokens, once
        per tokenizer), so that the first constrained request does not wait for it."""
        tokenizer_for(self.tokenizer, int(self.spec.target.config.vocab_size))

    def request(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], chat: bool = False,
                response_format: Any = None, tools: list[dict[str, Any]] | None = None,
                tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                tool_call_recovery: bool | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> TokenRequest:
        """A request's checked prompt ids and the constraint on its answer: the grammar of its
        `response_format`, or of a call to one of its `tools` (OpenAI's `tools`, `tool_choice`
        and `parallel_tool_calls`, toolcalls.py; described in the chat template;
        `tool_call_recovery` false: no bare JSON answer taken for a call). The two
        cannot be combined: a call is constrained to its schema. `chat_template_kwargs`: more of
        the chat template's variables (`encode_chat`)."""
        spec = ToolSpec.parse(tools, tool_choice, parallel_tool_calls, tool_call_recovery)
        ids = self.prompt_ids(prompt, chat, spec, chat_template_kwargs)
        if spec is not None and response_format is not None:
            raise UserError("tools and a response_format cannot be combined (a call is constrained to its schema)")
        grammar = self.grammar(spec.grammar(self.tokenizer) if spec is not None else response_format)
        return TokenRequest(ids, grammar, spec)

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], chat: bool = False,
                   tools: ToolSpec | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Checked token ids of a text prompt (in the chat template with `chat`), of a
        conversation (OpenAI's messages, tool calls and results included) or of token ids (used
        as they are). `tools` are described in the template (a text prompt needs `chat`);
        `template_kwargs`: more of its variables."""
        described = tools.template_tools() if tools else None
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encode_chat(template_messages(prompt), described, template_kwargs=template_kwargs)
        if template_kwargs and not (chat and isinstance(prompt, str)):
            raise UserError("chat_template_kwargs need a chat prompt: chat=True, or a list of messages")
        if isinstance(prompt, str) and (tools is not None or template_kwargs):
            if not chat:
                raise UserError("tools need a chat prompt: chat=True, or a list of messages")
            if not prompt.strip():
                raise UserError("the prompt is empty")
            return self.encode_chat([{"role": "user", "content": prompt}], described, template_kwargs=template_kwargs)
        if isinstance(prompt, str):
            return self.encode(prompt, chat=chat)
        if chat:
            raise UserError("chat=True needs a text prompt, not token ids")
        ids = [int(i) for i in prompt]
        self._check_ids(ids)
        return ids


# The template's variables that the request sets itself (a kwarg may not replace them).
TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation", "documents",
                          "continue_final_message", "return_dict", "chat_template", "tokenizer"})


def check_template_kwargs(kwargs: Any) -> None:
    """A request's extra chat-template variables: an object of names (letters, digits, `_`) to
    JSON values, none of the variables the request sets itself; UserError otherwise."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise UserError("chat_template_kwargs must be an object of template variables")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in TEMPLATE_OWN or name.startswith("_"):
            raise UserError(f"chat_template_kwargs may not set {name!r} (the request sets it)")


def _normalized_shrink(tokenizer: Any, text: str) -> int | None:
    """By how much the tokenizer's normalizer may shorten `text`: 1 without one, or with a Unicode
    normal form (NFC, NFKC) that leaves the text as it is; NORMALIZER_SHRINK where such a form
    changes it; None for any other normalizer (one that strips accents may drop any number)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: its normalization is its own code
    normalizer = backend.normalizer
    if normalizer is None:
        return 1
    form = type(normalizer).__name__
    if form not in ("NFC", "NFKC"):
        return None
    return 1 if unicodedata.is_normalized(form, text) else NORMALIZER_SHRINK


def _check_unicode(text: str, what: str) -> None:
    """A text that is not Unicode (a lone surrogate: JSON's "\\ud800" escape, or a command line's
    undecodable bytes) is refused by name; the tokenizer would fail with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        at = f" at character {e.start}" if what == "the prompt" else ""  # a message's: not the rendered text's
        raise UserError(f"{what} is not valid Unicode: {e.reason} ({text[e.start]!r}{at})") from None
