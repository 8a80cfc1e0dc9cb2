"""Runtime micro-benchmark: load, prefill, decode and verification costs against the machine's floors.

Load time, prefill speed, the cost of a forward of 1 to N rows over a cached context, the
memory-bandwidth floor of a decode step, and prefill and many-row forwards against the CPU's
compute floor (the roofline).

    python -m specextend.bench.runtime [--target REF] [--dtype float32] [--context 2048]
                                       [--rows 1,4,8,16] [--prefill-lengths 512,2048] [--json]

The memory floor is (weight bytes read per forward) / (measured memory read bandwidth): no
implementation can run a decode step faster on this machine. The compute floor (quantized
kernels) is the forward's multiply-adds counted from the model's shape, the linear layers' at the
int8 peak (a BF16 file on bfloat16 products: the bfloat16 peak) and attention's at the bfloat16 peak
of the kernel path (`specextend kernels --peak`);
prefill is timed whole and inside the linear-layer and attention kernels (`kernels.clocked`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from ..models.loader import QUANTIZED_WEIGHTS
from ..options import OneLineParser, add_model_arguments, model_options
from ..runtime import hugepages, kernels
from ..runtime.experts import Experts
from . import roofline, step_split


class ReadRate:
    """The memory's streaming read rate (`read_pass_gbs`: a sum over a buffer far larger than the caches,
    in the kind of memory the weights are loaded into: 2 MB pages read faster than 4 KB ones), sampled at the moments a
    benchmark chooses. On a shared host the rate can move from one minute to the next, within a run
    (docs/log/2026-12-read-rate.md), so a memory floor is comparable only with timings taken beside
    its sample; `span` says how far it moved."""

    def __init__(self, mb: int = 1024) -> None:
        self.buf = read_buffer(mb)
        self.samples: list[float] = []

    def sample(self, passes: int = 2) -> float:
        """GB/s now: the best of `passes` reads (the first read of fresh pages runs slower)."""
        gbs = max(read_pass_gbs(self.buf) for _ in range(passes))
        self.samples.append(gbs)
        return gbs

    @property
    def span(self) -> tuple[float, float]:
        return min(self.samples), max(self.samples)


def read_buffer(mb: int = 1024) -> torch.Tensor:
    """A float32 buffer of `mb` MB in the weights' kind of memory, for `read_pass_gbs`."""
    return hugepages.like_weights(mb * 1024 * 1024).view(torch.float32).fill_(1.0)


def read_pass_gbs(buf: torch.Tensor) -> float:
    """GB/s of one plain read (a sum) of `buf`."""
    t = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - t) / 1e9


def cpu_kernels(model) -> str | None:
    """The kernel path the model's quantized weights run on (None for float weights)."""
    from ..runtime import kernels

    return kernels.path() if model.weights in QUANTIZED_WEIGHTS else None


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights a one-row forward reads: everything except the embedding table (a lookup), and of
    a layer's experts the k a token runs (`expert_bytes`)."""
    total = 0
    for name, mod in model.named_modules():
        if name.endswith(("embed", "moe.router", "moe.shared_gate")):  # a lookup; a router's bytes are its layer's
            continue
        if isinstance(mod, Experts):
            total += expert_bytes(mod)
        elif getattr(mod, "qweight", None) is not None:
            total += mod.qweight.nbytes
        elif getattr(mod, "packed", None) is not None:
            total += mod.packed.numel() * mod.packed.element_size()
        elif getattr(mod, "weight", None) is not None:
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def expert_bytes(moe: Experts) -> int:
    """What one row reads of a layer's experts: the router (and a shared expert's gate; the quantized
    runtime's three bfloat16 parts) and `used` of its `count` experts (the shared expert's projections are
    modules of their own)."""
    if moe.q_stacked is not None:
        router = moe.q_router.nbytes if moe.q_router is not None else 0
        return router + sum(s.nbytes for s in moe.q_stacked) * moe.used // moe.count
    router = sum(m.weight.numel() * m.weight.element_size() for m in (moe.router, getattr(moe, "shared_gate", None))
                 if m is not None and m.weight is not None)
    experts = sum(t.numel() * t.element_size() for t in (moe.gate, moe.up, moe.down) if t is not None)
    return router + experts * moe.used // moe.count


def elapsed(fn) -> float:
    """Seconds of one call of `fn`."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, draft=False)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--prefill-lengths", default="512,2048",
                    help="prompt lengths whose prefill is timed against the compute floor, split into linear "
                         "layers and attention (quantized kernels; '' skips; default 512,2048)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    return ap


def parse_counts(ap: argparse.ArgumentParser, flag: str, text: str, allow_empty: bool = False, sep: str = ","
                 ) -> list[int]:
    """Whole numbers of at least 1 separated by `sep` (exit 2 with one line otherwise)."""
    if allow_empty and not text.strip():
        return []
    try:
        values = [int(v) for v in text.lower().split(sep)]
    except ValueError:
        what = "comma-separated" if sep == "," else f"{sep!r}-separated"
        ap.error(f"{flag}: {what} whole numbers, not {text!r}")
    if min(values) < 1:
        ap.error(f"{flag}: every number must be at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    from .. import api

    ap = _parser()
    a = ap.parse_args(argv)
    rows = parse_counts(ap, "--rows", a.rows)
    lengths = parse_counts(ap, "--prefill-lengths", a.prefill_lengths, allow_empty=True)
    if min([a.context, a.prefill_tokens, a.repeats, *rows]) < 1:
        ap.error("--context, --prefill-tokens, --repeats and --rows must be at least 1")
    if a.device != "cpu":
        # The floor is CPU memory bandwidth; GPU kernels are timed by specextend.bench.kernels.
        print("specextend runtime: error: --device cpu only (see python -m specextend.bench.kernels)",
              file=sys.stderr)
        return 2
    prepared = api.prepare(a.target, load_draft=False, **model_options(a))
    t = time.perf_counter()
    pair = prepared.load()
    too_long = [n for n in lengths if n > pair.target.cfg.max_position]
    if too_long:
        ap.error(f"--prefill-lengths: {too_long[0]} tokens is beyond the model's {pair.target.cfg.max_position} "
                 "positions")
    res: dict[str, Any] = {"model": str(pair.target_path), "dtype": a.dtype, "weights": pair.target.weights,
                           "load_s": time.perf_counter() - t, "threads": torch.get_num_threads(),
                           "cpu_kernels": cpu_kernels(pair.target)}
    res.update(prefill_speed(pair.target, a.prefill_tokens))
    rate = ReadRate()
    rate.sample(5)
    res.update(step_costs(pair.target, a.context, rows, a.repeats,
                          split=res["cpu_kernels"] not in (None, kernels.EMULATED_AMX)))
    rate.sample(5)
    wb = weight_bytes_per_forward(pair.target)
    if res["cpu_kernels"] not in (None, kernels.EMULATED_AMX) and pair.target.fused:
        res["one_row_split"] = step_split.split_one_row(pair.target, a.context, wb, rate, a.repeats * 4)
    # The floor at the best rate seen: the machine's limit in this run (`read_bandwidth_gbs_span`: where it moved).
    bw = rate.span[1]
    res.update(read_bandwidth_gbs=bw, read_bandwidth_gbs_span=list(rate.span), weight_bytes=wb,
               floor_s=wb / (bw * 1e9))
    if res["cpu_kernels"] not in (None, kernels.EMULATED_AMX):  # an emulation has no peak to divide by
        res["roofline"] = measure_roofline(pair.target, res, lengths)
    print(json.dumps(res, indent=2) if a.json else report(res, a.prefill_tokens))
    return 0


def prefill_speed(model: Any, tokens: int) -> dict[str, float]:
    """Prefill tokens per second of a random prompt, per attention backend."""
    cache = model.new_cache(tokens + 64)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
    for backend in ("eager", "efficient"):  # first-use kernel builds stay out of the timings
        cache.reset()
        model.prefill(ids[:512], cache, backend)
    out = {}
    for backend in ("efficient", "eager"):
        cache.reset()
        t = time.perf_counter()
        model.prefill(ids, cache, backend)
        out[f"prefill_tokens_per_s_{backend}"] = tokens / (time.perf_counter() - t)
    return out


def step_costs(model: Any, context: int, rows: list[int], repeats: int, split: bool = False) -> dict[str, Any]:
    """Seconds of one forward of each row count (a causal block) over a cache of `context` tokens;
    with `split` (quantized kernels), also the seconds its linear-layer and attention kernels took,
    timed in a forward of their own (`kernels.clocked`: each layer's calls, not the whole step's),
    which says what a verification's extra rows cost where."""
    cache = model.new_cache(context + max(rows) + 64)
    model.prefill(torch.randint(0, model.cfg.vocab_size, (context,)), cache, "efficient")
    steps = {}
    for r in rows:
        toks = torch.randint(0, model.cfg.vocab_size, (r,))
        pos = torch.arange(context, context + r)
        mask = torch.ones(r, r, dtype=torch.bool).tril_()

        def step(toks=toks, pos=pos, mask=mask):
            model(toks, pos, cache, mask, "efficient")
            cache.discard()

        steps[r] = step
        step()  # warm-up
    # Row counts interleaved within each repeat, so a slow spell on a shared machine lands on all
    # of them rather than on one; each keeps its best time.
    per_rows = {r: float("inf") for r in rows}
    linear = {r: float("inf") for r in rows}
    attention = {r: float("inf") for r in rows}
    for _ in range(repeats):
        for r in rows:
            per_rows[r] = min(per_rows[r], elapsed(steps[r]))
            if split:
                with kernels.clocked() as clock:
                    steps[r]()
                linear[r], attention[r] = min(linear[r], clock.linear_s), min(attention[r], clock.attention_s)
    out: dict[str, Any] = {"forward_s_at_context": {str(r): per_rows[r] for r in rows}, "context": context}
    if 1 in per_rows:
        out["rows_cost_vs_one"] = {str(r): per_rows[r] / per_rows[1] for r in rows}
    if split:
        out["linear_s_at_context"] = {str(r): linear[r] for r in rows}
        out["attention_s_at_context"] = {str(r): attention[r] for r in rows}
    return out


# --------------------------------------------------------------------------- the roofline


def measure_roofline(model: Any, res: dict[str, Any], lengths: list[int]) -> dict[str, Any]:
    """The kernel path's peaks, prefill at each of `lengths`, and `res`'s many-row forwards
    against the compute floor. The floor divides by the best peaks recorded on this machine (noise
    only lowers a measurement); this run's own are reported beside them."""
    path = res["cpu_kernels"]
    measured = roofline.measure(paths=[path])
    loops = measured["paths"][path]["loops"]
    kind = linear_peak_kind(model)
    peaks = {**roofline.floor_peaks(measured, path)}
    peaks["linear"] = peaks[kind]
    return {
        "path": path, "cpu": measured["cpu"], "threads": measured["threads"],
        "kernel_build": measured["kernel_build"], "linear_peak_kind": kind,
        "peak_gmac_per_s": peaks,
        "peak_measured_now_gmac_per_s": {k: loops[k]["gmac_per_s"] for k in roofline.FLOOR_KINDS},
        "peak_instruction": {k: loops[k]["instruction"] for k in roofline.FLOOR_KINDS},
        "prefill": prefill_roofline(model, lengths, peaks),
        "rows": rows_roofline(model, res, peaks),
    }


def linear_peak_kind(model: Any) -> str:
    """The peak a model's linear layers are held to: bf16 where every kernel matrix is BF16 on bfloat16
    products (`bf16d`: VDPBF16PS), else int8 (the quantized formats' VPDPBUSD)."""
    fmts = {s.fmt for m in model.modules() if getattr(m, "qweight", None) is not None for s in m.qweight.segments}
    return "bf16" if fmts == {"bf16d"} else "int8"


def against_floor(macs: roofline.Macs, seconds: float, clock: kernels.KernelClock | None,
                  peaks: dict[str, float]) -> dict[str, Any]:
    """A forward of `macs` that took `seconds`, against the compute floor at `peaks`; with the
    kernels' clock, its linear-layer and attention parts against their own peaks."""
    linear = peaks.get("linear", peaks["int8"])
    floor = roofline.floor_s(macs, linear, peaks["bf16"])
    out: dict[str, Any] = {
        "seconds": seconds, "linear_gmacs": macs.linear / 1e9, "attention_gmacs": macs.attention / 1e9,
        "sustained_gmac_per_s": macs.total / seconds / 1e9, "floor_s": floor, "share_of_floor": floor / seconds,
    }
    if clock is not None:
        out["linear_s"], out["attention_s"] = clock.linear_s, clock.attention_s
        out["other_s"] = seconds - clock.linear_s - clock.attention_s  # RoPE, embedding, Python
        for part, peak, m, s in (("linear", linear, macs.linear, clock.linear_s),
                                 ("attention", peaks["bf16"], macs.attention, clock.attention_s)):
            rate = m / s / 1e9 if s > 0 else 0.0
            out[f"{part}_gmac_per_s"] = rate
            out[f"{part}_share_of_peak"] = rate / peak
    return out


def prefill_roofline(model: Any, lengths: list[int], peaks: dict[str, float]) -> list[dict[str, Any]]:
    """Each length prefilled once from an empty cache (a random prompt: the arithmetic does not
    depend on the tokens), timed whole and inside the kernels."""
    if not lengths:
        return []
    longest = max(lengths)
    cache = model.new_cache(longest)
    ids = torch.randint(0, model.cfg.vocab_size, (longest,))
    model.prefill(ids[: min(512, longest)], cache)  # warm-up: buffers and first-use costs stay out
    out = []
    for n in tqdm(lengths, desc="prefill against the roofline", unit="prompt", file=sys.stderr):
        cache.reset()
        with kernels.clocked() as clock:
            t = time.perf_counter()
            model.prefill(ids[:n], cache)
            seconds = time.perf_counter() - t
        row = {"tokens": n, "tokens_per_s": n / seconds}
        row.update(against_floor(roofline.prefill_macs(model.cfg, n), seconds, clock, peaks))
        out.append(row)
    return out


def rows_roofline(model: Any, res: dict[str, Any], peaks: dict[str, float]) -> dict[str, Any]:
    """The many-row forwards `step_costs` timed (best of its repeats, logits for every row),
    against the compute floor and against the roofline's floor (the higher of compute and memory)."""
    context = res["context"]
    out = {}
    for r, seconds in res["forward_s_at_context"].items():
        row = against_floor(roofline.forward_macs(model.cfg, int(r), context, logits=int(r)), seconds, None, peaks)
        row["roofline_floor_s"] = max(row["floor_s"], res["floor_s"])
        row["share_of_roofline"] = row["roofline_floor_s"] / seconds
        out[r] = row
    return out


def report(res: dict[str, Any], prefill_tokens: int) -> str:
    """The measurements as text."""
    lines = [f"model {res['model']} ({res['dtype']}, {res['weights']} weights, kernels {res['cpu_kernels']}), "
             f"{res['threads']} threads, loaded in {res['load_s']:.1f} s",
             f"prefill: {res['prefill_tokens_per_s_efficient']:.1f} tok/s efficient, "
             f"{res['prefill_tokens_per_s_eager']:.1f} tok/s eager ({prefill_tokens} tokens)",
             f"forward over a {res['context']}-token cache:"]
    vs_one = res.get("rows_cost_vs_one", {})
    linear, attention = res.get("linear_s_at_context", {}), res.get("attention_s_at_context", {})
    for r, seconds in res["forward_s_at_context"].items():
        extra = f"  ({vs_one[r]:.2f}x one row)" if vs_one else ""
        if linear:
            extra += f"; kernels: linear layers {linear[r] * 1e3:.1f} ms, attention {attention[r] * 1e3:.1f} ms"
            if "1" in linear:
                extra += f" ({linear[r] / linear['1']:.2f}x, {attention[r] / attention['1']:.2f}x one row's)"
        lines.append(f"  {int(r):3d} new tokens: {seconds * 1e3:7.1f} ms{extra}")
    lines.append(f"floor: {res['weight_bytes'] / 1e9:.2f} GB of weights / {res['read_bandwidth_gbs']:.1f} GB/s read "
                 f"bandwidth = {res['floor_s'] * 1e3:.0f} ms{moved_note(res.get('read_bandwidth_gbs_span'))}")
    if "one_row_split" in res:
        lines.append(step_split.report(res["one_row_split"]))
    if "roofline" in res:
        lines.append(roofline_report(res["roofline"]))
    return "\n".join(lines)


def moved_note(span: list[float] | tuple[float, float] | None, moved: float = 1.1) -> str:
    """A floor's caveat where the read rate moved by more than `moved` during the run ('' if not)."""
    if not span or span[1] <= moved * span[0]:
        return ""
    return (f" (the read rate moved between {span[0]:.1f} and {span[1]:.1f} GB/s during this run: a time taken at "
            f"the lower rate sits up to {span[1] / span[0]:.2f}x further from this floor than the memory held it)")


def roofline_report(rf: dict[str, Any]) -> str:
    """The roofline part of the report: the peaks, then prefill and the many-row forwards."""
    pk, now, ins = rf["peak_gmac_per_s"], rf["peak_measured_now_gmac_per_s"], rf["peak_instruction"]
    lk = rf.get("linear_peak_kind", "int8")  # bf16 for BF16 files on bfloat16 products
    lines = [f"compute floor ({rf['path']} kernels, {rf['cpu']}, {rf['threads']} threads): linear layers at the {lk} "
             f"peak {pk[lk]:.0f} G MAC/s ({ins[lk]}; {now[lk]:.0f} this run), attention at the bf16 "
             f"peak {pk['bf16']:.0f} G MAC/s ({ins['bf16']}; {now['bf16']:.0f} this run)"]
    if rf["prefill"]:
        head = ("tokens", "tok/s", "time s", "floor s", "of floor", "linear G/s", f"of {lk}", "attn G/s",
                "of bf16", "lin s", "attn s", "other s")
        rows = [head] + [
            (str(p["tokens"]), f"{p['tokens_per_s']:.1f}", f"{p['seconds']:.2f}", f"{p['floor_s']:.2f}",
             f"{p['share_of_floor']:.0%}", f"{p['linear_gmac_per_s']:.0f}", f"{p['linear_share_of_peak']:.0%}",
             f"{p['attention_gmac_per_s']:.0f}", f"{p['attention_share_of_peak']:.0%}", f"{p['linear_s']:.2f}",
             f"{p['attention_s']:.2f}", f"{p['other_s']:.2f}")
            for p in rf["prefill"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines.append("prefill (one run per length):")
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("forwards over the cache: share of the compute floor / of the roofline (max of compute and memory)")
    for r, row in rf["rows"].items():
        lines.append(f"  {int(r):3d} new tokens: {row['share_of_floor']:5.1%} / {row['share_of_roofline']:5.1%}  "
                     f"({row['sustained_gmac_per_s']:.0f} G MAC/s sustained)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
