"""Data layer: tokenizer loading, SFT data validation/tokenization and deterministic batching."""

from .batching import GlobalBatchPlan, ValBatches, collate, val_batches
from .sft import IGNORE_INDEX, DataError, SFTExamples, load_sft_examples, read_jsonl_rows, tokenize_sft
from .tokenizer import DEFAULT_ASSETS_DIR, load_tokenizer

__all__ = [
    "DEFAULT_ASSETS_DIR",
    "IGNORE_INDEX",
    "DataError",
    "GlobalBatchPlan",
    "SFTExamples",
    "ValBatches",
    "collate",
    "load_sft_examples",
    "load_tokenizer",
    "read_jsonl_rows",
    "tokenize_sft",
    "val_batches",
]
