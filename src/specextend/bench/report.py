"""summary.md, speedup.png and accepted.png from bench rows (results.jsonl).

    python -m specextend.bench.report DIR      # rebuild DIR's summary and plots from DIR/results.jsonl

Aggregates per data set (one input length) and method: decode tokens/s is total new tokens over
total decode seconds; end-to-end tokens/s is total new tokens over total seconds of prefill +
decode (each row's own prefill: what a user of that method waits for); speedups are ratios of
those rates, on both bases, and per sample the end-to-end ratio's range and how many samples
were at least as fast as `ar` end to end (a mean hides a prompt that lost); accepted per step is
weighted by steps;
the retrieval share is retrieval seconds over decode seconds; the match rate counts samples whose
tokens equal `ar`'s token for token, and the ar prefix is the mean number of leading tokens equal to
`ar`'s (peers with other numerics part from `ar` at a near-tie). Files are written atomically
(temp file + os.replace), so an interrupted run never leaves a half-written summary or plot.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.jsonl import read_rows
from .data import data_family, data_length

RESULTS = "results.jsonl"
SUMMARY = "summary.md"
SPEEDUP_PNG = "speedup.png"
ACCEPTED_PNG = "accepted.png"
SPECULATIVE_ORDER = ("ar", "sd", "specextend", "lookup")  # listed first, in this order; the rest alphabetically
PEER_PREFIXES = ("hf-", "llamacpp-")  # other engines, listed after ours in this order


# --------------------------------------------------------------------------- results.jsonl


def latest_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (data, sample, method): the last one written."""
    by_key: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        by_key[(r.get("data"), r.get("sample"), r.get("method"))] = r
    return list(by_key.values())


# --------------------------------------------------------------------------- aggregation


@dataclass
class Cell:
    """One (data set, method) aggregate."""

    data: str
    method: str
    samples: int
    input_tokens: float
    new_tokens: int
    decode_tps: float | None
    accepted: float | None
    prefill_s: float | None
    retrieval_share: float | None
    matches: int
    compared: int
    ar_prefix: float | None = None  # mean leading tokens equal to ar's
    total_s: float | None = None  # mean prefill + decode seconds per sample
    e2e_tps: float | None = None  # new tokens / (prefill + decode seconds), summed over samples
    speedup_ar: float | None = None
    speedup_sd: float | None = None
    e2e_speedup_ar: float | None = None
    e2e_ratios_ar: list[float] = field(default_factory=list)  # per sample: ar's total seconds over this row's
    prefill_borrowed: bool = False  # prefill made by another backend (bench --prefill shared)

    @property
    def e2e_range_ar(self) -> tuple[float, float] | None:
        """The lowest and highest per-sample end-to-end ratio to ar."""
        return (min(self.e2e_ratios_ar), max(self.e2e_ratios_ar)) if self.e2e_ratios_ar else None

    @property
    def e2e_wins(self) -> tuple[int, int] | None:
        """Samples at least as fast as ar end to end, and samples compared."""
        r = self.e2e_ratios_ar
        return (sum(x >= 1.0 for x in r), len(r)) if r else None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def mean(xs: Sequence[float]) -> float | None:
    """The mean, or None for no values (a table shows '-')."""
    return sum(xs) / len(xs) if xs else None


def method_order(methods: Iterable[str]) -> list[str]:
    ms = set(methods)
    first = [m for m in SPECULATIVE_ORDER if m in ms]
    ours = sorted(m for m in ms if m not in first and not m.startswith(PEER_PREFIXES))
    peers = [m for prefix in PEER_PREFIXES for m in sorted(ms) if m.startswith(prefix)]
    return first + ours + peers


def data_order(names: Iterable[str], cells_input: dict[str, float]) -> list[str]:
    return sorted(set(names), key=lambda d: (data_family(d), data_length(d) or cells_input.get(d, 0), d))


def _matches(rows: list[dict[str, Any]], ar_ids: dict[tuple, list[int]]) -> tuple[int, int]:
    """(equal, compared): the row's own matches_ar, or recomputed when an ar row exists now."""
    equal = compared = 0
    for r in rows:
        ref = ar_ids.get((r.get("data"), r.get("sample")))
        m = (r.get("token_ids") == ref) if ref is not None else r.get("matches_ar")
        if isinstance(m, bool):
            compared += 1
            equal += m
    return equal, compared


def _prefix(rows: list[dict[str, Any]], ar_ids: dict[tuple, list[int]]) -> float | None:
    """Mean leading tokens equal to ar's: recomputed when an ar row exists now, else the row's own."""
    found: list[float] = []
    for r in rows:
        ref, ids = ar_ids.get((r.get("data"), r.get("sample"))), r.get("token_ids")
        if isinstance(ref, list) and isinstance(ids, list):
            n = 0
            for a, b in zip(ids, ref, strict=False):
                if a != b:
                    break
                n += 1
            found.append(float(n))
        elif (p := _num(r.get("ar_prefix_match"))) is not None:
            found.append(p)
    return mean(found)


def _borrowed(row: dict[str, Any]) -> bool:
    made_by = row.get("prefill_attention")
    return made_by is not None and made_by != (row.get("config") or {}).get("attention")


def aggregate(rows: list[dict[str, Any]]) -> list[Cell]:
    ar_ids = {(r["data"], r["sample"]): r.get("token_ids") for r in rows if r.get("method") == "ar"}
    ar_totals = {(r["data"], r["sample"]): _total(r) for r in rows if r.get("method") == "ar"}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r.get("data")), str(r.get("method"))), []).append(r)
    cells: dict[tuple[str, str], Cell] = {}
    for (data, method), rs in groups.items():
        new = sum(int(r.get("new_tokens") or 0) for r in rs)
        dec = sum(_num(r.get("decode_s")) or 0.0 for r in rs)
        steps = [(_num(r.get("steps")), _num(r.get("accepted_per_step"))) for r in rs]
        weighted = [(s, a) for s, a in steps if s is not None and a is not None and s > 0]
        accepted = (sum(s * a for s, a in weighted) / sum(s for s, _ in weighted) if weighted
                    else mean([a for _, a in steps if a is not None]))
        retr = sum(_num((r.get("phases") or {}).get("retrieval_s")) or 0.0 for r in rs)
        eq, cmp_ = _matches(rs, ar_ids)
        totals = [t for t in (_total(r) for r in rs) if t is not None]
        cells[(data, method)] = Cell(
            data=data, method=method, samples=len(rs),
            input_tokens=mean([float(r.get("input_tokens") or r.get("prompt_tokens") or 0) for r in rs]) or 0.0,
            new_tokens=new,
            decode_tps=new / dec if dec > 0 else None,
            accepted=accepted,
            prefill_s=mean([p for p in (_num(r.get("prefill_s")) for r in rs) if p is not None]),
            total_s=mean(totals),
            e2e_tps=new / sum(totals) if totals and len(totals) == len(rs) and sum(totals) > 0 else None,
            retrieval_share=retr / dec if dec > 0 else None,
            matches=eq, compared=cmp_,
            ar_prefix=None if method == "ar" else _prefix(rs, ar_ids),
            e2e_ratios_ar=[] if method == "ar" else _e2e_ratios(rs, ar_totals),
            prefill_borrowed=any(_borrowed(r) for r in rs),
        )
    for (data, _method), c in cells.items():
        for base, attr in (("ar", "speedup_ar"), ("sd", "speedup_sd")):
            ref = cells.get((data, base))
            if ref is not None and ref.decode_tps and c.decode_tps is not None:
                setattr(c, attr, c.decode_tps / ref.decode_tps)
        ref = cells.get((data, "ar"))
        if ref is not None and ref.e2e_tps and c.e2e_tps is not None:
            c.e2e_speedup_ar = c.e2e_tps / ref.e2e_tps
    return list(cells.values())


def _e2e_ratios(rows: list[dict[str, Any]], ar_totals: dict[tuple, float | None]) -> list[float]:
    """Each sample's end-to-end ratio to ar's (ar's seconds over the row's), where both have them."""
    ratios = []
    for r in rows:
        ref, own = ar_totals.get((r.get("data"), r.get("sample"))), _total(r)
        if ref is not None and own is not None and own > 0:
            ratios.append(ref / own)
    return ratios


def _total(row: dict[str, Any]) -> float | None:
    """A row's end-to-end seconds: its `total_s`, else its prefill + decode."""
    t = _num(row.get("total_s"))
    if t is not None:
        return t
    p, d = _num(row.get("prefill_s")), _num(row.get("decode_s"))
    return p + d if p is not None and d is not None else None


# --------------------------------------------------------------------------- summary.md


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _range(r: tuple[float, float] | None) -> str:
    return "-" if r is None else f"{r[0]:.3f}–{r[1]:.3f}x"


def _count(c: tuple[int, int] | None) -> str:
    return "-" if c is None else f"{c[0]}/{c[1]}"


def summary_tables(cells: list[Cell]) -> str:
    """One markdown table per data set, ordered by family and input length."""
    inputs = {c.data: c.input_tokens for c in cells}
    out = []
    for data in data_order(inputs, inputs):
        cs = {c.method: c for c in cells if c.data == data}
        n = max(c.samples for c in cs.values())
        out.append(f"### {data}: {inputs[data]:,.0f} input tokens (mean), {n} sample{'s' * (n != 1)}\n")
        out.append("| method | samples | new tokens | decode tok/s | vs ar | vs sd | prefill s | total s "
                   "| end-to-end tok/s | e2e vs ar | e2e vs ar per sample | e2e ≥ ar | accepted/step | retrieval share "
                   "| = ar | ar prefix |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in method_order(cs):
            c = cs[m]
            match = f"{c.matches}/{c.compared}" if c.compared else "-"
            retr = "-" if c.retrieval_share is None else f"{100 * c.retrieval_share:.1f}%"
            out.append(
                f"| {m} | {c.samples} | {c.new_tokens} | {_f(c.decode_tps, '.2f')} | {_x(c.speedup_ar)} | "
                f"{_x(c.speedup_sd)} | {_f(c.prefill_s, '.1f')}{' †' * c.prefill_borrowed} | {_f(c.total_s, '.1f')} | "
                f"{_f(c.e2e_tps, '.2f')} | {_x(c.e2e_speedup_ar)} | {_range(c.e2e_range_ar)} | "
                f"{_count(c.e2e_wins)} | {_f(c.accepted, '.2f')} | "
                f"{retr} | {match} | "
                f"{_f(c.ar_prefix, '.1f')} |"
            )
        out.append("")
    return "\n".join(out)


def _run_info(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    info = [f"- target: `{first.get('target')}`"]
    drafts = sorted({str(r.get("draft")) for r in rows if r.get("draft")})
    if drafts:
        info.append(f"- draft: {', '.join(f'`{d}`' for d in drafts)}")
    info.append(f"- dtype: {first.get('dtype')}, device: {first.get('device')}")
    mnt = sorted({(r.get("config") or {}).get("max_new_tokens") for r in rows} - {None})
    if mnt:
        info.append(f"- max new tokens: {', '.join(map(str, mnt))}")
    return info


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    cells = aggregate(rows)
    parts = ["# specextend bench", ""]
    parts += _run_info(rows)
    parts += [
        "",
        "Decode tok/s = new tokens / decode seconds (prefill excluded), summed over samples; vs ar / vs sd: "
        "ratio of those rates on the same data; prefill s: the method's own prefill, mean per sample (the "
        "target's, plus the prompt KV its draft computed; target only for ar); total s: prefill + decode, "
        "mean per sample; end-to-end tok/s = new tokens / total seconds, e2e vs ar its ratio to ar's; e2e vs ar "
        "per sample: the lowest and highest of each sample's ar total seconds over the method's; e2e ≥ ar: "
        "samples whose ratio is at least 1; "
        "accepted/step: mean draft tokens accepted per target forward (τ); retrieval share: "
        "retrieval seconds / decode seconds; = ar: samples whose tokens equal ar's token for token; ar prefix: "
        "mean leading tokens equal to ar's. hf-* rows: transformers on the same weights; llamacpp-* rows: "
        "llama.cpp's llama-server on the same GGUF files and prompt tokens (its own prefill/decode clocks).",
        "",
        summary_tables(cells) if cells else "(no results yet)",
    ]
    if any(c.prefill_borrowed for c in cells):
        parts += ["† target prefill made once per sample by the efficient backend and shared (bench --prefill "
                  "shared); the method decodes with its own attention from that cache.", ""]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------- plots


def _series(cells: list[Cell], value: Callable[[Cell], float | None], skip: set[str]
            ) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(family, method) -> [(mean input tokens, value)] sorted by input length."""
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for c in cells:
        v = value(c)
        if c.method in skip or v is None:
            continue
        series.setdefault((data_family(c.data), c.method), []).append((c.input_tokens, v))
    return {k: sorted(v) for k, v in series.items()}


@dataclass
class Panel:
    """One plot: a value per cell against input length."""

    value: Callable[[Cell], float | None]
    skip: set[str]
    ylabel: str
    title: str
    reference: float | None


def _plot(path: Path, cells: list[Cell], panels: list[Panel]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), layout="constrained", squeeze=False)
    try:
        for ax, panel in zip(axes[0], panels, strict=True):
            _draw(ax, cells, panel)
        _atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)


def _draw(ax: Any, cells: list[Cell], panel: Panel) -> None:
    series = _series(cells, panel.value, panel.skip)
    families = sorted({f for f, _ in series})
    styles = ["-", "--", ":", "-."]
    # One colour per method across every plot: assigned over every method in the results.
    order = method_order({c.method for c in cells})
    colors = {m: f"C{i % 10}" for i, m in enumerate(order)}
    for (family, method), pts in sorted(series.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        xs, ys = zip(*pts, strict=True)
        label = method if len(families) == 1 else f"{method} ({family})"
        ax.plot(xs, ys, styles[families.index(family) % len(styles)], marker="o", color=colors[method], label=label)
    if panel.reference is not None:
        ax.axhline(panel.reference, color="grey", linewidth=0.8, linestyle="--")
    xs_all = sorted({round(x) for pts in series.values() for x, _ in pts})
    if xs_all and xs_all[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [f"{x:,}" for x in xs_all], rotation=30 if len(xs_all) > 5 else 0)
        ax.minorticks_off()
    ax.set_xlabel("input tokens (mean per data set)")
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


def plot_speedup(path: Path, cells: list[Cell]) -> None:
    """Decode speedup and end-to-end speedup over ar, side by side."""
    _plot(path, cells, [
        Panel(lambda c: c.speedup_ar, {"ar"}, "decode speedup vs ar", "Decode (prefill excluded) vs ar", 1.0),
        Panel(lambda c: c.e2e_speedup_ar, {"ar"}, "end-to-end speedup vs ar", "End to end (prefill + decode) vs ar",
              1.0),
    ])


def plot_accepted(path: Path, cells: list[Cell]) -> None:
    _plot(path, cells, [Panel(lambda c: c.accepted, {"ar", "hf-ar", "llamacpp-ar"}, "accepted tokens per step (τ)",
                              "Draft tokens accepted per target forward", None)])


# --------------------------------------------------------------------------- files


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temp file in the same folder, then os.replace: readers see old or new."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    _atomic(path, write)


def write_report(out_dir: Path, rows: list[dict[str, Any]], plots: bool = True) -> str:
    """summary.md (and, with `plots`, speedup.png and accepted.png) in `out_dir`; returns the
    summary's markdown."""
    text = summary_markdown(rows)
    write_text_atomic(out_dir / SUMMARY, text)
    if plots:
        cells = aggregate(rows)
        plot_speedup(out_dir / SPEEDUP_PNG, cells)
        plot_accepted(out_dir / ACCEPTED_PNG, cells)
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m specextend.bench.report DIR", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    out = Path(args[0])
    rows = latest_rows(read_rows(out / RESULTS))
    if not rows:
        print(f"specextend: error: no results in {out / RESULTS}", file=sys.stderr)
        return 2
    write_report(out, rows)
    print(summary_tables(aggregate(rows)))
    print(f"wrote {out / SUMMARY}, {out / SPEEDUP_PNG}, {out / ACCEPTED_PNG}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
