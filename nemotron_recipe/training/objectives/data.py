"""The training data an objective reads: SFT examples, or preference pairs for DPO."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


def load_training_data(cfg: Any, tokenizer: PreTrainedTokenizerBase) -> Any:
    """Train and validation data as `data` and `objective` say (`data.format=preference`: pairs)."""
    seq_len = cfg.trainer.seq_len
    if cfg.objective.name == "dpo":
        from nemotron_recipe.data.preference import load_preference_data

        return load_preference_data(cfg.data, tokenizer, seq_len=seq_len, seed=cfg.seed)
    from nemotron_recipe.data import load_sft_data

    return load_sft_data(cfg.data, tokenizer, seq_len=seq_len, seed=cfg.seed)
