"""Repetition penalties on a row of logits, as OpenAI and vLLM define them.

- `frequency_penalty` f and `presence_penalty` p (OpenAI): logit[t] -= f * c[t] + p * (c[t] > 0),
  c[t] the times token t occurs in the output so far;
- `repetition_penalty` r (the CTRL / Hugging Face rule, as vLLM applies it): a token seen in the
  prompt or the output has its logit divided by r if positive, multiplied by r otherwise.

Repetition first, then frequency and presence. A row's penalty depends only on the counts of the
tokens before it, computed by one function, so a speculative tree node and `ar` at the same
position (the same tokens before them) get the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Penalties:
    """Token counts of one generation (the output's, and which tokens the prompt holds)."""

    def __init__(self, frequency: float, presence: float, repetition: float, prompt_ids: Sequence[int],
                 vocab: int) -> None:
        self.frequency, self.presence, self.repetition = frequency, presence, repetition
        self.vocab = vocab
        self.counts = torch.zeros(vocab, dtype=torch.float64)  # in the output so far
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)
        self.in_prompt[ids] = True

    @property
    def active(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0

    def commit(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if 0 <= t < self.vocab:
                self.counts[t] += 1.0

    def apply(self, logits: torch.Tensor, extra: Sequence[int] = ()) -> torch.Tensor:
        """The penalised row (a new tensor) after the output so far plus `extra` tokens."""
        counts = self.counts
        if extra:
            counts = counts.clone()
            for t in extra:
                if 0 <= t < self.vocab:
                    counts[t] += 1.0
        n = min(logits.shape[-1], self.vocab)
        counts = counts[:n].to(logits.dtype)
        out = logits.clone()
        row = out[..., :n]
        if self.repetition != 1.0:
            seen = self.in_prompt[:n] | (counts > 0)
            row.copy_(torch.where(seen, torch.where(row > 0, row / self.repetition, row * self.repetition), row))
        if self.frequency != 0.0 or self.presence != 0.0:
            row.sub_(counts * self.frequency + (counts > 0).to(logits.dtype) * self.presence)
        return out
