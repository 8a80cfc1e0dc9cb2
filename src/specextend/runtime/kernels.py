"""The project's C++ CPU kernels (quantized linear layers, attention, RoPE), built once per machine.

The sources live in `csrc/`: a core over raw pointers (`csrc/core/`, no PyTorch: one file per
instruction set behind one dispatch) and a thin PyTorch binding (`csrc/torch_ops.cpp`). The
extension is compiled with PyTorch's `cpp_extension` into `~/.cache/specextend/kernels/<key>/`
(see `build_dir`), where the key covers the sources, the torch and Python versions and the
compiler flags, so an edited source or a new torch builds again while every later process
loads the cached library in well under a second. `make setup` builds it; the first use builds
it otherwise. OpenMP comes from torch's own runtime (same thread pool). `build` makes any
extension of csrc/ this way: the multiply-add peak loops are one of their own (bench/roofline.py),
so the production kernels do not carry them.

Kernel paths (`SPECEXTEND_CPU`): `portable` (plain C++, any CPU), `avx2` (AVX2 + FMA + F16C),
`avx512` (AVX-512 with VNNI; its attention uses AVX512-BF16 where present), `neon` (ARMv8.2
dot products) and `amx` (Intel AMX tiles for products of 16+ rows, avx512 for the rest; only where
CPUID, XCR0 and Linux's permission request all allow it). Every path computes the same arithmetic
in the same order, so each gives the portable path's bits; `auto` (the default) takes the fastest
this CPU runs. `amx-emulated` is a test switch, not a path to run: the amx code with its tile
operations emulated in plain C++ (any CPU, slowly), so tests compare it bit for bit everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..common.errors import UserError

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("torch_ops.cpp", "core/cpu.cpp", "core/qlinear.cpp", "core/qlinear_portable.cpp",
            "core/qlinear_avx2.cpp", "core/qlinear_avx512.cpp", "core/qlinear_neon.cpp", "core/attention.cpp",
            "core/attention_portable.cpp", "core/attention_avx2.cpp", "core/attention_avx512.cpp",
            "core/attention_neon.cpp", "core/rope.cpp", "step_ops.cpp", "core/step.cpp", "core/qlinear_amx.cpp",
            "core/family.cpp", "core/experts.cpp", "core/qlinear_bf16_avx512.cpp")
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17")
_lock = threading.Lock()
_module: ModuleType | None = None

PATHS = ("portable", "avx2", "avx512", "neon", "amx")  # the kernel paths; ids in csrc/core/cpu.h
EMULATED_AMX = "amx-emulated"  # test switch (csrc/core/cpu.h): the amx code on emulated tiles
# The kernels' arithmetic, versioned: raised whenever an output's bits change, so that KV written
# by another version (the prefix cache's files) is never read back as if this one had computed
# it. 2: an attention score is one chain over the dimension pairs. 3: Q4_0's weights as d * (q - 8)
# under q8's epilogue (the offset in the integer sum), not a one-group q4k's minimum term. 4: attention's
# online softmax runs per chunk of 512 keys, the chunks folded in order (a long cache read in pieces).
# 5: a family's post norms, GeGLU and whole-row q/k norms as core/family.h's row operations, partial
# rotary in rope_store, a score scale in the attention kernel (the families' KV and logits). 6: an expert
# router's weighting in the kernels (core/experts.h), not PyTorch's softmax and top-k (expert models' bits).
# 7: soft-capped attention scores (Gemma 2) in the attention kernel (fastexp.h's tanh), not PyTorch's.
# 8: Qwen2-MoE's shared expert added under core/experts.h's sigmoid, not PyTorch's (the whole-step call's).
ARITHMETIC_VERSION = 8
CPU_ENV = "SPECEXTEND_CPU"
# "1" (or some of q4k,q5k,iq4,q6k,q3k,q2k): the K-quants (Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K, Q2_K) take
# activations with one scale per 256 values (llama.cpp's Q8_K; csrc/core/qlinear.h), the other
# formats keep theirs per 32. Off by default: on the default target it costs 1.6 points of top-1
# agreement with float32 (Q6_K alone 1.0, Q4_K alone 0.4 on 8 chunks: docs/log/2026-12-q8k.md),
# outside the project's rule of 0.5 but for Q4_K, whose 20-chunk check is still due; and avx2 and neon
# compute it on the portable tiles (the same bits, slowly), avx512 and amx on avx512's kernels.
K256_ENV = "SPECEXTEND_K256"
K256_FORMATS = {"q4k": 0, "q6k": 1, "q5k": 3, "iq4": 4, "q3k": 5, "q2k": 6}  # csrc/core/qlinear.h's Format


def k256() -> int:
    """The mask of K-quant formats (bit: the format's id) whose activations are quantized per 256."""
    value = os.environ.get(K256_ENV, "0").strip().lower()
    if value in ("", "0"):
        return 0
    names = list(K256_FORMATS) if value == "1" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in K256_FORMATS]
    if bad:
        raise UserError(f"{K256_ENV}={value}: not a K-quant format: {', '.join(bad)} "
                        f"(1, 0 or some of {', '.join(K256_FORMATS)})")
    return sum(1 << K256_FORMATS[n] for n in set(names))


# "auto" (the default), "1" or "0": a BF16 file's weights multiply bfloat16-rounded activations on
# bfloat16 dot products (llama.cpp's arithmetic for them; the quant format bf16d, csrc/core/qlinear.h),
# or float32 ones exactly. auto: on where VDPBF16PS runs at full rate (AMD's Zen 4 and Zen 5, twice
# their FMA rate), off elsewhere (Intel's Xeons run it at half theirs; avx2 and neon have none). A
# property of the CPU, not of a timing, so one machine's processes share one arithmetic; every path
# of a process computes it (avx512 on VDPBF16PS, the others on the portable tiles: the same bits).
BF16_PRODUCTS_ENV = "SPECEXTEND_BF16_PRODUCTS"


@functools.cache
def _cpu_vendor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


def bf16_products() -> bool:
    """Whether BF16 files' weights take bfloat16 activations on bfloat16 dot products (`BF16_PRODUCTS_ENV`)."""
    value = os.environ.get(BF16_PRODUCTS_ENV, "auto").strip().lower()
    if value in ("0", "1"):
        return value == "1"
    if value not in ("", "auto"):
        raise UserError(f"{BF16_PRODUCTS_ENV}={value}: expected auto, 1 or 0")
    return (_cpu_vendor() == "AuthenticAMD" and available() and "avx512" in cpu_paths()
            and bool(load().has_avx512_bf16()))


def arithmetic_version() -> str:
    """ARITHMETIC_VERSION, which formats take activations per 256 and whether BF16 weights take
    bfloat16 products: KV computed under one is never read back under another (the prefix cache's
    fingerprint)."""
    mask = k256()
    version = f"{ARITHMETIC_VERSION}-k256:{mask}" if mask else str(ARITHMETIC_VERSION)
    return f"{version}-bf16dot" if bf16_products() else version


def _key(sources: tuple[str, ...] = _SOURCES) -> str:
    h = hashlib.sha256()
    # The checkout's own path too: the build records absolute source paths, so two checkouts (git
    # worktrees) sharing one directory would rebuild it over each other at every load.
    h.update(str(_CSRC.resolve()).encode())
    # The extension's sources and every header (any source may include any of them): an edited
    # header must build again.
    headers = sorted(f.relative_to(_CSRC).as_posix() for f in _CSRC.rglob("*.h") if f.parent.name != "test")
    for name in [*sources, *headers]:
        h.update(name.encode())
        h.update((_CSRC / name).read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{_CFLAGS}".encode())
    return h.hexdigest()[:16]


def source_key() -> str:
    """What identifies this build of the kernels (sources, torch, Python, flags): measured step
    costs are kept per build (costmodel.py), since a kernel change moves them."""
    return _key()


def build_dir(sources: tuple[str, ...] = _SOURCES) -> Path:
    """Where the compiled kernels (or the extension of `sources`) live: `SPECEXTEND_KERNEL_CACHE`,
    else ~/.cache/specextend/kernels. Not under SPECEXTEND_HOME: pointing that at another model
    cache should not compile again."""
    root = os.environ.get("SPECEXTEND_KERNEL_CACHE", "~/.cache/specextend/kernels")
    return Path(root).expanduser() / _key(sources)


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (building it on first use); UserError if it cannot be built."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            module = build("specextend_kernels", _SOURCES, "the CPU kernels", verbose)
            module.set_k256(k256())
            _module = module
    return _module


def build(stem: str, sources: tuple[str, ...], what: str, verbose: bool = False) -> ModuleType:
    """The extension of `sources` (paths under csrc/), built into its own folder of the kernel
    cache on first use (`what` names it in the one line that says so); UserError if it cannot be."""
    import fcntl

    from torch.utils import cpp_extension

    out = build_dir(sources)
    out.mkdir(parents=True, exist_ok=True)
    # The `ninja` that cpp_extension runs is the one installed beside this interpreter (a pinned
    # dependency), also when the virtual environment is not activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # One process builds while the others wait, on a lock the system releases when its holder dies.
    # cpp_extension's own baton (a file named `lock`, waited on while it exists) is left behind by a
    # build that was killed, and every later load would then wait on it forever: under our lock no
    # one else is building, so a baton found there is such a leftover.
    with open(out / f"{stem}.build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (out / "lock").unlink(missing_ok=True)
        if not any(out.glob("*.so")):
            print(f"specextend: building {what} (once per machine, about a minute)", file=sys.stderr, flush=True)
        try:
            return cpp_extension.load(
                name=f"{stem}_{out.name}",
                sources=[str(_CSRC / n) for n in sources],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                verbose=verbose,
            )
        except (RuntimeError, OSError, ImportError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot build {what} in {out}: {first} (is g++ installed?)") from None


def build_library(stem: str, sources: tuple[str, ...], what: str) -> Path:
    """A plain shared library of `sources` (paths under csrc/, no PyTorch), compiled with g++ into
    its own folder of the kernel cache on first use; the path of the `.so`. One process builds
    while the others wait (a lock file); the library appears under its name only once whole."""
    import fcntl
    import subprocess

    out = build_dir(sources)
    lib = out / f"lib{stem}.so"
    if lib.is_file():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():
            return lib
        print(f"specextend: building {what} (once per machine, a few seconds)", file=sys.stderr, flush=True)
        tmp = out / f"lib{stem}.so.{os.getpid()}.tmp"
        cmd = ["g++", *_CFLAGS, "-shared", "-fPIC", *(str(_CSRC / n) for n in sources), "-o", str(tmp)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise UserError(f"cannot build {what} in {out}: {e} (is g++ installed?)") from None
        if run.returncode != 0:
            first = (run.stderr.strip().splitlines() or ["g++ failed"])[0]
            tmp.unlink(missing_ok=True)
            raise UserError(f"cannot build {what} in {out}: {first}")
        os.replace(tmp, lib)
    return lib


def available() -> bool:
    """Whether the kernels can be used here (built or buildable); never raises."""
    if os.environ.get("SPECEXTEND_NO_KERNELS"):
        return False
    try:
        load()
    except UserError:
        return False
    return True


def cpu_paths() -> list[str]:
    """The kernel paths this CPU runs, slowest first (always starting with `portable`)."""
    return list(load().cpu_paths())


def path_index(name: str) -> int:
    """The C++ id of a kernel path (PATHS, or the EMULATED_AMX test switch)."""
    return (*PATHS, EMULATED_AMX).index(name)


def amx_refusal() -> str | None:
    """Why the amx path cannot run on this machine (CPU, OS, VM or build), or None where it runs."""
    return load().amx_status()


def path() -> str:
    """The path the kernels run: `SPECEXTEND_CPU` if set (UserError if this CPU cannot run it),
    else the fastest this CPU has."""
    want = os.environ.get(CPU_ENV, "auto").strip().lower() or "auto"
    if want != "auto" and want not in PATHS and want != EMULATED_AMX:
        raise UserError(f"{CPU_ENV}={want} is not a kernel path; choose auto, {', '.join(PATHS)}")
    have = cpu_paths()
    if want == "auto":
        return auto_path(have)
    if want == EMULATED_AMX:
        return want  # runs anywhere (slowly): a test switch
    if want not in have:
        why = f": {amx_refusal()}" if want == "amx" and amx_refusal() else ""
        raise UserError(f"{CPU_ENV}={want}: this CPU cannot run the {want} kernels{why} (it runs {', '.join(have)})")
    return want


def path_id() -> int:
    """The index (csrc/core/cpu.h) of the path the kernels run now, as every kernel call takes it."""
    # A decode step makes ~150 kernel calls: the environment is read once per value it has.
    global _resolved
    env = os.environ.get(CPU_ENV, "")
    if _resolved is None or _resolved[0] != env:
        _resolved = (env, path_index(path()))
    return _resolved[1]


_resolved: tuple[str, int] | None = None
AMX_MARGIN = 0.95  # `auto` takes amx where its many-row product took at most this share of avx512's time
AMX_ROUNDS = 7  # rounds of the two products, alternated; the median round's ratio decides
# The share of its threads' time the measuring process must get for its record to stand: below it
# other work held the cores (a build beside it: 0.50 on a 2-core Xeon, and amx measured 1.19x
# avx512's speed where quiet rounds measure 0.96-1.04x), and the next process measures again.
QUIET_SHARE = 0.8


def auto_path(have: list[str] | None = None) -> str:
    """What `auto` runs: the fastest path this CPU has, except that amx is taken only where it
    measured 5% faster than avx512 on a many-row product (the median of alternated rounds, once per
    machine, kernel build and arithmetic, kept in the build's folder): a CPU that has AMX but runs it
    slowly (a VM, an early stepping) keeps avx512. The product is Q4_K's, in the arithmetic in effect:
    per 256 (SPECEXTEND_K256) the tiles win where per 32 they do not."""
    have = cpu_paths() if have is None else have
    if have[-1] != "amx":
        return have[-1]
    record = build_dir() / "auto-path.json"
    # One process measures while the others wait and then read its record: two measuring at once
    # could choose differently, and processes of one machine would then run different paths.
    import fcntl

    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):  # an unwritable cache measures without the lock
            fcntl.flock(held.enter_context(open(record.with_name("auto-path.lock"), "w")), fcntl.LOCK_EX)
        return _stored_choice(record) or _measure_choice(record)


def _stored_choice(record: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        stored = json.loads(record.read_text())
        # A record without rounds is from the one-shot timing that a burst of other work could sway;
        # one taken while other work held the cores is measured again.
        if (stored["cpu"] == cpu_name() and stored.get("arithmetic") == arithmetic_version()
                and "amx_over_avx512" in stored and stored.get("cpu_share", 1.0) >= QUIET_SHARE):
            return str(stored["choice"])
    return None


def _measure_choice(record: Path, rounds: int = AMX_ROUNDS) -> str:
    # The two paths are timed in alternation and compared round by round: a burst of other work
    # (a test suite, a build) then slows both sides of a round, not one path's every run, and the
    # median round decides. Timed one path after the other, such a burst once made a build on a
    # Xeon VM take amx at 0.92x avx512's time where quiet rounds measure 1.02x.
    # A burst cancels out; a load that lasts the whole measurement does not, so the process's CPU
    # time against its threads' wall time says whether it had the cores (QUIET_SHARE).
    ratios, times = [], {"avx512": float("inf"), "amx": float("inf")}
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        now = {p: _many_row_seconds(p) for p in ("avx512", "amx")}
        ratios.append(now["amx"] / now["avx512"])
        times = {p: min(times[p], now[p]) for p in times}
    share = _cpu_share(time.process_time() - cpu, time.perf_counter() - wall)
    ratio = statistics.median(ratios)
    # A clear margin: where the two are alike (per 32 on a Xeon VM, within 3%) a coin flip would
    # change the path from one build to the next; avx512 keeps no tile state.
    choice = "amx" if ratio < AMX_MARGIN else "avx512"
    with contextlib.suppress(OSError):  # an unwritable cache measures again next time
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"cpu": cpu_name(), "arithmetic": arithmetic_version(), "choice": choice,
                                   "seconds": times, "amx_over_avx512": ratio, "rounds": rounds,
                                   "cpu_share": share}))
        os.replace(tmp, record)  # atomic: another process reads the old record or the new one
    return choice


def _cpu_share(cpu_s: float, wall_s: float) -> float:
    """The share of its threads' wall time the process ran (1: it had its cores); a span too short
    to tell (under 50 ms: the real rounds take 0.14 s on a quiet 2-core Xeon) counts as had."""
    return 1.0 if wall_s < 0.05 else cpu_s / (wall_s * torch.get_num_threads())


def _many_row_seconds(path: str, rows: int = 128, repeats: int = 5) -> float:
    """Best wall seconds of a 4-bit product of `rows` rows (2048 -> 1024 channels, random codes)."""
    n, k, sbg = 1024, 2048, 8
    g = torch.Generator().manual_seed(0)
    blob = torch.randint(0, 256, (n // 16 * k // 256, 64 + 288 * sbg), dtype=torch.uint8, generator=g)
    blob[:, :64] = torch.tensor([0x00, 0x2C], dtype=torch.uint8).repeat(32)  # float16 scales 1/16
    blob[:, 64 : 64 + 32 * sbg] &= 63  # 6-bit group scales and minimums, as Q4_K's
    x = torch.randn(rows, k, generator=g)
    args = ([blob.reshape(-1)], [0], [n], [0], [sbg], None, None, 0.0, False, None, path_index(path))
    best = float("inf")
    for _ in range(repeats + 1):  # the first run pays for first-touch page faults
        t = time.perf_counter()
        load().qlinear(x, *args)
        best = min(best, time.perf_counter() - t)
    return best


def has_fast_path() -> bool:
    """Whether the quantized kernels run here on a vector path (anything but portable); never
    raises for a missing build, but a `SPECEXTEND_CPU` this CPU cannot run is a UserError."""
    return available() and path() != "portable"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None,
           scale: float | None = None, sinks: torch.Tensor | None = None,
           softcap: float | None = None, ends: torch.Tensor | None = None, lead: int = 0) -> torch.Tensor:
    """Row-independent attention of new tokens q [H, T, D] over a bfloat16 cache k, v [Hkv, S, D];
    `scale`: the score scale (None: 1/sqrt(D)); `sinks` [H]: a logit a head that joins each
    softmax's denominator (gpt-oss); `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2).
    A window's keys (`attention.window_mask`) keep their full lists' numbers: `ends` [T], each token's
    (`attention.list_ends`), and `lead`, the window's first slot (csrc/core/attention.h)."""
    return timed("attention", load().attend,
                 (q, k, v, tree_mask, path_id(), float(scale or 0.0), sinks, float(softcap or 0.0), ends, lead))


def timed(part: str, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    """`fn(*args)`, a kernel call, timed as `part` ("linear" or "attention") inside `clocked`."""
    if _clock is not None:
        return _clock.time(part, fn, args)
    return fn(*args)


@dataclass
class KernelClock:
    """Wall seconds spent inside the linear-layer (`qlinear`) and attention (`attend`) kernels."""

    linear_s: float = 0.0
    attention_s: float = 0.0
    linear_calls: int = 0
    attention_calls: int = 0

    def time(self, part: str, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
        t = time.perf_counter()
        y = fn(*args)
        dt = time.perf_counter() - t
        if part == "linear":
            self.linear_s += dt
            self.linear_calls += 1
        else:
            self.attention_s += dt
            self.attention_calls += 1
        return y


_clock: KernelClock | None = None


@contextlib.contextmanager
def clocked() -> Iterator[KernelClock]:
    """Time every `qlinear` and `attend` call made inside the block (the runtime bench's split of a
    forward into linear layers and attention); the kernels run as they always do. Not reentrant."""
    global _clock
    if _clock is not None:
        raise RuntimeError("kernels.clocked() is already active")
    _clock = KernelClock()
    try:
        yield _clock
    finally:
        _clock = None


def clocking() -> bool:
    """Whether `clocked` is timing kernel calls now: forwards then make their per-layer calls
    (not the whole-step call, fused_step.py), which is what it splits."""
    return _clock is not None


def cpu_name() -> str:
    """The CPU's model name (measured costs and peaks are kept per machine)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe() -> str:
    """One line for `make setup`: where the kernels are and which paths this CPU runs."""
    ext = load()
    paths = cpu_paths()
    extra = ""
    if "avx512" in paths and ext.has_avx512_bf16():
        extra = (" (attention on VDPBF16PS)" if ext.bf16_dot_pays() else
                 " (attention's many-row runs on FMAs: VDPBF16PS measured slower here)")
    line = (f"specextend kernels: {build_dir()}; paths this CPU runs: {', '.join(paths)}{extra}; "
            f"auto = {auto_path(paths)}; BF16 weights on {'bfloat16 dot products' if bf16_products() else 'float32'}")
    why = amx_refusal()
    if why and platform.machine() in ("x86_64", "AMD64"):
        line += f"; no amx: {why}"
    elif "amx" in paths:
        line += f"; {amx_choice()}"
    return line


def amx_choice() -> str:
    """Why `auto` took amx or avx512 where both run: the many-row product's measured ratio."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        stored = json.loads((build_dir() / "auto-path.json").read_text())
        ratio = 1 / stored["amx_over_avx512"]
        return (f"amx's many-row Q4_K product measured {ratio:.2f}x avx512's speed (arithmetic "
                f"{stored['arithmetic']}; amx from {1 / AMX_MARGIN:.2f}x)")
    return "amx and avx512 not yet compared"

