"""A list of prompts from Python (`Pair.generate([...])`) and from the command line
(`generate --prompts-file`): one continuous batch, results in order, each the tokens that prompt
gets alone, whatever mix of methods, grammars and penalties; one cancelled, the others finish;
several threads share the batch."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from specextend.api import Pair, load
from specextend.cli.main import main
from specextend.common.errors import UserError

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own

SMALL = dict(chunk_size=4, top_k_chunks=2, cmr_min_ratio=0.0)
PROMPTS = ["hello the world", "the budget of the agency", "def parse(s):", "one two three four five six seven",
           "héllo 日本 and more", "a", "the report covers the hearings held " * 4]
REQUESTS = [
    {"prompt": PROMPTS[0], "method": "ar"},
    {"prompt": PROMPTS[1], "method": "sd", "frequency_penalty": 0.5},
    {"prompt": PROMPTS[2], "method": "specextend", "response_format": {"type": "regex", "regex": "[a-z ]{3,12}"}},
    {"prompt": PROMPTS[3], "method": "lookup", "repetition_penalty": 1.3, "logprobs": 2},
    {"prompt": PROMPTS[4], "method": "sd", "temperature": 0.8, "seed": 5},
    {"prompt": PROMPTS[5], "method": "specextend", "draft_gate": False, "max_new_tokens": 7},
    {"prompt": PROMPTS[6], "method": "specextend", "chat": True},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    # Random weights: no end token, so every generation runs to its length.
    return Pair(replace(p.spec, eos_ids=()), p.target, p.draft)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """The command line in this process (the output contract is the point here, not the process;
    tests/test_clean_exit.py runs it as a process)."""
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def alone(pair, request: dict, **common):
    own = {k: v for k, v in request.items() if k != "prompt"}
    return pair.generate(request["prompt"], **{**common, **own})


def test_a_list_gives_each_prompt_the_tokens_it_gets_alone(pair):
    common = dict(max_new_tokens=16, **SMALL)
    want = [alone(pair, r, **common) for r in REQUESTS]
    got = pair.generate(REQUESTS, **common)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.method for r in got] == [r["method"] for r in REQUESTS]
    assert [r.text for r in got] == [r.text for r in want]
    assert got[3].logprobs is not None and [e["token_id"] for e in got[3].logprobs] == want[3].token_ids
    assert [e["logprob"] for e in got[3].logprobs] == pytest.approx([e["logprob"] for e in want[3].logprobs])


def test_plain_prompts_and_token_ids_with_common_settings(pair):
    ids = pair.encode(PROMPTS[1])
    got = pair.generate([PROMPTS[0], ids, PROMPTS[2]], method="sd", max_new_tokens=12, **SMALL)
    want = [pair.generate(p, method="sd", max_new_tokens=12, **SMALL).token_ids for p in (PROMPTS[0], ids, PROMPTS[2])]
    assert [r.token_ids for r in got] == want


def test_one_cancelled_the_others_finish(pair):
    cancel = threading.Event()
    doomed = pair.generation(PROMPTS[3], method="sd", max_new_tokens=200, on_piece=lambda *_: cancel.set(),
                             cancel=cancel, **SMALL)
    rest = [{"prompt": p, "method": m} for p, m in zip(PROMPTS[:3], ("ar", "sd", "specextend"), strict=True)]
    got = pair.generate([rest[0], doomed, rest[1], rest[2]], max_new_tokens=14, **SMALL)
    assert got[1] is None
    want = [alone(pair, r, max_new_tokens=14, **SMALL).token_ids for r in rest]
    assert [got[0].token_ids, got[2].token_ids, got[3].token_ids] == want


def test_threads_share_the_batch(pair):
    common = dict(max_new_tokens=10, method="sd", **SMALL)
    want = [pair.generate(p, **common).token_ids for p in PROMPTS]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: pair.generate([PROMPTS[i], PROMPTS[-1 - i]], **common), range(3)))
    assert [[r.token_ids for r in pair_] for pair_ in got] == [[want[i], want[-1 - i]] for i in range(3)]


def test_bad_items_are_refused_before_anything_runs(pair):
    with pytest.raises(UserError, match="needs its 'prompt'"):
        pair.generate([{"text": "x"}])
    with pytest.raises(UserError, match="unknown setting 'nonsense'"):
        pair.generate(["a", {"prompt": "b", "nonsense": 1}])
    with pytest.raises(UserError, match="on_text"):
        pair.generate(["a", "b"], on_text=print)


def test_the_prompts_file_runs_in_one_batch(pair, folders, tmp_path, capsys):
    lines = [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "method": "ar", "max_new_tokens": 5},
             {"prompt": PROMPTS[2], "frequency_penalty": 0.4}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, err = run_cli(capsys, "--target", str(folders["target"]), "--draft", str(folders["draft"]),
                             "--dtype", "float64", "--method", "sd", "--max-new-tokens", "8",
                             "--prompts-file", str(path), "--json", "-q")
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    base = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    want = [base.generate(x["prompt"], **{"method": "sd", "max_new_tokens": 8, **{k: v for k, v in x.items()
                                                                                   if k != "prompt"}})
            for x in lines]
    assert [r["token_ids"] for r in rows] == [w.token_ids for w in want]
    assert [r["method"] for r in rows] == ["sd", "ar", "sd"]


def test_the_prompts_file_without_json_labels_each_answer(pair, folders, tmp_path, capsys):
    lines = [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "id": "q7", "method": "ar"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--target", str(folders["target"]), "--draft", str(folders["draft"]), "--dtype", "float64",
            "--method", "sd", "--max-new-tokens", "6", "--prompts-file", str(path)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    base = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    texts = [base.generate(PROMPTS[0], method="sd", max_new_tokens=6).text,
             base.generate(PROMPTS[1], method="ar", max_new_tokens=6).text]
    assert out == f"=== line 1 ===\n{texts[0]}\n\n=== line 2 (id q7) ===\n{texts[1]}\n"
    summaries = [x for x in err.splitlines() if "tokens after" in x]
    assert [x.split(":")[0] for x in summaries] == ["line 1", "line 2 (id q7)"]
    code, out, err = run_cli(capsys, *argv, "--json", "-q")
    assert code == 0, err
    assert [json.loads(x).get("id") for x in out.splitlines()] == [None, "q7"]


def test_a_bad_prompts_file_is_one_line(folders, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    code, out, err = run_cli(capsys, "--target", str(folders["target"]), "--prompts-file", str(path), "--json")
    assert code == 2 and "line 2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""
