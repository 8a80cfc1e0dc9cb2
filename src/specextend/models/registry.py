"""Turning a model reference given by the user into a local Hugging Face folder.

A reference is one of: nothing (the default for the role), a known short name, a model folder, a
`.gguf` file, or a hub id. Whatever it is, callers get back a folder holding `config.json` and
safetensors weights, or a UserError that says in one line what was wrong.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

from ..common import meminfo
from ..common.errors import UserError
from .footprint import Footprint, active_kernel_path, check_fits
from .gguf import (
    COMPLETE_MARKER,
    announce,
    convert_gguf,
    file_footprint,
    is_complete,
    is_current,
    open_gguf,
    pid_alive,
    recorded_footprint,
)
from .pull import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    SPECS,
    ModelSpec,
    file_lock,
    gguf_file,
    model_dir,
    pull,
    specextend_home,
)

Role = Literal["target", "draft"]

# Known short names: the table `pull` fetches from.
KNOWN_MODELS: dict[str, ModelSpec] = SPECS
DEFAULTS: dict[str, str] = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}

# `owner/name`, as the Hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model(role: Role) -> str:
    if role not in DEFAULTS:
        raise UserError(f"unknown model role {role!r} (expected 'target' or 'draft')")
    return DEFAULTS[role]


def resolve_model_ref(ref: str | None, role: Role, progress: bool = True) -> Path:
    """The local HF folder for `ref` (see the module docstring), fetching or converting on first use."""
    if ref is None or ref == "":
        return pull(default_model(role), progress)
    path = Path(ref).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return converted_gguf(path, progress)
        raise UserError(f"{ref} is not a model folder or a .gguf file")
    if ref in KNOWN_MODELS:
        return pull(ref, progress)
    if _looks_like_path(ref):
        raise UserError(f"model path not found: {ref}")
    return hub_snapshot(ref)


def check_model_folder(folder: Path) -> None:
    """Refuse folders that cannot be loaded: no config.json, no safetensors, or a half-written conversion."""
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} is not a model folder: no config.json")
    if not any(folder.glob("*.safetensors")):
        raise UserError(f"{folder} is not a model folder: no .safetensors weights")
    if _is_ours(folder) and not is_complete(folder):
        raise UserError(f"{folder} is an unfinished conversion (no {COMPLETE_MARKER}); delete it and retry")


def _is_ours(folder: Path) -> bool:
    """Folders inside our cache are only valid with the completion marker."""
    try:
        folder.resolve().relative_to(specextend_home().resolve())
    except ValueError:
        return False
    return True


def _looks_like_path(ref: str) -> bool:
    if ref.startswith(("/", "./", "../", "~")) or (os.sep in ref and not _HUB_ID.match(ref)):
        return True
    return ref.lower().endswith((".gguf", ".safetensors", ".json"))


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def converted_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a user's `.gguf` once into `HOME/converted/<stem>-<key>/` and return that folder.

    The key covers the absolute path, size and mtime, so editing or replacing the file converts
    it again while repeated runs reuse the earlier conversion.
    """
    folder = converted_folder(path)
    if is_current(folder):
        recorded = recorded_footprint(folder)
        if recorded is not None:  # converted earlier: say again what it expanded, check it still fits
            check_fits(recorded, meminfo.available_memory_mb)
            announce(recorded)
        return folder
    with file_lock(specextend_home() / f".lock-converted-{folder.name}", progress):
        if not is_current(folder):
            convert_gguf(path, folder, progress=progress)
    return folder


def converted_folder(path: Path) -> Path:
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return specextend_home() / "converted" / f"{path.stem}-{key}"


def hub_snapshot(repo_id: str) -> Path:
    """Fetch `repo_id` from the Hugging Face Hub (or its local cache); UserError when that is impossible."""
    try:
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"],
            )
        )
    except Exception as exc:
        raise UserError(f"cannot fetch hub model {repo_id}: no hub reachable ({type(exc).__name__})") from exc
    check_model_folder(folder)
    return folder


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def list_models() -> list[dict[str, Any]]:
    """The known models, for `specextend models list`: whether each is pulled, its GGUF file (the
    size is the published file's, pulled or not) and its converted folder."""
    rows: list[dict[str, Any]] = []
    for name, spec in KNOWN_MODELS.items():
        folder, source = model_dir(name), gguf_file(name)
        pulled = source.is_file() and source.stat().st_size == spec.size
        installed = is_current(folder)
        rows.append(
            {
                "name": name,
                "role": spec.role,
                "description": spec.description,
                "pulled": pulled,
                "installed": installed,
                "size_bytes": spec.size,
                "gguf": str(source),
                "path": str(folder),
                "converted_bytes": folder_size(folder) if installed else 0,
            }
        )
    return rows


def inspected_file(ref: str) -> Path:
    """The GGUF file `models inspect` reads for `ref`: a .gguf path, or a known model's pulled file."""
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return path
        raise UserError(f"{ref} is not a .gguf file")
    if ref in KNOWN_MODELS:
        source = gguf_file(ref)
        if not source.is_file():
            raise UserError(f"{ref} is not pulled yet: run specextend models pull {ref}")
        return source
    if path.is_dir():
        raise UserError(f"{ref} is a folder; models inspect reads a .gguf file or a known model name")
    raise UserError(f"no such .gguf file or known model: {ref} (known: {', '.join(sorted(KNOWN_MODELS))})")


def inspect_model(ref: str) -> Footprint:
    """Types, counts, bytes and memory of a GGUF file (memory-mapped; nothing is converted)."""
    path = inspected_file(ref)
    reader = open_gguf(path)
    try:
        return file_footprint(reader, path.resolve(), active_kernel_path())
    finally:
        del reader


def _in_progress(entry: Path) -> bool:
    """A temporary folder of a conversion that is still running (named `<folder>.tmp-<pid>`)."""
    suffix = entry.name.rsplit(".tmp-", 1)[-1] if ".tmp-" in entry.name else ""
    return suffix.isdigit() and pid_alive(int(suffix))


def clear_cache(pulled: bool = False) -> tuple[int, list[Path]]:
    """Delete the converted copies in the model cache (known models' folders, converted .gguf files,
    weights derived for other schemes, temporary folders of killed runs); with `pulled`, also the
    pulled GGUF files and their downloads. Returns (bytes freed, paths removed). The next load
    converts again (and `pulled`: pulls again)."""
    home = specextend_home()
    parents = ["models", "converted", "derived"] + (["gguf", "downloads"] if pulled else [])
    removed: list[Path] = []
    freed = 0
    for parent in parents:
        folder = home / parent
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if _in_progress(entry):
                continue
            size = folder_size(entry) if entry.is_dir() else entry.stat().st_size
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            if not entry.exists():
                freed += size
                removed.append(entry)
    return freed, removed
