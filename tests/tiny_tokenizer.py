"""A tiny byte-level BPE tokenizer (with a chat template) and tiny model folders that use it.

Byte-level, so any text encodes and multi-byte characters span several tokens (what streaming
detokenisation must get right). Layout of the TINY_VOCAB ids:
0 <s>, 1 <|user|>, 2 <|assistant|>, 3 <|endoftext|>, 4..259 the 256 bytes, 260..262 merges, 263 </s>
(the tiny configs' eos is vocab - 1 and bos 0, so they agree with this tokenizer).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import make_tiny_hf

TINY_VOCAB = 264
SPECIALS = ["<s>", "<|user|>", "<|assistant|>", "<|endoftext|>"]
EOS = "</s>"
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
# Tools are named in a system turn (a template that ignores them is refused tools: prompts.py).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|endoftext|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(swap: tuple[int, int] | None = None):
    """The tokenizer above; `swap` exchanges two ids (a same-size but different vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(byte_chars) == 256
    tokens = SPECIALS + byte_chars + ["".join(m) for m in MERGES] + [EOS]
    assert len(tokens) == TINY_VOCAB
    if swap is not None:
        i, j = swap
        tokens[i], tokens[j] = tokens[j], tokens[i]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*SPECIALS, EOS]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token=EOS,
        additional_special_tokens=SPECIALS[1:],
        chat_template=CHAT_TEMPLATE,
    )


def prose_tokenizer(texts: list[str], merges: int = 2048):
    """A byte-level BPE with `merges` merges learnt from `texts` (deterministic), the specials above
    and EOS last: English prose in ~4 bytes a token, as a real vocabulary cuts it, where the tiny
    tokenizer takes one a byte (a test that prefills a whole document then runs on a quarter of
    the tokens and a sixteenth of the attention)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + 256 + merges, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    assert tok.token_to_id(EOS) == tok.get_vocab_size() - 1  # the tiny configs' eos is vocab - 1
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=EOS,
                                   additional_special_tokens=SPECIALS[1:], chat_template=CHAT_TEMPLATE)


def save_tiny_model(folder: Path, arch: str = "qwen2", seed: int = 0, vocab: int = TINY_VOCAB,
                    tokenizer=None, **kw) -> Path:
    """A random tiny HF model (float64 weights) plus the tiny tokenizer, saved into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_hf(arch, seed, vocab=vocab, **kw).save_pretrained(folder)
    (tokenizer if tokenizer is not None else tiny_tokenizer()).save_pretrained(folder)
    return folder


def quantized_pair(root: Path, **shape):
    """A tiny target and one-layer draft on the row-independent runtime (int8 weights, so a batch
    stacks their rows), without end-of-sequence ids: random weights, every generation runs to its
    length."""
    from dataclasses import replace

    from specextend.api import Pair, load

    target = save_tiny_model(root / "target", seed=0, **shape)
    draft = save_tiny_model(root / "draft", seed=1, layers=1, **shape)
    p = load(target, draft, dtype="float32", weights="int8", draft_weights="int8", progress=False)
    p = Pair(replace(p.spec, eos_ids=()), p.target, p.draft)
    assert p.target.batches_rows and p.draft.batches_rows
    return p


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
