"""What a pipeline-parallel layout requires: the schedules, their stages per rank and micro-batch counts,
and hand-given split points. Pure checks on numbers, so the config can run them before anything exists.

The micro-batch rules are those of `torch.distributed.pipelining`'s schedules (torch 2.13), which raise
only once the stages are built: `Schedule1F1B` needs at least as many micro-batches as stages;
`ScheduleInterleaved1F1B` runs them in rounds of `max(1, n // pp)` and needs `n` to be a multiple of
that; `ScheduleGPipe` and `ScheduleZBVZeroBubble` run any number. `ScheduleZBVZeroBubble` takes exactly
two stages per rank, placed in a V (rank r holds stages r and 2*pp - 1 - r); the interleaved schedule
loops (rank r holds stages r, r + pp, ...). The tests hold these rules to the schedules themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv")


def n_stages(pp: int, virtual_stages: int) -> int:
    return pp * virtual_stages


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs `stage`: looped, or in a V for zbv."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def microbatches_problem(schedule: str, pp: int, micro_batches: int) -> str | None:
    """Why `schedule` cannot run `micro_batches` per step over `pp` ranks, or None. The text names the
    count only; the caller says where it comes from and how to change it."""
    if schedule == "1f1b" and micro_batches < pp:
        return f"1f1b needs at least mesh.pp={pp} micro-batches per step, and the step has {micro_batches}"
    if schedule == "interleaved_1f1b":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            below = micro_batches // pp * pp
            return (f"interleaved_1f1b runs micro-batches in rounds of mesh.pp={pp} and needs a whole number of "
                    f"rounds; the step has {micro_batches} (e.g. {below} or {below + pp} would do)")
    return None


def _count_fix(schedule: str, pp: int, micro_batches: int) -> str:
    """How to give the step a micro-batch count the schedule runs."""
    want = pp if micro_batches < pp else (micro_batches // pp + 1) * pp
    other = "; or mesh.pp_schedule=gpipe, which runs any number" if schedule != "gpipe" else ""
    return (f"Fix: make trainer.global_batch_size / (trainer.micro_batch_size x data-parallel size) a count the "
            f"schedule runs (e.g. {want}: raise trainer.global_batch_size or lower trainer.micro_batch_size){other}.")


def layout_problems(mesh: Any, micro_batches: int | None) -> list[str]:
    """The `mesh.pp*` fields on their own, and the step's micro-batch count (None: not known yet)."""
    pp, schedule = int(getattr(mesh, "pp", 1)), getattr(mesh, "pp_schedule", "1f1b")
    virtual = int(getattr(mesh, "pp_virtual_stages", 1))
    errors: list[str] = []
    if schedule not in PP_SCHEDULES:
        errors.append(f"mesh.pp_schedule={schedule!r}: unknown. Fix: use one of {list(PP_SCHEDULES)}.")
    if pp < 1:
        errors.append(f"mesh.pp={pp}: must be >= 1 (1: no pipeline). Fix: e.g. mesh.pp=2.")
    if virtual < 1:
        errors.append(f"mesh.pp_virtual_stages={virtual}: must be >= 1. Fix: 1, or 2 with an interleaved schedule.")
    if errors:
        return errors
    if pp == 1:
        if virtual > 1 or getattr(mesh, "pp_split", None):
            field = "pp_virtual_stages" if virtual > 1 else "pp_split"
            errors.append(f"mesh.{field}={getattr(mesh, field)!r} with mesh.pp=1: there is no pipeline to split. "
                          f"Fix: set mesh.pp>1, or leave mesh.{field} at its default.")
        return errors
    if schedule == "interleaved_1f1b" and virtual < 2:
        errors.append(f"mesh.pp_schedule=interleaved_1f1b with mesh.pp_virtual_stages={virtual}: interleaving needs "
                      "several stages per rank. Fix: mesh.pp_virtual_stages=2 (or more), or mesh.pp_schedule=1f1b.")
    elif schedule == "zbv" and virtual != 2:
        errors.append(f"mesh.pp_schedule=zbv with mesh.pp_virtual_stages={virtual}: the zero-bubble V schedule runs "
                      "exactly two stages per rank. Fix: mesh.pp_virtual_stages=2.")
    elif schedule not in MULTI_STAGE_SCHEDULES and virtual > 1:
        errors.append(f"mesh.pp_virtual_stages={virtual} with mesh.pp_schedule={schedule}: {schedule} runs one stage "
                      "per rank. Fix: mesh.pp_schedule=interleaved_1f1b (or zbv with 2), or mesh.pp_virtual_stages=1.")
    if micro_batches is not None and (problem := microbatches_problem(schedule, pp, micro_batches)):
        errors.append(f"mesh.pp_schedule={schedule}: {problem} (trainer.global_batch_size / (trainer.micro_batch_size "
                      f"x data-parallel size); the pipeline's micro-batches are the step's). "
                      + _count_fix(schedule, pp, micro_batches))
    return errors


def split_problem(split: Sequence[int] | None, n_blocks: int, stages: int) -> str | None:
    """Why hand-given split points (the first block of each stage after the first) do not cover the
    `n_blocks` blocks once over `stages` stages, or None."""
    if split is None:
        return None
    split = list(split)
    example = [round(i * n_blocks / stages) for i in range(1, stages)]
    fix = f"Fix: give {stages - 1} increasing block indices in [1, {n_blocks - 1}], e.g. mesh.pp_split={example}, " \
          "or mesh.pp_split=null to split by cost."
    if len(split) != stages - 1:
        return (f"mesh.pp_split={split}: {len(split)} split points for {stages} stages (mesh.pp x "
                f"mesh.pp_virtual_stages); each stage after the first starts at one. {fix}")
    if any(not 1 <= s <= n_blocks - 1 for s in split):
        return f"mesh.pp_split={split}: split points must lie in [1, {n_blocks - 1}] (the model has {n_blocks} " \
               f"blocks, and every stage needs one). {fix}"
    if any(b <= a for a, b in zip(split, split[1:])):
        return f"mesh.pp_split={split}: split points must be strictly increasing, so every stage has blocks. {fix}"
    return None


def model_problems(mesh: Any, n_blocks: int) -> list[str]:
    """The layout against the model: every stage needs a block, and a hand split must cover them all once."""
    pp, virtual = int(getattr(mesh, "pp", 1)), int(getattr(mesh, "pp_virtual_stages", 1))
    if pp <= 1:
        return []
    stages = n_stages(pp, virtual)
    if stages > n_blocks:
        what = f"mesh.pp={pp}: {pp}" if virtual == 1 else \
            f"mesh.pp={pp} x mesh.pp_virtual_stages={virtual}: {stages}"
        return [f"{what} stages for a model of {n_blocks} blocks: every stage needs at least one block. Fix: "
                f"mesh.pp <= {n_blocks // virtual}" + (", or fewer virtual stages." if virtual > 1 else ".")]
    problem = split_problem(getattr(mesh, "pp_split", None), n_blocks, stages)
    return [problem] if problem else []
