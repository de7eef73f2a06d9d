"""The training data a run builds from its config: tokenizer, then examples as `data` says.

One function for the trainer and for `recipes.preview`, so what the preview shows is what a run
trains on, by construction.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from nemotron_recipe.config import ConfigError
from nemotron_recipe.data import load_sft_data, load_tokenizer


def load_training_data(cfg: Any, vocab_size: int) -> tuple[PreTrainedTokenizerBase, Any]:
    """(tokenizer, train and validation data) for `cfg`, a `FinetuneConfig`-shaped config: SFT examples,
    or preference pairs under objective=dpo (`data.preference`)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
            f"tokens (data.tokenizer={cfg.data.tokenizer!r}). Fix: set model.vocab_size>={len(tokenizer)} "
            "or use the model's own tokenizer."
        )
    if getattr(getattr(cfg, "objective", None), "name", "sft") == "dpo":
        from nemotron_recipe.data.preference import load_preference_data

        return tokenizer, load_preference_data(cfg.data, tokenizer, seq_len=cfg.trainer.seq_len, seed=cfg.seed)
    return tokenizer, load_sft_data(cfg.data, tokenizer, seq_len=cfg.trainer.seq_len, seed=cfg.seed)
