"""Preference pairs for DPO: rows of (prompt, chosen, rejected), rendered and tokenized as chats.

A row's `prompt` is a string (one user turn) or a list of `{role, content}` turns ending with a user
turn; `chosen` and `rejected` are each a string or a list holding one assistant turn (which may carry
`reasoning_content`). Each half of a pair is the conversation prompt + its response, rendered by the
chat formatter SFT rows use (`encode_conversation`: `data.chat_template`, `data.reasoning`); its trained
tokens are the response's, over which DPO sums log-probs.

Lengths (`data.max_length_policy`): under `truncate` a sequence longer than `trainer.seq_len` keeps
its start, so the prompt stays whole and the response is cut at the end; a pair where either half has
no response token left (its prompt fills `seq_len`) is dropped and counted (`prompt_too_long`). Under
`drop` any pair with a half longer than `seq_len` is dropped (`dropped`). Pairs whose chosen and
rejected responses are equal carry no preference and are dropped and counted (`identical`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from .chat import ChatFormatter, describe, encode_conversation
from .examples import IGNORE_INDEX, SFTExamples, shifted_targets
from .sft import split_indices
from .sources import MAX_LENGTH_POLICIES, REASONING_FIELD, Columns, DataError, Rows, _check_turns, load_rows

log = logging.getLogger(__name__)

_CHUNK = 1024


@dataclass(frozen=True)
class PreferenceColumns:
    """The columns of a preference row (`data.prompt_key`, `data.chosen_key`, `data.rejected_key`)."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    role_key: str = "role"
    content_key: str = "content"
    is_chat = False
    key_fields = "data.prompt_key/data.chosen_key/data.rejected_key"

    @property
    def required(self) -> tuple[str, ...]:
        return (self.prompt_key, self.chosen_key, self.rejected_key)

    @classmethod
    def from_config(cls, data_cfg: Any) -> "PreferenceColumns":
        return cls(data_cfg.prompt_key, data_cfg.chosen_key, data_cfg.rejected_key, data_cfg.role_key,
                   data_cfg.content_key)

    def _turns_columns(self, key: str) -> Columns:
        return Columns(messages_key=key, role_key=self.role_key, content_key=self.content_key)

    def check_row(self, row: Any, where: str) -> None:
        """Raise a `DataError` naming `where` and the key unless `row` is a well-formed pair."""
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with keys {list(self.required)}, got a JSON "
                            f"{type(row).__name__}. Fix: wrap the row as an object with those keys.")
        missing = [k for k in self.required if k not in row or row[k] is None]
        if missing:
            raise DataError(
                f"{where}: preference row missing key(s) {missing}; the row has keys {sorted(row)}. Fix: add "
                f"them, or point {self.key_fields} at the columns this file uses."
            )
        self.turns(row, self.prompt_key, where)
        for key in (self.chosen_key, self.rejected_key):
            self.turns(row, key, where)

    def turns(self, row: dict[str, Any], key: str, where: str) -> list[dict[str, str]]:
        """Row `key` as `{role, content}` turns: a prompt string is a user turn, a response string an
        assistant turn; a response list must hold exactly one assistant turn."""
        value = row[key]
        response = key != self.prompt_key
        if isinstance(value, str):
            return [{"role": "assistant" if response else "user", "content": value}]
        turns = [{"role": t[self.role_key], "content": t[self.content_key],
                  **({REASONING_FIELD: t[REASONING_FIELD]} if t.get(REASONING_FIELD) is not None else {})}
                 for t in _check_turns(value, where, self._turns_columns(key))]
        if response and (len(turns) != 1 or turns[0]["role"] != "assistant"):
            raise DataError(
                f"{where}: {key!r} must be a string or a list of one assistant turn, got roles "
                f"{[t['role'] for t in turns]}. Fix: put earlier turns in {self.prompt_key!r} and keep the "
                "one assistant reply here."
            )
        if not response and (not turns or turns[-1]["role"] != "user"):
            raise DataError(
                f"{where}: {key!r} must end with a user turn (roles {[t['role'] for t in turns]}). Fix: end the "
                f"prompt with the user's message; the reply goes in {self.chosen_key!r}/{self.rejected_key!r}."
            )
        return turns


@dataclass
class PreferencePairs:
    """Tokenized pairs: `chosen.input_ids[i]` and `rejected.input_ids[i]` are pair `i`'s halves,
    with pre-shifted targets that train the response tokens only."""

    chosen: SFTExamples = field(default_factory=lambda: SFTExamples([], []))
    rejected: SFTExamples = field(default_factory=lambda: SFTExamples([], []))
    num_truncated: int = 0  # pairs with a half cut to seq_len (its response's end)
    num_dropped: int = 0  # pairs with a half longer than seq_len, under max_length_policy=drop
    num_prompt_too_long: int = 0  # pairs where a prompt leaves no response token within seq_len
    num_identical: int = 0  # pairs with chosen equal to rejected
    _sequences: Optional[SFTExamples] = None

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def sequences(self) -> SFTExamples:
        """Every half as one list of sequences: pair `i`'s chosen is sequence `i`, its rejected `len + i`."""
        if self._sequences is None or len(self._sequences) != 2 * len(self):
            self._sequences = SFTExamples(self.chosen.input_ids + self.rejected.input_ids,
                                          self.chosen.targets + self.rejected.targets)
        return self._sequences

    def counts(self) -> dict[str, int]:
        return {"pairs": len(self), "truncated": self.num_truncated, "dropped": self.num_dropped,
                "prompt_too_long": self.num_prompt_too_long, "identical": self.num_identical}


def add_pair(out: PreferencePairs, halves: list[tuple[list[int], list[bool]]], seq_len: int, policy: str) -> None:
    """Applies the length policy to one pair's (ids, trained) halves and keeps or counts it."""
    cut = any(len(ids) > seq_len for ids, _ in halves)
    if cut and policy == "drop":
        out.num_dropped += 1
        return
    halves = [(ids[:seq_len], trained[:seq_len]) for ids, trained in halves]
    targets = [shifted_targets(ids, trained) for ids, trained in halves]
    if any(all(t == IGNORE_INDEX for t in tgt) for tgt in targets):
        out.num_prompt_too_long += 1
        return
    out.num_truncated += cut
    for examples, (ids, _), tgt in zip((out.chosen, out.rejected), halves, targets):
        examples.input_ids.append(list(ids))
        examples.targets.append(tgt)


def tokenize_pairs(rows: Rows, formatter: ChatFormatter, cols: PreferenceColumns, *, seq_len: int,
                   max_length_policy: str = "truncate", indices: list[int] | None = None) -> PreferencePairs:
    """Render and tokenize `rows` (or those at `indices`) into pairs, as the module docstring says."""
    if max_length_policy not in MAX_LENGTH_POLICIES:
        raise DataError(f"data.max_length_policy={max_length_policy!r}: use one of {list(MAX_LENGTH_POLICIES)}.")
    order = range(len(rows)) if indices is None else indices
    out = PreferencePairs()
    for _, as_rows, wheres in rows.chunks(order, tuple(cols.required), _CHUNK):
        conversations, where = [], []
        for row, w in zip(as_rows, wheres):
            prompt = cols.turns(row, cols.prompt_key, w)
            chosen, rejected = cols.turns(row, cols.chosen_key, w), cols.turns(row, cols.rejected_key, w)
            if chosen == rejected:
                out.num_identical += 1
                continue
            conversations += [prompt + chosen, prompt + rejected]
            where += [w, w]
        encoded = [encode_conversation(formatter, turns, w) for turns, w in zip(conversations, where)]
        for k in range(0, len(encoded), 2):
            add_pair(out, encoded[k: k + 2], seq_len, max_length_policy)
    return out


@dataclass
class PreferenceData:
    train: PreferencePairs
    val: Optional[PreferencePairs]
    formatter: str

    def counts(self) -> dict[str, Any]:
        return {"train": self.train.counts(), "val": None if self.val is None else self.val.counts()}

    def describe(self, seq_len: int) -> str:
        """One log line: the pairs, and what the length policy and the checks left out."""
        parts = []
        for name, pairs in (("train", self.train), ("val", self.val)):
            if pairs is None:
                parts.append(f"{name}: none")
                continue
            parts.append(
                f"{name}: {len(pairs)} preference pairs ({pairs.num_truncated} with a response cut at "
                f"seq_len={seq_len}, {pairs.num_prompt_too_long} dropped as their prompt leaves no response token "
                f"within seq_len, {pairs.num_dropped} dropped as longer, {pairs.num_identical} dropped as chosen "
                "equals rejected)"
            )
        return f"{'; '.join(parts)}; {self.formatter}"


def _require_pairs(pairs: PreferencePairs, field_name: str, value: str, seq_len: int) -> None:
    if pairs.num_identical:
        log.warning("%s=%r: %d pair(s) have chosen equal to rejected and carry no preference; they are skipped",
                    field_name, value, pairs.num_identical)
    if pairs.num_prompt_too_long:
        log.warning("%s=%r: %d pair(s) dropped: their prompt leaves no response token within trainer.seq_len=%d "
                    "(responses are cut at the end, prompts are kept whole)", field_name, value,
                    pairs.num_prompt_too_long, seq_len)
    if len(pairs):
        return
    raise DataError(
        f"{field_name}={value!r}: no preference pair is left to train on: {pairs.num_prompt_too_long} have a prompt "
        f"that fills trainer.seq_len={seq_len}, {pairs.num_dropped} were dropped as longer and "
        f"{pairs.num_identical} have chosen equal to rejected. Fix: raise trainer.seq_len, shorten the prompts, "
        "or set data.max_length_policy=truncate."
    )


def load_preference_data(data_cfg: Any, tokenizer: PreTrainedTokenizerBase, *, seq_len: int,
                         seed: int) -> PreferenceData:
    """Train and validation pairs as the `data` config says (`data.format=preference`)."""
    cols = PreferenceColumns.from_config(data_cfg)
    # The response is the final assistant turn: the chat template and the reasoning options apply as in SFT.
    formatter = ChatFormatter(tokenizer, template=data_cfg.chat_template, train_on="last_assistant",
                              reasoning=data_cfg.reasoning, train_empty_think=data_cfg.train_empty_think)
    kw = dict(seq_len=seq_len, max_length_policy=data_cfg.max_length_policy)
    train_rows = load_rows(data_cfg.train_file, field_name="data.train_file", cols=cols, split=data_cfg.train_split)
    val: Optional[PreferencePairs] = None
    if data_cfg.val_file is not None:
        train = tokenize_pairs(train_rows, formatter, cols, **kw)
        val_rows = load_rows(data_cfg.val_file, field_name="data.val_file", cols=cols, split=data_cfg.val_split)
        val = tokenize_pairs(val_rows, formatter, cols, **kw)
        _require_pairs(val, "data.val_file", data_cfg.val_file, seq_len)
    elif data_cfg.val_split_fraction > 0:
        train_idx, val_idx = split_indices(len(train_rows), data_cfg.val_split_fraction, seed)
        train = tokenize_pairs(train_rows, formatter, cols, indices=train_idx, **kw)
        val = tokenize_pairs(train_rows, formatter, cols, indices=val_idx, **kw)
        _require_pairs(val, "data.val_split_fraction", str(data_cfg.val_split_fraction), seq_len)
    else:
        train = tokenize_pairs(train_rows, formatter, cols, **kw)
    _require_pairs(train, "data.train_file", data_cfg.train_file, seq_len)
    return PreferenceData(train=train, val=val, formatter=describe(formatter))
