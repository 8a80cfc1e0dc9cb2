"""Tool calls with the default pair (Qwen2.5-Coder; marked slow, skipped where it is not pulled):
its chat template renders the tools, a call the grammar admits, and the call and its result fed
back (the round trip); a forced call of the real model is valid for its schema and the same under
speculation as under `ar`."""

from __future__ import annotations

import json

import pytest

from specextend.api import prepare
from specextend.requests.callparser import CallParser
from specextend.requests.toolcalls import OPEN, ToolSpec, template_messages
from test_toolcalls import ASK, TOOLS, valid

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paths():
    """The pulled pair's folders (converted once by the pull: a GGUF file given by path would be
    converted again into a cache of its own on a machine's first run, half a minute)."""
    from specextend.models.gguf import is_current
    from specextend.models.pull import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir

    target, draft = model_dir(DEFAULT_TARGET), model_dir(DEFAULT_DRAFT)
    if not (is_current(target) and is_current(draft)):
        pytest.skip("the default pair is not pulled (specextend models pull)")
    return target, draft


@pytest.fixture(scope="module")
def prepared(paths):
    return prepare(str(paths[0]), str(paths[1]), progress=False)


@pytest.fixture(scope="module")
def pair(prepared):
    return prepared.load()


def render(prepared, messages, tools) -> str:
    return prepared.tokenizer.apply_chat_template(template_messages(messages), tools=tools,
                                                  add_generation_prompt=True, tokenize=False)


def test_the_template_round_trip(prepared):
    spec = ToolSpec.parse(TOOLS, "required")
    prompt = render(prepared, ASK, spec.template_tools())
    assert "<tools>" in prompt and json.dumps(spec.template_tools()[0], ensure_ascii=False) in prompt
    # A call as the grammar admits it (the model's own <tool_call> token, fixed separators) ...
    said = (f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 3, "unit": "c"}}}}\n'
            f'</tool_call>\n{OPEN}\n{{"name": "book", "arguments": {{"when": {{"day": 2, "late": false}}, '
            '"seats": ["a"]}}\n</tool_call>')
    ids = prepared.tokenizer.encode(said, add_special_tokens=False)
    assert ids[0] == prepared.tokenizer.get_added_vocab()[OPEN]
    state = prepared.grammar(spec.grammar(prepared.tokenizer)).start()
    assert state.valid_prefix(ids) == len(ids)
    content, calls = CallParser().answer(said)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "book"]
    # ... sent back as the assistant's message with the tools' results renders the call as it was said.
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"} for i, c in enumerate(calls)]
    convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    again = render(prepared, convo, spec.template_tools())
    assert again.startswith(prompt)
    assert f"<|im_start|>assistant\n{said}<|im_end|>\n" in again
    assert "<|im_start|>user\n<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n" \
           "</tool_response><|im_end|>\n<|im_start|>assistant\n" in again


def test_the_default_pair_calls_validly_and_speculation_equals_ar(pair, choice="required"):
    # One choice (about 14 minutes on a busy 2-core machine); a named function is tested on tiny models.
    spec = ToolSpec.parse(TOOLS, choice, False)
    ids = pair.encode_chat(ASK, spec.template_tools())
    grammar = pair.grammar(spec.grammar(pair.tokenizer))
    # No cost model: its one-off measurement of both models would dominate this test.
    ar = pair.generate(ids, method="ar", max_new_tokens=60, response_format=grammar, cost_model=False)
    content, calls = CallParser().answer(ar.text)
    assert content is None and len(calls) == 1 and valid(calls[0]), ar.text
    for method in ("sd", "specextend"):
        got = pair.generate(ids, method=method, max_new_tokens=60, response_format=grammar, draft_gate=False,
                            cost_model=False)
        assert got.token_ids == ar.token_ids, method
