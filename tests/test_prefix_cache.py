"""The prefix cache: a prompt that starts with a cached prefix decodes the same tokens as a cold
prefill (float64 oracle; the same KV bits on the quantized runtime), LRU eviction under the cap,
and files on disk that are written atomically and never used when corrupt."""

from __future__ import annotations

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.requests import kv_file
from specextend.requests.prefix_cache import PrefixCache
from specextend.runtime import kernels
from specextend.runtime.kv_cache import KVSnapshot, PrefixKV
from specextend.speculation.decoder import SpecEngine

from conftest import make_tiny_hf

SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, cmr_min_ratio=0.0)
# The draft starts at once (draft_gate off), so the cached prefix holds draft KV to reuse.
METHODS = {"ar": dict(method="ar"), "sd": dict(method="sd"),
           "specextend": dict(method="specextend", draft_gate=False, **SMALL)}


def ids(n: int, seed: int, vocab: int = 63) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC = ids(70, 1)
Q1, Q2 = [5, *ids(12, 2)], [6, *ids(9, 3)]  # two questions after the same document, differing at once


def kinds(s: Settings, with_draft: bool) -> tuple[str, str | None]:
    return s.attention, (s.attention if with_draft else None)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("method", list(METHODS))
def test_a_cached_prefix_decodes_the_same_tokens_as_a_cold_prefill(tiny_dir, arch, method):
    target = load_model(tiny_dir(arch, 0), torch.float64)
    draft = load_model(tiny_dir(arch, 7, layers=1), torch.float64)
    eng = SpecEngine(target, draft, eos_ids=[])
    s = Settings(max_new_tokens=24, **METHODS[method]).resolved()
    cache = PrefixCache(64 << 20)
    tk, dk = kinds(s, method != "ar")

    first = eng.prefill(DOC + Q1, s)
    eng.decode(first, s)  # the draft computes the prompt KV its policy reads, which the cache keeps
    snap = first.snapshot()
    assert (snap.draft_kv is None) == (method == "ar")
    cache.insert(DOC + Q1, snap, tk, dk)
    prefix = cache.lookup(DOC + Q2, tk, dk)
    assert prefix is not None and prefix.length == len(DOC)
    assert (prefix.draft_kv is None) == (method == "ar")

    cold = eng.generate(DOC + Q2, s)
    warm_state = eng.prefill(DOC + Q2, s, prefix)
    assert warm_state.cached_tokens == len(DOC)
    n = len(DOC + Q2)
    assert torch.allclose(warm_state.target_cache.k[:, :, :n], eng.prefill(DOC + Q2, s).target_cache.k[:, :, :n],
                          atol=1e-12, rtol=0)
    warm = eng.decode(warm_state, s)
    assert warm.token_ids == cold.token_ids
    assert warm.cached_prompt_tokens == len(DOC) and cold.cached_prompt_tokens == 0


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
def test_quantized_runtime_prefill_from_a_prefix_writes_the_same_bits(tmp_path):
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab=96)
    folders = []
    for seed, layers in ((0, 2), (5, 1)):
        d = tmp_path / f"m{seed}"
        model = make_tiny_hf("qwen2", seed, dtype=torch.float32, layers=layers, max_position_embeddings=1024, **shape)
        model.save_pretrained(d)
        folders.append(d)
    target, draft = (load_model(d, torch.float32, weights="int8") for d in folders)
    assert target.rowwise_attention and target.kv_dtype == torch.bfloat16
    eng = SpecEngine(target, draft, eos_ids=[])
    s = Settings(max_new_tokens=16, **METHODS["specextend"]).resolved()
    doc = ids(600, 4, vocab=95)  # longer than one 512-token prefill chunk: the chunks fall elsewhere
    q1, q2 = [7, *ids(9, 5, vocab=95)], [8, *ids(11, 6, vocab=95)]
    prefix = eng.prefill(doc + q1, s).snapshot().head(len(doc))
    cold, warm = eng.prefill(doc + q2, s), eng.prefill(doc + q2, s, prefix)
    n = len(doc + q2)
    # The target's KV is the same bits; the draft's prompt KV is computed when a decode reads it.
    a, b = cold.target_cache, warm.target_cache
    assert torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])
    assert torch.equal(cold.first_logits, warm.first_logits)
    assert all(torch.equal(cold.last_q[i], warm.last_q[i]) for i in cold.last_q)
    assert eng.decode(warm, s).token_ids == eng.decode(cold, s).token_ids


# --------------------------------------------------------------------------- the store alone


def fake_prefix(n: int, seed: int = 0, draft: bool = True, layers: int = 2) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)

    def snap() -> KVSnapshot:
        return KVSnapshot(torch.randn(layers, 2, n, 8, generator=g).to(torch.bfloat16),
                          torch.randn(layers, 2, n, 8, generator=g).to(torch.bfloat16))

    return PrefixKV(snap(), snap() if draft else None)


PER_TOKEN = fake_prefix(1).nbytes  # bytes of one token's KV (target + draft)


def test_lookup_takes_the_longest_common_run_and_leaves_the_last_token():
    cache = PrefixCache(1 << 20)
    a = list(range(40))
    cache.insert(a, fake_prefix(40), "k", "k")
    assert cache.lookup([99, *a], "k", "k") is None  # differs at the first token
    assert cache.lookup([*a[:25], 99, 98], "k", "k").length == 25
    assert cache.lookup(a, "k", "k").length == 39  # the whole prompt cached: its last token is prefilled again
    assert cache.lookup([*a, 1, 2], "k", "k").length == 40
    got = cache.lookup([*a[:10], 0], "k", None)
    assert got.length == 10 and got.draft_kv is None  # ar needs the target's KV only
    assert torch.equal(got.target_kv.k, fake_prefix(40).target_kv.k[:, :, :10])
    assert cache.lookup(a, "other", "k") is None and cache.lookup(a, "k", "other") is None
    st = cache.stats()
    assert st["hits"] == 4 and st["misses"] == 3 and st["entries"] == 1


def test_an_entry_without_draft_kv_serves_the_target_and_one_with_it_is_preferred():
    cache = PrefixCache(1 << 20)
    cache.insert(list(range(20)), fake_prefix(20, draft=False), "k", None)
    # A speculative prefill takes the target's KV; its draft computes the slots it reads.
    hit = cache.lookup(list(range(30)), "k", "k")
    assert hit is not None and hit.length == 20 and hit.draft_kv is None
    assert cache.lookup(list(range(30)), "k", None).length == 20
    # The same tokens with the draft's KV are stored beside it and preferred where a draft is needed.
    cache.insert(list(range(20)), fake_prefix(20), "k", "k")
    assert cache.lookup(list(range(30)), "k", "k").draft_kv is not None
    assert cache.lookup(list(range(30)), "k", None).draft_kv is None


def test_an_entry_with_more_of_the_drafts_kv_replaces_one_with_less():
    cache = PrefixCache(1 << 20)
    some = fake_prefix(20)
    mask = torch.zeros(20, dtype=torch.bool)
    mask[:8] = True
    cache.insert(list(range(20)), PrefixKV(some.target_kv, some.draft_kv, mask), "k", "k")
    assert cache.lookup(list(range(30)), "k", "k").draft_slots == 8
    cache.insert(list(range(20)), fake_prefix(20, seed=1), "k", "k")  # every slot computed
    assert cache.stats()["entries"] == 1 and cache.lookup(list(range(30)), "k", "k").draft_slots == 20
    cache.insert(list(range(20)), PrefixKV(some.target_kv, some.draft_kv, mask), "k", "k")  # less: not kept
    assert cache.lookup(list(range(30)), "k", "k").draft_slots == 20


def test_an_extension_replaces_its_prefix_and_a_covered_prompt_is_not_stored_twice():
    cache = PrefixCache(1 << 20)
    cache.insert(list(range(20)), fake_prefix(20), "k", "k")
    cache.insert(list(range(30)), fake_prefix(30), "k", "k")
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] == 30 * PER_TOKEN
    cache.insert(list(range(10)), fake_prefix(10), "k", "k")
    assert cache.stats()["entries"] == 1
    cache.insert([*list(range(10)), 99], fake_prefix(11), "k", "k")
    assert cache.stats()["entries"] == 2


def test_questions_about_one_document_keep_one_copy_of_it():
    cache = PrefixCache(1 << 30)
    doc = list(range(1000, 3000))  # 2,000 shared tokens
    first = fake_prefix(2003, 1)
    cache.insert([*doc, 1, 2, 3], first, "k", "k")
    cache.insert([*doc, 4, 5], fake_prefix(2002, 2), "k", "k")
    st = cache.stats()
    assert st["entries"] == 1 and st["bytes"] == first.nbytes  # the head, a view of the first prompt's KV
    hit = cache.lookup([*doc, 6, 7, 8], "k", "k")
    assert hit.length == 2000 and torch.equal(hit.target_kv.k, first.target_kv.k[:, :, :2000])
    assert torch.equal(hit.draft_kv.v, first.draft_kv.v[:, :, :2000])
    # A third question extends the head: it replaces it, and a fourth forks again.
    cache.insert([*doc, 6, 7, 8], fake_prefix(2003, 3), "k", "k")
    cache.insert([*doc, 9], fake_prefix(2001, 4), "k", "k")
    assert cache.stats()["entries"] == 1 and cache.lookup([*doc, 0], "k", "k").length == 2000
    # Tails longer than an eighth of the shared head (conversations after one system prompt) stay apart,
    # as do prompts sharing fewer than FORK_MIN tokens.
    cache = PrefixCache(1 << 30)
    cache.insert([*doc, *range(300)], fake_prefix(2300, 1), "k", "k")
    cache.insert([*doc, *range(5000, 5300)], fake_prefix(2300, 2), "k", "k")
    cache.insert([*doc[:1000], 1], fake_prefix(1001, 3), "k", "k")
    cache.insert([*doc[:1000], 2], fake_prefix(1001, 4), "k", "k")
    assert cache.stats()["entries"] == 4


def test_least_recently_used_entries_are_evicted_under_the_cap():
    cache = PrefixCache(100 * PER_TOKEN)
    a, b, c = ([i, *range(100, 139)] for i in (1, 2, 3))  # 40 tokens each, sharing nothing at token 0
    cache.insert(a, fake_prefix(40, 1), "k", "k")
    cache.insert(b, fake_prefix(40, 2), "k", "k")
    assert cache.lookup([*a, 0], "k", "k").length == 40  # a is now the most recently used
    cache.insert(c, fake_prefix(40, 3), "k", "k")  # 120 tokens > 100: b goes
    st = cache.stats()
    assert st["entries"] == 2 and st["bytes"] == 80 * PER_TOKEN <= st["max_bytes"] and st["evictions"] == 1
    assert cache.lookup([*b, 0], "k", "k") is None
    assert cache.lookup([*a, 0], "k", "k") is not None and cache.lookup([*c, 0], "k", "k") is not None
    cache.insert(list(range(500, 701)), fake_prefix(201), "k", "k")  # larger than the cap alone: not kept
    assert cache.stats()["entries"] == 2


# --------------------------------------------------------------------------- on disk


def test_a_restarted_cache_finds_its_prefixes_on_disk(tmp_path):
    a = list(range(50))
    p = fake_prefix(50, 4)
    PrefixCache(1 << 20, "fp", tmp_path).insert(a, p, "k", "k")
    assert [f.suffix for f in tmp_path.iterdir()] == [".kv"]  # no temporary file left behind
    again = PrefixCache(1 << 20, "fp", tmp_path)
    assert again.stats()["disk_entries"] == 1 and again.stats()["entries"] == 0
    got = again.lookup([*a[:30], 7], "k", "k")
    assert got.length == 30
    assert torch.equal(got.target_kv.k, p.target_kv.k[:, :, :30])
    assert torch.equal(got.draft_kv.v, p.draft_kv.v[:, :, :30])
    assert again.stats()["entries"] == 1  # now in memory too
    # Written by other models: neither used nor removed.
    other = PrefixCache(1 << 20, "other-models", tmp_path)
    assert other.lookup([*a, 1], "k", "k") is None and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "garbage"])
def test_a_corrupt_cache_file_is_ignored_and_removed(tmp_path, damage):
    a = list(range(50))
    PrefixCache(1 << 20, "fp", tmp_path).insert(a, fake_prefix(50), "k", "k")
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[-5] ^= 0x01
    elif damage == "header":
        # A token id in the header changes, but the file still parses: only the checksum tells.
        i = data.index(b'"tokens": [0, 1, 2')
        data[i + len('"tokens": [0, 1, ')] = ord("3")
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a cache file at all")
    path.write_bytes(bytes(data))
    cache = PrefixCache(1 << 20, "fp", tmp_path)
    assert cache.lookup([*a, 1], "k", "k") is None
    assert cache.lookup([0, 1, 3, 3, 4, 5], "k", "k") is None
    assert not path.exists() and cache.stats()["corrupt_files"] == 1


def test_the_disk_keeps_its_own_lru_cap(tmp_path):
    cache = PrefixCache(1 << 30, "fp", tmp_path, max_disk_bytes=100 * PER_TOKEN)
    for i in range(3):
        cache.insert([i, *range(100, 139)], fake_prefix(40, i), "k", "k")
    st = cache.stats()
    assert st["entries"] == 3 and st["disk_entries"] == 2 and st["disk_bytes"] <= 100 * PER_TOKEN
    assert len(list(tmp_path.iterdir())) == 2


def test_questions_about_one_document_keep_one_file_of_it(tmp_path):
    doc = list(range(1000, 3000))  # 2,000 shared tokens
    cache = PrefixCache(1 << 30, "fp", tmp_path)
    cache.insert([*doc, 1, 2, 3], fake_prefix(2003, 1), "k", "k")
    second = fake_prefix(2002, 2)
    cache.insert([*doc, 4, 5], second, "k", "k")
    files = list(tmp_path.iterdir())
    st = cache.stats()
    # One file, the shared head alone (written from the newer prompt's KV), the first prompt's file gone.
    assert len(files) == 1 and st["disk_entries"] == 1 and st["disk_bytes"] == 2000 * PER_TOKEN
    header = kv_file.read_header(files[0])
    assert header.tokens == tuple(doc) and header.payload_bytes == 2000 * PER_TOKEN
    again = PrefixCache(1 << 30, "fp", tmp_path)
    hit = again.lookup([*doc, 6, 7], "k", "k")
    assert hit.length == 2000 and torch.equal(hit.target_kv.k, second.target_kv.k[:, :, :2000])
    assert torch.equal(hit.draft_kv.v, second.draft_kv.v[:, :, :2000])
    # A question that extends the head replaces its file; long tails (a conversation) keep their own.
    again.insert([*doc, 6, 7], fake_prefix(2002, 3), "k", "k")
    again.insert([*doc, *range(300)], fake_prefix(2300, 4), "k", "k")
    assert len(list(tmp_path.iterdir())) == 2 == again.stats()["disk_entries"]


def test_kv_file_round_trip_without_draft(tmp_path):
    p = fake_prefix(7, draft=False)
    kv_file.write(tmp_path / "x.kv", list(range(7)), p, "fp", "rowwise", None)
    header, back = kv_file.read(tmp_path / "x.kv")
    assert header.tokens == tuple(range(7)) and header.draft_kind is None and back.draft_kv is None
    assert torch.equal(back.target_kv.k, p.target_kv.k) and back.target_kv.k.dtype == torch.bfloat16


def test_the_fingerprint_changes_with_the_kernels_arithmetic(tmp_path, monkeypatch):
    """KV written by kernels with other arithmetic (another version of the code) is never read back."""
    from specextend import api

    from tiny_tokenizer import save_tiny_model

    path = save_tiny_model(tmp_path / "model", seed=0)
    pair = api.load(path, path, progress=False, dtype="float32", weights="int8")
    before = pair.fingerprint()
    monkeypatch.setattr(kernels, "ARITHMETIC_VERSION", kernels.ARITHMETIC_VERSION + 1)
    assert pair.fingerprint() != before
