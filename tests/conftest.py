"""Shared fixtures: tiny random models of every supported architecture, saved as HF folders; a
model cache of each test's own (`isolated_home`); `SpecEngine.generate` for engine-level tests, and
`WatchedEngine`, whose steps a test watches."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# The families that are switches over the same block (runtime/families.py): the parity tests run
# them too; the engine-level tests of every feature keep the four above.
FAMILY_ARCHS = ["granite", "smollm3", "olmo2", "olmo3", "gemma3", "gemma2", "phi3", "mistral3", "exaone4", "ernie4_5",
                "glm4", "lfm2", "command-r", "cohere2", "granite_swa",
                "seed_oss"]


USER_COSTS_ENV = "SPECEXTEND_TESTS_USER_COST_CACHE"  # the cost cache's setting before the tests moved it


def pytest_configure(config: pytest.Config) -> None:
    """Load the C++ kernels once, from the user's cache (where `make setup` built them), before
    any test points SPECEXTEND_HOME at a temporary folder, which would build them again there."""
    from specextend.runtime import costmodel, kernels
    from specextend.speculation.decoder import SpecEngine

    kernels.available()  # tests of the kernels skip where they cannot be built
    # One thread per core per xdist worker: workers share the cores, and threads that spin while
    # another worker holds their core made a 5 s test of tiny models take a minute. Children (the
    # CLI and server tests' processes) inherit the setting.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # A crash in a child process (the CLI and server tests') prints where each thread was.
    os.environ["PYTHONFAULTHANDLER"] = "1"
    # Step costs the tests measure (tiny models) stay out of the user's cache; a test of the user's
    # own default pair reads that pair's costs where the user's commands keep them (user_cost_cache).
    # (Recorded once, by the first process: xdist's workers inherit the moved setting and the record.)
    os.environ.setdefault(USER_COSTS_ENV, str(costmodel.cache_dir()))
    os.environ["SPECEXTEND_COST_CACHE"] = tempfile.mkdtemp(prefix="specextend-costs-")
    SpecEngine.generate = generate  # type: ignore[attr-defined]
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        config.stash[DERIVED_BEFORE] = _derived_entries()


# What the user's cache held under derived/ before the session: a model a test loads from a temporary
# folder (outside SPECEXTEND_HOME) keeps its derived weights and key offsets there, under a key of that
# folder's path, which no later run asks for again. The session removes what it added (caches only: a
# process that wanted one computes it again).
DERIVED_BEFORE = pytest.StashKey[tuple[Path, set[str]]]()


def _derived_entries() -> tuple[Path, set[str]]:
    from specextend.models.pull import specextend_home

    folder = specextend_home() / "derived"
    return folder, {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if DERIVED_BEFORE not in session.config.stash:
        return
    folder, before = session.config.stash[DERIVED_BEFORE]
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name not in before:
                shutil.rmtree(entry, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests first, longest first (`long(seconds)`, 20 if not given; stable otherwise):
    `make test` has xdist hand tests out in this order, a few at a time (--dist loadgroup: a group
    marked `xdist_group` goes to one worker as a unit, the groups first), so the long ones start
    early on both workers and the short ones fill in around them, instead of one worker finishing
    the suite alone on a minute-long test."""

    def key(item: pytest.Item) -> float:
        mark = item.get_closest_marker("long")
        return 0.0 if mark is None else -float(mark.args[0] if mark.args else 20)

    items.sort(key=key)


def generate(engine, prompt_ids: list[int], settings, on_tokens=None):
    """Resolve the settings, prefill and decode in one call, on an engine built by a test. The
    package itself decodes through `Pair` (api.py); tests that drive the engine directly call
    this as `engine.generate`."""
    s = settings.resolved()
    return engine.decode(engine.prefill(prompt_ids, s), s, on_tokens)


@pytest.fixture
def user_cost_cache() -> str:
    """The step-cost cache the user's own commands use (SPECEXTEND_COST_CACHE as it was, else the
    default): where a test of the default pair from the user's model cache finds, or measures once,
    that pair's costs on this machine, as `specextend serve` would."""
    return os.environ[USER_COSTS_ENV]


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """A model cache of this test's own: nothing may touch (or pull into) the user's. Test files
    that load models by reference use it for every test (`pytestmark`). Returns the folder."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECEXTEND_HOME", str(home))
    return home


def tiny_hf_config(arch: str, vocab: int = 64, layers: int = 2, **kw):
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        bos_token_id=0,
    )
    common.update(kw)
    if arch == "llama":
        common.setdefault(
            "rope_scaling",
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
        )
        common.setdefault("rope_theta", 500000.0)
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=8, **common)
    if arch == "granite":
        # Multipliers far from 1, so a forward that drops one cannot pass.
        return tf.GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.25,
                                logits_scaling=2.5, **common)
    if arch == "smollm3":
        # NoPE on every 2nd layer here (the default is every 4th), so a 2-layer model has one.
        n = common["num_hidden_layers"]
        common.setdefault("no_rope_layers", [int((i + 1) % 2 != 0) for i in range(n)])
        return tf.SmolLM3Config(pad_token_id=None, **common)
    if arch == "gemma3":
        # A query scale other than 1/sqrt(head_dim), a window shorter than the tests' prompts, a
        # scaled global rope; 5 windowed layers to 1 global (llama.cpp's) where there are 6 layers,
        # else alternating, so a 2-layer model has both kinds.
        n = common["num_hidden_layers"]
        pattern = 6 if n >= 6 else 2
        common["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        common.setdefault("layer_types", ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)])
        common.setdefault("head_dim", 8)
        common.setdefault("query_pre_attn_scalar", 12)
        common.setdefault("sliding_window", 8)
        common.setdefault("rope_parameters", {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
        return tf.Gemma3TextConfig(pad_token_id=None, **common)
    if arch == "gemma2":
        # Caps small enough that dropping either moves the logits (Gemma 2's own are 50 and 30).
        common["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        common.setdefault("head_dim", 8)
        common.setdefault("query_pre_attn_scalar", 12)
        common.setdefault("sliding_window", 8)
        common.setdefault("attn_logit_softcapping", 2.0)
        common.setdefault("final_logit_softcapping", 1.5)
        return tf.Gemma2Config(pad_token_id=None, **common)
    if arch == "phi3":
        # Phi-4-mini's layout: LongRoPE (its short factors and magnitude: the prompts stay inside the
        # original window) over part of each head.
        rot = 4 if "head_dim" not in kw else int(kw["head_dim"] * 0.75)
        gen = torch.Generator().manual_seed(1)
        common.setdefault("original_max_position_embeddings", 128)
        common.setdefault("rope_parameters", {
            "rope_type": "longrope", "rope_theta": 10_000.0,
            "partial_rotary_factor": rot / (common["hidden_size"] // common["num_attention_heads"]),
            "short_factor": (1 + torch.rand(rot // 2, generator=gen)).tolist(),
            "long_factor": (2 + 2 * torch.rand(rot // 2, generator=gen)).tolist()})
        common.pop("head_dim", None)
        return tf.Phi3Config(pad_token_id=None, **common)
    if arch == "olmo2":
        return tf.Olmo2Config(pad_token_id=None, **common)
    if arch == "exaone4":
        # The 1.2B's layout unless told otherwise: no window, rope on every layer; with `sliding_window`, the 32B's
        # (windows on all but every 4th layer, which take no rope).
        n = common["num_hidden_layers"]
        window = common.pop("sliding_window", None)
        common.setdefault("layer_types", ["sliding_attention" if window and (i + 1) % 4 else "full_attention"
                                          for i in range(n)])
        return tf.Exaone4Config(pad_token_id=None, sliding_window=window, sliding_window_pattern=4 if window else None,
                                **common)
    if arch == "mistral3":
        # Ministral 3's YaRN and its attention temperature from an original window shorter than the tests'
        # prompts, with a beta large enough that a temperature dropped, or applied from the wrong position, shows.
        common.setdefault("rope_parameters", {
            "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})
        return tf.Ministral3Config(pad_token_id=None, sliding_window=None, **common)
    if arch == "olmo3":
        # A window shorter than the tests' prompts on all but every 4th layer (alternating in a model of fewer
        # than 4), YaRN on the global layers alone, its attention factor other than the default (the file's
        # key is read), and the windowed layers' rope on a base of their own (a mix-up of the two shows).
        n = common["num_hidden_layers"]
        pattern = 4 if n >= 4 else 2
        common.setdefault("layer_types", ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)])
        common.setdefault("sliding_window", 8)
        common.setdefault("rope_parameters", {
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "attention_factor": 1.25, "rope_theta": 10_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50_000.0}})
        return tf.Olmo3Config(pad_token_id=None, **common)
    if arch == "ernie4_5":
        # tied embeddings, as every released ERNIE 4.5; its rope on adjacent pairs
        common["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        return tf.Ernie4_5Config(pad_token_id=None, **common)
    if arch == "glm4":
        # GLM-4's sandwich norms, q/k/v biases and rope on adjacent pairs of half of each head (a quarter where
        # the head is 8 wide: rotated dimensions must pair up in both orders)
        common.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10_000.0,
                                              "partial_rotary_factor": 0.5})
        return tf.Glm4Config(pad_token_id=None, **common)
    if arch == "lfm2":
        # short convolutions on the even layers, attention on the odd (a 1-layer model: a convolution alone); the
        # MLP's width as given (the 1.2B's config derives it: `block_auto_adjust_ff_dim`), tied embeddings
        n = common["num_hidden_layers"]
        common.setdefault("layer_types", ["full_attention" if i % 2 else "conv" for i in range(n)])
        common["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        return tf.Lfm2Config(pad_token_id=None, norm_eps=common["rms_norm_eps"], block_auto_adjust_ff_dim=False,
                             **common)
    if arch == "granite_swa":
        # Granite's multipliers (an attention scale below 1/sqrt(head_dim) and a logit divisor below 1: scores
        # that int8 activations do not flip, logits spread, not flat), a window shorter than the tests' prompts on
        # all but every 4th layer (from the first), no rope on the global layers (llama.cpp's files say rope or
        # none a layer, one base for all).
        n = common["num_hidden_layers"]
        common.setdefault("sliding_window", 8)
        common.setdefault("layer_rope_theta", [0 if i % 4 == 0 else 10_000.0 for i in range(n)])
        return tf.GraniteSWAConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                   logits_scaling=0.5, pad_token_id=None, **common)
    if arch == "seed_oss":  # biases on q/k/v, none on the output projection (the released model; llama.cpp reads none)
        return tf.SeedOssConfig(pad_token_id=None, attention_bias=True, attention_out_bias=False, mlp_bias=False,
                                attention_dropout=0.0, residual_dropout=0.0, **common)
    if arch in ("command-r", "cohere2"):
        # Cohere's LayerNorms (their eps), parallel block, rope on adjacent pairs and a logit scale that no power of
        # two is (a multiplier read as a divisor shows); Command R7B's windows on 3 layers of 4, which alone take rope.
        common["layer_norm_eps"] = common.pop("rms_norm_eps")
        common["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        common.setdefault("logit_scale", 0.3)
        if arch == "command-r":
            return tf.CohereConfig(pad_token_id=None, **common)
        common.setdefault("sliding_window", 8)
        return tf.Cohere2Config(pad_token_id=None, **common)
    raise ValueError(arch)


def make_tiny_hf(arch: str, seed: int = 0, dtype=torch.float64, **kw):
    """A random HF model (float64) with weights scaled so logits are spread, not flat."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kw)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + weight
                p.copy_((0.0 if cfg.model_type.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) * (0.6 / p.shape[1] ** 0.5))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Save a tiny model per architecture once per session; returns arch -> folder."""
    cache: dict[str, Path] = {}

    def get(arch: str, seed: int = 0, **kw) -> Path:
        key = f"{arch}-{seed}-{sorted(kw.items())}"
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}{seed}")
            make_tiny_hf(arch, seed, **kw).save_pretrained(d)
            cache[key] = d
        return cache[key]

    return get


class _WatchedProposer:
    """A proposer that tells `hook(target cache, draft policy, output so far, committed tokens the
    draft has not been fed)` after every step that did not end the decode (its `retrieved`)."""

    def __init__(self, proposer, tcache, hook) -> None:
        self._inner, self._tcache, self._hook = proposer, tcache, hook
        self._out: list[int] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def committed(self, tokens):
        self._out.extend(tokens)
        return self._inner.committed(tokens)

    def verified(self, tree, verdict, new, *args, **kwargs):
        self._out.extend(new)
        return self._inner.verified(tree, verdict, new, *args, **kwargs)

    def retrieved(self, seconds):
        self._inner.retrieved(seconds)
        self._hook(self._tcache, self._inner.policy, self._out, self._inner.backlog)


def _engine_class():
    from specextend.speculation.decoder import SpecEngine  # after pytest_configure: see there

    return SpecEngine


class WatchedEngine(_engine_class()):
    """A SpecEngine whose speculative steps a test watches through `step_hook` (see
    _WatchedProposer): a fake around the proposer, not a hook in the production engine."""

    step_hook = None

    def _start_proposer(self, state, s, rng, clock, proc=None):
        proposer, layers = super()._start_proposer(state, s, rng, clock, proc)
        if self.step_hook is None:
            return proposer, layers
        return _WatchedProposer(proposer, state.target_cache, self.step_hook), layers
