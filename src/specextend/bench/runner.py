"""`specextend bench`: time decoding methods over a data set and write results, summary and plots.

    specextend bench --out runs/x [--data PATH ...] [--methods ar,sd,specextend] [--samples 3]
                     [--max-new-tokens 128] [--lengths 1K,4K] [--set chunk_size=64] ...

Methods: the `generate` presets (`ar`, `sd`, `specextend`), ablations written `base+mod` (see
MODIFIERS, e.g. `sd+cmr`, `specextend+full`, or any setting as `specextend+retrieve_every=4`),
the transformers baselines `hf-ar`, `hf-assisted`, `hf-lookup` (hf_baselines.py), and the llama.cpp
peers `llamacpp-ar`, `llamacpp-sd`, `llamacpp-lookup` on the same GGUF files (llamacpp.py; `make peers`).

Order of work, chosen for time and memory:
1. everything the user typed is checked, data read and tokenised, and every prompt checked
   against the models' context before any weights are read (bad input: exit 2, one line);
2. our models are loaded once; per sample and attention backend the prompt is prefilled ONCE
   and decoded by every method using that backend (`ar` first, so the others can be compared
   with it token for token); the prefill time is reported in each of those rows (target only
   for `ar`, which needs no draft). With --prefill shared there is one prefill per sample, on
   the efficient backend, and every method decodes from it: the KV cache is the same whichever
   kernel wrote it, and on a small CPU a second prefill costs more than all of decoding;
3. our models are freed; the llama.cpp peers run, one llama-server per method; then the HF
   baselines run with HF copies of the weights.

Outputs in --out: results.jsonl (one JSON line per sample x method, appended with flush + fsync),
summary.md, speedup.png, accepted.png (rewritten atomically after every row). Re-running with
the same --out skips rows already there (same data, sample, method and settings hash).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..common.errors import UserError
from ..common.jsonl import append_jsonl, read_rows
from ..common.settings import DRAFT_CACHES, METHODS, Settings, parse_assignments
from ..options import add_model_arguments, check_model_options, model_options
from .data import (
    BUILTIN_LENGTHS,
    Sample,
    builtin_code_inputs,
    data_length,
    encode_samples,
    is_builtin,
    load_jsonl_inputs,
    parse_lengths,
)
from .hf_baselines import HF_METHODS, HFSettings
from .llamacpp import LLAMACPP_METHODS, LlamaCppSettings, Peer, is_llamacpp, parse_llamacpp_method, prefix_match
from .report import RESULTS, aggregate, summary_tables, write_report

DEFAULT_METHODS = "ar,sd,specextend"
# Drawing the plots takes CPU time from the runs being timed: redraw them after a row only when
# this long has passed since the last redraw (always at the end, also of an interrupted run).
# summary.md follows every row.
PLOT_EVERY_S = 20.0

# Ablation modifiers: `base+mod` sets one Settings field on top of the base preset.
MODIFIERS: dict[str, tuple[str, str]] = {
    **{name: ("draft_cache", name) for name in DRAFT_CACHES},
    "efficient": ("attention", "efficient"),
    "eager": ("attention", "eager"),
    "chain": ("tree", "chain"),
    "dynamic": ("tree", "dynamic"),
}
PREFILL_MODES = ("per-backend", "shared")
# What ar's single-model loop reads; any other modifier on ar would change nothing.
AR_SETTINGS = {"attention", "temperature", "top_p", "seed"}
# Settings that --methods and --max-new-tokens own; --set may not touch them.
RESERVED = {
    "method": "--methods (e.g. sd+cmr)",
    "draft_cache": "--methods (e.g. sd+cmr)",
    "attention": "--methods (e.g. sd+cmr)",
    "max_new_tokens": "--max-new-tokens",
}


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)

    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", default=None, metavar="PATH",
                      help="JSONL files (field `text`) or folders of them; a bare name such as `govreport` is "
                           "looked up in $SPECEXTEND_DATA and ../shared/data; `stdlib` is the built-in long-code "
                           "set (default: the built-in set)")
    data.add_argument("--lengths", default=None,
                      help="input lengths to run, e.g. 1K,4K: the built-in set's cuts (default: "
                           f"{','.join(f'{n // 1024}K' for n in BUILTIN_LENGTHS)}), and a filter on JSONL files "
                           "named like govreport_4K.jsonl")
    data.add_argument("--samples", type=int, default=3, help="samples per data set (default: 3)")
    data.add_argument("--no-chat", dest="chat", action="store_false",
                      help="tokenise prompts as raw text instead of a chat-template user turn")

    method = p.add_argument_group("methods and settings")
    method.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated: {', '.join(METHODS)}, ablations base+mod with mod in "
                             f"{', '.join(MODIFIERS)} or a setting key=value (e.g. sd+cmr, "
                             f"specextend+retrieve_every=4), {', '.join(HF_METHODS)}, and the llama.cpp "
                             f"peers {', '.join(LLAMACPP_METHODS)} (installed by `make peers`; settings as "
                             f"e.g. llamacpp-sd+draft_max=8) (default: {DEFAULT_METHODS})")
    method.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per run (default: 128)")
    method.add_argument("--prefill", choices=PREFILL_MODES, default="per-backend",
                        help="per-backend: each sample is prefilled once per attention backend and each method's "
                             "row times its own backend's prefill; shared: one prefill per sample (efficient "
                             "attention if any method uses it) reused by every method, rows of other backends "
                             "record prefill_attention; decode is timed per method either way (default: "
                             "per-backend)")
    method.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a generation setting for every method (e.g. chunk_size=64, top_k_chunks=16, "
                             "retrieve_every=4, tree_budget=16, temperature=0.7); repeatable")

    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="DIR",
                     help="results folder: results.jsonl, summary.md, speedup.png, accepted.png; "
                          "re-running with the same folder resumes")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar or loading messages")


# --------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class MethodSpec:
    name: str  # as written in --methods
    settings: Settings | None = None  # resolved, for our engine's methods
    hf: HFSettings | None = None  # for the transformers baselines
    llamacpp: LlamaCppSettings | None = None  # for the llama.cpp peers

    @property
    def is_hf(self) -> bool:
        return self.hf is not None

    @property
    def needs_draft(self) -> bool:
        if self.is_hf:
            return self.name == "hf-assisted"
        if self.llamacpp is not None:
            return self.llamacpp.needs_draft
        return self.settings is not None and self.settings.uses_draft

    @property
    def max_new_tokens(self) -> int:
        for s in (self.settings, self.hf, self.llamacpp):
            if s is not None:
                return s.max_new_tokens
        raise AssertionError("a method without settings")

    def config(self) -> dict[str, Any]:
        if self.hf is not None:
            return self.hf.config(self.name)
        if self.llamacpp is not None:
            return self.llamacpp.config(self.name)
        assert self.settings is not None
        return self.settings.as_dict()


def parse_set(items: list[str], where: str = "--set") -> dict[str, Any]:
    """--set KEY=VALUE items -> Settings field values (unknown or reserved keys: UserError)."""
    return parse_assignments(items, where, refused=RESERVED)


def parse_method(name: str, base: Settings) -> MethodSpec:
    if name in HF_METHODS:
        return MethodSpec(name, hf=HFSettings(base.max_new_tokens, base.temperature, base.top_p, base.seed))
    if is_llamacpp(name):
        return MethodSpec(name, llamacpp=parse_llamacpp_method(name, base.max_new_tokens, base.temperature,
                                                               base.top_p, base.seed))
    preset, *mods = name.split("+")
    if preset not in METHODS:
        raise UserError(f"unknown method {name!r}; choose from {', '.join(METHODS)}, ablations like sd+cmr, "
                        f"{', '.join(HF_METHODS)} and {', '.join(LLAMACPP_METHODS)}")
    changes: dict[str, Any] = {}
    for mod in mods:
        if "=" in mod:
            # `+key=value`: any --set setting for this method alone, e.g. specextend+retrieve_every=4.
            ((field_name, value),) = parse_set([mod], where=f"method {name}:").items()
        elif mod in MODIFIERS:
            field_name, value = MODIFIERS[mod]
        else:
            raise UserError(f"unknown modifier +{mod} in {name!r}; choose from {', '.join(MODIFIERS)} "
                            "or a setting written key=value")
        if field_name in changes:
            raise UserError(f"method {name!r} sets {field_name} twice")
        if preset == "ar" and field_name not in AR_SETTINGS:
            raise UserError(f"method {name!r}: ar uses no draft, so +{mod} means nothing")
        changes[field_name] = value
    return MethodSpec(name, settings=replace(base, method=preset, **changes).resolved())


def parse_methods(text: str, base: Settings) -> list[MethodSpec]:
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise UserError("--methods is empty")
    return [parse_method(n, base) for n in names]


def prefill_attention(spec: MethodSpec, specs: list[MethodSpec], mode: str) -> str:
    """The attention backend whose prefill `spec`'s decode starts from."""
    assert spec.settings is not None
    if mode == "per-backend":
        return spec.settings.attention
    used = [sp.settings.attention for sp in specs if sp.settings is not None]
    # Efficient prefill is the fastest and never materialises an L x L matrix; the KV it leaves is
    # the same cache every backend decodes from.
    return "efficient" if "efficient" in used else used[0]


def engine_groups(specs: list[MethodSpec], mode: str = "per-backend") -> list[tuple[str, list[MethodSpec]]]:
    """Our methods grouped by the prefill they decode from (one prefill each); `ar` and its group first."""
    groups: dict[str, list[MethodSpec]] = {}
    for sp in specs:
        if sp.settings is not None:
            groups.setdefault(prefill_attention(sp, specs, mode), []).append(sp)
    for g in groups.values():
        g.sort(key=lambda sp: sp.name != "ar")
    return sorted(groups.items(), key=lambda kv: kv[1][0].name != "ar")


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    out: Path
    specs: list[MethodSpec]
    base: Settings
    jsonl: list[Sample]  # read and checked, not yet tokenised
    builtin: bool
    lengths: list[int] | None
    samples: int
    chat: bool
    prefill: str = "per-backend"
    peer: Peer | None = None  # llama.cpp's server, when a llamacpp-* method is asked for
    gguf: tuple[Path, Path | None] | None = None  # (target, draft) GGUF files for the llama.cpp peers


def make_plan(args: argparse.Namespace) -> Plan:
    """Every check that needs no model: numbers, methods, settings, data files, the output folder."""
    if args.samples is None or args.samples <= 0:
        raise UserError(f"--samples must be a positive integer, got {args.samples}")
    if args.max_new_tokens is None or args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    check_model_options(args)
    base = Settings(max_new_tokens=args.max_new_tokens, **parse_set(args.set))
    specs = parse_methods(args.methods, base)
    specs, peer = with_peer(specs)
    lengths = parse_lengths(args.lengths) if args.lengths is not None else None

    items = args.data or ["stdlib"]
    builtin = any(is_builtin(i) for i in items)
    paths = [i for i in items if not is_builtin(i)]
    jsonl: list[Sample] = []
    if paths:
        # Read and check every record now; keep only what the length filter selects.
        jsonl = load_jsonl_inputs(paths, limit=args.samples)
        if lengths is not None:
            jsonl = [s for s in jsonl if data_length(s.data) in lengths]
            if not jsonl:
                raise UserError(f"no data file matches --lengths {args.lengths}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {args.out} exists and is not a folder")
    if (out / RESULTS).exists() and not (out / RESULTS).is_file():
        raise UserError(f"{out / RESULTS} is not a file")
    return Plan(out, specs, base, jsonl, builtin, lengths, args.samples, args.chat, args.prefill, peer)


def with_peer(specs: list[MethodSpec]) -> tuple[list[MethodSpec], Peer | None]:
    """Find llama.cpp's server if a llamacpp-* method is asked for (refused here, before any model is read,
    when it is not installed) and stamp its version into those methods' settings."""
    from .llamacpp import find_peer

    first = next((sp for sp in specs if sp.llamacpp is not None), None)
    if first is None:
        return specs, None
    peer = find_peer(first.name)
    return [replace(sp, llamacpp=replace(sp.llamacpp, version=peer.version, cpu=peer.cpu))
            if sp.llamacpp is not None else sp for sp in specs], peer


def load_samples(plan: Plan, tokenizer: Any) -> list[Sample]:
    samples: list[Sample] = []
    if plan.builtin:
        samples += builtin_code_inputs(tokenizer, plan.lengths or BUILTIN_LENGTHS, plan.samples, plan.chat)
    if plan.jsonl:
        encode_samples(plan.jsonl, tokenizer, plan.chat)
        samples += plan.jsonl
    for s in samples:
        if not s.prompt_ids:
            raise UserError(f"{s.data} sample {s.sample} encodes to no tokens")
    return samples


def check_context(prepared: Any, samples: list[Sample], specs: list[MethodSpec]) -> None:
    """Every prompt + new tokens within every model's context, before any weights are read."""
    longest = max(samples, key=lambda s: s.input_tokens)
    for sp in specs:
        try:
            if sp.settings is not None:
                prepared.check_fits(longest.input_tokens, sp.settings)
            else:
                limit = prepared.context
                if longest.input_tokens + sp.max_new_tokens > limit:
                    raise UserError(f"a prompt of {longest.input_tokens} tokens + {sp.max_new_tokens} new "
                                    f"tokens exceeds the target's context of {limit} tokens")
        except UserError as e:
            raise UserError(f"{longest.data} sample {longest.sample} with {sp.name}: {e}") from None


# --------------------------------------------------------------------------- rows and keys


def settings_hash(run: dict[str, Any], spec: MethodSpec, sample: Sample, prefill: str | None = None) -> str:
    """What makes a row reusable: models, dtypes, device, the method's resolved settings, the
    exact prompt tokens, and the prefill's backend where it is not the method's own."""
    prompt = hashlib.sha256(json.dumps(sample.prompt_ids).encode()).hexdigest()
    models = dict(run)
    if not spec.needs_draft:
        models.pop("draft", None)
        models.pop("draft_dtype", None)
    key: dict[str, Any] = {"models": models, "config": spec.config(), "prompt": prompt}
    if spec.settings is not None and prefill is not None and prefill != spec.settings.attention:
        key["prefill_attention"] = prefill
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def row_key(row: dict[str, Any]) -> tuple:
    return (row.get("data"), row.get("sample"), row.get("method"), row.get("settings_hash"))


# --------------------------------------------------------------------------- the run


class Bench:
    """State of one run: keys, rows written so far, the ar outputs to compare against."""

    def __init__(self, plan: Plan, prepared: Any, samples: list[Sample], quiet: bool) -> None:
        self.plan, self.prepared, self.samples, self.quiet = plan, prepared, samples, quiet
        self.run_info = {
            "target": str(prepared.target_path),
            "draft": str(prepared.draft_path) if prepared.draft_path is not None else None,
            "dtype": prepared.dtype,
            "draft_dtype": prepared.draft_dtype or prepared.dtype,
            "device": prepared.device,
        }
        self.keys = {(s.data, s.sample, sp.name): settings_hash(self.run_info, sp, s, self._prefill_of(sp))
                     for s in samples for sp in plan.specs}
        self.results = plan.out / RESULTS
        existing = read_rows(self.results, repair=True)
        wanted = {(*k, h) for k, h in self.keys.items()}
        self.rows: dict[tuple, dict[str, Any]] = {row_key(r): r for r in existing if row_key(r) in wanted}
        self.bar: Any = None
        self.plotted_at = -math.inf

    # ----------------------------------------------------------------- bookkeeping

    def _prefill_of(self, spec: MethodSpec) -> str | None:
        return None if spec.settings is None else prefill_attention(spec, self.plan.specs, self.plan.prefill)

    def key(self, sample: Sample, spec: MethodSpec) -> tuple:
        return (sample.data, sample.sample, spec.name, self.keys[(sample.data, sample.sample, spec.name)])

    def done(self, sample: Sample, spec: MethodSpec) -> bool:
        return self.key(sample, spec) in self.rows

    def pending(self) -> list[tuple[Sample, MethodSpec]]:
        return [(s, sp) for s in self.samples for sp in self.plan.specs if not self.done(s, sp)]

    def ar_ids(self, sample: Sample) -> list[int] | None:
        ar = next((sp for sp in self.plan.specs if sp.name == "ar"), None)
        row = self.rows.get(self.key(sample, ar)) if ar is not None else None
        return row.get("token_ids") if row is not None else None

    def record(self, sample: Sample, spec: MethodSpec, row: dict[str, Any]) -> None:
        ar = self.ar_ids(sample)
        row.update(
            data=sample.data,
            sample=sample.sample,
            source=sample.source,
            input_tokens=sample.input_tokens,
            settings_hash=self.keys[(sample.data, sample.sample, spec.name)],
            matches_ar=True if spec.name == "ar" else (row["token_ids"] == ar if ar is not None else None),
            # Peers' numerics differ from ours, so after a near-tie they part: how far they agree first.
            ar_prefix_match=len(row["token_ids"]) if spec.name == "ar" else prefix_match(row["token_ids"], ar),
            finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        append_jsonl(self.results, row)  # a killed run loses at most a partial last line
        self.rows[row_key(row)] = row
        self.report(final=False)
        if self.bar is not None:
            self.bar.update(1)

    def report(self, final: bool) -> None:
        plots = final or time.monotonic() - self.plotted_at >= PLOT_EVERY_S
        write_report(self.plan.out, self.ordered_rows(), plots=plots)
        if plots:
            self.plotted_at = time.monotonic()

    def ordered_rows(self) -> list[dict[str, Any]]:
        order = {(s.data, s.sample, sp.name): i for i, (s, sp) in
                 enumerate((s, sp) for s in self.samples for sp in self.plan.specs)}
        return sorted(self.rows.values(), key=lambda r: order.get((r["data"], r["sample"], r["method"]), 0))

    def say(self, message: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(f"specextend: {message}", file=sys.stderr)
        else:
            print(f"specextend: {message}", file=sys.stderr, flush=True)

    def _status(self, sample: Sample, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{sample.data} #{sample.sample} {what}", refresh=True)

    # ----------------------------------------------------------------- our engine

    def run_engine(self) -> None:
        todo = [(s, sp) for s, sp in self.pending() if sp.settings is not None]
        if not todo:
            return
        pair = self.prepared.load()
        pair.warmup()  # kernel builds would otherwise land in the first method's timings
        try:
            for sample in self.samples:
                for attention, specs in engine_groups(self.plan.specs, self.plan.prefill):
                    waiting = [sp for sp in specs if not self.done(sample, sp)]
                    if waiting:
                        self._run_group(pair, sample, waiting, attention)
        finally:
            # Free our weights before the HF baselines load theirs.
            del pair
            gc.collect()

    def _run_group(self, pair: Any, sample: Sample, specs: list[MethodSpec], attention: str) -> None:
        # Prefill with a speculative method's settings if any, so the state has a draft store.
        first = next((sp for sp in specs if sp.needs_draft), specs[0])
        assert first.settings is not None
        self._status(sample, f"prefill ({attention})")
        state = pair.prefill(sample.prompt_ids, replace(first.settings, attention=attention))
        try:
            for sp in specs:
                assert sp.settings is not None
                self._status(sample, sp.name)
                state.forget_draft()  # each method computes the draft's prompt KV it reads, as alone
                row = self._engine_row(sp, pair.decode(state, sp.settings), state.target_s)
                row["prefill_attention"] = state.attention
                self.record(sample, sp, row)
        finally:
            del state

    def _engine_row(self, spec: MethodSpec, res: Any, target_s: float) -> dict[str, Any]:
        """The `generate --json` object, named by the method as written. Its prefill is its own:
        the shared target prefill (`target_s`), plus the draft's prompt KV this method's decode
        computed (each method starts from none), so `total_s` is what a user of this method alone
        waits for."""
        row = res.to_json()
        draft_s = float((res.extra or {}).get("draft_prefill_s", 0.0))
        row.update(method=spec.name, preset=res.settings.method, prefill_target_s=target_s, prefill_draft_s=draft_s)
        return row

    # ----------------------------------------------------------------- llama.cpp peers

    def run_llamacpp(self) -> None:
        from . import llamacpp

        todo = [(s, sp) for s, sp in self.pending() if sp.llamacpp is not None]
        if not todo:
            return
        assert self.plan.peer is not None and self.plan.gguf is not None
        target, draft = self.plan.gguf
        tok = self.prepared.tokenizer
        dtype = llamacpp.gguf_file_type(target)
        longest = max(s.input_tokens for s in self.samples)
        context = self.prepared.context
        for spec in dict.fromkeys(sp for _, sp in todo):  # one server per method, in --methods order
            s = spec.llamacpp
            assert s is not None
            samples = [sample for sample, sp in todo if sp is spec]
            n_ctx = llamacpp.context_size(longest, s.max_new_tokens, max(s.draft_max, s.ngram_m), context)
            self.say(f"{spec.name}: starting llama-server {self.plan.peer.version}")
            with llamacpp.running(self.plan.peer, s, target, draft, n_ctx, samples[0].prompt_ids, self.say) as server:
                info = llamacpp.server_info(server)
                for sample in samples:
                    self._status(sample, spec.name)
                    resp, wall = server.complete(sample.prompt_ids, s.max_new_tokens)
                    m = llamacpp.measurements(resp, wall, sample.prompt_ids)
                    m["extra"]["server"] = info
                    self.record(sample, spec, {
                        "method": spec.name,
                        "preset": None,
                        "target": str(target),
                        "draft": str(draft) if s.needs_draft else None,
                        "dtype": dtype,
                        "draft_dtype": llamacpp.gguf_file_type(draft) if s.needs_draft and draft else None,
                        "device": "cpu",
                        "config": llamacpp.row_config(spec.config(), server),
                        "text": tok.decode(m["token_ids"], skip_special_tokens=True,
                                           clean_up_tokenization_spaces=False),
                        **m,
                    })

    # ----------------------------------------------------------------- HF baselines

    def run_hf(self) -> None:
        todo = [(s, sp) for s, sp in self.pending() if sp.is_hf]
        if not todo:
            return
        from ..models.loader import parse_dtype
        from .hf_baselines import HFBaselines

        p = self.prepared
        tok = p.tokenizer
        eos = p.eos_ids
        hf = HFBaselines(p.target_path, p.draft_path, parse_dtype(p.dtype),
                         parse_dtype(p.draft_dtype or p.dtype), p.device)
        try:
            for sample, sp in todo:
                assert sp.hf is not None
                self._status(sample, sp.name)
                m = hf.run(sp.name, sample.prompt_ids, sp.hf, eos)
                self.record(sample, sp, self._hf_row(sp, sample, m, tok))
        finally:
            hf.close()

    def _hf_row(self, spec: MethodSpec, sample: Sample, m: dict[str, Any], tok: Any) -> dict[str, Any]:
        assisted = spec.name == "hf-assisted"
        return {
            "method": spec.name,
            "preset": None,
            "target": self.run_info["target"],
            "draft": self.run_info["draft"] if assisted else None,
            "dtype": self.run_info["dtype"],
            "draft_dtype": self.run_info["draft_dtype"] if assisted else None,
            "device": self.run_info["device"],
            "config": spec.config(),
            "prompt_tokens": sample.input_tokens,
            "text": tok.decode(m["token_ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False),
            **m,
        }

    # ----------------------------------------------------------------- all

    def run(self, progress_factory: Callable[..., Any] | None) -> None:
        total = len(self.samples) * len(self.plan.specs)
        done = total - len(self.pending())
        if done:
            self.say(f"resuming: {done} of {total} runs already in {self.results}")
        if progress_factory is not None and not self.quiet:
            self.bar = progress_factory(total=total, initial=done, desc="bench", unit="run", file=sys.stderr,
                                        dynamic_ncols=True)
        try:
            self.run_engine()
            self.run_llamacpp()
            self.run_hf()
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            # Also after Ctrl-C: the plots then show every row written.
            self.report(final=True)


def run(args: argparse.Namespace) -> int:
    """`specextend bench`; returns the exit status (bad input raises UserError -> 2)."""
    from tqdm import tqdm

    from .. import api

    plan = make_plan(args)
    needs_draft = any(sp.needs_draft for sp in plan.specs)
    t0 = time.perf_counter()
    prepared = api.prepare(args.target, args.draft, **model_options(args), load_draft=needs_draft,
                       progress=not args.quiet)
    if plan.peer is not None:
        # After `prepare`, which pulls the default pair (and so its GGUF files) on first use.
        from .llamacpp import gguf_for

        sd = any(sp.llamacpp is not None and sp.llamacpp.needs_draft for sp in plan.specs)
        plan.gguf = (gguf_for(args.target, "target"), gguf_for(args.draft, "draft") if sd else None)
    samples = load_samples(plan, prepared.tokenizer)
    check_context(prepared, samples, plan.specs)
    plan.out.mkdir(parents=True, exist_ok=True)

    bench = Bench(plan, prepared, samples, args.quiet)
    bench.run(tqdm)
    rows = bench.ordered_rows()
    print(summary_tables(aggregate(rows)))
    if not args.quiet:
        print(f"specextend: {len(rows)} rows in {plan.out / RESULTS}; summary.md, speedup.png, accepted.png "
              f"written ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0
