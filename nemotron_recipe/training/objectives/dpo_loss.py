"""DPO's arithmetic: response log-probs of whole sequences, and the pair losses and rewards.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y|x) summed over the response tokens,
the policy's and the reference's log-ratios give

    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
    sigmoid: loss = -(1 - ls) * log sigmoid(beta * h) - ls * log sigmoid(-beta * h)   (ls: label_smoothing)
    ipo:     loss = (h - 1 / (2 * beta))^2

and the rewards beta * (log pi(y|x) - log ref(y|x)) of each half (Rafailov et al. 2023; Azar et al.
2023 for IPO, here on summed log-probs as for sigmoid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nemotron_recipe.config import DPO_LOSSES
from nemotron_recipe.distributed.tensor_parallel import vocab_parallel_cross_entropy
from nemotron_recipe.training.loss import IGNORE_INDEX, is_vocab_sharded



class _SumOverSequenceRanks(torch.autograd.Function):
    """The sum of each rank's part of a per-sequence total over the context-parallel ranks. Every
    rank then computes the same pair losses and back-propagates them into its own tokens only: the
    gradient passes through unchanged, and the ranks' parameter gradients add up to the whole one."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows, length] log-probs of the pre-shifted `targets` (0 where ignored); vocab-sharded logits
    stay sharded."""
    rows, length = targets.shape
    targets = targets.to(logits.device)
    if is_vocab_sharded(logits):
        return -vocab_parallel_cross_entropy(logits, targets).view(rows, length)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    nll = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none")
    return -nll.view(rows, length)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, cp_group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """[rows] log-probs of each row's trained (response) tokens, summed; over the context-parallel
    ranks too when the sequence is split over them (`cp_group`)."""
    sums = token_logps(logits, targets).sum(-1)
    if cp_group is not None:
        sums = _SumOverSequenceRanks.apply(sums, cp_group)
    return sums


@dataclass
class PairTerms:
    """Per pair: the loss and the two halves' rewards."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, *, beta: float, loss: str = "sigmoid",
                    label_smoothing: float = 0.0) -> PairTerms:
    """The per-pair DPO losses and rewards of summed response log-probs (module docstring)."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"objective.loss={loss!r}: unknown. Fix: use one of {list(DPO_LOSSES)}.")
    return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
