"""SFT examples: rows from any source, rendered as chats, cut to `seq_len` with pre-shifted targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import logging

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from .chat import ChatFormatter, Encoded, describe
from .examples import IGNORE_INDEX, SFTExamples, shifted_targets
from .packing import pack_examples
from .reasoning import has_reasoning
from .sources import MAX_LENGTH_POLICIES, Columns, DataError, Rows, load_rows, source_format, turns_of

log = logging.getLogger(__name__)

# Rows are rendered and tokenized this many at a time: large enough for batched tokenization,
# small enough that a big data set never holds all its intermediate lists at once.
_CHUNK = 2048


def encode_examples(
    encoded: Sequence[Encoded], seq_len: int, max_length_policy: str = "truncate", out: SFTExamples | None = None
) -> SFTExamples:
    """Turn `(ids, trained)` pairs into examples: the length policy, shifted targets, skip counts."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 to hold one input and one target, got {seq_len}")
    if max_length_policy not in MAX_LENGTH_POLICIES:
        raise DataError(f"data.max_length_policy={max_length_policy!r}: use one of {list(MAX_LENGTH_POLICIES)}.")
    out = out if out is not None else SFTExamples(input_ids=[], targets=[])
    for ids, trained in encoded:
        if len(ids) > seq_len:
            if max_length_policy == "drop":
                out.num_dropped += 1
                continue
            ids, trained = ids[:seq_len], trained[:seq_len]
            out.num_truncated += 1
        targets = shifted_targets(ids, trained)
        if all(t == IGNORE_INDEX for t in targets):
            out.num_skipped += 1
            continue
        out.input_ids.append(list(ids))
        out.targets.append(targets)
    return out


def tokenize_rows(
    rows: Rows,
    formatter: ChatFormatter,
    cols: Columns,
    *,
    seq_len: int,
    max_length_policy: str = "truncate",
    indices: Sequence[int] | None = None,
) -> SFTExamples:
    """Render and tokenize `rows` (or the rows at `indices`, in that order) into examples."""
    order = range(len(rows)) if indices is None else indices
    out = SFTExamples(input_ids=[], targets=[])
    for _, as_rows, where in rows.chunks(order, cols.required, _CHUNK):
        conversations = [turns_of(r, cols) for r in as_rows]
        out.num_reasoning += sum(has_reasoning(turns) for turns in conversations)
        encode_examples(formatter.encode(conversations, where), seq_len, max_length_policy, out)
    return out


def _require_examples(examples: SFTExamples, field_name: str, value: str, seq_len: int) -> None:
    if len(examples):
        return
    raise DataError(
        f"{field_name}={value!r}: no row is left to train on: {examples.num_skipped} rows have no trained token "
        f"(no assistant turn, or the prompt fills the whole sequence of {seq_len} tokens) and "
        f"{examples.num_dropped} were dropped as longer than trainer.seq_len. Fix: increase the sequence "
        "length (trainer.seq_len), shorten the prompts, add assistant turns, or set "
        "data.max_length_policy=truncate."
    )


def load_sft_examples(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str | None = None,
    seq_len: int,
    field_name: str = "data.train_file",
    fmt: str | None = None,
    split: str = "train",
    chat_template: str = "auto",
    train_on: str = "assistant",
    max_length_policy: str = "truncate",
    reasoning: str = "train",
    train_empty_think: bool = False,
) -> SFTExamples:
    """Check, load and tokenize one source (see `load_sft_data` for the config-driven entry point)."""
    cols = Columns(prompt_key=prompt_key, response_key=response_key, messages_key=messages_key)
    rows = load_rows(str(path), field_name=field_name, cols=cols, fmt=fmt, split=split)
    formatter = ChatFormatter(tokenizer, template=chat_template, train_on=train_on, reasoning=reasoning,
                              train_empty_think=train_empty_think)
    examples = tokenize_rows(rows, formatter, cols, seq_len=seq_len, max_length_policy=max_length_policy)
    _require_examples(examples, field_name, str(path), seq_len)
    return examples


def split_indices(num_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) row indices: a seeded random `fraction` of the rows, at least one, held out."""
    num_val = max(1, round(num_rows * fraction))
    if num_val >= num_rows:
        raise DataError(
            f"data.val_split_fraction={fraction} holds out {num_val} of the {num_rows} training rows, leaving "
            "none to train on. Fix: lower data.val_split_fraction, or give data.val_file."
        )
    # Its own stream (seed offset) so the split does not repeat the first epoch's batch order.
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    return sorted(perm[num_val:]), sorted(perm[:num_val])


@dataclass
class SFTData:
    train: SFTExamples
    val: Optional[SFTExamples]
    formatter: str

    def counts(self) -> dict[str, Any]:
        return {"train": self.train.counts(), "val": None if self.val is None else self.val.counts()}

    def describe(self, seq_len: int) -> str:
        """One log line: how many examples, what was cut or left out, and packing."""
        parts = []
        for name, ex in (("train", self.train), ("val", self.val)):
            if ex is None:
                parts.append(f"{name}: none")
                continue
            packed = f" packed into {len(ex)} sequences" if ex.packed else ""
            parts.append(
                f"{name}: {ex.num_documents} examples{packed} ({ex.num_truncated} truncated to seq_len={seq_len}, "
                f"{ex.num_dropped} dropped as longer, {ex.num_skipped} skipped with nothing to train on, "
                f"{ex.num_reasoning} with reasoning traces)"
            )
        return f"{'; '.join(parts)}; {self.formatter}"


def load_sft_data(data_cfg: Any, tokenizer: PreTrainedTokenizerBase, *, seq_len: int, seed: int) -> SFTData:
    """Train and validation examples as the `data` config says, packed when `data.packing`.

    Every rank loads everything (the data is small next to the model, and each rank then raises
    the same error for a bad row). Hub datasets are fetched by rank 0 first, so the other ranks
    read its cache rather than all downloading into it at once.
    """
    hub = any(
        value is not None and source_format(value, data_cfg.format) == "hub"
        for value in (data_cfg.train_file, data_cfg.val_file)
    )
    if not (hub and dist.is_initialized() and dist.get_world_size() > 1):
        return _load_sft_data(data_cfg, tokenizer, seq_len=seq_len, seed=seed)
    failure: BaseException | None = None
    result = None
    if dist.get_rank() == 0:
        try:
            result = _load_sft_data(data_cfg, tokenizer, seq_len=seq_len, seed=seed)
        except Exception as e:  # re-raised below, once the others are released to fail on their own
            failure = e
    dist.barrier()
    if failure is not None:
        raise failure
    if result is None:
        result = _load_sft_data(data_cfg, tokenizer, seq_len=seq_len, seed=seed)
    return result


def _load_sft_data(data_cfg: Any, tokenizer: PreTrainedTokenizerBase, *, seq_len: int, seed: int) -> SFTData:
    cols = Columns.from_config(data_cfg)
    formatter = ChatFormatter.from_config(data_cfg, tokenizer)
    kw = dict(seq_len=seq_len, max_length_policy=data_cfg.max_length_policy)

    train_rows = load_rows(data_cfg.train_file, field_name="data.train_file", cols=cols, fmt=data_cfg.format,
                           split=data_cfg.train_split)
    val: Optional[SFTExamples] = None
    if data_cfg.val_file is not None:
        train = tokenize_rows(train_rows, formatter, cols, **kw)
        val_rows = load_rows(data_cfg.val_file, field_name="data.val_file", cols=cols, fmt=data_cfg.format,
                             split=data_cfg.val_split)
        val = tokenize_rows(val_rows, formatter, cols, **kw)
        _require_examples(val, "data.val_file", data_cfg.val_file, seq_len)
    elif data_cfg.val_split_fraction > 0:
        train_idx, val_idx = split_indices(len(train_rows), data_cfg.val_split_fraction, seed)
        train = tokenize_rows(train_rows, formatter, cols, indices=train_idx, **kw)
        val = tokenize_rows(train_rows, formatter, cols, indices=val_idx, **kw)
        _require_examples(val, "data.val_split_fraction", str(data_cfg.val_split_fraction), seq_len)
    else:
        train = tokenize_rows(train_rows, formatter, cols, **kw)
    _require_examples(train, "data.train_file", data_cfg.train_file, seq_len)

    _note_reasoning_without_traces(formatter, data_cfg, train, val)
    if data_cfg.packing:
        train = pack_examples(train, seq_len, seed=seed)
        val = None if val is None else pack_examples(val, seq_len, seed=seed)
    return SFTData(train=train, val=val, formatter=describe(formatter))


def _note_reasoning_without_traces(formatter: ChatFormatter, data_cfg: Any, train: SFTExamples,
                                   val: Optional[SFTExamples]) -> None:
    """`data.reasoning` set to act on traces the data does not have: said once (by rank 0), not per row."""
    mode = formatter.policy.mode
    if mode == "train" or train.num_reasoning or (val is not None and val.num_reasoning):
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.warning(
        "data.reasoning=%s: no row of data.train_file=%r%s has a reasoning trace (<think>...</think> in an assistant "
        "turn, or a 'reasoning_content' field), so the setting changes nothing. Fix: point data.train_file at data "
        "with reasoning traces, or leave data.reasoning at train.", mode, data_cfg.train_file,
        "" if data_cfg.val_file is None else f" or data.val_file={data_cfg.val_file!r}",
    )
