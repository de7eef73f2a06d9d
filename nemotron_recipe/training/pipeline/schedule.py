"""How a step's micro-batches run: the seam between the trainer's step and the model's stages.

`train_step` hands its micro-batches and the objective's step context to one schedule object and gets
back each micro-batch's loss sums, whatever runs them:
- `MicroBatchLoop`, the one-stage schedule: each micro-batch's forward and backward in turn on this
  rank's whole model (the objective's `forward_backward`);
- `PipelineSchedule`: the micro-batches flow through the pipeline's stages under one of
  `torch.distributed.pipelining`'s schedules (`SCHEDULES`: GPipe, 1F1B, interleaved 1F1B); the last stage computes the losses, which
  are then handed to every stage so that metrics, the non-finite guard and the step's sums read alike
  on every rank.

The pipeline's stages are built for static shapes: every micro-batch is padded to `trainer.seq_len`
(padding is never trained on and the model is causal, so the losses are unchanged). Each schedule object
is built once per micro-batch shape, and the training one once per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from nemotron_recipe.training.loss import IGNORE_INDEX
from nemotron_recipe.training.pipeline.stages import (
    LAST_STAGE_OUTPUTS,
    PipelineStageModel,
    StageInputs,
)

# `zbv` (ScheduleZBVZeroBubble) is refused before the run (training.pipeline.limits).
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
MULTI_STAGE = ("interleaved_1f1b",)


class MicroBatchLoop:
    """The one-stage schedule: each micro-batch's forward and backward on this rank's whole model,
    the expert loads counted after each."""

    def __init__(self, forward_backward: Callable[[dict, Any], tuple[torch.Tensor, Any]], balance: Any) -> None:
        self.forward_backward, self.balance = forward_backward, balance

    def run(self, micro_batches: list[dict[str, torch.Tensor]], context: Any) -> tuple[list, list]:
        losses, extras = [], []
        for batch in micro_batches:
            loss, extra = self.forward_backward(batch, context)
            if self.balance:
                self.balance.after_micro_batch()
            losses.append(loss)
            extras.append(extra)
        return losses, extras


@dataclass(frozen=True)
class StageShapes:
    """What travels between stages for one micro-batch shape: input ids [b, l] into the first stage,
    the residual stream [b, l_act, d] (l_act: this rank's part of the sequence under sequence
    parallel) and, with MTP layers in training, the shifted tokens' embeddings [b, l_act, depths, d]."""

    batch: int
    length: int
    activation_length: int
    hidden: int
    dtype: torch.dtype
    mtp_depths: int = 0

    def inputs(self, stage: PipelineStageModel) -> tuple[torch.Tensor, ...]:
        if stage.is_first:
            return (torch.empty(self.batch, self.length, dtype=torch.long, device="meta"),)
        return self._activations()

    def outputs(self, stage: PipelineStageModel) -> tuple[torch.Tensor, ...]:
        if stage.is_last:
            return (torch.empty(LAST_STAGE_OUTPUTS, dtype=torch.float32, device="meta"),)
        return self._activations()

    def _activations(self) -> tuple[torch.Tensor, ...]:
        shape = (self.batch, self.activation_length, self.hidden)
        out = [torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)]
        if self.mtp_depths:
            out.append(torch.empty(*shape[:2], self.mtp_depths, shape[2], dtype=self.dtype, device="meta",
                                   requires_grad=True))
        return tuple(out)


def _objective_share(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: the last stage's output already holds the micro-batch's normalised share."""
    return output[0]


class PipelineSchedule:
    """Runs a step's micro-batches through this rank's stages, and one batch forward-only (validation)."""

    def __init__(self, stages: list[PipelineStageModel], inputs: StageInputs, *, schedule: str, pp_group: Any,
                 stage_ranks: list[int], device: torch.device, shapes: Callable[[int, int, bool], StageShapes],
                 balance: Any = None) -> None:
        self.stages, self.inputs, self.name = stages, inputs, schedule
        self.pp_group, self.device, self.shapes = pp_group, device, shapes
        # The global rank of each stage's holder in this rank's pipeline.
        self.ranks = [dist.get_global_rank(pp_group, r) for r in stage_ranks]
        self.last_rank = self.ranks[-1]
        self.first = any(s.is_first for s in stages)
        self.balance = balance
        inputs.after_forward = self._after_forward if balance else None
        self._built: dict[tuple, Any] = {}

    def _after_forward(self, stage: PipelineStageModel) -> None:
        self.balance.after_micro_batch(stage)

    def _schedule(self, n: int, batch: int, length: int):
        key = (n, batch, length)
        if key not in self._built:
            shapes = self.shapes(batch, length, True)
            pipeline_stages = [
                PipelineStage(s, s.stage_index, s.num_stages, self.device, input_args=shapes.inputs(s),
                              output_args=shapes.outputs(s), group=self.pp_group)
                for s in self.stages
            ]
            stages = pipeline_stages if self.name in MULTI_STAGE else pipeline_stages[0]
            self._built[key] = SCHEDULES[self.name](stages, n, loss_fn=_objective_share, scale_grads=False)
        return self._built[key]

    @torch.no_grad()
    def _forward_pass(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """One batch through every stage in order, forward only (validation, decoding): each rank runs its
        stages and sends their outputs to the next stage's rank, whatever the schedule's placement.
        Returns the last stage's output on the rank that holds it, else None."""
        shapes = self.shapes(*batch["input_ids"].shape, False)
        held = {s.stage_index: s for s in self.stages}
        carried: tuple[torch.Tensor, ...] = ()
        for index, rank in enumerate(self.ranks):
            stage = held.get(index)
            if stage is None:
                continue
            if index == 0:
                carried = (batch["input_ids"].to(self.device),)
            elif index - 1 not in held:
                carried = tuple(torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in shapes.inputs(stage))
                for t in carried:
                    dist.recv(t, src=self.ranks[index - 1], group=self.pp_group)
            out = stage(*carried)
            carried = out if isinstance(out, tuple) else (out,)
            if index + 1 < len(self.ranks) and index + 1 not in held:
                for t in carried:
                    dist.send(t.contiguous(), dst=self.ranks[index + 1], group=self.pp_group)
        return carried if len(self.ranks) - 1 in held else None

    def _step(self, batches: list[dict[str, torch.Tensor]], *, train: bool) -> torch.Tensor:
        """Runs `batches` through the stages; returns [micro-batches, 2] (loss sum, MTP loss sum) of each,
        the same on every stage."""
        if train:
            schedule = self._schedule(len(batches), *batches[0]["input_ids"].shape)
            ids = torch.cat([b["input_ids"] for b in batches]).to(self.device)
            target = torch.zeros(len(batches), device=self.device)
            schedule.step(*((ids,) if self.first else ()), target=target, return_outputs=False)
        else:
            for batch in batches:
                self._forward_pass(batch)
        sums = torch.zeros(len(batches), 2, dtype=torch.float32, device=self.device)
        if self.inputs.sums:
            for index, (main, mtp) in self.inputs.sums.items():
                sums[index, 0] = main
                sums[index, 1] = 0.0 if mtp is None else mtp
        dist.broadcast(sums, src=self.last_rank, group=self.pp_group)
        return sums

    def run(self, micro_batches: list[dict[str, torch.Tensor]], context: Any) -> tuple[list, list]:
        """The step's micro-batches (the objective's, padded to one length) through the pipeline; returns
        each one's loss sum and MTP loss sum (None without MTP training), as the objective's
        `forward_backward` would."""
        self.inputs.start(micro_batches, context)
        sums = self._step(micro_batches, train=True)
        mtp = self.inputs.mtp_loss_scale > 0 and any("mtp_input_ids" in b for b in micro_batches)
        return list(sums[:, 0]), [row if mtp else None for row in sums[:, 1]]

    def forward_only(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                     loss_chunk_size: int | None = None, **_: Any) -> SimpleNamespace:
        """One batch's loss sum and trained tokens, forward only (the model's `loss_sum` output)."""
        if targets is None:
            raise ValueError("a pipeline-parallel model returns loss sums, not logits: pass targets")
        batch = {"input_ids": input_ids, "targets": targets}
        if document_ids is not None:
            batch["document_ids"] = document_ids
        if token_mask is not None:
            batch["token_mask"] = token_mask
        self.inputs.start([batch], 1)
        sums = self._step([batch], train=False)
        return SimpleNamespace(logits=None, loss_sum=sums[0, 0], num_tokens=(targets != IGNORE_INDEX).sum(),
                               mtp_loss_sum=None)

    def next_tokens(self, input_ids: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One decoding step: `input_ids` [b, l] through the stages, forward only; the last stage's rank
        turns its logits into each row's next token with `pick` (-> [b] ids, the same on every rank of
        that stage's tensor- and context-parallel groups) and sends them to every stage, so the whole
        pipeline continues alike. Same signature as `samples.model_forward`'s step."""
        self.inputs.start([{"input_ids": input_ids}], 1)
        out = self._forward_pass({"input_ids": input_ids})
        ids = torch.empty(input_ids.shape[0], dtype=torch.long, device=self.device)
        if out is not None:
            ids.copy_(pick(out[0]))
        dist.broadcast(ids, src=self.last_rank, group=self.pp_group)
        return ids
