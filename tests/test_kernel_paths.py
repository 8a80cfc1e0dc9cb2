"""Every kernel path this CPU runs gives the portable path's bits, and `SPECEXTEND_CPU` chooses one.

The portable path (plain C++) defines the arithmetic; the vector paths (avx2, avx512, neon) and
the amx path reproduce it operation for operation. These tests compare each path the machine can
run with the portable one on random inputs of several shapes (the amx path's code everywhere, on
emulated tiles: `amx-emulated`), and run the kernel core's own exactness program
(csrc/test/exactness.cpp, no PyTorch) natively; `make test-arm` runs that program for aarch64
under emulation."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from specextend.common.errors import UserError
from specextend.runtime import kernels, quant
from test_quant import random_blocks

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

ext = kernels.load()
PORTABLE = kernels.path_index("portable")
# Every path this CPU runs, and the amx code on emulated tiles (any CPU; slow, so small shapes).
PATHS = [*kernels.cpu_paths(), kernels.EMULATED_AMX]
VECTOR = [p for p in PATHS if p != "portable"]
CSRC = Path(kernels.__file__).parent / "csrc"

# (GGUF kind or float bits, rows, width): widths not multiples of 256 and a partial panel of 16
WEIGHTS = [("Q4_K", 48, 512), ("Q4_K", 64, 1536), ("Q6_K", 40, 256), ("Q6_K", 35, 768), ("Q8_0", 35, 96),
           ("Q5_0", 33, 64), (4, 48, 896), (4, 40, 96), (8, 32, 160), ("Q4_0", 33, 96), ("Q3_K", 40, 512),
           ("Q4_1", 48, 160), ("IQ4_NL", 32, 64), ("Q5_K", 48, 512), ("IQ4_XS", 35, 768), ("Q5_1", 40, 96),
           ("Q2_K", 48, 512), ("F16", 48, 416), ("BF16", 35, 160), ("F16", 33, 96), ("BF16", 64, 768),
           ("MXFP4", 40, 896), ("MXFP4", 33, 64), ("BF16D", 35, 160), ("BF16D", 64, 768),
           ("IQ3_S", 40, 512), ("IQ3_S", 33, 256), ("IQ3_XXS", 48, 512), ("IQ2_XXS", 35, 256),
           ("IQ1_S", 33, 768), ("IQ2_XS", 40, 512), ("IQ2_S", 33, 256), ("IQ1_M", 35, 768)]


def segment(kind: str, n: int, k: int) -> quant.Segment:
    """A GGUF kind's random blocks as the load keeps them (BF16D: BF16 on bfloat16 products)."""
    if kind == "BF16D":
        return quant.bf16_pairs(quant.from_gguf_blocks("BF16", random_blocks("BF16", n, k, seed=n), n, k))
    return quant.from_gguf_blocks(kind, random_blocks(kind, n, k, seed=n), n, k)


def weight(kind: str | int, n: int, k: int) -> quant.QWeight:
    if isinstance(kind, int):
        return quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)), kind)
    return quant.QWeight(k, [segment(kind, n, k)])


def product(w: quant.QWeight, x: torch.Tensor, path: str, **kw) -> torch.Tensor:
    args = (w.blobs, w.formats, w.widths, w.offsets, w.groups)
    return ext.qlinear(x, *args, kw.get("bias"), kw.get("norm"), 1e-6, kw.get("silu", False), kw.get("residual"),
                       kernels.path_index(path))


def centred(x: torch.Tensor) -> torch.Tensor:
    """Each row less its mean in family.h's center_row arithmetic: float32 sums in 16 interleaved lanes, added in
    lane order."""
    a = x.numpy().astype(np.float32)
    lanes = np.zeros((a.shape[0], 16), dtype=np.float32)
    for i in range(a.shape[1]):
        lanes[:, i % 16] += a[:, i]
    total = np.zeros(a.shape[0], dtype=np.float32)
    for j in range(16):
        total += lanes[:, j]
    return torch.from_numpy(a - (total / np.float32(a.shape[1]))[:, None])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("kind", "n", "k"), [("Q4_K", 48, 512), ("Q8_0", 35, 96), ("BF16D", 35, 160)])
def test_a_layer_norm_is_the_rms_norm_of_the_centred_row_on_every_path(path: str, kind, n: int, k: int) -> None:
    """A product through a LayerNorm (`center`, Cohere's) gives, on every path, the bits of the same product through
    the RMSNorm of each row less its mean, the centring in center_row's own arithmetic."""
    w = weight(kind, n, k)
    g = torch.Generator().manual_seed(3)
    norm = torch.rand(k, generator=g) + 0.5
    args = (w.blobs, w.formats, w.widths, w.offsets, w.groups, None, norm, 1e-6, False, None, kernels.path_index(path))
    for m in (1, 9):
        x = torch.randn(m, k, generator=g) * 3 + 2  # a mean far from 0: a centring left out shows
        got = ext.qlinear(x, *args, center=True)
        assert torch.equal(got, ext.qlinear(centred(x), *args))
        assert not torch.equal(got, ext.qlinear(x, *args))


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
@pytest.mark.parametrize(("kind", "n", "k"), WEIGHTS)
def test_products_equal_the_portable_bits(path: str, kind, n: int, k: int) -> None:
    w = weight(kind, n, k)
    g = torch.Generator().manual_seed(7)
    for m in (1, 2, 4, 9, 16, 19):
        x = torch.randn(m, k, generator=g) * 3
        assert torch.equal(product(w, x, path), product(w, x, "portable")), m
        fused = dict(bias=torch.randn(n, generator=g), norm=torch.rand(k, generator=g) + 0.5,
                     residual=torch.randn(m, n, generator=g))
        assert torch.equal(product(w, x, path, **fused), product(w, x, "portable", **fused)), m
        gate_up = torch.cat([x, torch.randn(m, k, generator=g)], dim=1)
        assert torch.equal(product(w, gate_up, path, silu=True), product(w, gate_up, "portable", silu=True)), m


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
@pytest.mark.parametrize("fmt", ["iq2xs", "iq1m"])
def test_the_largest_codes_at_full_scale_stay_exact(path: str, fmt: str) -> None:
    """Every weight at its table's largest magnitude and every activation at full scale with the
    weight's sign: each group's integer sums reach their largest (16 products of the top code and
    127), which a path summing more steps in int16 than fit (AVX2's VPMADDUBSW) would wrap."""
    n, k = 32, 512
    sign = np.random.default_rng(0).choice([-1.0, 1.0], k)
    idx = np.broadcast_to(np.where(sign > 0, 5, 0), (n, k)).astype(np.uint8)  # the table's largest, either sign
    seg = quant.pack_q3k(np.full((n, k // 256), 0.125, np.float32), np.full((n, k // 16), 31, np.int8), idx, fmt)
    w = quant.QWeight(k, [seg])
    x = torch.from_numpy(np.tile(sign, (3, 1)).astype(np.float32))
    exact = 0.125 * 31 * (43 if fmt == "iq2xs" else 9) * k  # every product positive, activations exactly 1
    assert torch.equal(product(w, x, path), product(w, x, "portable"))
    assert torch.allclose(product(w, x, path), torch.full((3, n), float(exact)), rtol=1e-6)


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
def test_one_row_over_segments_of_odd_panel_counts(path: str) -> None:
    """One row takes full panels in pairs (float formats) or fours (BF16D) on some paths: a group never
    spans two segments (three panels of F16, then BF16, five of BF16D, a partial panel of Q8_0, one and
    a half of BF16D, one of F16), at any thread count."""
    k = 256
    parts = [("F16", 48), ("BF16", 80), ("BF16D", 80), ("Q8_0", 40), ("BF16D", 24), ("F16", 24)]
    w = quant.QWeight(k, [segment(kind, n, k) for kind, n in parts])
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        for t in {1, threads}:
            torch.set_num_threads(t)
            assert torch.equal(product(w, x, path), product(w, x, "portable")), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("kind", "n", "k"), WEIGHTS[::2])
def test_a_row_alone_equals_the_row_in_any_batch(path: str, kind, n: int, k: int) -> None:
    w = weight(kind, n, k)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3)) * 2
    batch = product(w, x, path)
    for rows in range(1, 17):
        for r0 in (0, 19 - rows):
            assert torch.equal(product(w, x[r0 : r0 + rows], path), batch[r0 : r0 + rows]), (rows, r0)


# Row counts around every boundary of the kernels' work split: tiles (up to 10-11 rows), the rows
# kernel (from 12 on avx512), its blocks of 64 rows and a prefill chunk's 512, never a multiple.
MANY_ROWS = (1, 2, 3, 5, 8, 11, 12, 13, 17, 33, 63, 64, 65, 100, 129, 257, 511, 600)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("kind", "n", "k"), WEIGHTS)
def test_many_rows_equal_each_row_alone(path: str, kind, n: int, k: int) -> None:
    """The many-row product (tiles, the rows kernel, row blocks, threads taking units in any
    order) gives every row the bits of that row computed alone, on every path, for every
    weight format, up to 600 rows."""
    w = weight(kind, n, k)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(600, k, generator=g) * 2
    res = torch.randn(600, n, generator=g)
    alone = torch.cat([product(w, x[r : r + 1], "portable", residual=res[r : r + 1]) for r in range(600)])
    for m in MANY_ROWS:
        assert torch.equal(product(w, x[:m], path, residual=res[:m]), alone[:m]), m


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
def test_activation_quantization_equals_the_portable_bits(path: str) -> None:
    x = torch.randn(13, 256) * torch.logspace(-3, 3, 13).unsqueeze(1)
    x[0, :32] = 0  # a zero block
    ours, ref = ext.quantize_activations(x, kernels.path_index(path)), ext.quantize_activations(x, PORTABLE)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def tree_mask(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        mask[i] = mask[int(torch.randint(0, i, (1,), generator=g))]
        mask[i, i] = True
    return mask


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
@pytest.mark.parametrize("d", [64, 128, 96, 32])
@pytest.mark.parametrize(("heads", "kv", "t", "prefix"), [(12, 2, 1, 100), (12, 2, 9, 2000), (4, 1, 20, 45),
                                                          (6, 2, 3, 0)])
def test_attention_equals_the_portable_bits(path: str, d: int, heads: int, kv: int, t: int, prefix: int) -> None:
    g = torch.Generator().manual_seed(d + t)
    capacity = prefix + t + 7  # a view of a larger cache, as the model passes it
    k = torch.randn(kv, capacity, d, generator=g).bfloat16()[:, : prefix + t]
    v = torch.randn(kv, capacity, d, generator=g).bfloat16()[:, : prefix + t]
    q = torch.randn(heads, t, d, generator=g) * 2
    for mask in (None, tree_mask(t, seed=t)):
        ours = ext.attend(q, k, v, mask, kernels.path_index(path))
        assert torch.equal(ours, ext.attend(q, k, v, mask, PORTABLE))


@pytest.mark.parametrize("path", PATHS[:1] + VECTOR[:1])
def test_a_long_cache_read_in_pieces_gives_every_thread_count_and_a_tree_row_the_same_bits(path: str) -> None:
    """A decode step and a small tree over a cache of several 512-key chunks: read in pieces by two or
    more threads (flash-decoding) they get the bits of one thread, and a tree's row gets the bits of
    the same token decoded alone after its ancestors (the same visible keys in the same order)."""
    g = torch.Generator().manual_seed(5)
    prefix, t, d = 2600, 5, 64
    k = torch.randn(2, prefix + t, d, generator=g).bfloat16()
    v = torch.randn(2, prefix + t, d, generator=g).bfloat16()
    q = torch.randn(14, t, d, generator=g) * 2
    mask = tree_mask(t, seed=3)
    pid = kernels.path_index(path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.attend(q, k, v, mask, pid)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(ext.attend(q, k, v, mask, pid), one)
            assert torch.equal(ext.attend(q[:, :1], k[:, : prefix + 1], v[:, : prefix + 1], None, pid), one[:, :1])
    finally:
        torch.set_num_threads(before)
    # The last node alone: its ancestors become the committed prefix, in slot order.
    last = t - 1
    seen = torch.cat([torch.arange(prefix), prefix + mask[last].nonzero().flatten()])
    alone = ext.attend(q[:, last:], k[:, seen].contiguous(), v[:, seen].contiguous(), None, pid)
    assert torch.equal(alone, one[:, last:])


SOURCES = [str(p) for p in sorted((CSRC / "core").glob("*.cpp"))] + [str(CSRC / "test" / "exactness.cpp")]
FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off"]


def run_exactness(exe: Path, *runner: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    out = subprocess.run([*runner, str(exe), *args], capture_output=True, text=True, timeout=600,
                         env=None if env is None else {**os.environ, **env})
    assert out.returncode == 0 and " 0 failed" in out.stdout, out.stdout + out.stderr
    return out.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the standalone build")
def test_kernel_core_exactness_program(tmp_path: Path) -> None:
    """The core alone (no PyTorch): the exactness program linked with the production build's own
    objects of the core, so what it checks (each path = portable, rows independent) is the machine
    code every generation runs; the aarch64 build below compiles the core from its sources."""
    exe = tmp_path / "exactness"
    core = [n for n in kernels._SOURCES if n.startswith("core/")]
    objects = [str(kernels.build_dir() / (Path(n).stem + ".o")) for n in core]
    subprocess.run(["g++", *FLAGS, "-fopenmp", "-c", str(CSRC / "test" / "exactness.cpp"), "-o", str(exe) + ".o"],
                   check=True)
    subprocess.run(["g++", "-fopenmp", str(exe) + ".o", *objects, "-o", str(exe)], check=True)
    # Where the CPU has VDPBF16PS, attention's many-row runs use it or FMAs as timed
    # (avx512_bf16_dot_pays): both kinds run here, and both must give the portable bits.
    bf16 = "avx512" in kernels.cpu_paths() and "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    for env in [{"SPECEXTEND_BF16_DOT": d} for d in "01"] if bf16 else [None]:
        paths = run_exactness(exe, env=env).splitlines()[0]
        assert all(p in paths for p in kernels.cpu_paths())


@pytest.mark.skipif(not Path("/usr/include/simde/x86/avx512.h").is_file() or "avx2" not in kernels.cpu_paths()
                    or "avx512" in kernels.cpu_paths(),
                    reason="needs an AVX2 CPU without AVX-512 and SIMDe (Debian's libsimde-dev)")
def test_avx512_path_under_emulation(tmp_path: Path) -> None:
    """The avx512 path's code on this AVX2 CPU, its intrinsics emulated (csrc/test/emulate_avx512.h):
    on a CPU without AVX-512 nothing else runs that code before a user with one does."""
    exe = tmp_path / "exactness-avx512"
    emulated = [*FLAGS[1:], "-DSPECEXTEND_EMULATE_AVX512", "-mavx2", "-mfma", "-mf16c"]
    objects = []
    for source in SOURCES:
        # -O0 for the emulated files only: optimising SIMDe's emulation takes minutes, while the
        # portable reference unoptimised would take as long to run; the arithmetic is IEEE at any level
        level = "-O0" if source.endswith(("_avx512.cpp", "_amx.cpp")) else "-O2"
        objects.append(str(tmp_path / (Path(source).stem + ".o")))
        subprocess.run(["g++", level, *emulated, "-c", source, "-o", objects[-1]], check=True)
    subprocess.run(["g++", *objects, "-o", str(exe)], check=True)
    assert "avx512" in run_exactness(exe).splitlines()[0]  # amx-emulated ran with the AVX-512 epilogue too


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                    reason="needs Debian's g++-aarch64-linux-gnu and qemu-user (`make test-arm` installs them)")
@pytest.mark.long(60)  # the exactness program under qemu
def test_neon_path_under_emulation(tmp_path: Path) -> None:
    """`make test-arm` in a test: the core cross-built for aarch64 and checked with dot products
    (portable, neon and the emulated amx tiles); without them only the detection (neon refused),
    its one path, portable, being the same machine code the first run checked."""
    exe = tmp_path / "exactness-aarch64"
    subprocess.run(["aarch64-linux-gnu-g++", *FLAGS, "-static", *SOURCES, "-o", str(exe)], check=True)
    assert "neon" in run_exactness(exe, "qemu-aarch64", "-cpu", "max").splitlines()[0]
    out = subprocess.run(["qemu-aarch64", "-cpu", "cortex-a53", str(exe), "--paths-only"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("kernel paths on this CPU: portable\n"), out.stdout


def test_the_cpu_variable_forces_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.CPU_ENV, "portable")
    assert kernels.path() == "portable" and not kernels.has_fast_path()
    monkeypatch.setenv(kernels.CPU_ENV, "auto")
    assert kernels.path() == kernels.auto_path()
    monkeypatch.setenv(kernels.CPU_ENV, "sse9")
    with pytest.raises(UserError, match="not a kernel path"):
        kernels.path()
    missing = next(p for p in ("neon", "avx512", "avx2") if p not in kernels.cpu_paths())
    monkeypatch.setenv(kernels.CPU_ENV, missing)
    with pytest.raises(UserError, match=f"this CPU cannot run the {missing} kernels"):
        kernels.path()


def test_a_path_this_cpu_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    missing = next(p for p in ("neon", "avx512", "avx2") if p not in kernels.cpu_paths())
    env = dict(os.environ, SPECEXTEND_CPU=missing, SPECEXTEND_HOME=str(tmp_path / "home"))
    cli = Path(os.sys.executable).with_name("specextend")
    model = save_tiny_model(tmp_path / "model", seed=0)  # a real model: the path is refused, not the files
    out = subprocess.run([str(cli), "generate", "--target", str(model), "--prompt", "x", "--weights", "int8",
                          "--method", "ar"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2
    # one line, after the kernels' one-time build notice when this run had to build them
    lines = [x for x in out.stderr.strip().splitlines() if "building the CPU kernels" not in x]
    assert len(lines) == 1 and f"this CPU cannot run the {missing} kernels" in lines[0], out.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the standalone build")
def test_the_step_barrier_publishes_every_write_with_more_threads_than_cpus(tmp_path: Path) -> None:
    """The whole-step forward's own barrier (core/team_barrier.h), 4 and 7 threads on this machine's
    CPUs: every thread sees every write of the round it waited for, and none runs ahead."""
    exe = tmp_path / "team_barrier"
    subprocess.run(["g++", "-O2", "-std=c++17", "-fopenmp", str(CSRC / "test" / "team_barrier_test.cpp"), "-o",
                    str(exe)], check=True)
    for threads in (4, 7):
        out = subprocess.run([str(exe), str(threads), "5000"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and " 0 failed" in out.stdout, out.stdout + out.stderr


def test_a_build_killed_midway_does_not_stall_the_next(tmp_path, monkeypatch):
    """cpp_extension waits while its baton file (`lock`) exists in the build folder, and a killed build
    leaves it there: the next build, holding the kernels' own lock (released by the system when its
    holder dies), drops it. A fake load waits on the baton as cpp_extension's does, then answers."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPECEXTEND_KERNEL_CACHE", str(tmp_path))
    out = kernels.build_dir(("core/cpu.cpp",))
    out.mkdir(parents=True)
    (out / "lock").touch()  # what a build killed midway leaves
    seen = []

    def load(**kw):
        seen.append((Path(kw["build_directory"]) / "lock").exists())  # the baton a real load would wait on
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert kernels.build("x", ("core/cpu.cpp",), "x") == "module" and seen == [False]
