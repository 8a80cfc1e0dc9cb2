"""Weights in huge-page arenas (runtime/hugepages.py): the blobs an arena hands out are disjoint,
aligned and outlive the arena; a model read into them computes what the file's own pages compute;
the switch and the kernel's setting are read as documented."""

from __future__ import annotations

import gc
import itertools
import mmap

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
