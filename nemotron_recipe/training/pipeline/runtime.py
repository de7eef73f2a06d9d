"""One rank's share of a pipeline: which stages it runs, the model cut into them, and their schedule.

`Pipeline` is built once from the run's settings and meshes. `parallelize` cuts the full model at the
split's stage starts, keeps this rank's stages (one, or under interleaved 1F1B stages r, r + pp, ...),
applies the model's parallelizer to each as to a model, and returns them as one
`PipelineParts`, which the trainer holds as its model. `schedule` then gives the step's schedule, and
`next_tokens` a decoding step through it (the samples' forward).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nemotron_recipe.distributed.pipeline_layout import stage_rank
from nemotron_recipe.distributed.plan import ParallelMeshes, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.pipeline.schedule import (
    MULTI_STAGE,
    SCHEDULES,
    PipelineSchedule,
    StageShapes,
)
from nemotron_recipe.training.pipeline.stages import (
    PipelineParts,
    StageInputs,
    cut_stages,
)

log = logging.getLogger(__name__)


class Pipeline:
    """This rank's stages of a `plan.pp`-rank pipeline of `starts` (the first block of every stage)."""

    def __init__(self, *, plan: ParallelPlan, meshes: ParallelMeshes, model_config: NemotronHConfig,
                 schedule: str, virtual_stages: int, starts: list[int], loss_chunk_size: int,
                 device: torch.device) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"mesh.pp_schedule={schedule!r}: unknown. Fix: use one of {list(SCHEDULES)}.")
        self.plan, self.meshes, self.config, self.schedule_name = plan, meshes, model_config, schedule
        self.num_stages = plan.pp * virtual_stages
        if len(starts) != self.num_stages:
            raise ValueError(f"{len(starts)} stage starts for {self.num_stages} stages")
        self.starts, self.device = list(starts), device
        self.pp_rank = meshes.pp.get_local_rank()
        self.local = [s for s in range(self.num_stages) if stage_rank(s, plan.pp, schedule) == self.pp_rank]
        if len(self.local) > 1 and schedule not in MULTI_STAGE:
            raise ValueError(f"mesh.pp_schedule={schedule} runs one stage per rank, not {len(self.local)}")
        self.inputs = StageInputs(loss_chunk_size=loss_chunk_size or 0,
                                  mtp_loss_scale=model_config.effective_mtp_loss_scale, device=device)
        self.parts: PipelineParts | None = None
        self.built: PipelineSchedule | None = None

    def parallelize(self, model: NemotronHForCausalLM, parallelize_stage) -> PipelineParts:
        """The full model cut into this rank's stages, each parallelized by `parallelize_stage(stage)`."""
        stages = cut_stages(model, self.starts, self.local, self.inputs)
        stages = [parallelize_stage(stage) for stage in stages]
        self.parts = PipelineParts(model, stages)
        log.info("pipeline: rank %d of %d runs stage(s) %s: blocks %s", self.pp_rank, self.plan.pp, self.local,
                 [f"{s.blocks.start}..{s.blocks.stop - 1}" for s in stages])
        return self.parts

    def shapes(self, batch: int, length: int, train: bool) -> StageShapes:
        """The static shapes of a micro-batch of `batch` rows of `length` tokens (this rank's part of the
        sequence under context parallel)."""
        sp = self.plan.tp if self.plan.sequence_parallel else 1
        cfg = self.config
        mtp = cfg.num_nextn_predict_layers if train and cfg.effective_mtp_loss_scale > 0 else 0
        return StageShapes(batch, length, length // sp, cfg.hidden_size, self.plan.param_dtype, mtp)

    def schedule(self, balance: Any = None) -> PipelineSchedule:
        """The step's schedule over the stages `parallelize` made; validation runs through it too."""
        if self.parts is None:
            raise RuntimeError("Pipeline.schedule: parallelize the model first")
        ranks = [stage_rank(s, self.plan.pp, self.schedule_name) for s in range(self.num_stages)]
        schedule = PipelineSchedule(self.parts.stages, self.inputs, schedule=self.schedule_name,
                                    pp_group=self.meshes.pp.get_group(), stage_ranks=ranks,
                                    device=self.device, shapes=self.shapes, balance=balance)
        self.parts.run = schedule.forward_only
        self.built = schedule
        return schedule

    def next_tokens(self, input_ids: torch.Tensor, pick) -> torch.Tensor:
        """A decoding step through the stages (the samples' `Forward`): `PipelineSchedule.next_tokens`."""
        if self.built is None:
            raise RuntimeError("Pipeline.next_tokens: build the schedule first")
        return self.built.next_tokens(input_ids, pick)


def build_pipeline(cfg: Any, plan: ParallelPlan, meshes: ParallelMeshes, model_config: NemotronHConfig,
                   device: torch.device) -> Pipeline | None:
    """The run's pipeline (None with mesh.pp=1): the split `mesh.pp_split` gives, else the one balanced by
    estimated cost, printed at start."""
    if meshes.pp is None:
        return None
    from nemotron_recipe.training.pipeline.split import plan_split

    m, t = cfg.mesh, cfg.trainer
    virtual = int(m.pp_virtual_stages)
    split = plan_split(model_config, plan.pp * virtual, split_points=m.pp_split, seq_len=t.seq_len,
                       micro_batch=t.micro_batch_size)
    for line in split.describe():
        log.info("%s", line)
    return Pipeline(plan=plan, meshes=meshes, model_config=model_config, schedule=m.pp_schedule,
                    virtual_stages=virtual, starts=list(split.starts), loss_chunk_size=t.loss_chunk_size,
                    device=device)
