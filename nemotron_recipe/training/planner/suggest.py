"""Changes that would make a launch fit, each with its estimated total, ranked.

Each candidate changes one thing (more ranks, another split of the same ranks, another
checkpointing mode, precision or offload, LoRA, a smaller micro-batch), is run through the real
parallelizer in the fake world like the launch itself, and is dropped where the parallelizer or the
plan refuses it. Only changes that fit are listed, fastest step-time floor first. A launch that fits
gets the changes that make it faster at no cost in fit: expert parallel for MoE models, sequence parallel
where tensor parallel runs without it (`speedups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nemotron_recipe.distributed.plan import (
    ActivationCheckpointing,
    ParallelConfigError,
)
from nemotron_recipe.models.nemotron_v3.lora import LoRASpec

from .estimate import Planner
from .launch import Launch, Outcome, evaluate, with_plan
from .pipeline_estimate import PipelineLayout

MAX_WORLD_FACTOR = 64
MAX_TP = 8  # tensor parallel stays inside a node


@dataclass(frozen=True)
class Suggestion:
    change: str  # the override(s) to use
    outcome: Outcome


def _sequence_parallel(launch: Launch) -> Iterator[tuple[str, Launch]]:
    """Tensor parallel without sequence parallel keeps whole activations on every tp rank."""
    if launch.plan.tp > 1 and not launch.plan.sequence_parallel:
        yield "mesh.sequence_parallel=true", with_plan(launch, sequence_parallel=True)


def _expert_parallel(launch: Launch, max_ep: int) -> Iterator[tuple[str, Launch]]:
    """The widest expert parallel (up to `max_ep`, a node) that divides the experts and the dp x cp ranks:
    each rank keeps its own experts whole instead of gathering every expert's shards."""
    p, experts = launch.plan, launch.config.n_routed_experts
    if "E" not in launch.config.pattern or p.ep > 1:
        return
    ep = 1
    while ep * 2 <= max_ep and (p.dp_shard * p.cp) % (ep * 2) == 0 and experts % (ep * 2) == 0:
        ep *= 2
    if ep > 1:
        yield f"mesh.ep={ep}", with_plan(launch, ep=ep)


def _pipeline(launch: Launch) -> Iterator[tuple[str, Launch]]:
    """A pipeline of twice the stages over half the data-parallel ranks: each rank gathers only its stages'
    blocks, over fewer ranks, and only activations cross between stages. 1F1B where the step has a
    micro-batch per stage, else GPipe. With a hand split: the balanced one."""
    p = launch.plan
    if p.pp > 1 and launch.pipeline.split_points is not None:
        yield "mesh.pp_split=null", dataclasses.replace(
            launch, pipeline=dataclasses.replace(launch.pipeline, split_points=None))
    pp = p.pp * 2
    if p.dp_shard % 2 or pp > len(launch.config.pattern) or (p.dp_shard // 2 * p.cp) % p.ep:
        return
    variant = with_plan(launch, pp=pp, dp_shard=p.dp_shard // 2)
    layout = PipelineLayout("1f1b" if variant.grad_accum >= pp else "gpipe")
    change = f"mesh.pp={pp}" + (f" {layout.overrides()}" if layout.overrides() else "")
    yield change, dataclasses.replace(variant, pipeline=layout)


def _split_candidates(launch: Launch) -> Iterator[tuple[str, Launch]]:
    """Other splits of the same ranks: full sharding, sequence parallel, more tensor, context or expert parallel."""
    p = launch.plan
    yield from _sequence_parallel(launch)
    if p.dp_replicate > 1:
        yield "mesh.dp_replicate=1", with_plan(launch, dp_replicate=1, dp_shard=p.dp_shard * p.dp_replicate)
    if p.dp_shard % 2 == 0 and p.tp * 2 <= MAX_TP and (p.dp_shard // 2 * p.cp) % p.ep == 0:
        yield (f"mesh.tp={p.tp * 2} mesh.sequence_parallel=true",
               with_plan(launch, tp=p.tp * 2, dp_shard=p.dp_shard // 2, sequence_parallel=True))
    if p.dp_shard % 2 == 0 and p.check_seq_len(launch.work.seq_len) is None:
        cp = with_plan(launch, cp=p.cp * 2, dp_shard=p.dp_shard // 2)
        if cp.plan.check_seq_len(launch.work.seq_len) is None:
            yield f"mesh.cp={p.cp * 2}", cp
    if "E" in launch.config.pattern and (p.dp_shard * p.cp) % (p.ep * 2) == 0:
        yield f"mesh.ep={p.ep * 2}", with_plan(launch, ep=p.ep * 2)
    yield from _pipeline(launch)


def _memory_candidates(launch: Launch) -> Iterator[tuple[str, Callable[[Launch], Launch]]]:
    """Less memory on the same ranks: checkpointing, precision, offload, LoRA, micro-batch; each as a
    change that applies to any launch, so that two can be combined."""
    p, w = launch.plan, launch.work
    for mode in ("selective", "blocks", "full"):
        if mode != p.ac.mode:
            yield f"ac={mode}", lambda x, mode=mode: with_plan(x, ac=ActivationCheckpointing(mode, x.plan.ac.every))
    if p.param_dtype == torch.float32:
        yield "fsdp=bf16", lambda x: with_plan(x, param_dtype=torch.bfloat16)
    if not p.offload and launch.device == "cuda":
        yield "fsdp=bf16_offload", lambda x: with_plan(x, param_dtype=torch.bfloat16, offload=True)
    if launch.trainability.lora is None:
        spec = LoRASpec()  # what `peft=lora` runs: its defaults
        yield "peft=lora", lambda x: dataclasses.replace(
            x, trainability=dataclasses.replace(x.trainability, lora=spec, base_dtype=torch.bfloat16))
    if w.micro_batch > 1:
        yield f"trainer.micro_batch_size={w.micro_batch // 2}", lambda x: dataclasses.replace(
            x, work=dataclasses.replace(x.work, micro_batch=max(x.work.micro_batch // 2, 1)), grad_accum=x.grad_accum * 2)
    if p.tp == 1 and not w.loss_chunk_size:
        yield "trainer.loss_chunk_size=1024", lambda x: dataclasses.replace(
            x, work=dataclasses.replace(x.work, loss_chunk_size=1024))


def _more_ranks(planners: dict, launch: Launch, base: Outcome) -> Iterator[tuple[str, Outcome]]:
    """The fewest ranks (the launch's times a power of 2, up to 64) that fit, sharding over the added ones.

    Added data-parallel ranks shard the state and gradients, never a micro-batch's activations: a world
    whose resident state plus the launch's traced activations exceeds the budget cannot fit, and is
    passed over untraced. None when no such world fits."""
    p, floor = launch.plan, base.estimate.activations
    factor = 2
    while factor <= MAX_WORLD_FACTOR:
        more = with_plan(launch, dp_shard=p.dp_shard * factor)
        outcome = _evaluate(planners, dataclasses.replace(more, budget=max(more.budget - floor, 0)))
        if outcome is not None:
            outcome = dataclasses.replace(outcome, launch=more)  # judged against the real budget
            if outcome.fits:
                yield f"plan.world_size={more.plan.world_size} (launch {more.plan.world_size} ranks)", outcome
                return
        factor *= 2


def _evaluate(planners: dict, launch: Launch) -> Outcome | None:
    key = (id(launch.config), launch.trainability, launch.work)
    planner = planners.setdefault(key, Planner(launch.config, launch.work, launch.trainability))
    try:
        return evaluate(planner, launch)
    except (ParallelConfigError, ValueError, RuntimeError):
        return None  # the parallelizer (or the plan) refuses this variant


def _faster(planners: dict, found: list[Suggestion]) -> list[Suggestion]:
    """The fastest fitting change with expert parallel (MoE models) or sequence parallel (tp without it)
    on top, where that still fits: they rarely save memory, so alone they seldom make a launch fit."""
    if not found:
        return []
    best = found[0]
    launch = best.outcome.launch
    out = []
    for change, variant in (*_expert_parallel(launch, launch.hardware.devices_per_node), *_sequence_parallel(launch)):
        if change not in best.change and (outcome := _evaluate(planners, variant)) is not None and outcome.fits:
            out.append(Suggestion(f"{best.change} {change}", outcome))
    return out


def suggest(planner: Planner, launch: Launch, base: Outcome, *, limit: int = 8) -> list[Suggestion]:
    """Ranked changes for `launch` (whose own outcome is `base`), reusing `planner`'s traces. When no
    single change fits on the same ranks, the one that saves the most is also tried with ac=full."""
    planners = {(id(launch.config), launch.trainability, launch.work): planner}
    found: list[Suggestion] = []
    for change, variant in _split_candidates(launch):
        if (outcome := _evaluate(planners, variant)) is not None:
            found.append(Suggestion(change, outcome))
    memory = []
    for change, apply in _memory_candidates(launch):
        if (outcome := _evaluate(planners, apply(launch))) is not None:
            found.append(Suggestion(change, outcome))
            memory.append((outcome.estimate.device_total, change, apply))
    if not any(s.outcome.fits for s in found) and len(memory) >= 2:
        ranked = sorted(memory, key=lambda m: m[0])
        _, first, apply_first = ranked[0]
        # Full recomputation saves the most activations with any other change.
        _, second, apply_second = next((m for m in ranked[1:] if m[1] == "ac=full"), ranked[1])
        if (outcome := _evaluate(planners, apply_second(apply_first(launch)))) is not None:
            found.append(Suggestion(f"{first} {second}", outcome))
    found = [s for s in found if s.outcome.fits]  # a change that does not fit is no answer
    found.sort(key=lambda s: (s.outcome.time["floor_s"], s.outcome.estimate.device_total))
    found = sorted(found + _faster(planners, found), key=lambda s: (s.outcome.time["floor_s"],
                                                                    s.outcome.estimate.device_total))
    more = [Suggestion(change, o) for change, o in _more_ranks(planners, launch, base)]
    return (found[:limit - len(more)] + more)[:limit]


def speedups(planner: Planner, launch: Launch, *, limit: int = 8) -> list[Suggestion]:
    """For a launch that fits: expert parallel (MoE models) and sequence parallel (tp without it), where
    they still fit, and pipeline layouts that fit with a lower step-time floor; fastest first."""
    planners = {(id(launch.config), launch.trainability, launch.work): planner}
    found = []
    for change, variant in (*_expert_parallel(launch, launch.hardware.devices_per_node), *_sequence_parallel(launch)):
        if (outcome := _evaluate(planners, variant)) is not None and outcome.fits:
            found.append(Suggestion(change, outcome))
    if (base := _evaluate(planners, launch)) is not None:
        for change, variant in _pipeline(launch):
            outcome = _evaluate(planners, variant)
            if outcome is not None and outcome.fits and outcome.time["floor_s"] < base.time["floor_s"]:
                found.append(Suggestion(change, outcome))
    return sorted(found, key=lambda s: s.outcome.time["floor_s"])[:limit]
