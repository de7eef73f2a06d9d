"""Data layer: sources (files, hub datasets), chat rendering, tokenization, packing and batching."""

from .batching import GlobalBatchPlan, ValBatches, collate, val_batches
from .chat import ChatFormatter, Encoded, encode_conversation
from .packing import pack_examples
from .sft import (
    IGNORE_INDEX,
    SFTData,
    SFTExamples,
    encode_examples,
    load_sft_data,
    load_sft_examples,
    split_indices,
    tokenize_rows,
)
from .sources import Columns, DataError, Rows, check_data_config, load_rows
from .tokenizer import DEFAULT_ASSETS_DIR, load_tokenizer

__all__ = [
    "DEFAULT_ASSETS_DIR",
    "IGNORE_INDEX",
    "ChatFormatter",
    "Encoded",
    "Columns",
    "DataError",
    "GlobalBatchPlan",
    "Rows",
    "SFTData",
    "SFTExamples",
    "ValBatches",
    "check_data_config",
    "collate",
    "encode_conversation",
    "encode_examples",
    "load_rows",
    "load_sft_data",
    "load_sft_examples",
    "load_tokenizer",
    "pack_examples",
    "split_indices",
    "tokenize_rows",
    "val_batches",
]
