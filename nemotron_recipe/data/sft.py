"""Prompt/response JSONL loading, validation and tokenization for supervised fine-tuning."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100

# Role markers wrap the prompt when the tokenizer knows them, which gives the model an
# unambiguous prompt/response boundary. Tokenizers without them get plain concatenation.
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"


class DataError(ValueError):
    """A data file is missing or malformed; the message says where and how to fix it."""


@dataclass
class SFTExamples:
    """Tokenized SFT rows.

    ``targets[i][t]`` is the token to predict at position ``t`` of ``input_ids[i]`` (already
    shifted by one), or ``IGNORE_INDEX`` where no loss is taken.
    """

    input_ids: list[list[int]]
    targets: list[list[int]]
    num_truncated: int = 0
    num_skipped: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    # Every rank loads the file, so per-load progress bars would flood the logs.
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def _validate_jsonl(path: Path, *, field_name: str, required_keys: tuple[str, ...]) -> None:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(
            f"{field_name}={str(path)!r}: {what}. Set {field_name} to a JSONL file with one "
            f"{{{', '.join(repr(k) + ': ...' for k in required_keys)}}} object per line "
            "(relative paths resolve against the launch directory)."
        )
    num_rows = 0
    with open(path, encoding="utf-8") as f:
        line_no = 0
        while True:
            line_no += 1
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid UTF-8 ({e}). Re-encode the file as UTF-8.") from e
            if not line:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno}). "
                    "Each line must be one complete JSON object; fix or remove this line."
                ) from e
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}:{line_no}: expected a JSON object with keys {list(required_keys)}, "
                    f"got a JSON {type(row).__name__}. Wrap the line as an object with those keys."
                )
            missing = [k for k in required_keys if k not in row]
            if missing:
                raise DataError(
                    f"{path}:{line_no}: missing key(s) {missing}; the row has keys {sorted(row)}. "
                    f"Add the missing key(s), or point the prompt/response key settings at the "
                    f"columns this file uses."
                )
            for key in required_keys:
                if not isinstance(row[key], str):
                    raise DataError(
                        f"{path}:{line_no}: {key!r} must be a string, got {type(row[key]).__name__} "
                        f"({row[key]!r:.60}). Store the text as a JSON string."
                    )
            num_rows += 1
    if num_rows == 0:
        raise DataError(
            f"{field_name}={str(path)!r}: the file has no rows. Fill it with one JSON object per "
            f"line with keys {list(required_keys)}, or point {field_name} at another file."
        )


def read_jsonl_rows(
    path: str | Path,
    *,
    field_name: str,
    prompt_key: str = "prompt",
    response_key: str = "response",
) -> datasets.Dataset:
    """Validate a prompt/response JSONL file line by line, then load it with ``datasets``.

    Validation comes first because ``datasets``/pyarrow report malformed input without the
    line number or the offending keys. ``field_name`` is the config field the path came from,
    so errors tell the user which setting to change.
    """
    p = Path(path).expanduser()
    _validate_jsonl(p, field_name=field_name, required_keys=(prompt_key, response_key))
    with _quiet_datasets():
        return datasets.load_dataset("json", data_files=str(p), split="train")


def _role_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    vocab = tokenizer.get_vocab()
    if USER_TOKEN in vocab and ASSISTANT_TOKEN in vocab:
        return [vocab[USER_TOKEN]], [vocab[ASSISTANT_TOKEN]]
    return [], []


def tokenize_sft(
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str,
    response_key: str,
    seq_len: int,
) -> SFTExamples:
    """Tokenize prompt/response rows into fixed-role sequences with pre-shifted targets.

    Layout: ``[BOS] [<|user|>] prompt [<|assistant|>] response EOS`` (bracketed parts only when
    the tokenizer has them), right-truncated to ``seq_len``. Only response tokens and the EOS
    are predicted. Rows whose truncation leaves nothing to predict are skipped and counted.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 to hold one input and one target, got {seq_len}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer defines no EOS token; SFT sequences must end with EOS")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    user, assistant = _role_ids(tokenizer)

    prompts = list(dataset[prompt_key])
    responses = list(dataset[response_key])
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"] if responses else []

    out = SFTExamples(input_ids=[], targets=[])
    for p_ids, r_ids in zip(prompt_ids, response_ids):
        head = bos + user + p_ids + assistant
        ids = head + r_ids + [eos]
        if len(ids) > seq_len:
            ids = ids[:seq_len]
            out.num_truncated += 1
        # Position t predicts ids[t + 1]; it is trained only when that token is past the prompt.
        first_trained = max(len(head) - 1, 0)
        if first_trained >= len(ids) - 1:
            out.num_skipped += 1
            continue
        targets = [IGNORE_INDEX] * first_trained + ids[first_trained + 1 :] + [IGNORE_INDEX]
        out.input_ids.append(ids)
        out.targets.append(targets)
    return out


def load_sft_examples(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    seq_len: int,
    field_name: str = "data.train_file",
) -> SFTExamples:
    """Validate, load and tokenize one prompt/response JSONL file."""
    dataset = read_jsonl_rows(path, field_name=field_name, prompt_key=prompt_key, response_key=response_key)
    examples = tokenize_sft(dataset, tokenizer, prompt_key=prompt_key, response_key=response_key, seq_len=seq_len)
    if len(examples) == 0:
        raise DataError(
            f"{field_name}={str(path)!r}: all {examples.num_skipped} rows were skipped because their "
            f"prompts fill the whole sequence of {seq_len} tokens, leaving no response token to train on. "
            "Increase the sequence length (trainer.seq_len) or shorten the prompts."
        )
    return examples
