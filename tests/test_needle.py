"""The needle test's plumbing on tiny random models: trial construction, one trial per policy,
CMR's retrieval of a planted chunk, and resuming a sweep."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from specextend.api import load
from specextend.bench import needle
from specextend.common.errors import UserError
from specextend.common.settings import Settings

from tiny_tokenizer import save_tiny_model, tiny_tokenizer

WORDS = ["budget", "audit", "agency", "grant", "report", "review", "policy", "program"]
PHRASE = "amber-falcon-1234"


def govreport_text(n_sentences: int = 30, seed: int = 0) -> str:
    """A GovReport-shaped record: the summarisation instruction around plain sentences."""
    words = [WORDS[(i * 5 + seed) % len(WORDS)] for i in range(n_sentences)]
    body = " ".join(f"Item {i} of the {w} was checked." for i, w in enumerate(words))
    return ("\n\nSummarize the following text into a summary of less than 800 words.\n### Text:\n\n"
            f"{body}\n\n### Summary:\n\n")


pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("needle")
    return {
        "target": save_tiny_model(root / "target", seed=0, max_position_embeddings=4096),
        "draft": save_tiny_model(root / "draft", seed=3, layers=1, max_position_embeddings=4096),
    }


@pytest.fixture(scope="module")
def pair(folders):
    return load(folders["target"], folders["draft"], dtype="float64", progress=False)


def settings(**kw) -> Settings:
    base = dict(method="specextend", chunk_size=32, top_k_chunks=4, max_new_tokens=6)
    base.update(kw)
    return Settings(**base).resolved()


# --------------------------------------------------------------------------- trials


@pytest.mark.parametrize("depth", [0.1, 0.37, 0.5, 0.9])
def test_make_trial_puts_the_needle_at_the_depth(depth):
    tok = tiny_tokenizer()
    t = needle.make_trial(govreport_text(), tok, depth, PHRASE)
    a, b = t.needle_tokens
    assert tok.decode(t.prompt_ids[a:b]).strip() == f"The secret passphrase is: {PHRASE}."
    assert abs(t.token_depth - depth) < 0.05, (t.token_depth, depth)
    text = tok.decode(t.prompt_ids)
    assert "Summarize the following" not in text and "### Summary" not in text
    assert text.index(PHRASE) < text.index(needle.QUESTION)
    assert text.endswith("<|assistant|>")  # the chat template's generation prompt
    ds, de = t.doc_tokens
    assert ds <= a < b <= de < len(t.prompt_ids)


def test_trial_spec_is_seeded_per_trial():
    specs = [needle.trial_spec(0, i, 20) for i in range(40)]
    assert specs == [needle.trial_spec(0, i, 20) for i in range(40)]
    assert [h for h, _, _ in specs] == [i % 20 for i in range(40)]
    assert all(0.1 <= d <= 0.9 for _, d, _ in specs)
    assert len({p for _, _, p in specs}) == 40
    assert needle.trial_spec(1, 0, 20) != specs[0]


# --------------------------------------------------------------------------- one trial


def reference_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The draft alone with its whole prompt, decoded the plain way."""
    cache = model.new_cache(len(ids) + n + 1)
    logits = model.prefill(torch.tensor(ids), cache)
    out: list[int] = []
    while len(out) < n:
        x = int(torch.argmax(logits))
        out.append(x)
        if x in eos:
            break
        logits = model(torch.tensor([x]), torch.tensor([cache.length]), cache)[-1]
        cache.commit()
    return out


def test_run_trial_every_policy(pair):
    s = settings()
    budget, chunk = s.top_k_chunks * s.chunk_size, s.chunk_size
    trial = needle.make_trial(govreport_text(), pair.tokenizer, 0.5, PHRASE, length="T", index=3, haystack=1)
    n = len(trial.prompt_ids)
    assert n > 3 * budget  # a selective cache is really selective here
    rec = needle.run_trial(pair, trial, s, 6)
    assert rec["length"] == "T" and rec["trial"] == 3 and rec["prompt_tokens"] == n
    assert set(rec["policies"]) == set(needle.POLICIES)
    json.dumps(rec, allow_nan=False)
    for name, r in rec["policies"].items():
        assert isinstance(r["answer"], str) and 1 <= r["new_tokens"] <= 6
        assert r["correct"] == (PHRASE in r["answer"])
        if name == "full":
            assert r["working_tokens"] == n - 1 and r["needle_in_cache"]
        else:
            assert r["working_tokens"] <= budget + chunk, name
    assert rec["policies"]["streaming"]["max_working_tokens"] <= budget + chunk
    # The needle sits mid-prompt: sinks + recent window cannot hold it.
    assert not rec["policies"]["streaming"]["needle_in_cache"]

    # The full policy (store cut by one token, the last re-fed) answers exactly as the draft
    # decoding from its own full prefill does.
    ref = reference_greedy(pair.draft, trial.prompt_ids, 6, set(pair.eos_ids))
    assert rec["policies"]["full"]["answer"] == pair.tokenizer.decode(ref, skip_special_tokens=True)

    # Every policy starts from the same store, whatever ran before it.
    again = needle.run_trial(pair, trial, s, 6, policies=("cmr", "full", "streaming"))
    for name in needle.POLICIES:
        for key in ("answer", "working_tokens", "needle_in_cache"):
            assert again["policies"][name][key] == rec["policies"][name][key], (name, key)


def plant(state, layer: int, start: int, end: int, strength: float = 40.0) -> None:
    """Overwrite the target's keys [start, end) at `layer` so that every head's last-prompt query
    scores them `strength` (before the 1/sqrt(d) scale): they then take nearly all attention."""
    q = state.last_q[layer][:, 0]  # [H, D]
    k = state.target_cache.k
    n_kv = k.shape[1]
    g = q.shape[0] // n_kv
    for h in range(n_kv):
        qg = q[h * g : (h + 1) * g]  # the query heads sharing K/V head h
        # Least-norm key with q_i . key = strength * sqrt(d) for each of those heads.
        key = torch.linalg.pinv(qg) @ torch.full((g,), strength * q.shape[-1] ** 0.5, dtype=q.dtype)
        k[layer, h, start:end] = key


def test_cmr_keeps_the_chunk_the_target_attends_to(pair):
    s = settings()
    c = s.chunk_size
    trial = needle.make_trial(govreport_text(), pair.tokenizer, 0.5, PHRASE)
    state, scores = needle.prefill_trial(pair, trial, s)
    n_chunks = (len(trial.prompt_ids) - 1) // c
    before = pair.draft_alone(state, "cmr", scores, 0, s)  # the working cache only, no answer
    chosen = {a // c for a, _ in before.kept}
    # The needle's chunks, made the target's focus: only then must CMR keep them.
    a, b = trial.needle_tokens
    planted = range(a // c, (b - 1) // c + 1)
    assert 1 <= len(planted) < s.top_k_chunks and 0 not in planted and planted[-1] < n_chunks - 1
    assert not set(planted) <= chosen  # not kept already: the plant is what makes CMR keep them

    last = pair.target.cfg.num_layers - 1
    plant(state, 0, planted[0] * c, (planted[-1] + 1) * c)
    # Another layer's keys do not move the scores of the retrieval layer (the last).
    assert torch.equal(pair.retrieval_scores(state, s), scores)
    plant(state, last, planted[0] * c, (planted[-1] + 1) * c)
    focused = pair.retrieval_scores(state, s)
    assert focused[planted[0] * c : (planted[-1] + 1) * c].sum() > 0.9

    policy = pair.draft_alone(state, "cmr", focused, 0, s)
    for j in planted:
        assert needle.covers(policy.kept, (j * c, (j + 1) * c)), (j, policy.kept)
    assert needle.covers(policy.kept, (0, c))  # the sink chunk stays
    assert policy.working_tokens <= s.top_k_chunks * c + c
    assert needle.chunk_rank(focused, trial.needle_tokens, c, len(trial.prompt_ids) - 1) == 1
    r = needle.run_policy(pair, state, "cmr", s, focused, trial, 4)
    assert r["needle_in_cache"]

    # With --retrieval-layer 0 the layer-0 plant (made above) is what CMR follows.
    s0 = replace(s, retrieval_layer=0)
    p0 = pair.draft_alone(state, "cmr", pair.retrieval_scores(state, s0), 0, s0)
    assert needle.covers(p0.kept, trial.needle_tokens)


# --------------------------------------------------------------------------- the command


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    needle.add_arguments(p)
    return p.parse_args(list(argv))


def test_budget_options():
    s = needle.needle_settings(parse("--budget", "256", "--chunk-size", "16"))
    assert (s.top_k_chunks, s.chunk_size) == (16, 16)
    assert needle.needle_settings(parse("--top-k-chunks", "8")).top_k_chunks == 8
    for bad in (["--budget", "100"], ["--budget", "256", "--top-k-chunks", "4"]):
        with pytest.raises(UserError, match="budget"):
            needle.needle_settings(parse(*bad))


def test_sweep_resumes(folders, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "govreport_T.jsonl").write_text(
        "".join(json.dumps({"text": govreport_text(12, seed=k)}) + "\n" for k in range(3)))
    out = tmp_path / "out"
    calls: list[tuple[str, int]] = []
    real = needle.run_trial

    def counted(pair, trial, *a, **kw):
        calls.append((trial.length, trial.index))
        return real(pair, trial, *a, **kw)

    monkeypatch.setattr(needle, "run_trial", counted)
    common = ["--target", str(folders["target"]), "--draft", str(folders["draft"]), "--dtype", "float64",
              "--data", str(data), "--lengths", "t", "--out", str(out), "--chunk-size", "16", "--top-k-chunks", "2",
              "--max-new-tokens", "3", "-q"]

    from specextend.cli import main as cli

    assert cli.main(["needle", *common, "--trials", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert calls == [("T", 0), ("T", 1)]
    assert summary["lengths"]["T"]["trials"] == 2
    assert set(summary["lengths"]["T"]["policies"]) == set(needle.POLICIES)
    assert json.loads((out / needle.SUMMARY_FILE).read_text())["lengths"]["T"]["trials"] == 2

    # A run killed mid-write leaves a partial line: ignored, and that trial is simply redone.
    with (out / needle.RESULTS_FILE).open("a") as f:
        f.write('{"length": "T", "trial": 2, "po')
    calls.clear()
    assert needle.run(parse(*common, "--trials", "3")) == 0
    assert calls == [("T", 2)]
    table = capsys.readouterr().out
    assert "cmr/full" in table and all(p in table for p in needle.POLICIES)

    calls.clear()
    assert needle.run(parse(*common, "--trials", "3")) == 0
    assert calls == []
    assert json.loads((out / needle.SUMMARY_FILE).read_text())["lengths"]["T"]["trials"] == 3

    # Other settings: earlier records are not reused.
    assert needle.run(parse(*common, "--trials", "1", "--top-k-chunks", "3")) == 0
    assert calls == [("T", 0)]


def test_bad_length_is_a_user_error(tmp_path):
    (tmp_path / "govreport_4K.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match="have: 4K"):
        needle.run(parse("--data", str(tmp_path), "--lengths", "8K"))


def test_bad_draft_dtype_exits_2(folders, tmp_path, capsys):
    (tmp_path / "govreport_T.jsonl").write_text(json.dumps({"text": govreport_text(12, seed=0)}) + "\n")
    from specextend.cli import main as cli

    rc = cli.main(["needle", "--target", str(folders["target"]), "--draft", str(folders["draft"]), "--data",
                   str(tmp_path), "--lengths", "t", "--draft-dtype", "float8", "--out", str(tmp_path / "o"), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown dtype" in err and "Traceback" not in err
