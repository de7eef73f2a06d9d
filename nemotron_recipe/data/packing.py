"""Packing: several short documents laid end to end in one `seq_len` sequence.

Padding is compute spent on nothing; SFT rows are often far shorter than `seq_len`, so packing
them cuts the number of sequences (and steps per epoch) several-fold. The model keeps packed
documents apart through `document_ids` (Mamba conv/scan state and attention reset at every
document start), and each document's last target is already ignored, so no loss crosses a
boundary: a packed batch trains exactly like its documents run one by one.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch

from .examples import SFTExamples

# A bin with less room than this can take no document (each has at least one input and one target).
_MIN_DOCUMENT = 2


def pack_examples(examples: SFTExamples, seq_len: int, *, seed: int) -> SFTExamples:
    """Best-fit packing of `examples` into sequences of at most `seq_len` tokens.

    Documents are visited in a seeded random order (so one sequence mixes unrelated rows, the
    same on every rank and every run with that seed), and each goes into the sequence with the
    least room that still fits it, or opens a new one. Counts carry over; `len()` becomes the number
    of packed sequences, `num_documents` stays the number of documents.
    """
    if examples.packed:
        raise ValueError("these examples are already packed")
    lengths = [len(ids) for ids in examples.input_ids]
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(
            f"example {too_long[0]} has {lengths[too_long[0]]} tokens but seq_len is {seq_len}; tokenize with "
            "the seq_len that examples are packed to"
        )
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed + 104729)).tolist()
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin), sorted, only bins that can take a document
    for i in order:
        k = bisect_left(room, (lengths[i], -1))
        if k < len(room):
            free, b = room.pop(k)
            bins[b].append(i)
        else:
            free, b = seq_len, len(bins)
            bins.append([i])
        free -= lengths[i]
        if free >= _MIN_DOCUMENT:
            insort(room, (free, b))

    out = SFTExamples(
        input_ids=[], targets=[], num_truncated=examples.num_truncated, num_skipped=examples.num_skipped,
        num_dropped=examples.num_dropped, num_reasoning=examples.num_reasoning, document_lengths=[],
    )
    for members in bins:
        out.input_ids.append([tok for i in members for tok in examples.input_ids[i]])
        out.targets.append([tok for i in members for tok in examples.targets[i]])
        out.document_lengths.append([lengths[i] for i in members])
    return out
