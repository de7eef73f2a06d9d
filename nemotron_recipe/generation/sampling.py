"""What to generate (`GenerationConfig`) and how the next token is chosen from the logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class GenerationError(ValueError):
    """A generation setting or prompt that cannot work; the message names it, its value and a fix."""


@dataclass(frozen=True)
class GenerationConfig:
    """Settings of `generate`.

    max_new_tokens: the most tokens generated per prompt.
    greedy: take the most likely token (temperature, top_k, top_p and seed are then unused).
    temperature: divides the logits before sampling (> 0).
    top_k: sample among the k most likely tokens only (0: all).
    top_p: sample among the most likely tokens whose probabilities sum to at least top_p (1.0: all).
    seed: prompt i samples from its own generator seeded with seed + i, so the same seed gives the
        same text whatever the batch size or the other prompts.
    eos_token_ids: tokens that end a completion; None takes the tokenizer's EOS (none without one).
    stop_strings: texts that end a completion (needs a tokenizer); the text stops before them.
    batch_size: prompts decoded together.
    max_length: the most positions (prompt plus new tokens) the model may take; None: no limit.
    prepack_weights: run the linear layers on weights reordered for oneDNN once per call (packed.py),
        a copy as large as those weights that makes CPU decoding steps faster; None: where it pays
        (CPU, bf16 and fp32) and the copy takes at most half the free memory, True: wherever oneDNN
        runs, False: never.
    compile: where one row decodes at a time (batch_size 1, or a single prompt), on CPU, run each
        Mamba2 and MLP block's step compiled by torch.compile (compiled.py): faster steps after a
        compile of some seconds at the first one. Batches of several rows are not compiled.
    """

    max_new_tokens: int = 128
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    batch_size: int = 8
    max_length: int | None = None
    prepack_weights: bool | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens, isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "a positive integer, e.g. 128"),
            ("temperature", self.temperature, self.temperature > 0, "a positive number (use greedy for argmax)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "0 (off) or a positive integer"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("batch_size", self.batch_size, isinstance(self.batch_size, int) and self.batch_size >= 1,
             "a positive integer"),
            ("max_length", self.max_length, self.max_length is None or self.max_length >= 1,
             "a positive integer or None"),
            ("compile", self.compile, isinstance(self.compile, bool), "True or False"),
        ]
        for field, value, ok, fix in checks:
            if not ok:
                raise GenerationError(f"generation {field}={value!r} is invalid. Fix: {fix}.")
        if any(not s for s in self.stop_strings):
            raise GenerationError(f"generation stop_strings={list(self.stop_strings)!r} holds an empty string, "
                                  "which would stop at once. Fix: drop it.")


def row_generators(seed: int, indices: list[int], device: torch.device) -> list[torch.Generator]:
    """One generator per prompt, seeded by the prompt's index: sampling is then independent of batching."""
    return [torch.Generator(device=device).manual_seed(seed + i) for i in indices]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [b, V] with the tokens outside the top-k and outside the top-p nucleus set to -inf.
    The nucleus keeps the most likely tokens up to and including the one that reaches `top_p`."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, config: GenerationConfig, generators: list[torch.Generator]) -> torch.Tensor:
    """The next token of each row [b] from its logits [b, V]; row i samples from `generators[i]`."""
    if config.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / config.temperature, config.top_k, config.top_p).softmax(-1)
    return torch.cat([torch.multinomial(row, 1, generator=gen) for row, gen in zip(probs, generators)])
