"""The server's structured outputs, log-probabilities and penalties, through the official `openai`
client (its `chat.completions.parse` with a pydantic model) and plain HTTP, on tiny models with a
real (byte-level BPE) tokenizer: answers equal the Python API's, errors are OpenAI-shaped."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from specextend.api import load

import loopback as http
from test_serve import SMALL, client, running
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

DOC = "The report covers the budget of the agency, its staff and the hearings held. " * 4


class Facts(BaseModel):
    title: str = Field(max_length=12)
    year: int = Field(ge=1900, le=2100)
    audited: bool


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-serve")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders["target"], folders["draft"], dtype="float64", progress=False)


@pytest.fixture(scope="module")
def url(pair, folders):
    with running(pair, folders, max_new_tokens=80) as u:
        yield u


def schema_format() -> dict:
    from openai.lib._pydantic import to_strict_json_schema

    return {"type": "json_schema", "json_schema": {"name": "Facts", "schema": to_strict_json_schema(Facts),
                                                   "strict": True}}


@pytest.mark.parametrize("method", ["ar", "specextend"])
def test_the_openai_client_parses_into_a_pydantic_model(pair, url, method):
    messages = [{"role": "user", "content": f"{DOC}\nExtract the facts."}]
    done = client(url).chat.completions.parse(model="tiny", messages=messages, response_format=Facts,
                                              max_tokens=80, extra_body={"method": method, **SMALL})
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Facts)
    ref = pair.generate(messages[0]["content"], chat=True, method="ar", max_new_tokens=80,
                        response_format=schema_format())
    assert choice.message.content == ref.text
    assert Facts.model_validate_json(ref.text) == choice.message.parsed


def test_chat_logprobs_stream_and_match_the_api(pair, url):
    messages = [{"role": "user", "content": DOC}]
    body = dict(model="tiny", messages=messages, max_tokens=30, logprobs=True, top_logprobs=2,
                response_format={"type": "json_object"}, frequency_penalty=0.4, extra_body={"method": "lookup"})
    whole = client(url).chat.completions.create(**body)
    ref = pair.generate(DOC, chat=True, method="ar", max_new_tokens=30, response_format={"type": "json_object"},
                        frequency_penalty=0.4, logprobs=2)
    content = whole.choices[0].logprobs.content
    # float64 torch: a tree row or a prefix-cached prefill may round differently in the last bit
    # (test_structured.py checks the bitwise equality on the quantized runtime).
    assert [c.logprob for c in content] == pytest.approx([e["logprob"] for e in ref.logprobs], rel=1e-9, abs=1e-12)
    assert [c.token for c in content] == [e["token"] for e in ref.logprobs]
    assert all(len(c.top_logprobs) <= 2 for c in content)
    assert whole.choices[0].message.content == ref.text
    streamed, text = [], ""
    for ch in client(url).chat.completions.create(**body, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
    assert text == ref.text
    assert [c.logprob for c in streamed] == pytest.approx([e["logprob"] for e in ref.logprobs], rel=1e-9, abs=1e-12)


def test_completions_take_a_regex_and_return_logprobs(pair, url):
    rf = {"type": "regex", "regex": r"(yes|no)\. [a-z]{2,8}"}
    r = http.post(f"{url}/v1/completions", json={"prompt": DOC, "max_tokens": 20, "logprobs": 1,
                                                  "response_format": rf, "method": "specextend"}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = pair.generate(DOC, method="ar", max_new_tokens=20, response_format=rf, logprobs=1)
    assert choice["text"] == ref.text and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in ref.logprobs], rel=1e-9, abs=1e-12)
    assert lp["tokens"] == [e["token"] for e in ref.logprobs] and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]).startswith(ref.text)  # then the end-of-sequence token's own text
    assert all(len(t) <= 1 for t in lp["top_logprobs"])


def test_max_tokens_before_the_json_closes_is_length(url):
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": DOC}], max_tokens=4,
                                            response_format=schema_format())
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "cannot be compiled"),
    ({"response_format": {"type": "regex", "regex": "[a&&b]"}}, "response_format", "admits no output"),
    ({"response_format": {"type": "grammar", "grammar": "start: undefined_rule"}}, "response_format", "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format", "not one of"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"frequency_penalty": 3}, "frequency_penalty", "2"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
])
def test_bad_requests_are_openai_shaped_400s(url, body, param, needle):
    r = http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]
    json.dumps(err)


def test_concurrent_constrained_requests_each_keep_their_own_grammar(pair, url):
    """Requests with different grammars, penalties and methods, sent at once and batched together:
    each answers what it answers alone (its own grammar state and counts), log-probabilities too."""
    from concurrent.futures import ThreadPoolExecutor

    formats = [schema_format(), {"type": "regex", "regex": r"(yes|no)\. [a-z]{2,8}"}, {"type": "json_object"},
               None, {"type": "grammar", "grammar": 'start: "id-" /[0-9]{1,3}/'}]
    methods = ["specextend", "lookup", "ar", "sd", "lookup"]  # five: within the server's queue of four

    def ask(i: int) -> tuple[str, list[float]]:
        body: dict = {"model": "tiny", "messages": [{"role": "user", "content": f"{DOC[: 90 * i]} Question {i}?"}],
                      "max_tokens": 40, "logprobs": True, "top_logprobs": 1, "frequency_penalty": 0.3 * (i % 2),
                      "method": methods[i], **SMALL}
        if formats[i] is not None:
            body["response_format"] = formats[i]
        r = http.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], [c["logprob"] for c in choice["logprobs"]["content"]]

    alone = [ask(i) for i in range(len(formats))]
    with ThreadPoolExecutor(len(formats)) as pool:
        together = list(pool.map(ask, range(len(formats))))
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(together, alone, strict=True):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
