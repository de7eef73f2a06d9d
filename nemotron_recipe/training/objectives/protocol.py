"""The contract between the trainer and an objective: the `Objective` protocol and the sums a step leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class StepSums:
    """A step's local (this rank's) sums, detached, as an objective's `finish_step` leaves them.

    `loss_sum`: the value the non-finite guard checks and the row's loss is made of. `extra`:
    whatever else the objective reduces into its row (MTP sums, DPO rewards). `trained_tokens`:
    the step's trained tokens over every rank, for the throughput."""

    loss_sum: torch.Tensor
    trained_tokens: int
    extra: Any = None


class Objective(Protocol):
    """The training objective; every method is called on every rank in the same order."""

    # Sequences in one example (one row of the batch plan): 1 for SFT, 2 (chosen, rejected) for DPO.
    sequences_per_example: int

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the training examples at `indices`, sharded over the sequence."""

    def real_tokens(self, indices: list[int]) -> int:
        """The unpadded tokens of the training examples at `indices` (every sequence of each)."""

    def begin_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> Any:
        """The step's global normalisers (a collective), before any micro-batch runs."""

    def forward_backward(self, batch: dict[str, torch.Tensor], context: Any) -> tuple[torch.Tensor, Any]:
        """Forward and backward of one micro-batch; returns its local loss sum and objective sums."""

    def finish_step(self, losses: list[torch.Tensor], extras: list[Any], context: Any) -> StepSums:
        """The step's sums from its micro-batches' results."""

    def finite_value(self, sums: StepSums) -> torch.Tensor:
        """What must be finite for the step to be taken."""

    def row(self, sums: StepSums) -> dict[str, float]:
        """The step's metrics (a collective over the ranks holding different data): `loss` and more."""

    def validate(self, max_batches: int | None) -> dict[str, float] | None:
        """A validation pass over this rank's validation batches (`val_loss` and more); None without data."""
