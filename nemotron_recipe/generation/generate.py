"""Batched generation with the native model's decoding cache: prefill, then one token a step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nemotron_recipe.models.nemotron_v3.cache import DecodeCache

from .compiled import compiled_steps
from .packed import packed_linears
from .sampling import GenerationConfig, GenerationError, next_tokens, row_generators

# stream(prompt index, new text): called as each prompt's completion grows.
StreamCallback = Callable[[int, str], None]


@dataclass
class GenerationResult:
    completion_ids: list[int]  # the new tokens; an ending EOS is not among them
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max_new_tokens)
    text: str | None  # the decoded completion, cut before a stop string; None without a tokenizer


def generate(
    model: torch.nn.Module,
    prompts_ids: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    tokenizer=None,
    stream: StreamCallback | None = None,
) -> list[GenerationResult]:
    """Completions of `prompts_ids` (token ids, one list per prompt) by `model`, a native
    `NemotronHForCausalLM` (LoRA adapters included), in the prompts' order.

    Prompts are decoded `config.batch_size` at a time, longest first, left-padded: padding never
    enters a Mamba state or an attention score, so a prompt's completion does not depend on its
    batch. Each batch is prefilled in one forward, then decoded one token a step with the cached
    conv windows, SSM states and attention keys/values; rows that finish leave the batch. The model
    runs in eval mode and without gradients (its mode is restored after); MTP layers never run. On
    CPU its linear layers run on weights reordered once per call (packed.py, `config.prepack_weights`),
    and with `config.compile` one-row steps run compiled (compiled.py).

    `tokenizer` (a transformers tokenizer) decodes `text`, gives the default EOS and is needed for
    `config.stop_strings` and `stream`. `stream(index, delta)` receives each prompt's text as it
    grows (text that may still turn out to begin a stop string, or that ends in an incomplete
    character, is held back until it is settled).

    Raises GenerationError, before any forward, for an empty prompt, a token outside the
    vocabulary, a prompt that with `max_new_tokens` exceeds `config.max_length`, or stop strings or
    streaming without a tokenizer. Under a distributed mesh every rank must call this with the same
    prompts and config (greedy or seeded sampling gives every rank the same tokens)."""
    config = config or GenerationConfig()
    prompts = [list(map(int, p)) for p in prompts_ids]
    check_prompts(prompts, config, model.config.vocab_size)
    if tokenizer is None and (config.stop_strings or stream is not None):
        raise GenerationError("stop_strings and streaming need text: pass the tokenizer to generate().")
    eos = set(_eos_ids(config, tokenizer))
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[GenerationResult | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        rows = min(config.batch_size, len(prompts))
        with torch.no_grad(), compiled_steps(model, config.compile and rows == 1) as compiled, \
                packed_linears(model, rows, config.prepack_weights, skip=compiled):
            for start in range(0, len(order), config.batch_size):
                batch = order[start:start + config.batch_size]
                for i, result in zip(batch, _generate_batch(model, [prompts[i] for i in batch], batch, config,
                                                            eos, tokenizer, stream)):
                    results[i] = result
    finally:
        model.train(was_training)
    return results


def check_prompts(prompts: Sequence[Sequence[int]], config: GenerationConfig, vocab_size: int) -> None:
    """Raises GenerationError for an empty prompt, a token id outside the vocabulary, or a prompt that
    with `config.max_new_tokens` needs more than `config.max_length` positions."""
    limit = config.max_length
    for i, p in enumerate(prompts):
        if not p:
            raise GenerationError(f"prompt {i} is empty: generation needs at least one token to start from. "
                                  "Fix: give it text (or a BOS token).")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"prompt {i} holds token ids {bad[:5]} outside the model's vocabulary "
                                  f"(size {vocab_size}). Fix: tokenize with the model's own tokenizer.")
        if limit is not None and len(p) + config.max_new_tokens > limit:
            raise GenerationError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={config.max_new_tokens} that is "
                f"{len(p) + config.max_new_tokens} positions, more than the model takes (max_length={limit}). "
                f"Fix: shorten the prompt to at most {max(limit - config.max_new_tokens, 0)} tokens or lower "
                "max_new_tokens.")


def _eos_ids(config: GenerationConfig, tokenizer) -> tuple[int, ...]:
    if config.eos_token_ids is not None:
        return tuple(config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (eos,)


def _left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, length - len(p):] = torch.tensor(p)
        valid[row, length - len(p):] = True
    return ids.to(device), valid.to(device)


def _generate_batch(model, prompts: list[list[int]], indices: list[int], config: GenerationConfig,
                    eos: set[int], tokenizer, stream) -> list[GenerationResult]:
    device = model.lm_head.weight.device
    ids, valid = _left_padded(prompts, device)
    cache = DecodeCache(valid, ids.shape[1] + config.max_new_tokens, len(model.model.layers))
    rows = [_Row(i, config, tokenizer, stream) for i in indices]
    generators = row_generators(config.seed, indices, device)
    active = list(range(len(rows)))  # batch rows still decoding, in cache order
    logits = model(ids, cache=cache).logits[:, -1]
    for step in range(config.max_new_tokens):
        tokens = next_tokens(logits, config, [generators[r] for r in active]).tolist()
        for r, token in zip(active, tokens):
            rows[r].add(token, eos, last=step == config.max_new_tokens - 1)
        still = [k for k, r in enumerate(active) if rows[r].finish_reason is None]
        if not still:
            break
        if len(still) < len(active):
            keep = torch.tensor(still, device=device)
            cache.select(keep)
            active = [active[k] for k in still]
            tokens = [tokens[k] for k in still]
        logits = model(torch.tensor(tokens, device=device)[:, None], cache=cache).logits[:, -1]
    return [row.result() for row in rows]


class _Row:
    """One prompt's completion as it grows: its ids, why it ended, its text and what was streamed."""

    def __init__(self, index: int, config: GenerationConfig, tokenizer, stream):
        self.index, self.config, self.tokenizer, self.stream = index, config, tokenizer, stream
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.text = ""
        self.sent = 0  # characters streamed

    def add(self, token: int, eos: set[int], last: bool) -> None:
        if token in eos:
            self.finish_reason = "eos"
        else:
            self.ids.append(token)
            if self.tokenizer is not None:
                self._update_text()
            if self.finish_reason is None and last:
                self.finish_reason = "length"
        self._stream()

    def _update_text(self) -> None:
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.config.stop_strings:
            at = self.text.find(stop)
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"

    def _stream(self) -> None:
        if self.stream is None:
            return
        settled = self.text if self.finish_reason else _settled(self.text, self.config.stop_strings)
        if len(settled) > self.sent:
            self.stream(self.index, settled[self.sent:])
            self.sent = len(settled)

    def result(self) -> GenerationResult:
        return GenerationResult(self.ids, self.finish_reason or "length",
                                None if self.tokenizer is None else self.text)


def _settled(text: str, stop_strings: tuple[str, ...]) -> str:
    """`text` without its end that is still open: an incomplete character, or the start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return text[:len(text) - hold]
