"""Tokenized SFT examples, the unit that batching and packing work on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

IGNORE_INDEX = -100


def shifted_targets(ids: list[int], trained: list[bool]) -> list[int]:
    """Position t predicts ids[t + 1], and is trained when that token is; the last position never is."""
    return [nxt if keep else IGNORE_INDEX for nxt, keep in zip(ids[1:], trained[1:])] + [IGNORE_INDEX]


@dataclass
class SFTExamples:
    """Tokenized SFT sequences.

    ``targets[i][t]`` is the token to predict at position ``t`` of ``input_ids[i]`` (already
    shifted by one), or ``IGNORE_INDEX`` where no loss is taken; the last position of every
    document is always ``IGNORE_INDEX``. ``document_lengths[i]``, set once examples are packed,
    lists the lengths of the documents laid end to end in sequence ``i``.
    Counts: rows cut to ``seq_len`` (``num_truncated``), rows longer than ``seq_len`` left out
    under ``data.max_length_policy=drop`` (``num_dropped``), rows with no trained token left out
    (``num_skipped``: no assistant turn, or a prompt filling the whole sequence), and rows whose
    assistant turns carry a reasoning trace (``num_reasoning``, counted before any is left out).
    """

    input_ids: list[list[int]]
    targets: list[list[int]]
    num_truncated: int = 0
    num_skipped: int = 0
    num_dropped: int = 0
    num_reasoning: int = 0
    document_lengths: Optional[list[list[int]]] = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def packed(self) -> bool:
        return self.document_lengths is not None

    @property
    def num_documents(self) -> int:
        if self.document_lengths is None:
            return len(self.input_ids)
        return sum(len(lengths) for lengths in self.document_lengths)

    def counts(self) -> dict[str, int]:
        return {
            "documents": self.num_documents,
            "sequences": len(self),
            "truncated": self.num_truncated,
            "dropped": self.num_dropped,
            "skipped": self.num_skipped,
            "with_reasoning": self.num_reasoning,
        }
