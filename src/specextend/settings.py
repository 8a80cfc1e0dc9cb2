"""Generation settings, method presets and their validation (shared by the API, CLI and bench)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .draft_policy import DRAFT_POLICIES
from .errors import UserError

METHODS = ("ar", "sd", "specextend")
ATTENTIONS = ("eager", "efficient")
TREES = ("chain", "dynamic")
POSITION_MODES = ("compact", "original")

# What each preset means (the contract): sd = standard tree speculative decoding; specextend =
# efficient attention + cross-model retrieval for the draft.
PRESETS: dict[str, dict[str, Any]] = {
    "ar": {"draft_cache": None, "attention": "efficient"},
    "sd": {"draft_cache": "full", "attention": "eager"},
    "specextend": {"draft_cache": "cmr", "attention": "efficient"},
}


@dataclass
class Settings:
    method: str = "specextend"
    draft_cache: str | None = None  # None: the preset's
    attention: str | None = None  # None: the preset's
    # Cross-model retrieval (and the streaming baseline's budget).
    chunk_size: int = 32
    top_k_chunks: int = 32
    retrieve_every: int = 8
    retrieval_layer: int = -1  # target layer whose attention ranks chunks; -1 = last
    retrieval_layers_mean: int = 1  # average the scores of this many layers ending at retrieval_layer
    retrieval_query: str = "last"  # last accepted token, or "path": mean over the accepted path
    adaptive_refresh: bool = False  # refresh on acceptance drops instead of every N steps only
    chunk_overlap: int = 0  # extend each chosen chunk by this many neighbour tokens on both sides
    # CMR selects chunks only once the context exceeds this many working-cache budgets; below it
    # the working cache keeps every token. Dropping half of a short context saves the draft little
    # attention and costs acceptance (default pair, GovReport 2K, 1K budget: tau 3.22 vs 3.45 with
    # every token kept). 0 = always select.
    cmr_min_ratio: float = 2.0
    positions: str = "compact"  # draft working-cache positions: compact re-indexing or original
    sink_tokens: int = 4  # streaming: attention sinks at the start
    # Draft tree.
    tree: str = "dynamic"
    # Defaults from a measured sweep on the default pair (GovReport 2K, CPU; see README): a
    # verification of up to ~6 rows costs about one decode step here, 17 rows twice that, and
    # each tree level costs one draft forward, so a small, fairly deep tree wins.
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
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> Settings:
        """Fill the preset's choices and check every value; raises UserError on a bad one."""
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        preset = PRESETS[self.method]
        s = replace(
            self,
            draft_cache=self.draft_cache if self.draft_cache is not None else preset["draft_cache"],
            attention=self.attention if self.attention is not None else preset["attention"],
        )
        if s.method == "ar":
            s.draft_cache = None
        elif s.draft_cache not in DRAFT_POLICIES:
            raise UserError(f"unknown draft cache {s.draft_cache!r}; choose one of {', '.join(DRAFT_POLICIES)}")
        if s.attention not in ATTENTIONS:
            raise UserError(f"unknown attention {s.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if s.tree not in TREES:
            raise UserError(f"unknown tree {s.tree!r}; choose one of {', '.join(TREES)}")
        if s.positions not in POSITION_MODES:
            raise UserError(f"unknown positions {s.positions!r}; choose compact or original")
        if s.retrieval_query not in ("last", "path"):
            raise UserError("retrieval query must be 'last' or 'path'")
        for name in ("chunk_size", "top_k_chunks", "retrieve_every", "tree_budget", "tree_depth",
                     "tree_topk", "chain_length", "max_new_tokens", "retrieval_layers_mean"):
            v = getattr(s, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("chunk_overlap", "sink_tokens", "seed"):
            v = getattr(s, name)
            if not isinstance(v, int) or v < 0:
                raise UserError(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
        if not (s.temperature >= 0.0):
            raise UserError(f"--temperature must be >= 0, got {s.temperature}")
        if not (0.0 < s.top_p <= 1.0):
            raise UserError(f"--top-p must be in (0, 1], got {s.top_p}")
        if not (0.0 <= s.cmr_min_ratio < float("inf")):
            raise UserError(f"--cmr-min-ratio must be a finite number >= 0, got {s.cmr_min_ratio}")
        if not (0.0 <= s.tree_threshold < 1.0):
            raise UserError(f"--tree-threshold must be in [0, 1), got {s.tree_threshold}")
        return s

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return d
