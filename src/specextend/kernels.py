"""The project's C++ CPU kernels (quantized linear layers), built once per machine and cached.

The extension is compiled with PyTorch's `cpp_extension` into `~/.cache/specextend/kernels/<key>/`
(see `build_dir`), where the key covers the sources, the torch and Python versions and the
compiler flags, so an edited source or a new torch builds again while every
later process loads the cached library in well under a second. `make setup` builds it; the
first use builds it otherwise. OpenMP comes from torch's own runtime (same thread pool).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from .errors import UserError

if TYPE_CHECKING:
    from .quant import QWeight

_SOURCES = ("module.cpp", "qlinear.cpp", "attention.cpp")
_HEADERS = ("fastexp.h",)  # part of the build key: an edited header must build again
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17")
_lock = threading.Lock()
_module: ModuleType | None = None


def _key() -> str:
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update((Path(__file__).parent / "csrc" / name).read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}|{_CFLAGS}".encode())
    return h.hexdigest()[:16]


def source_key() -> str:
    """What identifies this build of the kernels (sources, torch, Python, flags): measured step
    costs are kept per build (costmodel.py), since a kernel change moves them."""
    return _key()


def build_dir() -> Path:
    """Where the compiled kernels live: `SPECEXTEND_KERNEL_CACHE`, else ~/.cache/specextend/kernels.
    Not under SPECEXTEND_HOME: pointing that at another model cache should not compile again."""
    root = os.environ.get("SPECEXTEND_KERNEL_CACHE", "~/.cache/specextend/kernels")
    return Path(root).expanduser() / _key()


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (building it on first use); UserError if it cannot be built."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _build(verbose)
    return _module


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    # The `ninja` that cpp_extension runs is the one installed beside this interpreter (a pinned
    # dependency), also when the virtual environment is not activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    if not any(out.glob("*.so")):
        print("specextend: building the CPU kernels (once per machine, about a minute)", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(
            name=f"specextend_kernels_{_key()}",
            sources=[str(Path(__file__).parent / "csrc" / n) for n in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot build the CPU kernels in {out}: {first} (is g++ installed?)") from None


def available() -> bool:
    """Whether the kernels can be used here (built or buildable); never raises."""
    if os.environ.get("SPECEXTEND_NO_KERNELS"):
        return False
    try:
        load()
    except UserError:
        return False
    return True


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None, *, norm: torch.Tensor | None = None,
            eps: float = 0.0, silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = pre(x) W^T (+ bias) (+ residual) for a block-quantized W; x is float32 [rows, k].

    pre: RMSNorm with weight `norm` and `eps`, or silu(gate) * up when `silu_mul` (x holds
    [gate | up]); each is applied in the same pass that quantizes the row.
    """
    return load().qlinear(x, w.blobs, w.formats, w.widths, w.offsets, w.groups, bias, norm, eps, silu_mul,
                          residual, False)


def main() -> int:
    """`python -m specextend.kernels`: build (or find) the kernels and say which paths run here."""
    try:
        ext = load()
    except UserError as e:
        print(f"specextend: {e}", file=sys.stderr)
        return 2
    print(f"specextend kernels: {build_dir()} (AVX512-VNNI linear: {'yes' if ext.has_avx512_vnni() else 'no'}, "
          f"AVX512-BF16 attention: {'yes' if ext.has_avx512_bf16() else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
