"""Tool calls in each family's own markup (requests/callmarkup.py): which markup a chat template
shows, each markup's answers parsed into calls whole and streamed alike, and tiny models whose
templates show Granite's and Mistral's lists and Phi-4-mini's blocks (their markers special tokens,
as in those families' files) made to write them by the grammar, read back as calls, speculation equal to
`ar`; and a template that reads the tools from the system message, as Phi-4-mini's own does.

The templates here are written for these tests: each shows the model its earlier calls as that
family's template does, which is all the detection reads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specextend.api import load
from specextend.requests import callmarkup, xmlcalls
from specextend.requests.callmarkup import (
    COHERE,
    FUNCTIONGEMMA,
    GRANITE,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    PHI,
    PYTHONIC,
    QWEN_XML,
    markup_of,
)
from specextend.requests.callparser import CallParser
from specextend.requests.toolcalls import ToolSpec
from test_toolcalls import _accumulate

import loopback as http
from test_serve import SMALL, running
from tiny_tokenizer import EOS, MERGES, SPECIALS, TINY_VOCAB, save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                     "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["seats"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
ASK = [{"role": "user", "content": "Weather in Oslo for two days, and book a seat?"}]

# What each family's template writes after an assistant's turn opens, for its earlier calls.
SHOWN = {
    "hermes": "{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}",
    "granite": "<|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}",
    "phi": "<|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}<|/tool_call|>",
    # Phi-4-mini's own: the tools read from the system message, no calls shown
    "phi-system": "{% if m['role'] == 'system' and m['tools'] %}<|tool|>{{ m['tools'] }}<|/tool|>{% endif %}",
    "mistral": "[TOOL_CALLS][{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}]",
    "mistral-small": "[TOOL_CALLS] [{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}]",
    # FunctionGemma's: not JSON (requests/gemmacalls.py)
    "functiongemma": ("{% for c in m.tool_calls %}<start_function_call>call:{{ c.function.name }}"
                      "{{ c.function.arguments }}<end_function_call>{% endfor %}"),
    # Mistral Small 3.2, Devstral, Magistral: the name outside the JSON
    "mistral-args": ("{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
                     "{{ c.function.arguments | tojson }}{% endfor %}"),
    "llama3": ("{%- set c = m.tool_calls[0].function %}{{- '{\"name\": \"' + c.name + '\", ' }}"
               "{{- '\"parameters\": ' }}{{- c.arguments | tojson }}{{- '}' }}"),
    # Command R7B's: the calls numbered, one a line, under its own keys
    "cohere": ('<|START_ACTION|>[\n{% for c in m.tool_calls %}    {"tool_call_id": "{{ loop.index0 }}", "tool_name": '
               '"{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
               '{% if not loop.last %},\n{% endif %}{% endfor %}\n]<|END_ACTION|>'),
    # Qwen3-Coder's: a function block of parameters inside Hermes's tags, strings as they are, the rest as JSON
    "qwen3-coder": ("{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
                    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
                    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
                    "{% endfor %}"),
    # LFM2's own: the tools listed in the system turn, no calls shown (they are written into the assistant's text)
    "lfm2": ("{% if m['role'] == 'system' and tools %}List of tools: <|tool_list_start|>{{ tools | tojson }}"
             "<|tool_list_end|>{% endif %}"),
    "none": "{{ m.content }}",
}


@pytest.mark.parametrize(("shown", "markup"), [
    ("hermes", HERMES), ("granite", GRANITE), ("phi", PHI), ("phi-system", PHI),
    ("mistral", MISTRAL), ("mistral-small", replace(MISTRAL, lead=" ")), ("mistral-args", MISTRAL_ARGS),
    ("functiongemma", FUNCTIONGEMMA), ("cohere", COHERE), ("qwen3-coder", QWEN_XML), ("lfm2", PYTHONIC),
    ("llama3", LLAMA3), ("none", HERMES)])
def test_the_template_says_which_markup_the_model_writes(shown, markup):
    template = "{% for m in messages %}<|{{ m.role }}|>" + SHOWN[shown] + "<|end|>{% endfor %}"
    assert markup_of(template) == markup
    assert markup_of(None) == HERMES


def test_inspect_describes_the_calls_a_template_asks_for():
    offered = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
    assert callmarkup.describe(offered + SHOWN["granite"] + "{% endfor %}").startswith("Granite's <|tool_call|> list")
    assert callmarkup.describe(offered + SHOWN["llama3"] + "{% endfor %}").startswith("Llama 3's bare JSON call")
    assert callmarkup.describe(offered + SHOWN["cohere"] + "{% endfor %}").startswith(
        "Command R7B's <|START_ACTION|> list")
    assert callmarkup.describe(offered + "{{ m.content }}{% endfor %}").startswith("Hermes's <tool_call> blocks")
    assert callmarkup.describe("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("none: its chat")
    assert callmarkup.describe(None) == "none: the file has no chat template"
    assert "gpt-oss" in callmarkup.describe("{{ tools }}<|channel|>analysis")


A = {"name": "get_weather", "arguments": {"city": "Os]lo,{", "days": 2}}
B = {"name": "book", "arguments": {"seats": ["a"]}}
ANSWERS = {
    "hermes": (HERMES, f"<tool_call>\n{json.dumps(A)}\n</tool_call>\n<tool_call>\n{json.dumps(B)}\n</tool_call>"),
    "phi": (PHI, f"<|tool_call|>{json.dumps([A, B])}<|/tool_call|>"),
    "phi, a block a call": (PHI, f"<|tool_call|>{json.dumps(A)}<|/tool_call|>"
                                 f"<|tool_call|>{json.dumps(B)}<|/tool_call|>"),
    "granite": (GRANITE, f"<|tool_call|>{json.dumps([A, B])}"),
    # Mistral's items carry an id of their own; the list may follow a space
    "mistral": (MISTRAL,
                f'[TOOL_CALLS] [{json.dumps({**A, "id": "a1b2c3d4e"})}, {json.dumps(B)}]'),
    "mistral-args": (MISTRAL_ARGS, f'[TOOL_CALLS]get_weather[ARGS]{json.dumps(A["arguments"])}'
                                   f'[TOOL_CALLS]book[ARGS]{json.dumps(B["arguments"])}'),
    "cohere": (COHERE, callmarkup.written(COHERE, [{"function": A}, {"function": B}])),
    "qwen3-coder": (QWEN_XML, callmarkup.written(QWEN_XML, [{"function": A}, {"function": B}])),
    "lfm2": (PYTHONIC, callmarkup.written(PYTHONIC, [{"function": A}, {"function": B}])),
}


def streamed(p: CallParser, text: str, size: int) -> tuple[str, list[tuple[str, dict]]]:
    deltas = [d for i in range(0, len(text), size) for d in p.push(text[i:i + size])] + p.finish()
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for d in deltas for c in d.get("tool_calls", [])]
    return "".join(d.get("content", "") for d in deltas), calls


def test_llamas_answer_is_one_call_as_bare_json():
    """Llama 3's call is the answer's JSON itself, its arguments under "parameters": read whole and
    streamed alike under `required` as under `auto`; text stays text, a call cut short is dropped."""
    text = json.dumps({"name": "get_weather", "parameters": A["arguments"]})
    for choice in ("required", "auto"):
        spec = ToolSpec.parse([WEATHER, BOOK], choice)
        content, calls = spec.parser(LLAMA3).answer(text)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", A["arguments"])]
        for size in (1, 4):
            assert streamed(spec.parser(LLAMA3), text, size) == ("", [("get_weather", A["arguments"])])
        assert spec.parser(LLAMA3).answer(text[:-3]) == (None, [])
        assert spec.parser(LLAMA3).answer("It is sunny.") == ("It is sunny.", [])


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_markups_calls_are_read_whole_and_streamed_alike(name):
    markup, text = ANSWERS[name]
    content, calls = CallParser(markup=markup).answer(text)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (A["name"], A["arguments"]), (B["name"], B["arguments"])]
    for size in (1, 3, 7):
        assert streamed(CallParser(markup=markup), text, size) == ("", [(A["name"], A["arguments"]),
                                                                          (B["name"], B["arguments"])])
    # cut inside the second call: the first is kept, the second dropped; a repeat ends the answer
    for at in (text.index("book") + 3, text.rindex("\"a\"") + 2):  # in its name, in its arguments
        assert [c["function"]["name"] for c in CallParser(markup=markup).answer(text[:at])[1]] == ["get_weather"]
    again = CallParser(markup=markup)
    repeated = text.replace('"book", "arguments": {"seats": ["a"]}',
                            '"get_weather", "arguments": {"city": "Os]lo,{", "days": 2}').replace(
        f'book[ARGS]{json.dumps(B["arguments"])}', f'get_weather[ARGS]{json.dumps(A["arguments"])}').replace(
        '"tool_name": "book", "parameters": {"seats": ["a"]}',
        '"tool_name": "get_weather", "parameters": {"city": "Os]lo,{", "days": 2}').replace(
        xmlcalls.write("book", B["arguments"]), xmlcalls.write("get_weather", A["arguments"])).replace(
        'book(seats=["a"])', 'get_weather(city="Os]lo,{", days=2)')
    assert repeated != text and len(again.answer(repeated)[1]) == 1
    assert again.ended
    # another family's markup is text
    plain = "Sure: " + text
    assert CallParser(markup=markup).answer(plain) == (plain, [])


def test_a_list_that_is_not_calls_gives_none():
    p = CallParser(markup=GRANITE)
    assert p.answer('<|tool_call|>["not a call"]') == (None, [])
    assert CallParser(markup=GRANITE).answer("<|tool_call|>no list") == (None, [])


def grammar_takes(spec: ToolSpec, tokenizer, text: str) -> bool:
    """Whether the grammar of `spec` on `tokenizer` admits `text` as a whole answer."""
    from specextend.sampling.grammar import compile_grammar

    state = compile_grammar(spec.grammar(tokenizer), tokenizer, len(tokenizer)).start()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if state.valid_prefix(ids) < len(ids):
        return False
    for t in ids:
        state.consume(t)
    return bool(state.accepting)


# --------------------------------------------------------------------------- tiny models writing them


def markup_tokenizer(markers: list[str], shown: str, special: bool = True):
    """The tiny byte-level tokenizer with `markers` as added tokens (ids after TINY_VOCAB's; special,
    or as a GGUF's user-defined tokens, not) and a template that offers the tools and shows earlier
    calls as `SHOWN[shown]`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES] + [EOS]
    tokens = tokens[:-1] + markers + [EOS]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*SPECIALS, *markers, EOS]
                            if special or t not in markers])
    if not special:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    template = ("{% if tools %}<|user|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                "<|endoftext|>{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
                "{% if m.tool_calls %}" + SHOWN[shown] + "{% else %}{{ m['content'] }}{% endif %}<|endoftext|>"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    if shown == "phi-system":  # as Phi-4-mini's own: the tools in the system message, no calls shown
        template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + SHOWN[shown] +
                    "<|endoftext|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    if shown == "lfm2":  # as LFM2's own: the tools listed in a system turn of their own, no calls shown
        template = ("{% if tools %}<|system|>List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>"
                    "<|endoftext|>{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>"
                    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=EOS,
                                   additional_special_tokens=SPECIALS[1:] + (markers if special else []),
                                   chat_template=template)


MARKERS = {"granite": ["<|tool_call|>"], "cohere": ["<|START_ACTION|>", "<|END_ACTION|>"],
           "qwen3-coder": ["<tool_call>", "</tool_call>"],
           "lfm2": ["<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>", "<|tool_list_end|>"],
           "phi": ["<|tool_call|>", "<|/tool_call|>"], "mistral-small": ["[TOOL_CALLS]"],
           "mistral-args": ["[TOOL_CALLS]", "[ARGS]"],
           "functiongemma": ["<start_function_call>", "<end_function_call>", "<escape>"],
           "llama3": [], "phi-system": ["<|tool_call|>", "<|/tool_call|>", "<|tool|>", "<|/tool|>"]}


@pytest.fixture(scope="module", params=sorted(MARKERS))
def family_pair(request, tmp_path_factory):
    markers = MARKERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    vocab = TINY_VOCAB + len(markers)
    tok = markup_tokenizer(markers, request.param)
    room = {"max_position_embeddings": 1024}  # the tools' JSON in the prompt: a byte a token
    folders = {"target": save_tiny_model(root / "target", seed=0, vocab=vocab, tokenizer=tok, **room),
               "draft": save_tiny_model(root / "draft", seed=1, layers=1, vocab=vocab, tokenizer=tok, **room)}
    return request.param, load(folders["target"], folders["draft"], dtype="float64", progress=False), folders


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_are_written_in_the_familys_markup(family_pair, parallel):
    """`required` on a model whose template shows Granite's or Mistral's list, Phi's blocks or Llama's
    bare JSON (or reads the tools from the system message, as Phi-4-mini's): the grammar makes
    the random model write that markup (its markers the tokenizer's special tokens, kept in the
    decoded text), and the answer is the calls, valid for their schemas, the same under speculation."""
    name, pair, _ = family_pair
    markup = callmarkup.markup_for(pair.tokenizer)
    assert markup == {"granite": GRANITE, "phi": PHI, "phi-system": PHI, "mistral-small": markup_of(SHOWN[name]),
                      "mistral-args": MISTRAL_ARGS, "llama3": LLAMA3, "functiongemma": FUNCTIONGEMMA,
                      "cohere": COHERE, "qwen3-coder": QWEN_XML, "lfm2": PYTHONIC}[name]
    runs = {m: pair.generate(ASK, method=m, max_new_tokens=120, tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=parallel, **SMALL) for m in ("ar", "specextend")}
    ar = runs["ar"]
    assert runs["specextend"].token_ids == ar.token_ids
    assert ar.text.startswith(markup.open or '{"name": "') and ar.tool_calls, ar.text
    if markup.open:  # the marker is written as the tokenizer's own token
        assert ar.token_ids[0] == pair.tokenizer.get_added_vocab()[markup.open]
    for call in ar.tool_calls:
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in ("get_weather", "book") and isinstance(args, dict)
    assert len(ar.tool_calls) == 1 or parallel
    # the text read again as the markup says, whole: the calls the generation gave as it streamed
    assert [c["function"] for c in ToolSpec.parse(TOOLS, "required").parser(markup).answer(ar.text)[1]] == [
        c["function"] for c in ar.tool_calls]


def test_the_server_answers_the_familys_calls_streamed_or_not(family_pair):
    """Through the server, streamed and not: the calls of the family's markup as `tool_calls`
    (content null, no marker anywhere), the same as the Python API's."""
    _, pair, folders = family_pair
    want = pair.generate(ASK, method="ar", max_new_tokens=120, tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False, **SMALL).tool_calls
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 120, "method": "specextend", **SMALL}
    with running(pair, folders, max_new_tokens=120) as url:
        whole = http.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        events = []
        with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = _accumulate(events)
    for choice in (whole, streamed):
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [c["function"] for c in want]


def test_a_plain_decode_keeps_only_the_markups_markers():
    tok = markup_tokenizer(["<|tool_call|>", "<|/tool_call|>"], "phi")
    ids = tok.encode("<|user|>x<|tool_call|>{}<|/tool_call|></s>", add_special_tokens=False)
    assert callmarkup.decode(tok, ids) == "x<|tool_call|>{}<|/tool_call|>"
    assert callmarkup.markup_for(tok) == PHI and callmarkup.markup_for(object()) == HERMES
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # shows no Phi markup now
    assert callmarkup.decode(tok, ids) == "x{}"
    assert HARMONY.name == "harmony"


# --------------------------------------------------------------------------- tools read from the system message

CALLED = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_offer_puts_the_tools_where_the_template_reads_them():
    """A template that reads a message's `tools` (Phi-4-mini's) gets the functions as JSON text in
    the system message (one added where the request has none), not the `tools` variable; one that
    reads the variable gets it; earlier calls go into the assistant's text where the template never
    shows `tool_calls`, in its markup, and stay as they are where it does."""
    phi = "{% for m in messages %}" + SHOWN["phi-system"] + "{% endfor %}"
    functions = json.loads(json.dumps([t["function"] for t in TOOLS]))
    shown, extra = callmarkup.offer(phi, ASK, TOOLS)
    assert extra == {} and shown[0] == {"role": "system", "content": callmarkup.TOOLS_SYSTEM,
                                        "tools": json.dumps(functions)} and shown[1:] == ASK
    own = [{"role": "system", "content": "Be brief."}, *ASK]
    shown, _ = callmarkup.offer(phi, own, TOOLS)
    assert shown[0]["content"] == "Be brief." and json.loads(shown[0]["tools"]) == functions and len(shown) == 2
    assert "tools" not in own[0]  # the caller's messages are not changed
    hermes = "{% for m in messages %}" + SHOWN["hermes"] + "{% endfor %}"
    assert callmarkup.offer(hermes, ASK, TOOLS) == (ASK, {"tools": TOOLS})
    assert callmarkup.offer(phi, ASK, None) == (ASK, {})

    from specextend.requests.toolcalls import template_messages
    history = template_messages([*ASK, *CALLED])
    shown, _ = callmarkup.offer(phi, history, TOOLS)
    assert shown[2] == {"role": "assistant", "content": '<|tool_call|>[{"name": "get_weather", "arguments": '
                        '{"city": "Oslo", "days": 2}}]<|/tool_call|>'}
    assert callmarkup.offer(hermes, history, None)[0] == history  # the template writes the calls itself
    assert callmarkup.written(HERMES, history[1]["tool_calls"]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
    assert callmarkup.written(LLAMA3, history[1]["tool_calls"]).startswith('{"name": "get_weather", "parameters": ')


@pytest.mark.parametrize("family_pair", ["phi-system"], indirect=True)
def test_a_template_reading_the_system_messages_tools_shows_them_to_the_model(family_pair):
    """Through the pair's own chat template: the tools are offered (not refused as unseen), between
    <|tool|> and <|/tool|> in the system turn; an earlier call is shown in Phi's list."""
    _, pair, _ = family_pair
    assert pair.template_takes_tools()
    text = pair.tokenizer.decode(pair.encode_chat(ASK, TOOLS))
    assert text.startswith(f"<|system|>{callmarkup.TOOLS_SYSTEM}<|tool|>[{{\"name\": \"get_weather\"")
    assert text.endswith("<|/tool|><|endoftext|><|user|>" + ASK[0]["content"] + "<|endoftext|><|assistant|>")
    from specextend.requests.toolcalls import template_messages
    text = pair.tokenizer.decode(pair.encode_chat(template_messages([*ASK, *CALLED]), TOOLS))
    assert '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]' \
           '<|/tool_call|><|endoftext|><|tool|>sunny' in text
    assert callmarkup.describe(pair.tokenizer.chat_template) == (
        "Phi-4-mini's <|tool_call|> blocks (a call or a list), the tools offered in the system message as its chat "
        "template reads them")


def test_qwen3_coders_blocks_type_each_argument_by_its_schema_and_the_grammar_holds_them():
    """Qwen3-Coder's blocks: a string's text as it is (over lines, with JSON's own characters), other values as JSON
    (Python's True and None read too), a function's unknown name read as the model wrote it; the grammar admits a
    string over lines and refuses one past its maxLength, a number past its bounds, a missing required parameter."""
    spec = ToolSpec.parse(TOOLS, "required")
    block = ('<tool_call>\n<function=get_weather>\n<parameter=city>\n"Os\nlo"\n</parameter>\n<parameter=days>\n2\n'
             '</parameter>\n</function>\n</tool_call>')
    assert spec.parser(QWEN_XML).answer(block)[1][0]["function"] == {
        "name": "get_weather", "arguments": json.dumps({"city": '"Os\nlo"', "days": 2})}
    schemas = {"f": {"properties": {"s": {"type": "string"}, "n": {"type": "integer"}, "o": {"type": "object"}}}}
    text = "<function=f>\n<parameter=s>\n12\n</parameter>\n<parameter=n>\n12\n</parameter>\n<parameter=o>\n" \
           '{"a": [1]}\n</parameter>\n<parameter=x>\nTrue\n</parameter>\n</function>'
    assert xmlcalls.parse(text, schemas) == (("f", {"s": "12", "n": 12, "o": {"a": [1]}, "x": True}), len(text))
    with pytest.raises(xmlcalls.Incomplete):
        xmlcalls.parse(text[:-4], schemas)
    tok = markup_tokenizer(MARKERS["qwen3-coder"], "qwen3-coder")
    ok = block.replace('"Os\nlo"', "Os\nlo")
    assert grammar_takes(spec, tok, ok)
    assert not grammar_takes(spec, tok, ok.replace("Os\nlo", "Oslo, far"))  # maxLength 8
    assert not grammar_takes(spec, tok, ok.replace("\n2\n", "\n9\n"))  # maximum 7
    assert not grammar_takes(spec, tok, ok.replace("<parameter=days>\n2\n</parameter>\n", ""))  # required


def test_lfm2s_python_calls_read_python_literals_and_the_grammar_holds_them():
    """LFM2's list of Python calls: keyword values read as Python's (True, None, quotes either way) or JSON's, a
    positional argument no call; the grammar writes booleans as Python's and refuses a value past its schema or a
    missing required keyword; an earlier call is written into the assistant's text, where its template shows none."""
    from specextend.requests import pycalls

    assert pycalls.parse("f(a='x', b=True, c=None, d=[1, \"y\"], e={\"k\": false})") == (
        "f", {"a": "x", "b": True, "c": None, "d": [1, "y"], "e": {"k": False}})
    assert pycalls.parse("f(1)") is None and pycalls.parse("f(a=g())") is None
    assert pycalls.call_end('get_weather(city="a)b", days=2), book()') == len('get_weather(city="a)b", days=2)')
    flag = {"type": "function", "function": {"name": "flag", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "why": {"type": "string"}}, "required": ["on"]}}}
    spec = ToolSpec.parse([WEATHER, flag], "required")
    tok = markup_tokenizer(MARKERS["lfm2"], "lfm2")
    assert grammar_takes(spec, tok, '<|tool_call_start|>[flag(on=True)]<|tool_call_end|>')
    assert grammar_takes(spec, tok, '<|tool_call_start|>[flag(on=False, why="x")]<|tool_call_end|>')
    assert not grammar_takes(spec, tok, '<|tool_call_start|>[flag(on=true)]<|tool_call_end|>')
    assert not grammar_takes(spec, tok, '<|tool_call_start|>[flag(why="x")]<|tool_call_end|>')
    assert not grammar_takes(spec, tok, '<|tool_call_start|>[get_weather(city="Oslo", days=9)]<|tool_call_end|>')
    assert [c["function"]["name"] for c in spec.parser(PYTHONIC).answer(
        '<|tool_call_start|>[flag(on=True), get_weather(city="Oslo", days=2)]<|tool_call_end|>')[1]] == [
        "flag", "get_weather"]
    earlier = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "flag", "arguments": {"on": True}}}]},
        {"role": "tool", "content": "done"}]
    shown, _ = callmarkup.offer(tok.chat_template, earlier, TOOLS)
    assert shown[1]["content"] == "<|tool_call_start|>[flag(on=True)]<|tool_call_end|>"
