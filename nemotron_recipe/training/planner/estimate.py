"""One rank's memory for a model, a parallel plan and a micro-batch: sharded state plus a traced step.

`Planner` holds what one planning run has already traced, so that alternatives sharing a parallel
plan and batch shape (e.g. with and without offload) reuse one trace. Another data-parallel size is
traced again: its gradients' share moves the moment of the peak, not only its height.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig

from .activations import (
    TRACE_WHOLE_MAX_BLOCKS,
    ActivationTrace,
    Workload,
    extrapolate,
    trace,
)
from .state import StateBytes, model_state, module_state
from .world import Trainability, fake_world, reduced_config, sharded_meta_model

# The planner simulates every device type on CPU: fake tensors have sizes, not placements.
SIMULATED_DEVICE = "cpu"


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes. `trace` is None when the state alone was enough to decide (it does not fit)."""

    state: StateBytes
    trace: ActivationTrace | None
    grad_accum: int = 1
    offload: bool = False
    reference: int = 0  # DPO's reference=copy: its frozen parameters, held beside the policy's

    @property
    def activations(self) -> int:
        return 0 if self.trace is None else self.trace.activations

    @property
    def step(self) -> int:
        """What a step adds on the device above the resident state. Over several micro-batches the
        gradients stay from the first backward on; offloaded ones live in host memory."""
        if self.trace is None:
            return 0
        if self.offload:
            return self.trace.activations
        if self.grad_accum > 1:
            return self.trace.activations + self.state.grads
        return self.trace.peak

    @property
    def device_total(self) -> int:
        resident = 0 if self.offload else self.state.params + self.state.optimizer + self.reference
        return resident + self.step

    @property
    def host_total(self) -> int:
        """Bytes FSDP's CPU offload keeps in host memory (0 without offload)."""
        return self.state.total + self.reference if self.offload else 0


@dataclass(frozen=True)
class StateParts:
    """A rank's state (`total`), one block's of each kind, and the ends: the embedding (a pipeline's first
    stage) and the final norm, lm_head and MTP layers (its last)."""

    total: StateBytes
    per_kind: dict[str, StateBytes]
    embedding: StateBytes
    head: StateBytes


class Planner:
    """Estimates for one model and workload under any number of plans, reusing traces."""

    def __init__(self, config: NemotronHConfig, work: Workload, trainability: Trainability | None = None) -> None:
        self.config, self.work, self.trainability = config, work, trainability or Trainability()
        self._traces: dict[tuple, ActivationTrace] = {}
        self._states: dict[ParallelPlan, StateParts] = {}

    def state(self, plan: ParallelPlan) -> StateBytes:
        return self.state_parts(plan).total

    def state_parts(self, plan: ParallelPlan) -> StateParts:
        """The model's state on one rank, and the parts a pipeline stage holds of it."""
        sim = _simulated(plan)
        if sim not in self._states:
            with fake_world(plan.world_size):
                reduced = sharded_meta_model(reduced_config(self.config), sim, sim.build_meshes(SIMULATED_DEVICE),
                                             self.trainability)
                total, per_kind = model_state(reduced, self.config)
                embedding = module_state(reduced.model.embeddings)
                blocks = sum((state * self.config.pattern.count(kind) for kind, state in per_kind.items()),
                             StateBytes())
                self._states[sim] = StateParts(total, per_kind, embedding, total - blocks - embedding)
        return self._states[sim]

    def estimate(self, plan: ParallelPlan, *, grad_accum: int = 1, budget: int | None = None,
                 work: Workload | None = None) -> MemoryEstimate:
        """`plan`'s estimate; with a `budget` (bytes) the trace is skipped when the resident state
        alone exceeds it."""
        work = work or self.work
        state = self.state(plan)
        resident = 0 if plan.offload else state.params + state.optimizer
        if budget is not None and resident > budget:
            return MemoryEstimate(state, None, grad_accum, plan.offload)
        return MemoryEstimate(state, self._trace(plan, work), grad_accum, plan.offload)

    def trace(self, plan: ParallelPlan, work: Workload | None = None) -> ActivationTrace:
        """One micro-batch's traced step of the whole model under `plan` (extrapolated where it is long)."""
        return self._trace(plan, work or self.work)

    def _trace(self, plan: ParallelPlan, work: Workload) -> ActivationTrace:
        sim = _simulated(plan)
        key = (sim, work)
        if key in self._traces:
            return self._traces[key]
        with fake_world(plan.world_size):
            meshes = sim.build_meshes(SIMULATED_DEVICE)
            whole = len(self.config.pattern) <= TRACE_WHOLE_MAX_BLOCKS or plan.ac.mode == "every_nth"
            if whole:
                result = trace(self.config, sim, meshes, work, self.trainability)
            else:
                reduced = trace(reduced_config(self.config), sim, meshes, work, self.trainability)
                result = extrapolate(self.config, reduced)
        self._traces[key] = result
        return result


def _simulated(plan: ParallelPlan) -> ParallelPlan:
    """`plan` as the fake world runs it: offload is accounted for, not simulated (host and device
    are one in a simulation on CPU)."""
    return dataclasses.replace(plan, offload=False)


def memory_estimate(config: NemotronHConfig, plan: ParallelPlan, *, micro_batch: int, seq_len: int,
                    loss_chunk_size: int | None = None, grad_accum: int = 1,
                    device_type: str = SIMULATED_DEVICE) -> MemoryEstimate:
    """One rank's estimate for `plan` (a convenience over `Planner` for a single plan)."""
    del device_type  # every device is simulated alike
    return Planner(config, Workload(micro_batch, seq_len, loss_chunk_size)).estimate(plan, grad_accum=grad_accum)
