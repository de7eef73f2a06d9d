"""Multi-token prediction (MTP) inputs: each depth's input tokens and targets, shifted from the
whole sequences (the MTP layers are blocks of `model.py`).

They are made before the sequence is split over context-parallel ranks (`shift_for_mtp`): a rank's
zig-zag part of the sequence does not hold the tokens that follow its own.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """t [b, l] moved k positions to the left, the last k filled with `fill`."""
    out = torch.full_like(t, fill)
    n = max(t.shape[1] - k, 0)
    out[:, :n] = t[:, k:k + n]
    return out


def shift_for_mtp(
    input_ids: torch.Tensor, targets: torch.Tensor, depths: int, document_ids: torch.Tensor | None = None,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each depth's input tokens and targets, [b, l, depths] each, from whole sequences.

    `targets` are pre-shifted (targets[t] is token t+1, or IGNORE_INDEX), so depth k's target at t is
    targets[t+k], token t+1+k. A target past the end of the row or in another packed document than
    position t is IGNORE_INDEX; the input token there is `pad_id` (never the source of a trained target).
    """
    ids, tgts = [], []
    for k in range(1, depths + 1):
        tgt = _shift_left(targets, k, IGNORE_INDEX)
        if document_ids is not None:
            tgt = tgt.masked_fill(_shift_left(document_ids, k, -1) != document_ids, IGNORE_INDEX)
        ids.append(_shift_left(input_ids, k, pad_id))
        tgts.append(tgt)
    return torch.stack(ids, dim=-1), torch.stack(tgts, dim=-1)
