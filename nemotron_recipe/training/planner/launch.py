"""A launch to plan, read from the recipe's config, and its whole report: memory, verdict, traffic,
step-time floor and, when it does not fit, ranked changes that would."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nemotron_recipe.config import validate_config
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig

from .activations import Workload
from .comms import Hardware, activation_bytes, fsdp_bytes, moe_tp_bytes, offload_bytes, step_floor
from .estimate import MemoryEstimate, Planner
from .pipeline_estimate import PipelineLayout, PipelineReport, evaluate_pipeline
from .world import Trainability

GIB = 2**30


@dataclass(frozen=True)
class Launch:
    """Everything the planner needs of a launch."""

    config: NemotronHConfig
    plan: ParallelPlan
    work: Workload
    grad_accum: int
    trainability: Trainability
    budget: int  # bytes of device memory per rank
    device: str = "cuda"  # what the budget is: a GPU's memory, or host memory ("cpu")
    hardware: Hardware = field(default_factory=Hardware)
    reference_copy: bool = False  # objective=dpo reference=copy: a frozen copy of the weights, sharded alike
    pipeline: PipelineLayout = field(default_factory=PipelineLayout)  # read where plan.pp > 1

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, budget: int, device: str = "cuda",
                    hardware: Hardware | None = None, *, validated: tuple | None = None) -> Launch:
        """`validate_config`'s checks for `world_size` ranks, so a mesh that cannot work fails with
        the message the launch would give."""
        config, plan = validated or validate_config(cfg, world_size, weights=False)
        t = cfg.trainer
        accum = max(t.global_batch_size // (t.micro_batch_size * plan.dp_size), 1)
        # objective=dpo: batches count pairs, each two sequences (chosen, rejected) of one forward.
        dpo = cfg.objective.name == "dpo"
        reference = cfg.objective.reference if dpo else None
        work = Workload(t.micro_batch_size * (2 if dpo else 1), t.seq_len, t.loss_chunk_size or None,
                        reference_forward=reference in ("base", "copy"))
        return cls(config, plan, work, accum, Trainability.from_config(cfg), budget, device, hardware or Hardware(),
                   reference_copy=reference == "copy", pipeline=PipelineLayout.from_mesh(cfg.mesh))


@dataclass(frozen=True)
class Outcome:
    """One plan's estimate, traffic and floor."""

    launch: Launch
    estimate: MemoryEstimate
    traffic: dict[str, float]
    time: dict[str, float]
    pipeline: PipelineReport | None = None  # with pipeline parallel: the split, the schedule played, each rank

    @property
    def fits(self) -> bool:
        return self.estimate.trace is not None and self.estimate.device_total <= self.launch.budget


def evaluate(planner: Planner, launch: Launch) -> Outcome:
    if launch.plan.pp > 1:
        return _evaluate_pipeline(planner, launch)
    est = planner.estimate(launch.plan, grad_accum=launch.grad_accum, budget=launch.budget, work=launch.work)
    if launch.reference_copy:  # the copy's parameters are the policy's, frozen (an adapter's worth more)
        est = dataclasses.replace(est, reference=est.state.params)
    traffic = {**fsdp_bytes(launch.plan, est.state, launch.grad_accum),
               **activation_bytes(launch.config, launch.plan, launch.work, launch.grad_accum),
               **offload_bytes(launch.plan, est.state, launch.grad_accum)}
    if launch.work.reference_forward and "fsdp_all_gather" in traffic:  # the reference forward gathers once more
        gathers = 1 if launch.plan.reshard_after_forward is False else 2
        traffic["fsdp_all_gather"] *= (gathers + 1) / gathers
    if moe_tp := moe_tp_bytes(launch.config, launch.plan, est.state, launch.grad_accum):
        traffic["moe_tp_all_reduce"] = moe_tp
    time = step_floor(launch.config, launch.plan, launch.work, traffic, launch.grad_accum, launch.hardware)
    return Outcome(launch, est, traffic, time)


def _evaluate_pipeline(planner: Planner, launch: Launch) -> Outcome:
    est, traffic, time, report = evaluate_pipeline(planner, launch)
    if launch.reference_copy:
        est = dataclasses.replace(est, reference=est.state.params)
    if launch.work.reference_forward and "fsdp_all_gather" in traffic:
        gathers = 1 if launch.plan.reshard_after_forward is False else 2
        traffic["fsdp_all_gather"] *= (gathers + 1) / gathers
    return Outcome(launch, est, traffic, time, report)


def with_plan(launch: Launch, **changes: Any) -> Launch:
    """`launch` on a changed parallel plan; the gradient accumulation follows the data-parallel size
    (the global batch stays)."""
    plan = dataclasses.replace(launch.plan, **changes)
    accum = max(launch.grad_accum * launch.plan.dp_size // plan.dp_size, 1)
    return dataclasses.replace(launch, plan=plan, grad_accum=accum)
