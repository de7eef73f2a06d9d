"""Show what a run trains on, without training:

    python -m recipes.preview data.reasoning=answer_only data.chat_template=nemotron3 preview.n=2
    python -m recipes.preview data.packing=true preview.format=json
    python -m recipes.preview objective=dpo peft=lora preview.n=1

Takes every override `recipes.finetune` takes, plus the `preview` group (`PreviewConfig`). Builds the
data exactly as a run does (chat format, reasoning option, length policy, packing) and prints the
first `preview.n` sequences in the order training reads them, trained text marked, then the
trained and total token counts of each split and how many rows were truncated, dropped or skipped.
Under `objective=dpo` it shows preference pairs: the prompt, then the chosen and the rejected sequence,
each with the tokens its log-prob sums over marked (`training/preview_pairs.py`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from nemotron_recipe.config import ConfigError, FinetuneConfig, build_model_config
from nemotron_recipe.data import DataError
from nemotron_recipe.models.nemotron_v3 import ModelConfigError


@dataclass
class PreviewConfig:
    n: int = 3  # sequences to show
    format: str = "text"  # text | json
    split: str = "train"  # train | val
    color: bool | None = None  # None: when printing to a terminal


@dataclass
class PreviewEntryConfig(FinetuneConfig):
    preview: PreviewConfig = field(default_factory=PreviewConfig)


ConfigStore.instance().store(name="preview_schema", node=PreviewEntryConfig)

_USER_ERRORS = (ConfigError, DataError, ModelConfigError, FileNotFoundError, ValueError)


def preview_report(cfg: DictConfig, *, color: bool = False) -> str:
    """The preview of `cfg`'s training data as text or JSON (`cfg.preview.format`)."""
    from nemotron_recipe.data.sources import check_data_config
    from nemotron_recipe.training.data import load_training_data
    from nemotron_recipe.training.preview import (
        FORMATS,
        SPLITS,
        as_json,
        as_text,
        preview_examples,
        training_order,
    )

    p = cfg.preview
    problems = [f"preview.{name}={value!r}: unknown. Fix: use one of {list(choices)}."
                for name, value, choices in (("format", p.format, FORMATS), ("split", p.split, SPLITS))
                if value not in choices]
    problems += [f"preview.n={p.n}: must be >= 1. Fix: e.g. preview.n=3."] if p.n < 1 else []
    problems += check_data_config(cfg.data)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    tokenizer, data = load_training_data(cfg, build_model_config(cfg.model).vocab_size)
    seq_len = cfg.trainer.seq_len
    if p.split == "val":
        if data.val is None:
            raise ConfigError("preview.split=val: the run has no validation data. Fix: set data.val_file or "
                              "data.val_split_fraction, or preview.split=train.")
        examples, order = data.val, list(range(min(p.n, len(data.val))))
    else:  # DPO's batch plan counts pairs, as SFT's counts sequences
        examples, order = data.train, training_order(len(data.train), cfg, p.n)
    if cfg.objective.name == "dpo":
        from nemotron_recipe.training.preview_pairs import pairs_as_json, pairs_as_text, preview_pairs

        pairs = preview_pairs(examples, order, seq_len, tokenizer.pad_token_id)
        if p.format == "json":
            return pairs_as_json(pairs, tokenizer, data, seq_len)
        return pairs_as_text(pairs, tokenizer, data, seq_len, color=color, split=p.split)
    shown = preview_examples(examples, order, seq_len, tokenizer.pad_token_id)
    if p.format == "json":
        return as_json(shown, tokenizer, data, seq_len)
    return as_text(shown, tokenizer, data, seq_len, color=color, split=p.split)


@hydra.main(version_base=None, config_path="../conf", config_name="preview")
def main(cfg: DictConfig) -> None:
    color = sys.stdout.isatty() if cfg.preview.color is None else bool(cfg.preview.color)
    try:
        print(preview_report(cfg, color=color))
    except _USER_ERRORS as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from recipes.cli import check_override_keys

    check_override_keys(sys.argv[1:], PreviewEntryConfig)
    main()
