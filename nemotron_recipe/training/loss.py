"""Token-sum cross-entropy that works on plain, replicated and vocab-sharded (DTensor) logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from nemotron_recipe.distributed.tensor_parallel import vocab_parallel_cross_entropy

IGNORE_INDEX = -100


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    if not isinstance(logits, DTensor):
        return False
    vocab_dim = logits.ndim - 1
    return any(isinstance(p, Shard) and p.dim % logits.ndim == vocab_dim for p in logits.placements)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding `t`'s full value (a DTensor scalar loss is replicated or partial)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of per-token losses, number of trained tokens) for pre-shifted `targets`.

    `logits` is [batch, seq, vocab]; `targets[b, t]` is the token to predict at position t, or
    `ignore_index`. Summing (rather than averaging) lets the caller divide by the global token
    count of the whole step, which keeps the loss independent of how the batch was split.
    Vocab-sharded DTensor logits stay sharded: the loss runs on their shards.
    """
    targets = targets.to(logits.device)
    count = (targets != ignore_index).sum()
    if is_vocab_sharded(logits):
        return vocab_parallel_cross_entropy(logits, targets, ignore_index).sum(), count
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = F.cross_entropy(
        logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return loss, count


@dataclass
class LossSums:
    """A micro-batch's token-summed losses: the main one, its trained tokens, and the MTP layers'
    (summed over tokens, averaged over depths; None when no MTP layer ran)."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    mtp_loss_sum: torch.Tensor | None = None


def forward_loss_sums(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    loss_chunk_size: int | None = None,
    backward_denominator: float | None = None,
    mtp: tuple[torch.Tensor, torch.Tensor] | None = None,
    mtp_loss_scale: float = 0.0,
    token_mask: torch.Tensor | None = None,
) -> LossSums:
    """One micro-batch's losses; with `backward_denominator`, also back-propagates
    (loss_sum + mtp_loss_scale * mtp_loss_sum) / backward_denominator.

    `loss_chunk_size` (tokens; 0 or None: off) lets the model compute the loss chunk by chunk
    without full logits. A model whose head is tensor-parallel returns vocab-sharded logits instead,
    and the loss then takes the plain path. `mtp`: the MTP layers' (input ids, targets), each
    [b, l, depths], shifted from the whole sequences (`models.nemotron_v3.mtp.shift_for_mtp`).
    `token_mask` (false at padding), for models with MoE balance losses.
    """
    kwargs = {} if document_ids is None else {"document_ids": document_ids}
    if token_mask is not None:
        kwargs["token_mask"] = token_mask
    # A pipeline's model computes its loss on the last stage and returns no logits: it always takes targets.
    if loss_chunk_size or getattr(model, "returns_loss_sums", False):
        kwargs.update(targets=targets, loss_chunk_size=loss_chunk_size or 0)
    if mtp is not None:
        kwargs.update(targets=targets, mtp_input_ids=mtp[0], mtp_targets=mtp[1])
    out = model(input_ids, **kwargs)
    if getattr(out, "loss_sum", None) is not None:
        sums = LossSums(out.loss_sum, out.num_tokens)
    else:
        sums = LossSums(*cross_entropy_sum(out.logits, targets))
    sums.mtp_loss_sum = getattr(out, "mtp_loss_sum", None)
    if backward_denominator is not None:
        total = sums.loss_sum
        if sums.mtp_loss_sum is not None:
            total = total + mtp_loss_scale * sums.mtp_loss_sum
        (total / backward_denominator).backward()
    return sums


def forward_loss_sum(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    loss_chunk_size: int | None = None,
    backward_denominator: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's (loss sum, trained tokens) of the main head (`forward_loss_sums` without MTP)."""
    sums = forward_loss_sums(model, input_ids, targets, document_ids=document_ids, loss_chunk_size=loss_chunk_size,
                             backward_denominator=backward_denominator)
    return sums.loss_sum, sums.count
