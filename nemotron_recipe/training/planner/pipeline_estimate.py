"""One pipeline-parallel launch: each pipeline rank's memory, the bytes between stages and the step's floor.

Every rank of a stage holds its stages' blocks (the first the embedding, the last the final norm, lm_head
and MTP layers), sharded over the stage's own ranks as the parallelizer shards them there: the planner
simulates one stage's world (`ParallelPlan.stage_world_size` ranks) and takes each block's state and
traced activations from it. A rank's activations are those its schedule keeps in flight at its peak
(`pipeline.play`: every micro-batch-stage between its forward and its backward, each with what its
blocks keep for backward plus its input from the stage before) plus the largest temporary of its blocks;
its gradients stay for the whole step. The rank that needs the most is the launch's verdict.

The step's compute is the schedule played with each stage's estimated time (`split.py`), so both the
bubble and an unbalanced split lengthen it; stage boundaries send each micro-batch's activation forward
and its gradient back (`pp_p2p`), over the link between stages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nemotron_recipe.distributed.pipeline_layout import n_stages, stage_rank
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.training.pipeline.split import StageSplit, plan_split

from .activations import ActivationTrace, Workload
from .comms import (
    _bytes,
    activation_bytes,
    comm_seconds,
    extra_forwards,
    fsdp_bytes,
    moe_tp_bytes,
    offload_bytes,
)
from .estimate import MemoryEstimate, Planner
from .pipeline import Played, p2p_bytes, play, schedule_actions
from .state import StateBytes


@dataclass(frozen=True)
class PipelineLayout:
    """The `mesh.pp_*` settings beside `ParallelPlan.pp`."""

    schedule: str = "1f1b"
    virtual_stages: int = 1
    split_points: tuple[int, ...] | None = None

    @classmethod
    def from_mesh(cls, mesh: Any) -> PipelineLayout:
        split = getattr(mesh, "pp_split", None)
        return cls(getattr(mesh, "pp_schedule", "1f1b"), int(getattr(mesh, "pp_virtual_stages", 1)),
                   tuple(split) if split is not None else None)

    def overrides(self) -> str:
        """This layout as `mesh.*` overrides (its non-default keys)."""
        parts = [] if self.schedule == "1f1b" else [f"mesh.pp_schedule={self.schedule}"]
        parts += [f"mesh.pp_virtual_stages={self.virtual_stages}"] if self.virtual_stages != 1 else []
        if self.split_points is not None:
            parts.append("mesh.pp_split=[" + ",".join(map(str, self.split_points)) + "]")
        return " ".join(parts)


@dataclass(frozen=True)
class PipelineReport:
    """What the pipeline adds to a plan's report."""

    layout: PipelineLayout
    split: StageSplit
    played: Played
    rank: int  # the rank the verdict is for: the one that needs the most memory
    rank_totals: tuple[int, ...]  # each pipeline rank's device bytes
    rank_states: tuple[StateBytes, ...]
    rank_stages: tuple[tuple[int, ...], ...]


def _rank_config(config: NemotronHConfig, split: StageSplit, stages: tuple[int, ...]) -> NemotronHConfig:
    """The blocks a rank runs, as a model config (its MTP layers only where it holds the last stage)."""
    pattern = "".join(config.pattern[b] for s in stages for b in split.blocks(s))
    if split.n_stages - 1 in stages or not config.num_nextn_predict_layers:
        return dataclasses.replace(config, pattern=pattern)
    return dataclasses.replace(config, pattern=pattern, num_nextn_predict_layers=0, mtp_loss_scale=None)


def _stage_states(split: StageSplit, parts) -> list[StateBytes]:
    out = []
    for s in range(split.n_stages):
        state = sum((parts.per_kind[split.costs.pattern[b]] for b in split.blocks(s)), StateBytes())
        state = state + (parts.embedding if s == 0 else StateBytes())
        out.append(state + (parts.head if s == split.n_stages - 1 else StateBytes()))
    return out


def _stage_activations(split: StageSplit, trace: ActivationTrace, boundary: float) -> list[tuple[float, int]]:
    """Per stage: (bytes one micro-batch keeps there until its backward, its largest temporary above that)."""
    out = []
    for s in range(split.n_stages):
        blocks = split.blocks(s)
        transient = max(trace.excess[b] - trace.kept[b] for b in blocks)
        if s == split.n_stages - 1:
            transient = max(transient, trace.head_excess)
        out.append((sum(trace.kept[b] for b in blocks) + boundary, max(transient, 0)))
    return out


def boundary_bytes(config: NemotronHConfig, plan: ParallelPlan, work: Workload) -> float:
    """One micro-batch's activation at a stage boundary, as one rank of the stage holds and sends it."""
    tokens = work.micro_batch * work.seq_len // plan.cp
    if plan.sequence_parallel:
        tokens //= plan.tp
    return tokens * config.hidden_size * _bytes(plan.param_dtype)


def evaluate_pipeline(planner: Planner, launch: Any) -> tuple[MemoryEstimate, dict[str, float], dict[str, float],
                                                             PipelineReport]:
    """(the binding rank's estimate, its traffic, the step's floor, the pipeline's report) for `launch`. As
    without a pipeline, nothing is traced when a rank's resident state alone exceeds the budget."""
    plan, layout, work, config = launch.plan, launch.pipeline, launch.work, launch.config
    stage_plan = dataclasses.replace(plan, pp=1)  # one stage's world: what the planner simulates
    stages = n_stages(plan.pp, layout.virtual_stages)
    split = plan_split(config, stages, split_points=layout.split_points, seq_len=work.seq_len,
                       micro_batch=work.micro_batch)
    owned = tuple(tuple(s for s in range(stages) if stage_rank(s, plan.pp, layout.schedule) == r)
                  for r in range(plan.pp))
    stage_states = _stage_states(split, planner.state_parts(stage_plan))
    states = [sum((stage_states[s] for s in mine), StateBytes()) for mine in owned]
    resident = max(0 if plan.offload else s.params + s.optimizer for s in states)
    trace = None if launch.budget is not None and resident > launch.budget else planner.trace(stage_plan, work)
    boundary = boundary_bytes(config, plan, work)
    kept = _stage_activations(split, trace, boundary) if trace else [(0.0, 0)] * stages
    n = launch.grad_accum
    # a stage's forward seconds: its FLOPs over the tp x cp ranks that split it, with any extra forwards
    scale = (3 + extra_forwards(plan, work)) / 3 / (plan.tp * plan.cp * launch.hardware.tflops_per_device * 1e12)
    played = play(schedule_actions(layout.schedule, plan.pp, layout.virtual_stages, n),
                  [t * scale / 3 for t in split.times], [k[0] for k in kept])
    estimates = []
    for r, mine in enumerate(owned):
        rank_trace = None
        if trace is not None:
            activations = int(played.peak_bytes[r] + max(kept[s][1] for s in mine))
            rank_trace = dataclasses.replace(trace, peak=activations, grads_at_peak=0,
                                             pattern=_rank_config(config, split, mine).pattern)
        # the gradients of a rank's stages stay from its first backward to the step's end
        estimates.append(MemoryEstimate(states[r], rank_trace, max(n, 2), plan.offload))
    rank = max(range(plan.pp), key=lambda r: estimates[r].device_total)
    rank_config = _rank_config(config, split, owned[rank])
    state = estimates[rank].state
    traffic = {**fsdp_bytes(stage_plan, state, n), **activation_bytes(rank_config, stage_plan, work, n),
               **offload_bytes(stage_plan, state, n),
               "pp_p2p": p2p_bytes(plan.pp, layout.virtual_stages, layout.schedule, n, boundary, rank)}
    if moe_tp := moe_tp_bytes(rank_config, stage_plan, state, n):
        traffic["moe_tp_all_reduce"] = moe_tp
    comm = comm_seconds(plan, traffic, launch.hardware)
    time = {"compute_s": played.makespan, "comm_s": comm, "floor_s": max(played.makespan, comm),
            "bubble": played.bubble}
    report = PipelineReport(layout, split, played, rank, tuple(e.device_total for e in estimates),
                            tuple(e.state for e in estimates), owned)
    return estimates[rank], traffic, time, report

