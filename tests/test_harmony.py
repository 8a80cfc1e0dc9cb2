"""gpt-oss's harmony chat format (requests/harmony.py): the reasoning (`analysis` channel) kept
apart from the answer (`final`), whole and streamed, and the server's chat answers split so:
`content` the final text, `reasoning_content` the reasoning, never any markup."""

from __future__ import annotations

import json

import pytest

from specextend.api import load
from specextend.requests import callmarkup, harmony
from specextend.requests.callmarkup import HARMONY
from specextend.requests.harmony import HarmonyParser, split
from specextend.serve import protocol

import loopback as http
from test_serve import SMALL, running
from tiny_tokenizer import EOS, MERGES, SPECIALS, TINY_VOCAB, save_tiny_model

ANSWER = ("<|channel|>analysis<|message|>The user wants the capital. It is Paris.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Paris is the capital of France.<|return|>")


def test_a_whole_answer_splits_into_reasoning_and_content() -> None:
    assert split(ANSWER) == ("The user wants the capital. It is Paris.", "Paris is the capital of France.")
    # a commentary preamble is for the user too; no markup at all is plain content
    pre = "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert split(pre) == (None, "Looking it up.Done.")
    assert split("just text, no markup") == (None, "just text, no markup")
    # cut by max_tokens inside the reasoning: reasoning only, no content
    assert split("<|channel|>analysis<|message|>Thinking about") == ("Thinking about", None)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_split(size: int) -> None:
    p = HarmonyParser()
    deltas = [d for i in range(0, len(ANSWER), size) for d in p.push(ANSWER[i : i + size])] + p.finish()
    assert all(len(d) == 1 and set(d) <= {"content", "reasoning_content"} for d in deltas)
    joined = {k: "".join(d.get(k, "") for d in deltas) for k in ("reasoning_content", "content")}
    assert (joined["reasoning_content"], joined["content"]) == split(ANSWER)
    assert not any("<|" in v for d in deltas for v in d.values())
    # the reasoning streams before the answer, and it streams as it comes (not held to the end)
    assert deltas[0].keys() == {"reasoning_content"} and deltas[-1].keys() == {"content"}
    if size < 10:
        assert len(deltas) > 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_message_to_a_function_is_a_tool_call_streamed_or_whole(size: int) -> None:
    """harmony's call (a commentary message addressed to functions.NAME, its body the arguments;
    <|call|> ends the generation, so the body ends with the text): one call, never content; a call
    cut short, or to a function not offered, is dropped."""
    from specextend.requests.toolcalls import ToolSpec

    spec = ToolSpec.parse([WEATHER])
    p = spec.parser(HARMONY)
    deltas = [d for i in range(0, len(CALL), size) for d in p.push(CALL[i : i + size])] + p.finish()
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert not any("content" in d for d in deltas) and p.finish_reason("stop") == "tool_calls"
    whole = spec.parser(HARMONY)
    content, made = whole.answer(CALL)
    assert content is None and [c["function"] for c in made] == [calls[0]["function"]]
    assert whole.reasoning == "Need the weather."
    for broken in (CALL[:-3], CALL.replace("get_weather", "get_time")):
        assert spec.parser(HARMONY).answer(broken) == (None, [])


def test_the_chat_answer_carries_reasoning_content_apart() -> None:
    use = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    msg = protocol.response("chat", "id", 0, "m", "Paris.", "stop", use, reasoning="It is Paris.")["choices"][0]
    assert msg["message"] == {"role": "assistant", "content": "Paris.", "reasoning_content": "It is Paris."}
    plain = protocol.response("chat", "id", 0, "m", "Paris.", "stop", use)["choices"][0]["message"]
    assert "reasoning_content" not in plain


# ------------------------------------------------------------------ a harmony tokenizer, served

MARKUP = list(harmony.MARKERS)
TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"  # as gpt-oss's
            "{% if tools %}<|start|>developer<|message|>functions:{% for t in tools %} {{ t['function']['name'] }}"
            "{% endfor %}<|end|>{% endif %}"
            "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def harmony_tokenizer():
    """The tiny byte-level tokenizer with harmony's markers as special tokens and a harmony-like template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + MARKUP + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES] + [EOS]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*SPECIALS, *MARKUP, EOS]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=EOS,
                                   additional_special_tokens=SPECIALS[1:] + MARKUP, chat_template=TEMPLATE)


def test_a_harmony_tokenizer_is_decoded_with_its_markup() -> None:
    tok = harmony_tokenizer()
    assert harmony.is_harmony(tok)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    assert callmarkup.decode(tok, ids) == ANSWER
    from tiny_tokenizer import tiny_tokenizer

    plain = tiny_tokenizer()
    assert not harmony.is_harmony(plain)
    assert callmarkup.decode(plain, plain.encode("<|user|>hi", add_special_tokens=False)) == "hi"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony")
    vocab = TINY_VOCAB + len(MARKUP)
    folders = {"target": save_tiny_model(root / "target", seed=0, vocab=vocab, tokenizer=harmony_tokenizer()),
               "draft": save_tiny_model(root / "draft", seed=1, layers=1, vocab=vocab, tokenizer=harmony_tokenizer())}
    pair = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    pair.step_costs()
    with running(pair, folders, max_new_tokens=48) as url:
        yield pair, url


ASK = [{"role": "user", "content": "The capital of France?"}]
# A random model writes no markup of its own: a grammar (llguidance's Lark, special tokens by name)
# makes it write a reasoning message and then a final one.
SHAPE = {"type": "grammar", "grammar": 'start: <|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> <|start|> '
                                       '"assistant" <|channel|> "final" <|message|> /[a-z ]{2,10}/'}


def test_served_chat_answers_keep_reasoning_apart_streamed_or_not(served) -> None:
    """The server's answer is the harmony split of what the model wrote (the same greedy tokens
    through the Python API, decoded with their markup), streamed or not, under speculation too."""
    pair, url = served
    raw = pair.generate(ASK, chat=True, max_new_tokens=48, method="ar", response_format=SHAPE).text
    reasoning, content = split(raw)
    assert raw.startswith("<|channel|>analysis") and reasoning and content and "</s>" not in raw
    for method in ("ar", "specextend"):
        body = {"messages": ASK, "max_tokens": 48, "method": method, "response_format": SHAPE, **SMALL}
        msg = http.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert (msg.get("reasoning_content"), msg["content"]) == (reasoning, content), method
        got = {"reasoning_content": "", "content": ""}
        with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    for k in got:
                        got[k] += delta.get(k) or ""
        assert (got["reasoning_content"] or None, got["content"] or None) == (reasoning, content), method
    for text in (msg["content"] or "", msg.get("reasoning_content") or ""):
        assert not any(m in text for m in MARKUP)


def test_a_required_call_is_written_in_harmony_and_answered_as_a_call(served) -> None:
    """`tool_choice: required` on a harmony model: the grammar makes it write harmony's own call
    (not another format's markup), and the answer is that call, streamed or not, under speculation too."""
    pair, url = served
    raw = pair.generate(ASK, method="ar", max_new_tokens=96, tools=[WEATHER], tool_choice="required", **SMALL)
    assert raw.text.startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{")
    assert [c["function"]["name"] for c in raw.tool_calls] == ["get_weather"]
    seen = []
    for method in ("ar", "specextend"):
        body = {"messages": ASK, "max_tokens": 96, "method": method, "tools": [WEATHER], "tool_choice": "required",
                **SMALL}
        r = http.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        calls = r["message"]["tool_calls"]
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None and len(calls) == 1, r
        assert calls[0]["function"]["name"] == "get_weather"
        assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}
        seen.append(calls[0]["function"]["arguments"])
        streamed = ""
        with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    assert not delta.get("content")
                    streamed += "".join(c["function"]["arguments"] for c in delta.get("tool_calls") or [])
        assert streamed == calls[0]["function"]["arguments"]
    assert seen[0] == seen[1]  # greedy speculation writes ar's call


def test_reasoning_effort_reaches_a_template_that_reads_it(served) -> None:
    """OpenAI's `reasoning_effort` is the template variable gpt-oss's template reads (its system
    message's "Reasoning: low"); one that chat_template_kwargs contradicts, or not one of low, medium
    and high, is a 400 naming the field."""
    pair, url = served
    body = {"messages": ASK, "max_tokens": 2, "method": "ar"}
    want = {e: len(pair.encode_chat(ASK, template_kwargs={"reasoning_effort": e})) for e in ("low", "medium")}
    assert "Reasoning: low" in pair.tokenizer.decode(pair.encode_chat(ASK, template_kwargs={"reasoning_effort": "low"}))
    for effort, tokens in want.items():
        r = http.post(f"{url}/v1/chat/completions", json={**body, "reasoning_effort": effort}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tokens, r.text
    for bad in ({"reasoning_effort": "extreme"}, {"reasoning_effort": "low", "chat_template_kwargs":
                                                   {"reasoning_effort": "high"}}):
        r = http.post(f"{url}/v1/chat/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", (bad, r.text)
