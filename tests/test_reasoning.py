"""A thinking model's `<think>` block kept apart from its answer (requests/reasoning.py): the parser
streamed and whole alike, a call made after thinking read as a call, the tool grammar letting the
model think first, and the server's `reasoning_content` on tiny models whose templates think.

The templates here are written for these tests: they name `</think>` as Qwen3's and SmolLM3's do,
and one opens the block in its generation prompt as DeepSeek-R1's does."""

from __future__ import annotations

import json

import pytest

from specextend.api import load
from specextend.requests import callmarkup, reasoning
from specextend.requests.callmarkup import HERMES
from specextend.requests.callparser import CallParser
from specextend.requests.reasoning import ThinkParser
from specextend.requests.toolcalls import ToolSpec, answer_parser
from test_callmarkup import TOOLS, grammar_takes, markup_tokenizer
from test_toolcalls import _accumulate

import loopback as http
from test_serve import SMALL, running
from tiny_tokenizer import TINY_VOCAB, save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

CALL = {"name": "book", "arguments": {"seats": ["a"]}}
THOUGHT = "The user wants a seat.\nI should book one."
ANSWERS = {  # name: (text, opened, reasoning, content, calls)
    "thought, then a call": (f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>",
                             False, THOUGHT + "\n", None, [CALL]),
    "thought, then text": (f"<think>{THOUGHT}</think>\n\nBooked.", False, THOUGHT, "Booked.", []),
    "no thought": ("Booked, <think> is a tag.", False, None, "Booked, <think> is a tag.", []),
    "an empty thought": ("<think>\n\n</think>\n\nBooked.", False, None, "Booked.", []),
    "opened by the prompt": (f"{THOUGHT}</think>\nBooked.", True, THOUGHT, "Booked.", []),
    "cut in the thought": (f"<think>\n{THOUGHT}</thi", False, THOUGHT + "</thi", None, []),
}


def _read(parser: ThinkParser, text: str, size: int) -> tuple[str | None, str | None, list[dict]]:
    deltas = [d for i in range(0, len(text), size) for d in parser.push(text[i:i + size])] + parser.finish()
    thought = "".join(d.get("reasoning_content", "") for d in deltas) or None
    content = "".join(d.get("content", "") for d in deltas) or None
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for d in deltas for c in d.get("tool_calls", [])]
    return thought, content, calls


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_thought_is_reasoning_and_the_rest_the_answer_whole_or_streamed(name):
    text, opened, thought, content, calls = ANSWERS[name]
    spec = ToolSpec.parse(TOOLS, "auto")
    whole = ThinkParser(spec.parser(HERMES), opened)
    got, got_calls = whole.answer(text)
    assert whole.reasoning == thought
    assert (got or None, [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                          for c in got_calls]) == (content, calls)
    assert whole.finish_reason("stop") == ("tool_calls" if calls else "stop")
    for size in (1, 3, 7):
        assert _read(ThinkParser(spec.parser(HERMES), opened), text, size) == (thought, content, calls)
    if not calls:  # without tools: the same split, the answer its text
        plain = ThinkParser(None, opened)
        assert plain.answer(text) == (content, None) and plain.reasoning == thought
        assert _read(ThinkParser(None, opened), text, 2) == (thought, content, [])


def test_without_a_thought_block_the_call_parser_alone_would_miss_the_call():
    text = ANSWERS["thought, then a call"][0]
    assert CallParser(markup=HERMES).answer(text) == (text, [])  # what a thinking model got before


def test_inspect_says_where_a_model_reasons():
    assert reasoning.describe(thinking_tokenizer(False).chat_template) == (
        "<think> blocks, answered as reasoning_content")
    assert reasoning.describe("{{ messages }}<|channel|>analysis").startswith("harmony's analysis channel")
    assert reasoning.describe("{{ messages }}") == "none: its chat template shows no thinking"
    assert reasoning.describe(None) == "none: the file has no chat template"


def thinking_tokenizer(opened: bool, markers: str = "special"):
    """The tiny tokenizer with <think> and </think> as its own tokens ("special", or "added" as
    Qwen3's user-defined ones) or as plain "text", a template that drops earlier thoughts by naming
    </think>, Hermes's calls; `opened`: its generation prompt opens the block."""
    tok = markup_tokenizer([] if markers == "text" else [reasoning.OPEN, reasoning.CLOSE], "hermes",
                           markers == "special")
    tok.chat_template = (
        "{% if tools %}<|user|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|endoftext|>"
        "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}{% else %}"
        "{{ m['content'].split('</think>')[-1] }}{% endif %}<|endoftext|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>" + ("<think>\n" if opened else "") +
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    return tok


@pytest.mark.parametrize(("opened", "markers"), [(False, "special"), (True, "special"), (False, "added"),
                                                  (False, "text"), (True, "text")])
def test_the_tool_grammar_lets_a_thinking_model_think_before_it_calls(opened, markers):
    """`auto` and `required`: a thought (its markers the tokenizer's tokens, special or not, or
    text), then the call, is an answer the grammar takes whole, as is a thought then text; without
    the thinking template the same answer is refused at the call's opener (`auto`'s free text may
    not hold it)."""
    tok = thinking_tokenizer(opened, markers)
    assert reasoning.markers_of(tok.chat_template) == ("<think>", "</think>") and reasoning.opens(tok) == opened
    call = "<tool_call>\n" + json.dumps(CALL, separators=(", ", ": ")) + "\n</tool_call>"
    answer = ("" if opened else "<think>") + "plan</think>\n\n" + call

    for choice in ("auto", "required"):
        spec = ToolSpec.parse(TOOLS, choice)
        assert grammar_takes(spec, tok, answer), choice
        assert callmarkup.decode(tok, tok.encode(answer, add_special_tokens=False)) == answer  # markers kept
    answer = answer.replace(call, "Booked, thanks.")
    assert grammar_takes(ToolSpec.parse(TOOLS, "auto"), tok, answer)
    if not opened:
        answer = answer.replace("Booked, thanks.", call)
        plain = markup_tokenizer([reasoning.OPEN, reasoning.CLOSE], "hermes", markers == "special")
        assert reasoning.markers_of(plain.chat_template) is None
        assert not grammar_takes(ToolSpec.parse(TOOLS, "auto"), plain, answer)


@pytest.fixture(scope="module", params=[False, True], ids=["thinks", "opened"])
def thinking_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    tok = thinking_tokenizer(request.param)
    vocab = TINY_VOCAB + 2
    folders = {"target": save_tiny_model(root / "target", seed=0, vocab=vocab, tokenizer=tok),
               "draft": save_tiny_model(root / "draft", seed=1, layers=1, vocab=vocab, tokenizer=tok)}
    return request.param, load(folders["target"], folders["draft"], dtype="float64", progress=False), folders


ASK = [{"role": "user", "content": "Book a seat?"}]


def test_the_server_sends_the_thought_as_reasoning_content(thinking_pair):
    """Through the server, streamed and not, with tools (`required`) and without: the answer
    split as ThinkParser splits the Python API's text (a prompt that opened the block: all of a
    short answer is thought, content null), the calls the API's, `specextend` equal to `ar`."""
    opened, pair, folders = thinking_pair
    cases = [({}, 12), ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, 120)]
    with running(pair, folders, max_new_tokens=120) as url:
        for extra, n in cases:
            tools = ToolSpec.parse(extra["tools"], "required", False) if extra else None
            ar = pair.generate(ASK, method="ar", max_new_tokens=n, **SMALL, **extra)
            assert pair.generate(ASK, method="specextend", max_new_tokens=n, **SMALL, **extra).token_ids == ar.token_ids
            parser = answer_parser(pair.tokenizer, tools)
            assert isinstance(parser, ThinkParser)
            content, calls = parser.answer(ar.text)
            if opened and not extra:
                assert content is None and parser.reasoning == ar.text.lstrip()
            if extra:
                assert [c["function"] for c in calls] == [c["function"] for c in ar.tool_calls]
            body = {"messages": ASK, "max_tokens": n, "method": "specextend", **SMALL, **extra}
            whole = http.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
            with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            streamed = _accumulate(events)
            thought = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events)
            streamed["message"]["reasoning_content"] = thought or None
            for choice in (whole, streamed):
                message = choice["message"]
                assert message["content"] == content and message.get("reasoning_content") == parser.reasoning
                assert [c["function"] for c in message.get("tool_calls") or []] == [
                    c["function"] for c in calls or []]


@pytest.mark.parametrize("thinking_pair", [False], indirect=True, ids=["thinks"])
def test_chat_template_kwargs_reach_the_template(thinking_pair):
    """`chat_template_kwargs` (vLLM's and llama.cpp's field): {"enable_thinking": false} renders the
    template's empty thought into the prompt, as Qwen3's does; a variable the request sets itself,
    a name that is not one, or no object at all is a 400 naming the field."""
    _, pair, folders = thinking_pair
    body = {"messages": ASK, "max_tokens": 2, **SMALL}
    thinking = pair.encode_chat(ASK)
    quiet = pair.encode_chat(ASK, template_kwargs={"enable_thinking": False})
    assert pair.tokenizer.decode(quiet[len(thinking):]) == "<think>\n\n</think>\n\n"
    with running(pair, folders, max_new_tokens=8) as url:
        use = [http.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60).json()["usage"]
               for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
        assert use[1]["prompt_tokens"] == len(quiet) and use[0]["prompt_tokens"] == len(thinking)
        for bad in ({"messages": []}, {"add_generation_prompt": False}, {"not a name": 1}, [1]):
            r = http.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": bad}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", (bad, r.text)
        # a template that reads no reasoning effort (Qwen3's thinks or not: enable_thinking) is refused one
        r = http.post(f"{url}/v1/chat/completions", json={**body, "reasoning_effort": "low"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
        assert "takes no reasoning effort" in r.json()["error"]["message"]


def test_magistrals_think_markers():
    """A template naming [/THINK] (Magistral's): the thought between [THINK] and [/THINK] is
    reasoning, parsed and admitted by the tool grammar (here as text: the tiny vocabulary has no such
    tokens) before a call."""
    tok = markup_tokenizer([], "hermes")
    tok.chat_template = tok.chat_template.replace("<|assistant|>", "<|assistant|>{# [/THINK] #}")
    markers = reasoning.markers_of(tok.chat_template)
    assert markers == ("[THINK]", "[/THINK]") and reasoning.describe(tok.chat_template).startswith("[THINK] blocks")
    parser = answer_parser(tok, None)
    assert parser.answer("[THINK]plan[/THINK]\n\nBooked.") == ("Booked.", None) and parser.reasoning == "plan"
    call = "<tool_call>\n" + json.dumps(CALL, separators=(", ", ": ")) + "\n</tool_call>"
    answer = "[THINK]plan[/THINK]\n" + call
    assert grammar_takes(ToolSpec.parse(TOOLS, "auto"), tok, answer)
    with_tools = answer_parser(tok, ToolSpec.parse(TOOLS, "auto"))
    assert [c["function"]["name"] for c in with_tools.answer(answer)[1]] == ["book"]


def test_command_r7bs_plan_before_its_action_is_reasoning():
    """Command R7B plans between <|START_THINKING|> and <|END_THINKING|>, then acts: its template (naming both, with
    the action markers as special tokens) gives a plan that is reasoning, admitted by the tool grammar before the
    numbered list of calls, which are read as calls."""
    tok = markup_tokenizer(["<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>"], "cohere")
    tok.chat_template = tok.chat_template.replace("<|assistant|>", "<|assistant|>{# <|END_THINKING|> #}")
    assert reasoning.markers_of(tok.chat_template) == ("<|START_THINKING|>", "<|END_THINKING|>")
    assert reasoning.markers_of("{# </seed:think> #}") == ("<seed:think>", "</seed:think>")  # Seed-OSS's thought
    assert callmarkup.markup_for(tok) == callmarkup.COHERE
    answer = "<|START_THINKING|>plan<|END_THINKING|>" + callmarkup.written(callmarkup.COHERE, [{"function": CALL}])
    assert '{"tool_call_id": "0", "tool_name": "book", "parameters": {"seats": ["a"]}}' in answer
    assert grammar_takes(ToolSpec.parse(TOOLS, "auto"), tok, answer)
    assert grammar_takes(ToolSpec.parse(TOOLS, "required"), tok, answer)
    assert not grammar_takes(ToolSpec.parse(TOOLS, "required"), tok, answer.replace('"0"', '"x"'))
    parser = answer_parser(tok, ToolSpec.parse(TOOLS, "auto"))
    content, calls = parser.answer(answer)
    assert parser.reasoning == "plan" and content is None and [c["function"]["name"] for c in calls] == ["book"]


@pytest.mark.parametrize("thinking_pair", [False], indirect=True, ids=["thinks"])
def test_the_python_api_takes_chat_template_kwargs(thinking_pair):
    """`generate(..., chat_template_kwargs=...)` as the server's field: the prompt is the template's
    with the variable set (a conversation or a text with chat=True); a prompt without a template is
    refused them, as is a variable the request sets itself."""
    from specextend.common.errors import UserError

    _, pair, _ = thinking_pair
    quiet = pair.encode_chat(ASK, template_kwargs={"enable_thinking": False})
    for prompt, chat in ((ASK, False), (ASK[0]["content"], True)):
        r = pair.generate(prompt, chat=chat, method="ar", max_new_tokens=2,
                          chat_template_kwargs={"enable_thinking": False}, **SMALL)
        assert r.prompt_tokens == len(quiet)
    with pytest.raises(UserError, match="need a chat prompt"):
        pair.generate("plain text", method="ar", max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(UserError, match="may not set 'tools'"):
        pair.generate(ASK, method="ar", max_new_tokens=2, chat_template_kwargs={"tools": []})


def test_the_templates_probes_run_once_per_tokenizer_and_name():
    """`template_reads`, `template_takes_tools` and `max_prompt_chars` render or read each tokenizer
    once (one memo, `Prompts._per_tokenizer`), and a replaced tokenizer is probed afresh."""
    from types import SimpleNamespace

    from specextend.requests.prompts import Prompts

    class Counting:
        chat_template = "t"

        def __init__(self, reads: bool):
            self.reads, self.renders = reads, 0

        def apply_chat_template(self, messages, **kw):
            self.renders += 1
            return "q" + (kw.get("reasoning_effort", "") if self.reads else "")

        def get_vocab(self):
            return {"abc": 0, "d": 1}

    def spec(tokenizer):
        return SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(config=SimpleNamespace(max_position=10)))

    prompts = Prompts()
    prompts.spec = spec(Counting(reads=True))
    first = prompts.tokenizer
    assert prompts.template_reads("reasoning_effort") and prompts.template_reads("reasoning_effort")
    assert not prompts.template_reads("other") and first.renders == 4  # two renders a name, once
    assert prompts.max_prompt_chars() == 30
    prompts.spec = spec(Counting(reads=False))
    assert not prompts.template_reads("reasoning_effort") and prompts.tokenizer.renders == 2
    assert first.renders == 4
