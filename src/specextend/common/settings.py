"""Generation settings, method presets, their validation, and the one KEY=VALUE parser
(`generate --set`, `bench --set`, bench's `base+key=value`, the sweep's `--base`/`--grid`).

A `Settings` is frozen. `resolved()` fills the preset's choices and checks every value; the API
resolves a caller's settings once per call (`Pair.settings`) and the engine takes the resolved
value as it is. This module imports nothing heavy: the command line reads its names and defaults
for `--help`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from .errors import UserError

METHODS = ("ar", "sd", "specextend", "lookup")
# The draft KV policies (`--draft-cache`); speculation/draft_policy.py registers one class under each name.
DRAFT_CACHES = ("full", "streaming", "cmr")
ATTENTIONS = ("eager", "efficient")
# The target's KV cache kinds (`--kv-cache`, a load option): bfloat16 rows, or int8 rows with a
# bfloat16 scale per 32 values (runtime/kv_cache.py).
KV_CACHES = ("bf16", "q8")
TREES = ("chain", "dynamic")
SEED_MAX = 2**64 - 1  # a random generator's seed: 64 bits
POSITION_MODES = ("compact", "original")
DRAFT_PREFILLS = ("selected", "full")
DRAFT_HORIZONS = ("produced", "budget")
RETRIEVAL_QUERIES = ("last", "path")


def check_context(tokens: Any) -> None:
    """A `--max-context` value (a load option, beside KV_CACHES): a whole number of tokens >= 1."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise UserError(f"--max-context must be a whole number of tokens >= 1, not {tokens!r}")

# What each preset means (the contract): sd = standard tree speculative decoding; specextend =
# efficient attention + cross-model retrieval for the draft, the tree sized each step from the
# measured step costs, and prompt-lookup candidates fused into it; lookup = the target with
# prompt-lookup candidates alone (no draft model), sized the same way.
PRESETS: dict[str, dict[str, Any]] = {
    "ar": {"draft_cache": None, "attention": "efficient", "cost_model": False, "lookup": False},
    "sd": {"draft_cache": "full", "attention": "eager", "cost_model": False, "lookup": False},
    "specextend": {"draft_cache": "cmr", "attention": "efficient", "cost_model": True, "lookup": True},
    "lookup": {"draft_cache": None, "attention": "efficient", "cost_model": True, "lookup": True},
}
DRAFTLESS = ("ar", "lookup")  # methods that never load or run a draft model


@dataclass(frozen=True)
class Settings:
    method: str = "specextend"
    draft_cache: str | None = None  # None: the preset's
    attention: str | None = None  # None: the preset's
    # Tree sizing from the measured step costs (speculation/sizing.py), down to no tree (an `ar` step), and
    # prompt-lookup candidates fused into the tree (speculation/prompt_lookup.py). None: the preset's.
    cost_model: bool | None = None
    lookup: bool | None = None
    lookup_ngram: int = 4  # longest suffix of the committed tokens matched against the context
    lookup_branches: int = 2  # distinct continuations proposed per step, at most
    lookup_length: int = 8  # tokens per continuation, at most
    # Cross-model retrieval (and the streaming baseline's budget): the contract's defaults (32
    # chunks of 32 tokens, refreshed every 8 steps), which the retrieval sweeps kept (docs/benchmarks.md).
    chunk_size: int = 32
    top_k_chunks: int = 32
    retrieve_every: int = 8
    retrieval_layer: int = -1  # target layer whose attention ranks chunks; -1 = last
    retrieval_layers_mean: int = 1  # average the scores of this many layers ending at retrieval_layer
    retrieval_query: str = "last"  # last accepted token, or "path": mean over the accepted path
    adaptive_refresh: bool = False  # refresh on acceptance drops instead of every N steps only
    chunk_overlap: int = 0  # extend each chosen chunk by this many neighbour tokens on both sides
    # CMR selects chunks only once the context exceeds this many working-cache budgets; below it
    # the working cache keeps every token: dropping half of a short context saves the draft little
    # attention and costs acceptance (docs/benchmarks.md, "Measured choices"). 0 = always select.
    cmr_min_ratio: float = 2.0
    positions: str = "compact"  # draft working-cache positions: compact re-indexing or original
    # The draft's KV of the prompt (speculation/draft_prefill.py): "selected" computes what the draft policy
    # reads (cmr: the chosen chunks, on demand), "full" the whole prompt when the draft starts.
    draft_prefill: str = "selected"
    # With the cost model: start the draft only once it is expected to repay computing the prompt
    # KV it reads over the tokens still to generate (sizing.Sizer.draft_pays); until then, and
    # for a request where it never pays, the proposer runs lookup alone.
    draft_gate: bool = True
    # The answer's remaining length the start decision counts on (sizing.tokens_left_to_repay): "produced"
    # assumes it runs as long again as it has so far (capped by max_new_tokens), so the draft starts once
    # what it would have gained so far covers its start (the ski-rental rule: however the answer ends,
    # it pays at most about twice what the best choice in hindsight would have); "budget" counts to
    # max_new_tokens, as if every answer ran to its cap.
    draft_horizon: str = "produced"
    sink_tokens: int = 4  # streaming: attention sinks at the start
    # Draft tree.
    tree: str = "dynamic"
    # Defaults from a measured sweep on the default pair (docs/benchmarks.md, "Measured choices"): a
    # verification of a few rows costs about one decode step, a wide one much more, and each tree
    # level costs one draft forward, so a small, fairly deep tree wins.
    tree_budget: int = 8  # draft nodes verified per step (dynamic tree)
    tree_depth: int = 5  # longest draft path
    tree_topk: int = 2  # children per expanded node, and nodes expanded per level
    tree_threshold: float = 0.0  # stop growing when the best frontier path prob falls below
    chain_length: int = 4  # chain builder: draft tokens per step
    # Sampling and length.
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # Penalties on the target's distribution (sampling/penalties.py; OpenAI's two, and the Hugging Face
    # repetition penalty), applied before verification, so speculation still equals `ar`.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Labels (`generate --set KEY=VALUE`): recorded in the result's config for the caller's own
    # bookkeeping and read by nothing; every setting above has its own option instead.
    labels: dict[str, str | int | float | bool] = field(default_factory=dict)

    def resolved(self) -> Settings:
        """The preset's choices filled in and every value checked; raises UserError on a bad one."""
        s = self._with_preset()
        s._check()
        return s

    def _with_preset(self) -> Settings:
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        preset = PRESETS[self.method]
        s = replace(self, **{k: getattr(self, k) if getattr(self, k) is not None else v for k, v in preset.items()})
        if s.method == "ar":
            return replace(s, draft_cache=None, cost_model=False, lookup=False)
        if s.method == "lookup":
            if not s.lookup:
                raise UserError("method lookup proposes only lookup candidates; it cannot run with lookup off")
            return replace(s, draft_cache=None)
        if s.draft_cache not in DRAFT_CACHES:
            raise UserError(f"unknown draft cache {s.draft_cache!r}; choose one of {', '.join(DRAFT_CACHES)}")
        return s

    def _check(self) -> None:
        if self.draft_prefill not in DRAFT_PREFILLS:
            raise UserError(f"unknown draft prefill {self.draft_prefill!r}; choose one of {', '.join(DRAFT_PREFILLS)}")
        if self.draft_horizon not in DRAFT_HORIZONS:
            raise UserError(f"unknown draft horizon {self.draft_horizon!r}; choose one of {', '.join(DRAFT_HORIZONS)}")
        for name in ("cost_model", "lookup", "draft_gate"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"--{name.replace('_', '-')} must be true or false, got {getattr(self, name)!r}")
        if self.attention not in ATTENTIONS:
            raise UserError(f"unknown attention {self.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if self.tree not in TREES:
            raise UserError(f"unknown tree {self.tree!r}; choose one of {', '.join(TREES)}")
        if self.positions not in POSITION_MODES:
            raise UserError(f"unknown positions {self.positions!r}; choose compact or original")
        if self.retrieval_query not in RETRIEVAL_QUERIES:
            raise UserError("retrieval query must be 'last' or 'path'")
        for name in ("chunk_size", "top_k_chunks", "retrieve_every", "tree_budget", "tree_depth",
                     "tree_topk", "chain_length", "max_new_tokens", "retrieval_layers_mean", "lookup_ngram",
                     "lookup_branches", "lookup_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("chunk_overlap", "sink_tokens", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise UserError(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
        if self.seed > SEED_MAX:
            raise UserError(f"--seed must be at most {SEED_MAX} (64 bits), got {self.seed}")
        if not (self.temperature >= 0.0):
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -2.0 <= v <= 2.0:
                raise UserError(f"--{name.replace('_', '-')} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, int | float) or not 0.0 < rp < float("inf"):
            raise UserError(f"--repetition-penalty must be a number > 0, got {rp!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.cmr_min_ratio < float("inf")):
            raise UserError(f"--cmr-min-ratio must be a finite number >= 0, got {self.cmr_min_ratio}")
        if not (0.0 <= self.tree_threshold < 1.0):
            raise UserError(f"--tree-threshold must be in [0, 1), got {self.tree_threshold}")
        for key, value in self.labels.items():
            check_label(key, value, where="label")

    @property
    def is_resolved(self) -> bool:
        """Whether the preset's choices are filled in (as `resolved` leaves them)."""
        return (self.attention is not None and self.cost_model is not None and self.lookup is not None
                and (self.draft_cache is not None or self.method in DRAFTLESS))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the target's distribution."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_draft(self) -> bool:
        """Whether this method runs a draft model (and so needs one loaded and prefilled)."""
        return self.method not in DRAFTLESS

    def as_dict(self) -> dict[str, Any]:
        """Every setting, and the labels beside them, as plain JSON values."""
        d = asdict(self)
        d.pop("labels")
        d.update(self.labels)
        return d


# --------------------------------------------------------------------------- KEY=VALUE

_DEFAULTS = {f.name: f.default for f in fields(Settings) if f.default is not MISSING}  # every setting, no labels
# Settings whose default (None: the preset's) does not show their type: parsed as this one's.
_TYPED_AS = {"cost_model": False, "lookup": False}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def value_type(name: str) -> type:
    """The type of a setting's values: its default's, the one it is parsed as where the default is
    None (the preset's), text otherwise (the server's request fields follow it)."""
    typical = _TYPED_AS.get(name, _DEFAULTS[name])
    return type(typical) if isinstance(typical, bool | int | float | str) else str


def make_settings(settings: Settings | None = None, **overrides: Any) -> Settings:
    """Settings from a base and keyword overrides; unknown names and bad values raise UserError."""
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(known - {'labels'}))}")
    base = settings if settings is not None else Settings()
    if not isinstance(base, Settings):
        raise UserError(f"settings must be a specextend.Settings, not {type(base).__name__}")
    return (replace(base, **overrides) if overrides else base).resolved()


def parse_assignments(items: Iterable[str], where: str = "--set", *, refused: Mapping[str, str] | None = None,
                      labels: bool = False) -> dict[str, Any]:
    """KEY=VALUE items -> {key: value}; bad items raise UserError naming `where`.

    A setting's value is typed like its default (bool: 1/true/yes/on or 0/false/no/off; int;
    finite float; otherwise text); dashes in KEY read as underscores. `refused` maps the keys a
    caller takes through another option to a hint naming it. A key that names no setting is
    refused, unless `labels`: then it is a label (see `Settings.labels`), typed as it reads.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not sep or not key:
            raise UserError(f"{where} wants KEY=VALUE, got {item!r}")
        if refused and key in refused:
            raise UserError(f"{where} {key}: use {refused[key]} instead")
        if key in _DEFAULTS:
            out[key] = _typed(key, raw, _TYPED_AS.get(key, _DEFAULTS[key]), where)
        elif labels:
            out[key] = check_label(key, _label_value(raw), where)
        else:
            known = sorted(set(_DEFAULTS) - set(refused or ()))
            raise UserError(f"{where} {key}: unknown setting; known: {', '.join(known)}")
    return out


def _typed(key: str, raw: str, default: Any, where: str) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            v = float(raw)
            if not math.isfinite(v):
                raise ValueError
            return v
    except ValueError:
        raise UserError(f"{where} {key}={raw}: expected a {type(default).__name__}") from None
    return raw


def _label_value(raw: str) -> str | int | float | bool:
    for cast in (int, float):
        try:
            v = cast(raw)
        except ValueError:
            continue
        if math.isfinite(v):
            return v
    return {"true": True, "false": False}.get(raw.lower(), raw)


def check_label(key: Any, value: Any, where: str = "--set") -> Any:
    """A label must not be (or look like a misspelling of) a setting, and holds one plain value."""
    if not isinstance(key, str) or not key.isidentifier():
        raise UserError(f"{where} {key!r}: a label's name is a word (letters, digits, _)")
    if key in _DEFAULTS or key == "labels":
        raise UserError(f"{where} {key}: a setting's name, not one a label can take")
    near = difflib.get_close_matches(key, list(_DEFAULTS), n=1, cutoff=0.8)
    if near:
        raise UserError(f"{where} {key}: no such setting (did you mean {near[0]}?)")
    if not isinstance(value, str | int | float | bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise UserError(f"{where} {key}: a label holds text, a number or true/false, got {value!r}")
    return value
