"""gpt-oss's harmony chat format (requests/harmony.py): the reasoning (`analysis` channel) kept
apart from the answer (`final`), whole and streamed, and the server's chat answers split so:
`content` the final text, `reasoning_content` the reasoning, never any markup."""

from __future__ import annotations

import json

import pytest

from specextend.api import load
from specextend.requests import harmony
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


def test_the_chat_answer_carries_reasoning_content_apart() -> None:
    use = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    msg = protocol.response("chat", "id", 0, "m", "Paris.", "stop", use, reasoning="It is Paris.")["choices"][0]
    assert msg["message"] == {"role": "assistant", "content": "Paris.", "reasoning_content": "It is Paris."}
    plain = protocol.response("chat", "id", 0, "m", "Paris.", "stop", use)["choices"][0]["message"]
    assert "reasoning_content" not in plain


# ------------------------------------------------------------------ a harmony tokenizer, served

MARKUP = list(harmony.MARKERS)
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
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
    assert harmony.decode(tok, ids) == ANSWER
    from tiny_tokenizer import tiny_tokenizer

    plain = tiny_tokenizer()
    assert not harmony.is_harmony(plain)
    assert harmony.decode(plain, plain.encode("<|user|>hi", add_special_tokens=False)) == "hi"


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
