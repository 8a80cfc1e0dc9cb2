"""What each weight scheme does to the target's predictions, teacher-forced on long text.

    python -m specextend.bench.quality --data ../shared/data/govreport/govreport_2K.jsonl \\
        --chunks 20 --weights float32,bfloat16,gguf,int8,int4 --llamacpp --out results/quality

The texts are joined into one token stream and cut into chunks of `--ctx` tokens; each chunk is
read in one causal pass and its second half is scored (every position predicts the next token),
which is how llama.cpp's `llama-perplexity` scores a file, so `--llamacpp` runs that tool on the
same text beside ours. The reference is the float32 model (a GGUF's weights dequantised exactly);
for every scheme the report gives perplexity, its change against the reference and next-token
top-1 agreement with the reference (± its standard error). Writes `quality.json` and `quality.md` into `--out`,
and each scheme's per-position scores into `--out`/scores/ (`<scheme>.pt`).

Two arithmetics of one model are compared *paired*, position by position, with `--baseline`: each row then
gains its top-1 agreement less the baseline's (points) and its perplexity over the baseline's, each ± a standard
error from runs of ~512 consecutive positions (a chunk at --ctx 1024; positions that share their context are not
independent draws): the error of the difference a rule
judges, where two rows' own errors set side by side say nothing of it (both rows share the reference and most
positions). The baseline and the reference may be an earlier run's scores file, which pairs runs an environment
switch sets apart (`SPECEXTEND_K256`):

    python -m specextend.bench.quality --data ... --weights gguf --out results/p32
    SPECEXTEND_K256=q4k python -m specextend.bench.quality --data ... --weights gguf \\
        --reference results/p32/scores/float32.pt --baseline results/p32/scores/gguf.pt --out results/k256

A `--weights` entry may be a scores file too: it is compared again, not scored again.

A scheme may end in `@kv-q8`: those weights with the target's KV cache in q8 (`--kv-cache q8`),
e.g. `--weights gguf,gguf@kv-q8 --reference gguf --ctx 8192` isolates what the KV cache's
quantization does at long context (top-1 agreement against float32 then moves by at most the
disagreement with the `gguf` reference; a float32 reference at 8K+ tokens costs minutes a chunk).

An `act-<rule>[:<types>]` scheme is the float32 model with the linear layers' inputs fake-quantized
by a rule for the activations (bench/emulate.py): what an arithmetic would cost before it is built;
`float32@scores-q8` or `act-<rule>@scores-q8` emulates attention scores from int8 queries and keys.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..common.errors import UserError
from ..common.jsonl import read_texts
from . import emulate
from .report import write_bytes_atomic, write_text_atomic

DEFAULT_WEIGHTS = "float32,bfloat16,gguf,int8,int4"


@dataclass
class Scored:
    """Per scored position of every chunk: the next token's log-probability and the top-1 choice."""

    logprob: torch.Tensor  # float64 [positions]
    top1: torch.Tensor  # long [positions]
    name: str = ""  # the scheme, or the scores file's scheme and path when read from an earlier run

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprob.mean()))


def token_stream(texts: list[str], tokenizer: Any) -> tuple[str, list[int]]:
    """The texts as one document (blank line between reports) and its tokens (no BOS, as the file's)."""
    text = "\n\n".join(t.strip() for t in texts)
    return text, [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def chunks_of(ids: list[int], ctx: int, count: int) -> list[torch.Tensor]:
    n = len(ids) // ctx
    if n < count:
        raise UserError(f"the texts give {n} chunks of {ctx} tokens, fewer than --chunks {count}; add --samples")
    return [torch.tensor(ids[i * ctx : (i + 1) * ctx]) for i in range(count)]


@torch.no_grad()
def score(model: Any, chunks: list[torch.Tensor], piece: int = 256, progress: str = "") -> Scored:
    """Teacher-forced scores of each chunk's second half (position j predicts token j + 1)."""
    logprobs, top1 = [], []
    for chunk in tqdm(chunks, desc=progress, unit="chunk", file=sys.stderr, disable=not progress):
        ctx = chunk.shape[0]
        first = ctx // 2
        cache = model.new_cache(ctx)
        for s in range(0, ctx, piece):
            part = chunk[s : s + piece]
            lo = max(first, s) - s
            hi = min(part.shape[0], ctx - 1 - s)  # the last token predicts nothing we can check
            rows = slice(lo, hi) if hi > lo else slice(0, 0)
            logits = model(part, torch.arange(s, s + part.shape[0]), cache, None, "efficient", logits_rows=rows)
            cache.commit()
            if hi > lo:
                lp = torch.log_softmax(logits.double(), -1)
                target = chunk[s + lo + 1 : s + hi + 1]
                logprobs.append(lp.gather(1, target.unsqueeze(1)).squeeze(1))
                top1.append(logits.argmax(-1))
    return Scored(torch.cat(logprobs), torch.cat(top1))


def top1_agreement(top1: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The share of positions whose top-1 choice is the reference's, and its standard error (a binomial
    share's, as llama-perplexity prints its own): on 4,088 predictions at 98.6%, ±0.18 points."""
    p = float((top1 == ref).double().mean())
    return {"top1_agreement": p, "top1_stderr": math.sqrt(p * (1 - p) / top1.numel())}


RUN = 512  # positions a run of the paired errors' batch means holds (about a chunk's at the default --ctx 1024)


def chunk_mean(d: torch.Tensor, chunks: int) -> tuple[float, float | None]:
    """The mean of per-position values and its standard error from the means of runs of ~RUN consecutive
    positions inside each of `chunks` equal chunks (batch means: positions that share their context are not
    independent draws, runs of hundreds nearly are); no error from one run."""
    per_chunk = d.numel() // chunks
    runs = [part.double().mean() for c in d.reshape(chunks, per_chunk)
            for part in torch.tensor_split(c, max(1, per_chunk // RUN))]
    se = float(torch.stack(runs).std() / math.sqrt(len(runs))) if len(runs) > 1 else None
    return float(d.double().mean()), se


def paired(a: Scored, base: Scored, ref_top1: torch.Tensor, chunks: int) -> dict[str, Any]:
    """`a` against `base` on the same positions: top-1 agreement with the reference less the baseline's
    (a share; x100 for points), perplexity over the baseline's, the share of top-1 choices that differ,
    each mean with its standard error (chunk_mean's)."""
    if a.logprob.shape != base.logprob.shape:
        raise UserError(f"{a.name} and {base.name} scored different positions")
    delta, delta_se = chunk_mean((a.top1 == ref_top1).double() - (base.top1 == ref_top1).double(), chunks)
    log_ratio, log_se = chunk_mean(base.logprob - a.logprob, chunks)
    ratio = math.exp(log_ratio)
    return {"baseline": base.name, "top1_delta": delta, "top1_delta_stderr": delta_se,
            "perplexity_ratio": ratio, "perplexity_ratio_stderr": None if log_se is None else ratio * log_se,
            "top1_changed": float((a.top1 != base.top1).double().mean())}


def chunks_digest(chunks: list[torch.Tensor]) -> str:
    """What a saved score's positions are: the chunks' tokens (so the data, --ctx and --chunks)."""
    return hashlib.sha256(torch.stack(chunks).to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def save_scores(folder: Path, sc: Scored, digest: str) -> Path:
    """A scheme's per-position scores, written atomically, for pairing with later runs."""
    from ..runtime import kernels

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (re.sub(r"[^A-Za-z0-9_.+@-]", "_", sc.name) + ".pt")
    buf = io.BytesIO()
    torch.save({"scheme": sc.name, "chunks": digest, "arithmetic": kernels.arithmetic_version(),
                "logprob": sc.logprob, "top1": sc.top1}, buf)
    write_bytes_atomic(path, buf.getvalue())
    return path


def load_scores(path: Path, digest: str) -> Scored:
    """Scores an earlier run saved (save_scores), refused unless they are of these chunks."""
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
        name, logprob, top1 = f"{d['scheme']} ({path}, arithmetic {d['arithmetic']})", d["logprob"], d["top1"]
    except Exception as e:  # a truncated, foreign or missing file: one clear error, not a traceback
        raise UserError(f"{path}: not a scores file of bench.quality ({type(e).__name__}: {e})") from None
    if d["chunks"] != digest:
        raise UserError(f"{path} scored other chunks (its data, --ctx, --chunks or --samples differ from this run's)")
    return Scored(logprob, top1, name)


LLAMACPP_KV = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "f32")


def llamacpp_args(gguf: Path, text_path: str, ctx: int, chunks: int, threads: int, kv: str,
                  logits: str | None, base: bool) -> list[str]:
    """llama-perplexity's arguments: the text cut as ours (`-b ctx`: a chunk in one pass), its KV cache
    in `kv` (a quantized V needs flash attention there), and with `logits` the file its first run
    saves the logits into (`base`) and the others compare with (`--kl-divergence`: top-1 agreement)."""
    args = ["-m", str(gguf), "-f", text_path, "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads),
            "-b", str(ctx)]
    if kv != "f16":
        args += ["-ctk", kv, "-ctv", kv, "-fa", "on"]
    if logits is not None:
        args += ["--kl-divergence-base", logits] + ([] if base else ["--kl-divergence"])
    return args


def parse_llamacpp_log(log: str) -> dict[str, Any]:
    """Perplexity from llama-perplexity's output: a plain run's final estimate, or in a --kl-divergence run
    its statistics (the perplexity, its ratio to the base run's as that run saved it, and top-1 agreement);
    {} where it printed neither."""
    kl = re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)\s*±\s*([0-9.]+)", log)
    m = kl or re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if m is None:
        return {}
    out: dict[str, Any] = {"perplexity": float(m.group(1)), "stderr": float(m.group(2))}
    tokens = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens", log, re.S)
    out["tokens"] = int(tokens.group(1)) if tokens else None
    ratio = re.search(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.]+)", log)
    top = re.search(r"Same top p:\s*([0-9.]+)\s*±\s*([0-9.]+)\s*%\s*$", log, re.M)
    if kl is not None and ratio is not None and top is not None:
        out["perplexity_ratio_to_base"] = float(ratio.group(1))
        out["top1_agreement"] = float(top.group(1)) / 100
        out["top1_stderr"] = float(top.group(2)) / 100
    return out


def llamacpp_perplexity(gguf: Path, text: str, ctx: int, chunks: int, threads: int = 2,
                        kv_types: tuple[str, ...] = ("f16",), logs: Path | None = None) -> list[dict[str, Any]]:
    """llama.cpp's `llama-perplexity` on the same text and chunking (installed by `make peers`), once per
    KV cache type; every type after the first also gets its top-1 agreement with the first's logits.
    Each run's output is kept in `logs` (a folder) as `llama-perplexity-<kv>.log`, read or not."""
    from .llamacpp import _server_env, find_peer

    peer = find_peer("--llamacpp")
    tool = peer.binary.with_name("llama-perplexity")
    if not tool.is_file():
        raise UserError(f"{tool} not found beside llama-server; run `make peers`")
    results = []
    with tempfile.TemporaryDirectory(prefix="specextend-ppl-") as tmp:
        path = os.path.join(tmp, "text.txt")
        Path(path).write_text(text, encoding="utf-8")
        logits = os.path.join(tmp, "base.kld") if len(kv_types) > 1 else None
        for i, kv in enumerate(kv_types):
            t0 = time.perf_counter()
            out = subprocess.run([str(tool), *llamacpp_args(gguf, path, ctx, chunks, threads, kv, logits, i == 0)],
                                 capture_output=True, text=True, env=_server_env(), timeout=6 * 3600, check=False)
            log = out.stdout + out.stderr
            if logs is not None:
                write_text_atomic(logs / f"llama-perplexity-{kv}.log", log)
            parsed = parse_llamacpp_log(log)
            if out.returncode != 0 or not parsed:
                raise UserError(f"llama-perplexity (KV {kv}) failed (exit {out.returncode}): "
                                f"{log.strip().splitlines()[-1:]}")
            results.append({**parsed, "kv_cache": kv, "seconds": time.perf_counter() - t0, "version": peer.version})
    return results


def _pm(value: float, se: float | None, scale: float, fmt: str) -> str:
    return format(scale * value, fmt) + ("" if se is None else " ± " + format(scale * se, fmt.lstrip("+")))


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    ref = meta.get("reference", "float32")
    base = meta.get("baseline")
    lines = [
        f"Teacher-forced on {meta['chunks']} chunks x {meta['scored_per_chunk']} scored positions "
        f"({meta['positions']} predictions; {meta['tokens']} tokens of {meta['data']}), ctx {meta['ctx']}; "
        f"the kernels' arithmetic {meta.get('arithmetic', '?')}.",
    ]
    if " (" in ref:  # an earlier run's scores: named in full once, by its scheme in the table
        lines.append(f"Reference: {ref}.")
        ref = ref.split(" (")[0]
    if base:
        lines.append(f"Paired against {base}: each error from the means of runs of ~{RUN} consecutive predictions.")
    head = f"| weights | perplexity | change vs {ref} | top-1 agreement with {ref} |"
    rule = "|---|---:|---:|---:|"
    if base:
        head += " top-1 vs baseline, points | perplexity / baseline's | top-1 changed |"
        rule += "---:|---:|---:|"
    lines += ["", head + " seconds |", rule + "---:|"]
    for r in rows:
        agree = "–" if r.get("top1_agreement") is None else f"{100 * r['top1_agreement']:.2f}%"
        if r.get("top1_stderr") is not None:
            agree += f" ± {100 * r['top1_stderr']:.2f}"
        change = "–" if r.get("perplexity_change") is None else f"{100 * r['perplexity_change']:+.2f}%"
        line = f"| {r['weights']} | {r['perplexity']:.4f} | {change} | {agree} |"
        if base:
            pr = r.get("paired")
            line += (" – | – | – |" if pr is None else
                     f" {_pm(pr['top1_delta'], pr['top1_delta_stderr'], 100, '+.2f')} |"
                     f" {_pm(pr['perplexity_ratio'], pr['perplexity_ratio_stderr'], 1, '.4f')} |"
                     f" {100 * pr['top1_changed']:.2f}% |")
        lines.append(line + (" – |" if r.get("seconds") is None else f" {r['seconds']:.0f} |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specextend.bench.quality", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target model (default: the default pair's)")
    ap.add_argument("--data", required=True, help="JSONL file(s) with a `text` field, joined in order")
    ap.add_argument("--samples", type=int, default=None, help="texts to read (default: all)")
    ap.add_argument("--ctx", type=int, default=1024, help="tokens per chunk (default: 1024)")
    ap.add_argument("--chunks", type=int, default=20, help="chunks to score (default: 20)")
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS,
                    help="schemes, comma-separated: a --weights name, NAME@kv-q8 (that KV cache), an earlier run's "
                         "scores file (OUT/scores/SCHEME.pt: compared again, not scored again), or act-RULE[:TYPES] "
                         f"(the float32 model, activations fake-quantized: {', '.join(emulate.RULES)}; TYPES "
                         f"K-quants joined by +); a float or act- scheme may end in {emulate.SCORES_Q8} (int8 "
                         f"attention scores, emulated) (default: {DEFAULT_WEIGHTS})")
    ap.add_argument("--reference", default="float32",
                    help="the scheme the others are compared with, or an earlier run's scores file "
                         "(OUT/scores/SCHEME.pt) (default: float32)")
    ap.add_argument("--baseline", default=None,
                    help="compare each scheme with this one position by position (paired): one of --weights, or "
                         "an earlier run's scores file (OUT/scores/SCHEME.pt) (default: none)")
    ap.add_argument("--llamacpp", action="store_true", help="also run llama.cpp's llama-perplexity (make peers)")
    ap.add_argument("--llamacpp-kv", default="f16",
                    help="llama.cpp's KV cache types, comma-separated, the first the others' top-1 reference "
                         f"(default: f16; of {', '.join(LLAMACPP_KV)})")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except UserError as e:
        print(f"specextend quality: error: {e}", file=sys.stderr)
        return 2


def _load_options(scheme: str) -> dict[str, str]:
    """The target's load options for a scheme: float64 and bfloat16 compute in their own dtype,
    every other scheme in float32 (quantized weights) or its own (float16, via the scheme); a
    `@kv-<kind>` suffix sets the KV cache's kind; an `act-` scheme is the float32 model (emulate.py), and
    `@scores-q8` keeps its scheme's options (a float one's)."""
    scheme, int8_scores = emulate.split_scores(scheme)
    if emulate.parse(scheme) is not None:
        return {"dtype": "float32", "weights": "float32", "kv_cache": "bf16"}
    if int8_scores and scheme not in ("float32", "float64"):
        raise UserError(f"{scheme}{emulate.SCORES_Q8}: int8 scores are emulated on float32, float64 and act- "
                        "schemes only")
    weights, _, kv = scheme.partition("@kv-")
    return {"dtype": weights if weights in ("float64", "bfloat16") else "float32", "weights": weights,
            "kv_cache": kv or "bf16"}


def _llamacpp_rows(target: str | None, text: str, ctx: int, chunks: int, kv_types: tuple[str, ...],
                   ref_perplexity: float, out: Path) -> list[dict[str, Any]]:
    """The report's rows of llama.cpp's runs, one per KV type."""
    from .llamacpp import gguf_for

    rows = []
    base = kv_types[0]
    for lc in llamacpp_perplexity(gguf_for(target, "target"), text, ctx, chunks, kv_types=kv_types, logs=out):
        row = {"weights": f"llama.cpp {lc['version']} (its own kernels, GGUF as is, KV {lc['kv_cache']})",
               "perplexity": lc["perplexity"], "perplexity_change": lc["perplexity"] / ref_perplexity - 1,
               "seconds": lc["seconds"], "llamacpp": lc}
        if "top1_agreement" in lc:  # against llama.cpp's own first KV type, not our reference: its perplexity
            # here is computed apart from the first run's final estimate, so only the ratio compares
            row["weights"] += f" (change and top-1 against its KV {base})"
            row["perplexity_change"] = lc["perplexity_ratio_to_base"] - 1
            row["top1_agreement"], row["top1_stderr"] = lc["top1_agreement"], lc.get("top1_stderr")
        rows.append(row)
    return rows


def _scores_file(scheme: str | None) -> Path | None:
    """A --reference or --baseline that names an earlier run's scores file (`.pt`) rather than a scheme."""
    return Path(scheme) if scheme and scheme.endswith(".pt") else None


def _score_scheme(folder: Path, w: str, chunks: list[torch.Tensor], types: dict[str, str],
                  calibration_tokens: list[int]) -> tuple[Scored, float]:
    """One scheme's model loaded, scored over the chunks and dropped (one model in memory at a time)."""
    from .. import api

    t0 = time.perf_counter()
    model = api.load(folder, load_draft=False, progress=False, **_load_options(w)).target
    rule, int8_scores = emulate.split_scores(w)
    emulated = emulate.parse(rule) is not None
    if emulated:
        emulate.apply(model, rule, types)
    if int8_scores:
        emulate.apply_scores_q8(model, calibration_tokens)
    sc = score(model, chunks, progress=f"quality {w if emulated or int8_scores else model.weights}")
    del model
    sc.name = w
    print(f"specextend quality: {w}: perplexity {sc.perplexity:.4f}", file=sys.stderr, flush=True)
    return sc, time.perf_counter() - t0


def _row(w: str, sc: Scored, seconds: float | None, ref: Scored, base: Scored | None, chunks: int,
         is_reference: bool) -> dict[str, Any]:
    """A scheme's row (a scores file's: named by its scheme, file and arithmetic; no seconds)."""
    row: dict[str, Any] = {"weights": w if seconds is not None else sc.name, "perplexity": sc.perplexity,
                           "seconds": seconds}
    if not is_reference:
        row["perplexity_change"] = sc.perplexity / ref.perplexity - 1
        row.update(top1_agreement(sc.top1, ref.top1))
    if base is not None and base.name != w:
        row["paired"] = paired(sc, base, ref.top1, chunks)
    return row


def _run(a: argparse.Namespace) -> int:
    from .. import api
    from ..models.calibration import CALIBRATION_TEXT
    from ..models.resolve import LoadOptions
    from ..runtime import kernels
    from .llamacpp import gguf_for

    schemes = [w.strip() for w in a.weights.split(",") if w.strip()]
    ref_file, base_file = _scores_file(a.reference), _scores_file(a.baseline)
    for w in [*schemes, a.reference]:
        if _scores_file(w) is None:
            LoadOptions(**_load_options(w))
    if a.baseline and not base_file and a.baseline not in schemes:
        raise UserError(f"--baseline {a.baseline}: not one of --weights ({a.weights}) nor a scores file (.pt)")
    kv_types = tuple(k.strip() for k in a.llamacpp_kv.split(",") if k.strip())
    bad = [k for k in kv_types if k not in LLAMACPP_KV]
    if bad or not kv_types:
        raise UserError(f"unknown --llamacpp-kv {','.join(bad) or repr(a.llamacpp_kv)}; choose from "
                        f"{', '.join(LLAMACPP_KV)}")
    if a.ctx < 64 or a.ctx % 2:
        raise UserError("--ctx must be an even number of at least 64")
    texts = [t for p in a.data.split(",") for t in read_texts(Path(p))][: a.samples]
    prepared = api.prepare(a.target, load_draft=False)
    folder = prepared.target_path
    text, ids = token_stream(texts, prepared.tokenizer)
    chunks = chunks_of(ids, a.ctx, a.chunks)
    digest = chunks_digest(chunks)
    ref = load_scores(ref_file, digest) if ref_file else None
    base = load_scores(base_file, digest) if base_file else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    # the GGUF's tensor types, which the `act-` schemes' rules go by
    emulated = any(emulate.parse(emulate.split_scores(w)[0]) for w in [a.reference, *schemes] if not _scores_file(w))
    types = emulate.gguf_types(gguf_for(a.target, "target")) if emulated else {}
    calibration = prepared.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    scored: dict[str, tuple[Scored, float | None]] = {}
    for w in ([] if ref_file else [a.reference]) + [s for s in schemes if s != a.reference]:
        if _scores_file(w) is not None:  # an earlier run's: paired again, not scored again
            scored[w] = (load_scores(Path(w), digest), None)
            continue
        scored[w] = _score_scheme(folder, w, chunks, types, calibration)
        save_scores(out / "scores", scored[w][0], digest)
    ref = ref or scored[a.reference][0]
    base = base or (scored[a.baseline][0] if a.baseline else None)
    rows = [_row(w, *scored[w], ref, base, a.chunks, w == a.reference) for w in schemes]
    if a.llamacpp:
        rows += _llamacpp_rows(a.target, text, a.ctx, a.chunks, kv_types, ref.perplexity, out)
    meta = {"data": a.data, "tokens": len(ids), "ctx": a.ctx, "chunks": a.chunks,
            "scored_per_chunk": a.ctx - a.ctx // 2 - 1, "positions": int(ref.logprob.numel()),
            "target": str(folder), "reference": ref.name, "baseline": None if base is None else base.name,
            "chunks_digest": digest, "arithmetic": kernels.arithmetic_version()}
    write_text_atomic(out / "quality.json", json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = report(rows, meta)
    write_text_atomic(out / "quality.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
