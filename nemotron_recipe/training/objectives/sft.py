"""Supervised fine-tuning: next-token cross-entropy over the trained tokens.

Loss normalisation: every optimizer step covers a fixed global batch. Its number of trained tokens
is summed over every rank that holds different tokens (data- and context-parallel ranks) before any
backward pass, and each micro-batch back-propagates (sum of its token losses) / (that global count).
With the parallelizer summing gradients over those ranks, loss and gradients are those of one big
batch, whatever the mesh, micro-batch size or padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nemotron_recipe.data import SFTData, collate, val_batches
from nemotron_recipe.models.nemotron_v3.model import MoE
from nemotron_recipe.models.nemotron_v3.mtp import shift_for_mtp
from nemotron_recipe.training.loss import IGNORE_INDEX, forward_loss_sum, forward_loss_sums, local_value
from nemotron_recipe.training.objectives.protocol import StepSums
from nemotron_recipe.training.setup import DataLayout


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Any,
    *,
    max_batches: int | None,
    device: torch.device,
    layout: DataLayout,
    loss_chunk_size: int | None = None,
) -> float:
    """Token-weighted mean loss over this rank's batches and every other rank's tokens."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, trained tokens]
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            docs = batch.get("document_ids")  # only packed data has them
            loss_sum, count = forward_loss_sum(
                model, layout.shard(batch["input_ids"]).to(device), layout.shard(batch["targets"]).to(device),
                document_ids=None if docs is None else layout.shard(docs).to(device), loss_chunk_size=loss_chunk_size,
            )
            totals[0] += local_value(loss_sum).double()
            totals[1] += count.double()
    finally:
        model.train()
    all_reduce_sum(totals, layout.token_group)
    return (totals[0] / totals[1].clamp(min=1)).item()


class SFTObjective:
    """Token-summed cross-entropy (plus the MTP layers' and the MoE balance loss, when trained)."""

    sequences_per_example = 1

    def __init__(self, *, cfg: Any, model: torch.nn.Module, data: SFTData, layout: DataLayout,
                 device: torch.device, pad_id: int, seq_len_divisor: int, mtp_depths: int,
                 mtp_loss_scale: float, **_: Any) -> None:
        self.cfg, self.model, self.data, self.layout, self.device = cfg, model, data, layout, device
        self.pad_id, self.divisor = pad_id, seq_len_divisor
        self.mtp_depths, self.mtp_loss_scale = mtp_depths, mtp_loss_scale
        self.seq_len, self.loss_chunk_size = cfg.trainer.seq_len, cfg.trainer.loss_chunk_size
        # The MoE balance loss and expert loads leave padding out.
        self.needs_token_mask = any(isinstance(m, MoE) for m in model.modules())
        self.val_data = None
        if data.val is not None:
            self.val_data = val_batches(data.val, cfg.trainer.micro_batch_size, layout.dp_rank, layout.dp_size,
                                        self.seq_len, pad_id, seq_len_divisor)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of the examples at `indices`, padded to its longest row (rounded up so the
        sequence splits over the cp/sp ranks, which read the same rows), cut to this rank's part."""
        batch = collate(self.data.train, indices, self.seq_len, self.pad_id, self.divisor)
        if self.mtp_depths:  # shifted before the sequence is split: a cp rank lacks the tokens after its own
            batch["mtp_input_ids"], batch["mtp_targets"] = shift_for_mtp(
                batch["input_ids"], batch["targets"], self.mtp_depths, batch.get("document_ids"), self.pad_id)
        if self.needs_token_mask:
            lengths = torch.tensor([len(self.data.train.input_ids[i]) for i in indices])
            batch["token_mask"] = torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]
        return {k: self.layout.shard(v) for k, v in batch.items()}

    def real_tokens(self, indices: list[int]) -> int:
        return sum(len(self.data.train.input_ids[i]) for i in indices)

    def begin_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> int:
        """The step's trained tokens summed over every rank that holds different tokens."""
        local = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in micro_batches)
        counts = torch.tensor([local], dtype=torch.int64, device=self.device)
        return int(all_reduce_sum(counts, self.layout.token_group).item())

    def mtp_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if "mtp_input_ids" not in batch:
            return None
        return batch["mtp_input_ids"].to(self.device), batch["mtp_targets"].to(self.device)

    def forward_backward(
        self, batch: dict[str, torch.Tensor], trained_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Back-propagates the micro-batch's (loss sum + mtp_loss_scale * MTP loss sum) / the step's
        trained tokens; returns this rank's loss sum and MTP loss sum (None without MTP training)."""
        device = self.device
        # Packed batches carry document_ids (already sharded like the inputs); others run the model's
        # single-document path.
        docs = batch.get("document_ids")
        sums = forward_loss_sums(
            self.model, batch["input_ids"].to(device), batch["targets"].to(device),
            document_ids=None if docs is None else docs.to(device),
            loss_chunk_size=self.loss_chunk_size, backward_denominator=max(trained_tokens, 1),
            mtp=self.mtp_inputs(batch), mtp_loss_scale=self.mtp_loss_scale,
            token_mask=batch["token_mask"].to(device) if "token_mask" in batch else None,
        )
        mtp = None if sums.mtp_loss_sum is None else local_value(sums.mtp_loss_sum.detach()).float()
        return local_value(sums.loss_sum.detach()).float(), mtp

    def finish_step(self, losses: list[torch.Tensor], extras: list[Any], trained_tokens: int) -> StepSums:
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        mtp_loss_sum = torch.zeros_like(loss_sum) if self.mtp_depths else None
        for main, mtp in zip(losses, extras):
            loss_sum += main
            if mtp_loss_sum is not None:
                mtp_loss_sum += mtp
        return StepSums(loss_sum, trained_tokens, mtp_loss_sum)

    def finite_value(self, sums: StepSums) -> torch.Tensor:
        return sums.loss_sum if sums.extra is None else sums.loss_sum + sums.extra

    def row(self, sums: StepSums) -> dict[str, float]:
        """The loss per trained token over the global batch (and the MTP layers', when trained)."""
        stacked = sums.loss_sum if sums.extra is None else torch.stack([sums.loss_sum, sums.extra])
        losses = all_reduce_sum(stacked, self.layout.token_group) / max(sums.trained_tokens, 1)
        row = {"loss": losses.flatten()[0].item()}
        if sums.extra is not None:
            row["mtp_loss"] = losses[1].item()
        return row

    def validate(self, max_batches: int | None) -> dict[str, float] | None:
        if self.val_data is None:
            return None
        return {"val_loss": evaluate(self.model, self.val_data, max_batches=max_batches, device=self.device,
                                     layout=self.layout, loss_chunk_size=self.loss_chunk_size)}
