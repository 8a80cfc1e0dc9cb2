"""Step costs, measured on this machine: what a forward of the target or the draft costs against
the number of new rows and the number of cached tokens they attend to.

Speculation pays only when the tokens a step gains outweigh what its draft forwards and its wider
verification cost, and on a CPU neither is free: a verification of several rows costs well over
one row, and a draft forward a good fraction of a target step (docs/benchmarks.md, "Measured choices"). So
the tree is sized from measured costs (speculation/sizing.py), never from constants:

- `measure_curve` times one model's forward over a grid of rows x cached length (the KV cache is
  only *set* to that length: attention costs the same whatever the keys hold), about 10 s for the
  default pair;
- `cached_curve` keeps the result in `$SPECEXTEND_COST_CACHE` (default ~/.cache/specextend/costs),
  one file per machine, model shape, weight format, precision, attention backend and kernel
  build (`curve_key`): a new kernel build or another CPU measures again;
- `measure_prefill` times prompt chunks of 16 to 512 tokens (what a prefill's forwards are: causal,
  no logits) from an empty cache and after 4K cached tokens: the cost per token falls with the
  chunk's size until the many-row kernels are busy, and at a long context until attention's
  per-chunk work is spread; the server's step budget (batching/budget.py) reads it, cached the same way
  (`cached_curve(..., kind="prefill")`);
- `CostModel` predicts from the two curves and refreshes itself online: each step the engine's
  phase timings are compared with the prediction and a scale follows their ratio (and a per-step
  overhead follows what the phases do not cover), so a busier machine or a faster kernel moves
  the estimate within a few steps. The target has two scales, one for a one-row step and one for
  wider verifications: a single scale learnt from tree steps alone would carry their error to the
  one-row step, the rate of decoding alone that every tree must beat, and nothing would correct it
  while the sizer keeps choosing trees (it corrects itself the other way: a one-row cost guessed
  too low leads to one-row steps, which measure it).

`python -m specextend.bench.costs` shows (or, with --remeasure, re-measures) a pair's curves.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = 1  # bump when the file layout or the measurement changes
ROWS = (1, 2, 4, 8, 16, 32)  # new tokens per forward: one decode step up to a large tree
CONTEXTS = (256, 2048, 8192)  # cached tokens those rows attend to
REPEATS = 3  # timed runs per point after one untimed one; the fastest counts (noise only adds)
# Prompt tokens per prefill chunk, up to the model's own prefill chunk (model.prefill's `chunk`,
# the bound on a chunk's working memory); fewer repeats: a 512-token chunk takes seconds on a small CPU.
PREFILL_ROWS = (16, 32, 64, 128, 256, 512)
# Cached tokens those chunks attend to: at a long context a small chunk pays attention's
# per-chunk work again and again, so the chunk that is efficient there can be larger.
PREFILL_CONTEXTS = (0, 4096)
PREFILL_REPEATS = 2
# Online refresh: how far one step's observed/predicted ratio moves the scale, and how far a
# single observation may pull (a page fault or a preempted step must not swing the model).
REFRESH_WEIGHT = 0.1
RATIO_CLAMP = (0.5, 2.0)
SCALE_CLAMP = (0.2, 5.0)


# --------------------------------------------------------------------------- one model's curve


@dataclass
class ForwardCurve:
    """Seconds of one forward: `seconds[i][j]` for `rows[j]` new rows over `contexts[i]` cached tokens.

    Between grid points the cost is interpolated linearly, beyond them extrapolated from the last
    two points; the table is made non-decreasing in both rows and context when built (from above,
    see below), so a larger tree or a longer context never predicts cheaper."""

    rows: list[int]
    contexts: list[int]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        if not self.rows or not self.contexts or len(self.seconds) != len(self.contexts):
            raise ValueError("a cost curve needs rows, contexts and one row of seconds per context")
        if any(len(r) != len(self.rows) for r in self.seconds):
            raise ValueError("a cost curve needs one time per row count at every context")
        table = [list(map(float, r)) for r in self.seconds]
        if any(not (0.0 < x < float("inf")) for r in table for x in r):
            raise ValueError("a cost curve's times must be positive and finite")
        # Non-decreasing from above: each point is at most every point with as many rows or more
        # and as much context or more. Timing noise only adds, so a slow outlier at a small point
        # is cut down by its larger neighbours instead of lifting the whole table.
        for i in range(len(table) - 1, -1, -1):
            for j in range(len(table[i]) - 1, -1, -1):
                ceiling = min(table[i][j + 1] if j + 1 < len(table[i]) else float("inf"),
                              table[i + 1][j] if i + 1 < len(table) else float("inf"))
                table[i][j] = min(table[i][j], ceiling)
        self.seconds = table

    def predict(self, rows: int, context: int) -> float:
        return _interp(self.contexts, [_interp(self.rows, r, rows) for r in self.seconds], context)

    def row_costs(self, context: int, max_rows: int) -> list[float]:
        """[cost of 0 rows (unused, 0), 1 row, ..., max_rows rows] at one context."""
        at_ctx = [_interp(self.contexts, [r[j] for r in self.seconds], context) for j in range(len(self.rows))]
        return [0.0] + [_interp(self.rows, at_ctx, n) for n in range(1, max_rows + 1)]

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "contexts": self.contexts, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ForwardCurve:
        return cls([int(r) for r in d["rows"]], [int(c) for c in d["contexts"]],
                   [[float(x) for x in r] for r in d["seconds"]])


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys); flat below the first point, the last slope beyond the
    last (never decreasing, never below the last value)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def fitted_contexts(model: Any, rows: Sequence[int], contexts: Sequence[int]) -> list[int]:
    """The cached lengths a curve is measured over, cut so that the most rows still fit the model's
    own context (distinct, ascending)."""
    limit = int(model.cfg.max_position) - max(rows)
    return sorted({max(0, min(c, limit)) for c in contexts})


def measure_curve(model: Any, backend: str, rows: Sequence[int] = ROWS, contexts: Sequence[int] = CONTEXTS,
                  repeats: int = REPEATS) -> ForwardCurve:
    """Time `model`'s forward of each row count (a causal block, as a chain of draft tokens is)
    over each cached length. Contexts beyond the model's own are cut to fit."""
    ctxs = fitted_contexts(model, rows, contexts)
    cache = model.new_cache(ctxs[-1] + max(rows))
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def once(n: int, ctx: int) -> float:
        cache.length = ctx  # the keys' values do not change what attention costs
        tokens = torch.zeros(n, dtype=torch.long)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        sync()
        t = time.perf_counter()
        model(tokens, torch.arange(ctx, ctx + n), cache, mask, backend)
        sync()
        cache.discard()
        return time.perf_counter() - t

    table = []
    for ctx in ctxs:
        line = []
        for n in rows:
            once(n, ctx)  # first use of a shape may build kernels
            line.append(min(once(n, ctx) for _ in range(repeats)))
        table.append(line)
    cache.length = 0
    return ForwardCurve(list(rows), ctxs, table)


def measure_prefill(model: Any, backend: str, rows: Sequence[int] = PREFILL_ROWS,
                    contexts: Sequence[int] = PREFILL_CONTEXTS, repeats: int = PREFILL_REPEATS) -> ForwardCurve:
    """Time a prefill chunk of each size: `rows` prompt tokens after each cached length (the cache
    only *set* to it, as in `measure_curve`), causal, no logits (a chunk before the last asks for
    none). The curve says how a chunk's cost per token falls with its size, and how much more
    that matters at a long context. Contexts beyond the model's own are cut to fit."""
    ctxs = fitted_contexts(model, rows, contexts)
    cache = model.new_cache(ctxs[-1] + max(rows))
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def once(n: int, ctx: int) -> float:
        cache.length = ctx
        sync()
        t = time.perf_counter()
        model(torch.zeros(n, dtype=torch.long), torch.arange(ctx, ctx + n), cache, None, backend,
              logits_rows=slice(0, 0))
        sync()
        cache.discard()
        return time.perf_counter() - t

    table = []
    for ctx in ctxs:
        once(rows[0], ctx)  # first use (buffers, page faults); a larger chunk's first run is as fast as its next
        table.append([min(once(n, ctx) for _ in range(repeats)) for n in rows])
    cache.length = 0
    return ForwardCurve(list(rows), ctxs, table)


# --------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    """Where measured curves live: `SPECEXTEND_COST_CACHE`, else ~/.cache/specextend/costs.
    Per machine, like the kernel builds, so not under SPECEXTEND_HOME (a model cache)."""
    return Path(os.environ.get("SPECEXTEND_COST_CACHE", "~/.cache/specextend/costs")).expanduser()


def curve_parts(model: Any, backend: str) -> dict[str, Any]:
    """What a forward's cost depends on: the machine (CPU or GPU, threads), the model's shape, its
    weight format and size, precisions, the attention path and, for the C++ kernels, their build."""
    from . import hugepages, kernels

    cfg = model.cfg
    device = model.device
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else kernels.cpu_name()
    weight_bytes = 0
    for mod in model.modules():
        q = getattr(mod, "qweight", None)
        w = getattr(mod, "weight", None)
        if q is not None:
            weight_bytes += int(q.nbytes)
        elif isinstance(w, torch.Tensor):
            weight_bytes += w.numel() * w.element_size()
    quantized = model.weights not in ("float", "float32", "bfloat16", "float16", "float64")
    parts = {
        "format": FORMAT,
        "machine": machine,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": [cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                  cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
        "weights": model.weights,
        "weight_bytes": weight_bytes,
        "dtype": str(model.dtype),
        "kv_dtype": str(model.kv_dtype),
        "attention": "rowwise" if model.rowwise_attention else backend,
        "kernels": kernels.source_key() if quantized else None,
        "cpu_kernels": kernels.path() if quantized else None,  # each instruction-set path has its own costs
        # weights streamed from 2 MB pages take ~0.9x the time of 4 KB ones (hugepages.py)
        "huge_pages": hugepages.wanted() if quantized else None,
    }
    return parts


def curve_key(model: Any, backend: str) -> str:
    """The cache file's name: the model's shape and weights, and a digest of `curve_parts`."""
    cfg = model.cfg
    digest = hashlib.sha256(json.dumps(curve_parts(model, backend), sort_keys=True).encode()).hexdigest()[:16]
    return f"{cfg.arch}-{cfg.num_layers}x{cfg.hidden_size}-{model.weights}-{digest}"


def cached_curve(model: Any, backend: str, remeasure: bool = False, quiet: bool = False,
                 kind: str = "steps") -> ForwardCurve:
    """The model's curve from the cache, measured (and stored) if absent, unreadable or asked for.
    `kind`: "steps" (`measure_curve`: rows x context) or "prefill" (`measure_prefill`)."""
    if kind not in ("steps", "prefill"):
        raise ValueError(f"unknown cost curve kind {kind!r}")
    suffix = "" if kind == "steps" else f"-{kind}"
    path = cache_dir() / f"{curve_key(model, backend)}{suffix}.json"
    parts = curve_parts(model, backend)
    if kind != "steps":  # the steps' files keep the parts they always had
        parts["kind"] = kind
        parts["contexts"] = list(PREFILL_CONTEXTS)  # a curve of one context (before them) is measured again
    parts = json.loads(json.dumps(parts))  # as it reads back from JSON
    if not remeasure:
        # Checked on read: a file for other parts (a digest collision, a hand edit), a torn or
        # malformed one, or impossible times are measured again rather than trusted.
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            stored = json.loads(path.read_text())
            if stored.get("parts") == parts:
                return ForwardCurve.from_json(stored["curve"])
    if not quiet:
        what, how_long = ("step costs", "10 s") if kind == "steps" else ("prefill chunk costs", "half a minute")
        print(f"specextend: measuring the {what} of a {model.cfg.num_layers}-layer model "
              f"(once per machine and model; about {how_long})", file=sys.stderr, flush=True)
    curve = measure_curve(model, backend) if kind == "steps" else measure_prefill(model, backend)
    with contextlib.suppress(OSError):  # an unwritable cache only means measuring next time again
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "parts": parts,
                                   "curve": curve.to_json()}))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    return curve


# --------------------------------------------------------------------------- the pair's model


class CostModel:
    """Predicted seconds of the target's and the draft's forwards, refreshed from observations.

    `refresh=False` freezes it (tests use a synthetic model so sizing decisions are reproducible).
    """

    # Whether other sequences wait on this one's steps (batch.StepCosts, with others decoding):
    # then the sizer runs no probes (a probe would cost every sequence a round) and the proposer
    # rests between steps that propose nothing (its own work would hold up the others too).
    shared = False
    # Whether this step's costs stand for the steps to come (false in a batch step that carries
    # prompt chunks, where rows ride on the prefill): long-term decisions (starting the draft) wait.
    settled = True

    def __init__(self, target_curve: ForwardCurve, draft_curve: ForwardCurve | None = None, refresh: bool = True
                 ) -> None:
        self.target_curve, self.draft_curve, self.refresh = target_curve, draft_curve, refresh
        # "target_1row": one-row steps; "target": verifications of more rows.
        self.scale = {"target_1row": 1.0, "target": 1.0, "draft": 1.0}
        self.overhead_s = 0.0  # per step, outside the forwards and retrieval (Python, sampling)
        # Per step that ran the draft: the draft policy's bookkeeping and retrieval after it (a
        # step without the draft has nothing to retrieve for, so this is the draft's cost).
        self.retrieval_s = 0.0

    # ----------------------------------------------------------------- predictions

    @staticmethod
    def target_key(rows: int) -> str:
        """Which of the target's scales applies to a forward of `rows` rows."""
        return "target_1row" if rows <= 1 else "target"

    def target_s(self, rows: int, context: int) -> float:
        return self.target_curve.predict(rows, context) * self.scale[self.target_key(rows)]

    def draft_s(self, rows: int, context: int) -> float:
        if self.draft_curve is None:
            raise ValueError("this cost model has no draft curve")
        return self.draft_curve.predict(rows, context) * self.scale["draft"]

    def draft_prefill_s(self, tokens: int) -> float:
        """Seconds for the draft to compute `tokens` prompt tokens' KV: forwards of the widest
        measured row count, attending on average to half of them (a prefill's forwards are wider
        still and cheaper per token, so this errs towards not starting the draft)."""
        if tokens <= 0:
            return 0.0
        rows = ROWS[-1]
        return tokens / rows * self.draft_s(rows, tokens // 2)

    def verify_costs(self, context: int, max_rows: int) -> list[float]:
        """Seconds of a verification with n rows, n = 0..max_rows (index 0 unused). Each row
        beyond the first costs at least its increment on the curve times the lower of the two
        scales: the scales are learnt apart, and a one-row scale pulled up by what every step of a
        decode pays (or a wider one pulled down) must not make the rows a tree adds look free."""
        raw = self.target_curve.row_costs(context, max_rows)
        low = min(self.scale["target_1row"], self.scale["target"])
        out = [0.0]
        for n in range(1, len(raw)):
            added = (raw[n] - raw[n - 1]) * low if n > 1 else 0.0
            out.append(max(raw[n] * self.scale[self.target_key(n)], out[-1] + added))
        return out

    # ----------------------------------------------------------------- online refresh

    def observe_verify(self, rows: int, context: int, observed: float) -> None:
        """One verification's wall time: `rows` rows over `context` cached tokens."""
        self.observe(self.target_key(rows), self.target_curve.predict(rows, context), observed)

    def observe(self, model: str, predicted_raw: float, observed: float) -> None:
        """One phase's wall time against the curve's raw (unscaled) prediction for it; `model`
        names the scale (see `scale`)."""
        if not self.refresh or predicted_raw <= 0.0 or observed <= 0.0:
            return
        ratio = min(max(observed / predicted_raw, self.scale[model] * RATIO_CLAMP[0]),
                    self.scale[model] * RATIO_CLAMP[1])
        new = (1.0 - REFRESH_WEIGHT) * self.scale[model] + REFRESH_WEIGHT * ratio
        self.scale[model] = min(max(new, SCALE_CLAMP[0]), SCALE_CLAMP[1])

    def observe_overhead(self, seconds: float) -> None:
        if self.refresh and seconds >= 0.0:
            self.overhead_s = (1.0 - REFRESH_WEIGHT) * self.overhead_s + REFRESH_WEIGHT * min(seconds, 1.0)

    def observe_retrieval(self, seconds: float) -> None:
        if self.refresh and seconds >= 0.0:
            self.retrieval_s = (1.0 - REFRESH_WEIGHT) * self.retrieval_s + REFRESH_WEIGHT * min(seconds, 1.0)

    def stats(self) -> dict[str, float]:
        return {"cost_scale_target": self.scale["target"], "cost_scale_target_1row": self.scale["target_1row"],
                "cost_scale_draft": self.scale["draft"],
                "cost_overhead_s": self.overhead_s, "cost_retrieval_s": self.retrieval_s}
