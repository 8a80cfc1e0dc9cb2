"""Needle retrieval by the draft alone, per draft cache policy (the paper's Table 1 idea).

A needle sentence with a random passphrase is hidden at a random depth of a long GovReport
document and asked for at the end. The target prefills the prompt once: its attention from the
last prompt token (the same layers and scoring function as the engine's retrieval) ranks the
chunks for CMR. Then, for each policy, the draft computes the prompt KV that policy reads (as
in decoding: speculation/draft_prefill.py, `--draft-prefill`) and alone answers greedily from its working
cache:

- `full`: the whole prompt,
- `streaming`: attention sinks + the most recent tokens, `budget` tokens in all,
- `cmr`: the top-k chunks by the target's attention (+ the chunk still open), the same budget.

An answer is correct when the passphrase appears in it. Each trial's result is appended to
`trials.jsonl` in --out as soon as it is done; a rerun skips trials already there (with the
same settings), so a long sweep can run in the background, be stopped and resumed.

    specextend needle --lengths 4K,8K --trials 20 --out results/needle
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..common.errors import UserError
from ..common.jsonl import append_jsonl, read_rows, read_texts
from ..common.settings import DRAFT_CACHES, POSITION_MODES, Settings
from ..options import add_model_arguments, model_options
from ..speculation.draft_policy import chunk_scores
from .data import DATA_ENV, data_roots, split_list
from .report import mean

if TYPE_CHECKING:
    from ..api import Pair
    from ..speculation.decoder import Prefilled

POLICIES = DRAFT_CACHES
RESULTS_FILE = "trials.jsonl"
SUMMARY_FILE = "needle.json"
# The issue's goal: CMR keeps most of the full cache's accuracy, StreamingLLM loses the needle.
GOAL_CMR_OVER_FULL = 0.85
GOAL_STREAMING_BELOW = 0.3

QUESTION = "What is the secret passphrase? Answer with the passphrase only."
HEADER = "A secret passphrase is hidden somewhere in the following report. Remember it.\n\n"
ADJECTIVES = (
    "amber", "azure", "bold", "brisk", "calm", "coral", "crimson", "dusty", "eager", "frosty", "gentle",
    "golden", "hollow", "ivory", "jade", "lunar", "misty", "noble", "olive", "quiet", "rapid", "rusty",
    "scarlet", "silver", "solar", "stormy", "tawny", "velvet", "wild", "young",
)  # fmt: skip
ANIMALS = (
    "badger", "beaver", "bison", "cobra", "condor", "coyote", "falcon", "ferret", "gecko", "heron", "ibex",
    "jackal", "koala", "lemur", "lynx", "marmot", "otter", "panther", "pelican", "puffin", "raven",
    "salmon", "stork", "tapir", "toucan", "walrus", "weasel", "wombat", "yak", "zebra",
)  # fmt: skip

# GovReport records are summarisation prompts; the needle test wants the report alone.
_GOV_HEAD = re.compile(r"^\s*Summarize the following text.*?### Text:\s*", re.S)
_GOV_TAIL = re.compile(r"\s*### Summary:\s*$")


# --------------------------------------------------------------------------- trials


@dataclass
class Trial:
    """One needle prompt: where the needle is, in characters and in prompt tokens."""

    length: str  # the haystack file's label, e.g. "4K"
    index: int  # trial number within this length
    haystack: int  # record of the haystack file
    depth: float  # requested depth, a fraction of the report
    passphrase: str
    prompt_ids: list[int]
    needle_tokens: tuple[int, int]  # [start, end) prompt token range holding the needle sentence
    doc_tokens: tuple[int, int]  # [start, end) prompt token range holding the report

    @property
    def token_depth(self) -> float:
        """Where the needle actually starts, as a fraction of the report's tokens."""
        a, b = self.doc_tokens
        return (self.needle_tokens[0] - a) / max(1, b - a)


def trial_spec(seed: int, index: int, n_haystacks: int) -> tuple[int, float, str]:
    """(haystack record, depth, passphrase) of trial `index`.

    Seeded per trial (not from a shared stream), so a resumed run draws exactly what an
    uninterrupted one would, and trial i asks for the same passphrase at the same depth at
    every length (a paired comparison across lengths).
    """
    rng = random.Random(f"specextend-needle:{seed}:{index}")
    depth = rng.uniform(0.1, 0.9)
    passphrase = f"{rng.choice(ADJECTIVES)}-{rng.choice(ANIMALS)}-{rng.randint(1000, 9999)}"
    return index % n_haystacks, depth, passphrase


def report_text(text: str) -> str:
    """The report of a GovReport record, without its summarisation instruction."""
    return _GOV_TAIL.sub("", _GOV_HEAD.sub("", text)).strip()


def _insertion_point(body: str, depth: float) -> int:
    """A character offset near `depth` of `body`: the nearest sentence end, else a word start."""
    target = round(depth * len(body))
    ends = [m.end() for m in re.finditer(r"(?<=[.!?])\s+", body)]
    best = min(ends, key=lambda e: abs(e - target), default=None)
    if best is not None and abs(best - target) <= 0.05 * len(body):
        return best
    space = body.rfind(" ", 0, target)
    return space + 1 if space >= 0 else target


def make_trial(text: str, tokenizer: Any, depth: float, passphrase: str, *, length: str = "", index: int = 0,
               haystack: int = 0) -> Trial:
    """Insert the needle at `depth` of the report in `text`, ask for it, apply the chat template."""
    body = report_text(text)
    at = _insertion_point(body, depth)
    needle = f"The secret passphrase is: {passphrase}."
    sep = "" if at == 0 or body[at - 1].isspace() else " "
    doc = body[:at] + sep + needle + " " + body[at:]
    content = HEADER + doc + "\n\n" + QUESTION
    if getattr(tokenizer, "chat_template", None):
        # Render to text, then tokenize: the template already holds any special tokens.
        full = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        full = content + "\nAnswer:"
    ids, offsets = _encode_with_offsets(tokenizer, full)
    doc_start = full.index(content) + len(HEADER)
    needle_start = doc_start + len(body[:at] + sep)
    return Trial(
        length=length,
        index=index,
        haystack=haystack,
        depth=depth,
        passphrase=passphrase,
        prompt_ids=ids,
        needle_tokens=_token_span(offsets, needle_start, needle_start + len(needle)),
        doc_tokens=_token_span(offsets, doc_start, doc_start + len(doc)),
    )


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(i) for i in enc["input_ids"]], [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The tokens overlapping characters [start, end) (a boundary token counts as inside)."""
    inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    if not inside:
        raise ValueError(f"no token covers characters {start}..{end}")
    return inside[0], inside[-1] + 1


# --------------------------------------------------------------------------- one trial


def prefill_trial(pair: Pair, trial: Trial, s: Settings) -> tuple[Prefilled, torch.Tensor]:
    """Prefill both models once; returns the state and the CMR scores over the prompt tokens.

    The scores are exactly the engine's first retrieval (`Pair.retrieval_scores`): the chosen
    target layers' queries of the last prompt token over the target cache.
    """
    # The full policy reads every position, so the draft's own context must fit the prompt too.
    pair.check_fits(len(trial.prompt_ids), replace(s, draft_cache="full"))
    state = pair.prefill(trial.prompt_ids, s)
    return state, pair.retrieval_scores(state, s)


def covers(ranges: Iterable[tuple[int, int]], span: tuple[int, int]) -> bool:
    a, b = span
    return sum(max(0, min(b, e) - max(a, s)) for s, e in ranges) >= b - a


def chunk_rank(scores: torch.Tensor, span: tuple[int, int], chunk: int, n: int) -> int | None:
    """1-based rank of the best chunk holding the needle by mean attention (as CMR ranks, but
    without forcing chunk 0 first); None if the needle lies only in the open chunk."""
    order = torch.argsort(chunk_scores(scores, n, chunk), descending=True).tolist()
    needle_chunks = set(range(span[0] // chunk, (span[1] - 1) // chunk + 1))
    ranks = [r + 1 for r, c in enumerate(order) if c in needle_chunks]
    return min(ranks) if ranks else None


def run_policy(pair: Pair, state: Prefilled, name: str, s: Settings, scores: torch.Tensor, trial: Trial,
               max_new_tokens: int) -> dict[str, Any]:
    """The draft alone answering from policy `name`'s working cache (`Pair.draft_alone`)."""
    r = pair.draft_alone(state, name, scores, max_new_tokens, s)
    answer = pair.tokenizer.decode(r.tokens, skip_special_tokens=True)
    return {
        "answer": answer,
        "correct": trial.passphrase in answer,
        "working_tokens": r.working_tokens,
        "max_working_tokens": r.max_working_tokens,
        "needle_in_cache": covers(r.kept, trial.needle_tokens),
        "new_tokens": len(r.tokens),
        "draft_prefill_s": r.prefill_s,
        "draft_prompt_tokens": r.prefill_tokens,
        "decode_s": r.decode_s,
    }


def run_trial(pair: Pair, trial: Trial, s: Settings, max_new_tokens: int, policies: Sequence[str] = POLICIES
              ) -> dict[str, Any]:
    """Prefill once, answer with every policy from the same store; one JSON-able record."""
    t0 = time.perf_counter()
    state, scores = prefill_trial(pair, trial, s)
    n = len(trial.prompt_ids)
    a, b = trial.needle_tokens
    rec: dict[str, Any] = {
        "length": trial.length,
        "trial": trial.index,
        "haystack": trial.haystack,
        "depth": trial.depth,
        "token_depth": trial.token_depth,
        "passphrase": trial.passphrase,
        "prompt_tokens": n,
        "needle_tokens": [a, b],
        "needle_attention": float(scores[a:b].sum()),
        "needle_chunk_rank": chunk_rank(scores, trial.needle_tokens, s.chunk_size, n - 1),
        "target_prefill_s": state.target_s,
        "policies": {},
    }
    # Scores are all CMR needs from the target: free its cache before the draft decodes.
    state.target_cache = None  # type: ignore[assignment]
    for name in policies:
        rec["policies"][name] = run_policy(pair, state, name, s, scores, trial, max_new_tokens)
    rec["trial_s"] = time.perf_counter() - t0
    return rec


# --------------------------------------------------------------------------- summary


def summarise(records: Sequence[dict[str, Any]], lengths: Sequence[str],
              policies: Sequence[str] = POLICIES) -> dict[str, Any]:
    """Accuracy, working-cache size and timings per policy and length, and the goal check."""
    out: dict[str, Any] = {}
    for length in lengths:
        recs = [r for r in records if r["length"] == length]
        per: dict[str, Any] = {}
        for p in policies:
            rs = [r["policies"][p] for r in recs if p in r["policies"]]
            correct = sum(bool(x["correct"]) for x in rs)
            per[p] = {
                "trials": len(rs),
                "correct": correct,
                "accuracy": correct / len(rs) if rs else None,
                "working_tokens_mean": mean([x["working_tokens"] for x in rs]),
                "max_working_tokens": max((x["max_working_tokens"] for x in rs), default=None),
                "needle_in_cache_rate": mean([float(x["needle_in_cache"]) for x in rs]),
                "decode_s_mean": mean([x["decode_s"] for x in rs]),
                "draft_prefill_s_mean": mean([x["draft_prefill_s"] for x in rs if "draft_prefill_s" in x]),
            }
        acc = {p: per[p]["accuracy"] for p in policies}
        rel = acc.get("cmr") / acc["full"] if acc.get("cmr") is not None and acc.get("full") else None
        ranks = [r["needle_chunk_rank"] for r in recs if r.get("needle_chunk_rank") is not None]
        entry: dict[str, Any] = {
            "trials": len(recs),
            "policies": per,
            "cmr_over_full": rel,
            "prompt_tokens_mean": mean([r["prompt_tokens"] for r in recs]),
            "needle_chunk_rank_median": sorted(ranks)[len(ranks) // 2] if ranks else None,
            "target_prefill_s_mean": mean([r["target_prefill_s"] for r in recs]),
            "trial_s_mean": mean([r["trial_s"] for r in recs]),
        }
        if rel is not None and acc.get("streaming") is not None:
            entry["goal_met"] = rel >= GOAL_CMR_OVER_FULL and acc["streaming"] < GOAL_STREAMING_BELOW
        out[length] = entry
    return {"lengths": out, "goal": {"cmr_over_full_at_least": GOAL_CMR_OVER_FULL,
                                     "streaming_accuracy_below": GOAL_STREAMING_BELOW}}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(summary: dict[str, Any]) -> str:
    rows = [f"{'length':<7} {'policy':<10} {'accuracy':>13} {'working tokens':>15} {'needle kept':>12} "
            f"{'draft prefill s':>16}"]
    notes = []
    for length, e in summary["lengths"].items():
        for p, d in e["policies"].items():
            acc = f"{d['correct']}/{d['trials']} {_f(d['accuracy'], '.2f')}"
            rows.append(f"{length:<7} {p:<10} {acc:>13} {_f(d['working_tokens_mean'], '.0f'):>15} "
                        f"{_f(d['needle_in_cache_rate'], '.2f'):>12} {_f(d.get('draft_prefill_s_mean'), '.1f'):>16}")
        goal = {True: "met", False: "not met"}.get(e.get("goal_met"), "n/a")
        notes.append(
            f"{length}: cmr/full {_f(e['cmr_over_full'], '.2f')} (goal >= {GOAL_CMR_OVER_FULL}), streaming "
            f"{_f(e['policies'].get('streaming', {}).get('accuracy'), '.2f')} (goal < {GOAL_STREAMING_BELOW}): "
            f"{goal}; prompt {_f(e['prompt_tokens_mean'], '.0f')} tok, needle chunk rank (median) "
            f"{e['needle_chunk_rank_median']}; per trial {_f(e['trial_s_mean'], '.0f')} s (target prefill "
            f"{_f(e['target_prefill_s_mean'], '.0f')} s)"
        )
    return "\n".join([*rows, "", *notes])


# --------------------------------------------------------------------------- data and results


def data_dir(given: str | None) -> Path:
    """--data, else the GovReport folder under the data roots ($SPECEXTEND_DATA, ../shared/data)."""
    candidates = [Path(given)] if given else data_roots()
    for c in candidates:
        c = c.expanduser()
        # A data root holding govreport/ is accepted as well as the govreport folder itself.
        for d in (c, c / "govreport"):
            if d.is_dir() and any(d.glob("govreport_*.jsonl")):
                return d
    raise UserError(f"no govreport_*.jsonl found in {', '.join(map(str, candidates))} (give --data DIR)")


def parse_lengths(text: str) -> list[str]:
    """Haystack labels, as the files name them (govreport_<LABEL>.jsonl): '4k,8K' -> ['4K', '8K']."""
    return list(dict.fromkeys(x.upper() for x in split_list(text, "--lengths")))


def load_haystacks(folder: Path, length: str) -> list[str]:
    path = folder / f"govreport_{length}.jsonl"
    if not path.is_file():
        have = sorted(p.stem.removeprefix("govreport_") for p in folder.glob("govreport_*.jsonl"))
        raise UserError(f"no haystack file for length {length!r} in {folder} (have: {', '.join(have)})")
    return read_texts(path)


# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    add_model_arguments(p)
    t = p.add_argument_group("trials")
    t.add_argument("--data", help=f"folder with govreport_<LEN>.jsonl (default: govreport/ in ${DATA_ENV} or "
                                  "../shared/data beside the repository)")
    t.add_argument("--lengths", default="4K,8K", help="haystack lengths, comma-separated (default: 4K,8K)")
    t.add_argument("--trials", type=int, default=20, help="trials per length (default: 20)")
    t.add_argument("--seed", type=int, default=0, help="seed of needle depths and passphrases (default: 0)")
    t.add_argument("--max-new-tokens", type=int, default=20, help="answer tokens at most (default: 20)")
    c = p.add_argument_group("draft cache (streaming and cmr get the same token budget)")
    c.add_argument("--budget", type=int, help="working-cache tokens = top-k-chunks x chunk-size "
                                              "(sets --top-k-chunks)")
    c.add_argument("--chunk-size", type=int, default=d.chunk_size, help=f"(default: {d.chunk_size})")
    c.add_argument("--top-k-chunks", type=int, help=f"(default: {d.top_k_chunks}, or budget / chunk-size)")
    c.add_argument("--positions", choices=POSITION_MODES, default=d.positions,
                   help=f"working-cache positions (default: {d.positions})")
    c.add_argument("--retrieval-layer", type=int, default=d.retrieval_layer,
                   help=f"target layer whose attention ranks chunks (default: {d.retrieval_layer})")
    c.add_argument("--retrieval-layers-mean", type=int, default=d.retrieval_layers_mean,
                   help=f"average this many layers ending at --retrieval-layer (default: {d.retrieval_layers_mean})")
    c.add_argument("--sink-tokens", type=int, default=d.sink_tokens, help=f"(default: {d.sink_tokens})")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="results/needle",
                   help=f"folder for {RESULTS_FILE} (resumable) and {SUMMARY_FILE} (default: results/needle)")
    o.add_argument("--json", action="store_true", help="print the summary as JSON instead of the table")
    o.add_argument("-q", "--quiet", action="store_true", help="no loading messages or progress bar")


def needle_settings(args: argparse.Namespace) -> Settings:
    """The trials' settings: CMR's options from the command line, one budget for both selective caches."""
    chunk = args.chunk_size
    top_k = args.top_k_chunks
    if args.budget is not None:
        if args.budget < chunk or args.budget % chunk:
            raise UserError(f"--budget {args.budget} must be a positive multiple of --chunk-size {chunk}")
        if top_k is not None and top_k * chunk != args.budget:
            raise UserError(f"--budget {args.budget} disagrees with --top-k-chunks {top_k} x --chunk-size {chunk}")
        top_k = args.budget // chunk
    s = Settings(method="specextend", chunk_size=chunk, top_k_chunks=top_k or Settings().top_k_chunks,
                 positions=args.positions, retrieval_layer=args.retrieval_layer,
                 retrieval_layers_mean=args.retrieval_layers_mean, sink_tokens=args.sink_tokens,
                 max_new_tokens=args.max_new_tokens, seed=args.seed)
    return s.resolved()


def run_config(pair: Pair, s: Settings) -> dict[str, Any]:
    """What a record depends on: a rerun reuses records only when this is unchanged."""
    keys = ("chunk_size", "top_k_chunks", "positions", "retrieval_layer", "retrieval_layers_mean", "sink_tokens",
            "attention", "max_new_tokens", "seed")
    cfg = {k: asdict(s)[k] for k in keys}
    cfg.update(target=str(pair.target_path), draft=str(pair.draft_path), dtype=pair.dtype,
               draft_dtype=pair.draft_dtype, device=pair.device, policies=list(POLICIES))
    return cfg


def sweep(pair: Pair, s: Settings, lengths: Sequence[str], trials: int, folder: Path, out: Path, config: dict,
          quiet: bool = False) -> list[dict[str, Any]]:
    """Run every trial not yet in out/trials.jsonl; returns this config's records."""
    path = out / RESULTS_FILE
    old = read_rows(path)
    mine = [r for r in old if r.get("config") == config]
    if len(mine) < len(old) and not quiet:
        print(f"needle: ignoring {len(old) - len(mine)} records in {path} made with other settings",
              file=sys.stderr)
    done = {(r["length"], r["trial"]) for r in mine}
    haystacks = {length: load_haystacks(folder, length) for length in lengths}
    # Interleave lengths, so a run stopped early has results at every length.
    todo = [(length, i) for i in range(trials) for length in lengths if (length, i) not in done]
    if todo:
        from tqdm import tqdm

        # Weight progress by haystack size: a longer trial takes longer, so the ETA stays honest.
        weight = {length: len(haystacks[length][0]) for length in lengths}
        bar = tqdm(total=sum(weight[x] for x, _ in todo), disable=quiet, unit="ch", unit_scale=True,
                   desc="needle", file=sys.stderr, dynamic_ncols=True,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")
        for k, (length, i) in enumerate(todo):
            texts = haystacks[length]
            hay, depth, phrase = trial_spec(config["seed"], i, len(texts))
            trial = make_trial(texts[hay], pair.tokenizer, depth, phrase, length=length, index=i, haystack=hay)
            bar.set_description_str(f"needle {k + 1}/{len(todo)}: {length} #{i} ({len(trial.prompt_ids)} tok)")
            rec = run_trial(pair, trial, s, s.max_new_tokens)
            rec["config"] = config
            append_jsonl(path, rec)
            mine.append(rec)
            bar.update(weight[length])
            if not quiet:
                marks = " ".join(f"{p}={'ok' if v['correct'] else 'x'}" for p, v in rec["policies"].items())
                bar.write(f"needle {length} #{i}: {marks} ({rec['trial_s']:.0f} s)", file=sys.stderr)
        bar.close()
    return [r for r in mine if r["length"] in lengths and r["trial"] < trials]


def run(args: argparse.Namespace) -> int:
    if args.trials < 1:
        raise UserError(f"--trials must be >= 1, got {args.trials}")
    s = needle_settings(args)
    lengths = parse_lengths(args.lengths)
    folder = data_dir(args.data)
    for length in lengths:
        load_haystacks(folder, length)  # a bad length fails before the models load
    from .. import api

    pair = api.load(args.target, args.draft, **model_options(args), progress=not args.quiet)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = run_config(pair, s)
    records = sweep(pair, s, lengths, args.trials, folder, out, config, quiet=args.quiet)
    summary = summarise(records, lengths)
    summary["config"] = config
    summary["data"] = str(folder)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m specextend.bench.needle` (the same as `specextend needle`)."""
    p = argparse.ArgumentParser(prog="specextend needle", description=__doc__.splitlines()[0])
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except UserError as e:
        print(f"specextend needle: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
