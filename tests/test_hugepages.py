"""Weights in 2 MB pages (runtime/hugepages.py): used in place where the kernel maps the file in 2 MB
pages, else read into arenas, whose blobs are disjoint, aligned and outlive the arena; a model read
into them computes what the file's own pages compute; the switch, the kernel's setting and its
answer on a file's pages are read as documented."""

from __future__ import annotations

import gc
import itertools
import mmap
import os

import pytest
import torch

from specextend.models.qstore import QuantizedFile
from specextend.runtime import hugepages
from test_gguf_memory import random_gguf, tokenizer_gguf  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own
needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                            ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("garbled", None)])
def test_the_kernels_setting_is_the_bracketed_word(tmp_path, text, mode) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert hugepages.system_mode(str(path)) == mode
    assert hugepages.system_mode(str(tmp_path / "missing")) is None


def test_the_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.wanted()
    monkeypatch.setattr(hugepages, "system_mode", lambda: "never")
    monkeypatch.setenv(hugepages.ENV, "1")
    assert not hugepages.wanted()


@needs_madvise
def test_blobs_are_disjoint_aligned_and_outlive_their_arena() -> None:
    arena = hugepages.Arena(chunk=8 << 20)
    sizes = [100, 64, 1 << 20, 3 << 20, 5, 12 << 20]  # the last: bigger than a quarter chunk, a mapping alone
    blobs = [arena.empty(n) for n in sizes]
    for i, (b, n) in enumerate(zip(blobs, sizes, strict=True)):
        assert b.dtype == torch.uint8 and b.is_contiguous() and b.numel() == n
        assert b.data_ptr() % hugepages.ALIGN == 0
        b.fill_(i + 1)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in blobs)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    del arena
    gc.collect()
    for i, b in enumerate(blobs):  # each blob's chunk lives as long as the blob
        assert int(b.min()) == int(b.max()) == i + 1


def test_a_model_reads_the_same_bytes_and_tokens_either_way(tmp_path, tokenizer_gguf, monkeypatch) -> None:  # noqa: F811
    from specextend import api

    src = random_gguf(tmp_path, tokenizer_gguf, "Q4_K_M")
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(hugepages.ENV, switch)
        with api.load(str(src), load_draft=False, progress=False) as pair:
            runs[switch] = pair.generate("hello there", method="ar", max_new_tokens=8).token_ids
    assert runs["0"] == runs["1"]
    stored = next(tmp_path.rglob("model.safetensors"))  # the converted copy, in the test's own home
    files = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(hugepages.ENV, switch)
        qf = QuantizedFile(stored)
        assert (qf.arena is not None) == hugepages.wanted()
        files[switch] = {n: qf.segment(n).blob.clone() for n in qf.formats}
    assert files["0"].keys() == files["1"].keys()
    assert all(torch.equal(files["0"][n], files["1"][n]) for n in files["0"])


def test_replicas_name_the_switch_the_loader_reads() -> None:
    ray_serve = pytest.importorskip("specextend.serve.ray_serve")
    assert ray_serve.SHARE_PAGES_ENV == hugepages.ENV


def _inside(blob: torch.Tensor, whole: torch.Tensor) -> bool:
    return whole.data_ptr() <= blob.data_ptr() and blob.data_ptr() + blob.numel() <= whole.data_ptr() + whole.numel()


@needs_madvise
@pytest.mark.parametrize("switch", ["0", "1"])
def test_weights_are_used_in_place_with_the_switch_off(tmp_path, tokenizer_gguf, monkeypatch, switch) -> None:  # noqa: F811
    """With the switch off, every streamed blob, stacks included, is a view of the file's map (nothing
    copied); on, each is a copy in an arena; the bytes agree."""
    from specextend import api

    src = random_gguf(tmp_path, tokenizer_gguf, "Q4_K_M")
    with api.load(str(src), load_draft=False, progress=False):
        pass  # converts it
    stored = next(tmp_path.rglob("model.safetensors"))
    monkeypatch.setenv(hugepages.ENV, switch)
    monkeypatch.setattr(hugepages, "system_mode", lambda: "madvise")
    qf = QuantizedFile(stored)
    assert (qf.arena is None) == (switch == "0")
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"]
    stacked = qf.stacked_segments(names)
    single = qf.segment("model.layers.0.mlp.down_proj.weight")
    assert stacked is not None and single is not None
    for seg in [*stacked, single]:
        assert _inside(seg.blob, qf.whole) == (switch == "0")
    joined = torch.cat([qf._read(n) for n in names])
    assert torch.equal(torch.cat([s.blob for s in stacked]), joined)


def test_the_kernel_is_asked_how_it_maps_a_file(tmp_path) -> None:
    """`huge_file_pages` reads the answer from the mapping's own lines of smaps; a file under three
    huge pages has no aligned window past its first and is small-paged by definition."""
    small = tmp_path / "small"
    small.write_bytes(bytes(3 << 20))
    assert not hugepages.huge_file_pages(hugepages.map_file(small))
    big = tmp_path / "big"
    big.write_bytes(bytes(8 << 20))
    whole = hugepages.map_file(big)
    lo, hi = whole.data_ptr(), whole.data_ptr() + whole.numel()
    for kb, expected in ((6144, True), (2048, False), (0, False)):  # its 3 windows: all, one, none
        fake = tmp_path / f"smaps{kb}"
        fake.write_text(f"1000-2000 r--p 00000000 00:00 0 /elsewhere\nFilePmdMapped:      4096 kB\n"
                        f"{lo:x}-{hi:x} r--p 00000000 fd:00 12 {big}\nRss:  1 kB\nFilePmdMapped:  {kb} kB\n")
        assert hugepages.huge_file_pages(whole, smaps=str(fake)) is expected


def test_a_file_cached_in_small_pieces_is_read_again_in_2_mb_pages(tmp_path) -> None:
    """A file written 4 KB at a time is cached in 4 KB folios: the kernel maps it in small pages. Given
    its path, `huge_file_pages` drops it from the cache where one window read again comes back in 2 MB,
    and then says yes (on kernels whose page cache holds files in 2 MB folios; skipped elsewhere)."""
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.write(bytes(16 << 20))
        f.flush()
        os.fsync(f.fileno())
    if not hugepages.huge_file_pages(hugepages.map_file(probe), probe):
        pytest.skip("this kernel does not map this file system's files in 2 MB pages")
    small = tmp_path / "small"
    with open(small, "wb") as f:
        for _ in range(4096):
            f.write(bytes(4096))
        f.flush()
        os.fsync(f.fileno())  # dirty pages are not dropped
    assert not hugepages.huge_file_pages(hugepages.map_file(small))
    assert hugepages.huge_file_pages(hugepages.map_file(small), small)
    assert hugepages.huge_file_pages(hugepages.map_file(small))  # and stays so in the cache
