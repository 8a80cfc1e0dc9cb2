"""The markup a model writes its tool calls in, read from its own chat template.

Each family's template shows the model its earlier calls in the form it was trained to write them,
so the template's text says which form to expect and to constrain (as llama.cpp's server tells
them apart): Hermes's blocks (Qwen 2.5 and 3, SmolLM3, and the default where a template shows
none), one JSON object a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Phi-4-mini's blocks, `<|tool_call|>...<|/tool_call|>`, each a call or a JSON list of calls (the
model writes both; Ollama's template shows it the list); or one JSON list of every call after a
single opener, which ends the answer: Granite 3's `<|tool_call|>[{...}, ...]` and Mistral's
`[TOOL_CALLS][{...}, ...]` (`[TOOL_CALLS] [` where the template writes a space), and Command R7B's
`<|START_ACTION|>[` one call a line `]<|END_ACTION|>`, each call numbered by the model and its name
and arguments under keys of its own (`{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}`); Mistral's later
calls, the name outside the JSON, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` a call (Mistral
Small 3.2, Devstral, Magistral: templates that write `[ARGS]`); or Llama 3.x's
answer that is one call as bare JSON, `{"name": "get_weather", "parameters": {...}}`. FunctionGemma's
calls are not JSON (gemmacalls.py), nor are Qwen3-Coder's, `<function=NAME>` blocks of `<parameter=KEY>`
inside Hermes's tags (xmlcalls.py), nor LFM2's, a Python list of calls with keyword arguments between
`<|tool_call_start|>` and `<|tool_call_end|>` (pycalls.py; its template lists the tools between
`<|tool_list_start|>` and `<|tool_list_end|>` and shows no calls: the earlier ones are written into
the assistant's text); gpt-oss writes calls as harmony messages (harmony.py).

Phi-4-mini's own template reads the tools from the system message's `tools` field (JSON text,
between `<|tool|>` and `<|/tool|>`) rather than from the template's `tools` variable, and shows no
earlier calls: `offer` puts the tools where a template reads them and writes earlier calls into
the assistant's text, in the markup, where the template would drop them.

Markers the tokenizer holds as special tokens (Granite's, Mistral's) are skipped by a plain decode;
`decode` keeps them, as it keeps harmony's and a thought's (reasoning.py), for the parser that
reads them (and removes them).
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from . import gemmacalls, harmony, pycalls, reasoning, xmlcalls


@dataclass(frozen=True)
class CallMarkup:
    """How calls are written: `open` before each call (`listed`: once, before a JSON list of them
    all), `close` after it ("" for a list, which ends the answer); `lead` between the opener and
    the JSON, `trail` between the JSON and the closer, `sep` between two blocks: what the grammar
    writes (the parser also takes other whitespace there). No opener: the answer is one call as
    bare JSON, its arguments under `key`. `title`: how `models inspect` names it."""

    name: str
    title: str
    open: str
    close: str = ""
    listed: bool = False
    lead: str = ""
    trail: str = ""
    sep: str = ""
    key: str = "arguments"
    lists: bool = False  # a block may hold a JSON list of calls (Phi-4-mini writes either)
    args: str = ""  # between the function's name and its arguments: a block is open NAME args {...}
    gemma: bool = False  # a block is open lead NAME{...} in FunctionGemma's syntax (gemmacalls.py), not JSON
    xml: bool = False  # a block holds a <function=NAME> of <parameter=KEY> values (xmlcalls.py), not JSON
    python: bool = False  # a listed markup's items are Python calls, NAME(key=value, ...) (pycalls.py), not JSON
    name_key: str = "name"  # the call's JSON names its function under it
    id_key: str = ""  # the call's JSON opens with an id the model numbers under it ("0", "1", ...; Command R7B's)
    items: tuple[str, str, str] = ("[", ", ", "]")  # a listed markup's list as written: its start, separator and end

    @property
    def bare(self) -> bool:
        return not self.open

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.open, self.close, self.args, gemmacalls.ESCAPE if self.gemma else "") if m)


HERMES = CallMarkup("hermes", "Hermes's <tool_call> blocks", "<tool_call>", "</tool_call>", lead="\n", trail="\n",
                    sep="\n")
PHI = CallMarkup("phi", "Phi-4-mini's <|tool_call|> blocks (a call or a list)", "<|tool_call|>", "<|/tool_call|>",
                 lists=True)
GRANITE = CallMarkup("granite", "Granite's <|tool_call|> list", "<|tool_call|>", listed=True)
MISTRAL = CallMarkup("mistral", "Mistral's [TOOL_CALLS] list", "[TOOL_CALLS]", listed=True)
MISTRAL_ARGS = CallMarkup("mistral-args", "Mistral's [TOOL_CALLS]name[ARGS] calls", "[TOOL_CALLS]", args="[ARGS]")
LLAMA3 = CallMarkup("llama3", 'Llama 3\'s bare JSON call ("parameters")', "", key="parameters")
FUNCTIONGEMMA = CallMarkup("functiongemma", "FunctionGemma's <start_function_call> calls", "<start_function_call>",
                           "<end_function_call>", lead="call:", gemma=True)
QWEN_XML = CallMarkup("qwen3-coder", "Qwen3-Coder's <function=NAME> blocks in <tool_call>", "<tool_call>",
                      "</tool_call>", lead="\n", trail="\n", sep="\n", xml=True)
PYTHONIC = CallMarkup("lfm2", "LFM2's Pythonic <|tool_call_start|> list", "<|tool_call_start|>", "<|tool_call_end|>",
                      listed=True, python=True)
LFM2_TOOLS = "<|tool_list_start|>"  # where LFM2's template lists the tools (it shows no calls)
COHERE = CallMarkup("cohere", "Command R7B's <|START_ACTION|> list", "<|START_ACTION|>", "<|END_ACTION|>", listed=True,
                    key="parameters", name_key="tool_name", id_key="tool_call_id", items=("[\n    ", ",\n    ", "\n]"))
MARKUPS = (HERMES, PHI, GRANITE, MISTRAL, MISTRAL_ARGS, LLAMA3, FUNCTIONGEMMA, COHERE, QWEN_XML, PYTHONIC)
PHI_TOOLS = "<|tool|>"  # where Phi-4-mini's template writes the system message's tools
# A template that reads a message's `tools` field (message['tools'], message.tools), not the variable
MESSAGE_TOOLS = re.compile(r"""\w\[\s*['"]tools['"]\s*\]|\w\.tools\b""")
# gpt-oss: calls are messages (harmony.py), not this markup
HARMONY = CallMarkup("harmony", "harmony messages to functions.NAME (gpt-oss)", harmony.CHANNEL_MARK)


# Call formats a template may show that no markup here reads, by a marker its text holds (checked before the
# markups: GLM-4.5's XML arguments sit inside Hermes's own <tool_call> tags): such a model is refused tools in one
# line, where constraining it to another family's markup would make it write what it never learned.
UNREAD = (("<arg_key>", "GLM-4.5's XML calls (<arg_key>, <arg_value>)"),
          ("<|tool_calls_section_begin|>", "Kimi's <|tool_calls_section_begin|> calls"),
          ("tool▁calls▁begin", "DeepSeek's <｜tool▁calls▁begin｜> calls"),
          ("<seed:tool_call>", "Seed-OSS's <seed:tool_call> calls"))


def unread(template: str | None) -> str | None:
    """The call format a chat template shows that no markup here reads (its name), or None."""
    return next((name for marker, name in UNREAD if template is not None and marker in template), None)


def markup_of(template: str | None) -> CallMarkup:
    """The markup a chat template's text writes an assistant's calls in (Hermes's where it shows
    none of the others)."""
    text = template or ""
    if HERMES.open in text:
        return QWEN_XML if "<function=" in text else HERMES
    if FUNCTIONGEMMA.open in text:
        return FUNCTIONGEMMA
    if COHERE.open in text:
        return COHERE
    if PYTHONIC.open in text or LFM2_TOOLS in text:
        return PYTHONIC
    if MISTRAL_ARGS.args in text:  # Mistral's v11 templates and later (Small 3.2, Devstral, Magistral)
        return MISTRAL_ARGS
    if MISTRAL.open in text:
        return replace(MISTRAL, lead=" ") if f"{MISTRAL.open} [" in text else MISTRAL
    if GRANITE.open in text:
        return PHI if PHI.close in text else GRANITE
    if PHI_TOOLS in text:  # Phi-4-mini's own template: it offers tools, shows no calls
        return PHI
    if '"parameters": ' in text:  # Llama 3.x writes a call's JSON itself, this key a literal
        return LLAMA3
    return HERMES


def describe(template: str | None) -> str:
    """One line on the tool calls a chat template's text asks for (`models inspect`). A template
    that never names `tools` cannot show them to the model: such a model is refused them."""
    if not template:
        return "none: the file has no chat template"
    if harmony.CHANNEL_MARK in template:
        return HARMONY.title
    if "tools" not in template:
        return "none: its chat template does not describe tools (a request with tools is refused)"
    if unread(template) is not None:
        return f"none: its chat template shows {unread(template)}, which are not read here (a request with tools " \
               "is refused)"
    if MESSAGE_TOOLS.search(template):
        return f"{markup_of(template).title}, the tools offered in the system message as its chat template reads them"
    return f"{markup_of(template).title}, as its chat template writes them"


def markup_for(tokenizer: Any) -> CallMarkup:
    """The markup of `tokenizer`'s chat template (a Hugging Face tokenizer's `chat_template`, text
    or a dict of named templates, whose default one is read); HARMONY for gpt-oss's tokenizer."""
    if harmony.is_harmony(tokenizer):
        return HARMONY
    return markup_of(template_of(tokenizer))


def template_of(tokenizer: Any) -> str | None:
    """A tokenizer's chat template text: its `chat_template`, or of a dict of named templates the
    default one (as `apply_chat_template` picks it)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


# The system message given where a request has none and the template reads the tools from it
# (the wording of Phi-4-mini's model card).
TOOLS_SYSTEM = "You are a helpful assistant with some tools."


def offer(template: str | None, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
          ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables that show a model `tools` (OpenAI's shape) and its
    earlier calls as its template reads them: the `tools` variable, or (a template that reads a
    message's `tools`, Phi-4-mini's) the functions as JSON text in the first system message, one
    added if there is none; an assistant's `tool_calls` (as toolcalls.template_messages makes
    them) written into its text in the markup where the template never shows `tool_calls`."""
    text = template or ""
    out = [dict(m) for m in messages]
    if "tool_calls" not in text and harmony.CHANNEL_MARK not in text:
        markup = markup_of(text)
        for m in out:
            if m.get("tool_calls"):
                m["content"] = (m.get("content") or "") + written(markup, m.pop("tool_calls"))
    if not tools:
        return out, {}
    if not MESSAGE_TOOLS.search(text):
        return out, {"tools": list(tools)}
    functions = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
    system = next((m for m in out if m.get("role") == "system"), None)
    if system is None:
        system = {"role": "system", "content": TOOLS_SYSTEM}
        out.insert(0, system)
    system["tools"] = functions
    return out, {}


def written(markup: CallMarkup, calls: Sequence[dict[str, Any]]) -> str:
    """Calls ({"function": {"name", "arguments"}}, the arguments an object) as `markup` writes them."""
    if markup.xml:
        blocks = [xmlcalls.write(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return markup.sep.join(f"{markup.open}{markup.lead}{b}{markup.trail}{markup.close}" for b in blocks)
    if markup.args or markup.gemma:  # the name outside the arguments
        value = gemmacalls.write if markup.gemma else partial(json.dumps, ensure_ascii=False)
        return "".join(f"{markup.open}{markup.lead}{c['function']['name']}{markup.args}"
                       f"{value(c['function']['arguments'])}{markup.close}" for c in calls)
    items = [pycalls.write(c["function"]["name"], c["function"]["arguments"]) if markup.python else
             json.dumps({**({markup.id_key: str(i)} if markup.id_key else {}), markup.name_key: c["function"]["name"],
                         markup.key: c["function"]["arguments"]}, ensure_ascii=False) for i, c in enumerate(calls)]
    if markup.bare:
        return items[0] if items else ""
    if markup.listed:
        start, sep, end = markup.items
        return f"{markup.open}{markup.lead}{start}{sep.join(items)}{end}{markup.trail}{markup.close}"
    if markup.lists:
        return f"{markup.open}{markup.lead}[{', '.join(items)}]{markup.trail}{markup.close}"
    return markup.sep.join(f"{markup.open}{markup.lead}{i}{markup.trail}{markup.close}" for i in items)


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of generated token ids: special tokens skipped, except the markers an answer's
    parser reads (harmony's, or the call markup's where they are special tokens)."""
    ids = list(token_ids)
    keep, special = _kept(tokenizer)
    if not keep:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return tokenizer.decode([i for i in ids if i in keep or i not in special], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


# A tokenizer's kept markers and special ids, worked out once (decode runs at every streamed piece, and
# a vocabulary may hold thousands of added tokens); asked again if its template or size changes.
_KEPT: weakref.WeakKeyDictionary[Any, tuple[Any, int, frozenset[int], frozenset[int]]] = weakref.WeakKeyDictionary()


def _kept(tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    """The ids `decode` keeps (the markup's markers that are special tokens) and the special ids."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        size = len(tokenizer)  # its vocabulary with the added tokens
    except TypeError:
        size = -1
    try:
        known = _KEPT.get(tokenizer)
    except TypeError:  # not weakly referable: worked out each time
        known = None
    if known is not None and known[0] is template and known[1] == size:
        return known[2], known[3]
    markup = markup_for(tokenizer)
    markers = harmony.MARKERS if markup is HARMONY else markup.markers
    markers = (*markers, *(reasoning.markers_of(template_of(tokenizer)) or ()))  # a thought's, for ThinkParser
    special = frozenset(special_ids(tokenizer))
    keep = frozenset(i for i in (_added(tokenizer).get(m) for m in markers) if i in special)
    with contextlib.suppress(TypeError):
        _KEPT[tokenizer] = (template, size, keep, special)
    return keep, special


def special_ids(tokenizer: Any) -> set[int]:
    """The ids a decode that skips special tokens leaves out: the named ones and every added token
    marked special (a GGUF's control tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(i)
    return ids


def _added(tokenizer: Any) -> dict[str, int]:
    try:
        return dict(tokenizer.get_added_vocab())
    except (AttributeError, TypeError):
        return {}
