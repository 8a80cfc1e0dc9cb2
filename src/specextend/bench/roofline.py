"""The roofline: this CPU's measured multiply-add peaks per kernel path, and the multiply-adds a
forward needs, which together give the compute floor of a forward.

`measure` times register-only loops of each path's own instructions (csrc/core/peak.h, built as
an extension of its own, `probes`, apart from the production kernels) on every thread at once:
the int8 dot product of its linear layers and the bfloat16 arithmetic of its attention. Another
process on the machine can only slow a loop down, so each figure is the best of several short
repeats, and the best figure measured so far for this CPU, thread count and kernel build is kept
beside the compiled peak loops (`record_path`): the runtime bench divides by it.

`forward_macs` counts a forward's multiply-adds exactly from the model's shape; `floor_s` puts
the linear layers' at the int8 peak and attention's at the bfloat16 peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..common.errors import UserError
from ..runtime import kernels

if TYPE_CHECKING:
    from ..runtime.config import ModelConfig

FLOOR_KINDS = ("int8", "bf16")  # the loops the compute floor divides by (the other kinds are reported only)
PEAK_KINDS = ("int8", "bf16", "bf16_native", "int8_pair")  # what a peak loop stands for; ids in csrc/core/peak.h
# The peak loops' library: its C interface, the loops and the CPU detection they run by.
PROBE_SOURCES = ("peak_lib.cpp", "core/peak.cpp", "core/cpu.cpp")


# --------------------------------------------------------------------------- multiply-adds


@dataclass(frozen=True)
class Macs:
    """Multiply-adds of a forward: the linear layers' (int8 dot products on the quantized kernels)
    and attention's (QK^T and PV over each token's visible keys, bfloat16 products)."""

    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def linear_macs_per_token(cfg: ModelConfig) -> int:
    """One token through every layer's q, k, v, o, gate, up and down projections (k x n each)."""
    h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q_out + 2 * kv_out) + q_out * h + h * 2 * cfg.intermediate_size + cfg.intermediate_size * h
    return cfg.num_layers * per_layer


def _seen(first: int, last: int, window: int | None = None) -> int:
    """Keys seen by tokens that see first, first + 1, ..., last keys, each at most `window`."""
    if last < first:
        return 0
    if window is None or last <= window:
        return (first + last) * (last - first + 1) // 2
    if first > window:
        return window * (last - first + 1)
    return _seen(first, window) + window * (last - window)


def forward_macs(cfg: ModelConfig, new: int, context: int = 0, logits: int = 0) -> Macs:
    """A forward of `new` tokens after `context` cached ones, causal among themselves (new token i
    sees context + i + 1 keys; on a windowed layer at most its window), with the LM head run for
    `logits` rows."""
    windowed = cfg.windowed_layers
    keys = (cfg.num_layers - windowed) * _seen(context + 1, context + new)
    if windowed:
        keys += windowed * _seen(context + 1, context + new, cfg.sliding_window)
    head = logits * cfg.hidden_size * cfg.vocab_size
    attention = 2 * cfg.num_heads * cfg.head_dim * keys
    return Macs(linear=new * linear_macs_per_token(cfg) + head, attention=attention)


def prefill_macs(cfg: ModelConfig, tokens: int) -> Macs:
    """A prompt of `tokens` prefilled from an empty cache, logits for its last token only. Chunking
    changes nothing: each token sees its predecessors and itself whichever chunk it is in."""
    return forward_macs(cfg, tokens, 0, logits=1)


def floor_s(macs: Macs, int8_gmac_per_s: float, bf16_gmac_per_s: float) -> float:
    """Seconds the forward's arithmetic takes at the peaks: linear at int8's, attention at bf16's."""
    return macs.linear / (int8_gmac_per_s * 1e9) + macs.attention / (bf16_gmac_per_s * 1e9)


# --------------------------------------------------------------------------- peaks


@functools.cache
def probes() -> ctypes.CDLL:
    """The peak loops' own library (csrc/peak_lib.cpp), built on first use beside the kernels."""
    lib = ctypes.CDLL(str(kernels.build_library("specextend_peak", PROBE_SOURCES, "the multiply-add peak loops")))
    d, p = ctypes.c_double, ctypes.POINTER
    lib.spx_peak.argtypes = [ctypes.c_int, ctypes.c_int, d, ctypes.c_int, ctypes.c_int, p(d), p(d),
                             p(ctypes.c_char_p), p(ctypes.c_char_p), p(ctypes.c_uint32)]
    lib.spx_peak.restype = ctypes.c_int
    return lib


def peak(path: str, kind: str, seconds: float, repeats: int) -> dict[str, Any] | None:
    """One register-only multiply-add loop of `path` (csrc/core/peak.h) on as many threads as
    torch's pool: its instruction and note, and each repeat's wall seconds and multiply-adds (all
    threads); None where the path has no loop of that `kind` (PEAK_KINDS)."""
    if seconds <= 0 or repeats < 1:
        raise ValueError("peak: seconds must be positive and repeats at least 1")
    threads = torch.get_num_threads()
    secs, macs = (ctypes.c_double * repeats)(), (ctypes.c_double * repeats)()
    instruction, note, digest = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_uint32()
    got = probes().spx_peak(kernels.path_index(path), PEAK_KINDS.index(kind), seconds, repeats, threads, secs, macs,
                            ctypes.byref(instruction), ctypes.byref(note), ctypes.byref(digest))
    if got == -2:
        raise UserError(f"this CPU cannot run the {path} kernels")
    if got != 0:
        return None
    return {"instruction": (instruction.value or b"").decode(), "note": (note.value or b"").decode(),
            "threads": threads, "seconds": list(secs), "macs": list(macs), "digest": digest.value}


def record_path() -> Path:
    """Where the best peaks of this CPU and thread count are kept: beside the compiled peak loops,
    so a new build of the loops (or another machine sharing the cache) starts its own record."""
    who = f"{kernels.cpu_name()}|{platform.machine()}|{torch.get_num_threads()}"
    return kernels.build_dir(PROBE_SOURCES) / f"peaks-{hashlib.sha256(who.encode()).hexdigest()[:12]}.json"


def _read_record(path: Path) -> dict[str, dict[str, Any]]:
    # A torn, hand-edited or foreign file is ignored: the record then starts again.
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, KeyError):
        best = json.loads(path.read_text())["best"]
        return {str(k): {"gmac_per_s": float(v["gmac_per_s"]), "measured_at": str(v["measured_at"])}
                for k, v in best.items()}
    return {}


def _update_record(path: Path, fresh: dict[str, float]) -> dict[str, float]:
    """The best figure of each loop, this run's included; written back (atomically) if it moved."""
    best = _read_record(path)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    moved = False
    for k, v in fresh.items():
        if v > best.get(k, {}).get("gmac_per_s", 0.0):
            best[k] = {"gmac_per_s": v, "measured_at": stamp}
            moved = True
    if moved:
        with contextlib.suppress(OSError):  # an unwritable cache only loses the record
            doc = {"cpu": kernels.cpu_name(), "threads": torch.get_num_threads(),
                   "kernel_build": kernels.source_key(), "best": best}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    return {k: v["gmac_per_s"] for k, v in best.items()}


def measure(paths: list[str] | None = None, seconds: float = 0.5, repeats: int = 5,
            record: bool = True) -> dict[str, Any]:
    """Each path's peaks on all threads (`paths`: default every path; those this CPU cannot run
    are listed as such). `seconds` per loop, split into `repeats` timed runs; a loop's figure is
    its best run. With `record`, the best figures so far are kept and reported beside them."""
    runnable = kernels.cpu_paths()
    threads = torch.get_num_threads()
    out: dict[str, Any] = {
        "cpu": kernels.cpu_name(), "machine": platform.machine(), "threads": threads,
        "kernel_build": kernels.source_key(), "auto": kernels.auto_path(runnable),
        "has_avx512_bf16": bool(kernels.load().has_avx512_bf16()),
        "seconds_per_loop": seconds, "repeats": repeats, "figure": "best of the repeats",
        "unit": "G multiply-adds per second", "paths": {},
    }
    fresh: dict[str, float] = {}
    for path in paths or list(kernels.PATHS):
        if path not in runnable:
            why = kernels.amx_refusal() if path == "amx" else None
            out["paths"][path] = {"runnable": False,
                                  "reason": f"this CPU cannot run the {path} kernels" + (f": {why}" if why else "")}
            continue
        loops = {}
        for kind in PEAK_KINDS:
            r = peak(path, kind, seconds, repeats)
            if r is None:
                continue
            rates = [m / s / 1e9 for m, s in zip(r["macs"], r["seconds"], strict=True)]
            best = max(rates)
            loops[kind] = {
                "instruction": r["instruction"], "note": r["note"] or None,
                "estimate": path == "portable", "in_floor": kind in FLOOR_KINDS,
                "gmac_per_s": best, "gmac_per_s_per_thread": best / r["threads"],
                "repeats_gmac_per_s": rates,
            }
            fresh[f"{path}/{kind}"] = best
        out["paths"][path] = {"runnable": True, "loops": loops}
    if record:
        rec = record_path()
        best = _update_record(rec, fresh)
        out["record"] = str(rec)
        for path, entry in out["paths"].items():
            for kind, loop in entry.get("loops", {}).items():
                loop["best_recorded_gmac_per_s"] = best.get(f"{path}/{kind}", loop["gmac_per_s"])
    return out


def floor_peaks(measured: dict[str, Any], path: str) -> dict[str, float]:
    """The int8 and bf16 peaks of `path` the floor divides by: the best recorded where there is a
    record (noise only lowers a measurement), else this run's."""
    loops = measured["paths"][path]["loops"]
    return {k: loops[k].get("best_recorded_gmac_per_s", loops[k]["gmac_per_s"]) for k in FLOOR_KINDS}


def table(measured: dict[str, Any]) -> str:
    """`measure`'s result as text: one line per path and loop, then the loops' notes."""
    m = measured
    lines = [f"peak multiply-adds per kernel path on {m['cpu']} ({m['machine']}), {m['threads']} threads, "
             f"kernel build {m['kernel_build']}",
             f"each figure the best of {m['repeats']} runs of {m['seconds_per_loop'] / m['repeats']:.2f} s "
             "on all threads at once (register-only loops; the machine is shared, so the best run is the "
             "least disturbed)"]
    recorded = "record" in m
    head = ["path", "kind", "instruction", "G MAC/s", "per thread"] + (["best recorded"] if recorded else [])
    rows: list[list[str]] = [head]
    notes = []
    for path, entry in m["paths"].items():
        if not entry["runnable"]:
            rows.append([path, "-", f"not runnable: {entry['reason']}"])
            continue
        for kind, loop in entry["loops"].items():
            mark = " (estimate)" if loop["estimate"] else ("" if loop["in_floor"] else " (not in the floor)")
            row = [path, kind, loop["instruction"] + mark, f"{loop['gmac_per_s']:.1f}",
                   f"{loop['gmac_per_s_per_thread']:.1f}"]
            if recorded:
                row.append(f"{loop['best_recorded_gmac_per_s']:.1f}")
            rows.append(row)
            if loop["note"]:
                notes.append(f"  {path} {kind}: {loop['note']}")
    widths = [max(len(r[i]) for r in rows if len(r) > 3) for i in range(len(head))]
    for r in rows:
        if len(r) == 3:  # a path this CPU cannot run
            lines.append(f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}")
            continue
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells))
    if notes:
        lines += ["notes:", *notes]
    if recorded:
        lines.append(f"best recorded: the highest each loop has reached on this machine and build ({m['record']})")
    return "\n".join(lines)
