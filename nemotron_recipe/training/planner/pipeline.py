"""A pipeline step, played out: which micro-batches each pipeline rank holds at once, how long the step
takes with its stages' estimated times, and the bytes that cross between stages.

The action lists are the schedules' own: GPipe runs every forward, then every backward; 1F1B starts
`pp - r` forwards on rank r, then alternates a backward and a forward; the interleaved and zero-bubble
schedules are built by `torch.distributed.pipelining` itself (in a fake process group of `pp` ranks) and
their compute actions read off. Played with each stage's forward time (backward twice that, or input
and weight halves of one each under zero bubble), every action starts once its rank is free and the
action it depends on has finished: a forward on the stage before, a backward on the stage after. The
step lasts until the last action ends; the bubble is the share of rank-time spent waiting.

A micro-batch's activations stay on a stage from its forward to its (weight) backward: the peak of
what a rank holds is the most, over its action list, of the activations of the micro-batches then in
flight, each weighted by its stage's bytes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import nn

from nemotron_recipe.distributed.pipeline_layout import n_stages, stage_rank

from .world import fake_world

FORWARD, BACKWARD, INPUT_BACKWARD, WEIGHT_BACKWARD = "F", "B", "I", "W"
# Each kind's time in forwards: a full backward costs two (input and weight gradients), each half one.
_COST = {FORWARD: 1.0, BACKWARD: 2.0, INPUT_BACKWARD: 1.0, WEIGHT_BACKWARD: 1.0}
_FREES = (BACKWARD, WEIGHT_BACKWARD)  # the action after which a micro-batch's activations are gone


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    micro_batch: int


def _single_stage_actions(schedule: str, pp: int, n: int) -> dict[int, list[Action]]:
    orders = {}
    for r in range(pp):
        f = [Action(FORWARD, r, m) for m in range(n)]
        b = [Action(BACKWARD, r, m) for m in range(n)]
        if schedule == "gpipe":
            orders[r] = f + b
            continue
        warmup = min(n, pp - r)
        order = f[:warmup]
        for m in range(n - warmup):  # steady state: one backward, then the next forward
            order += [b[m], f[warmup + m]]
        orders[r] = order + b[n - warmup:]
    return orders


@lru_cache(maxsize=64)
def _torch_actions(schedule: str, pp: int, virtual: int, n: int) -> dict[int, tuple[Action, ...]]:
    """The compute actions of torch's multi-stage schedule, every rank's, built for rank 0 of a fake group."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    cls = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleInterleaved1F1B
    total = n_stages(pp, virtual)
    own = dist.is_initialized()
    with (contextlib.nullcontext() if own else fake_world(pp)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the stages' shape inference warns about the stand-in module
        try:
            stages = [PipelineStage(nn.Identity(), s, total, torch.device("cpu"))
                      for s in range(total) if stage_rank(s, pp, schedule) == 0]
            built = cls(stages, n, loss_fn=lambda out, target: out.sum())
        finally:
            logging.disable(logging.NOTSET)
    return {rank: tuple(Action(str(a.computation_type.value), a.stage_index, a.microbatch_index)
                        for a in ops if a is not None and a.computation_type.value in _COST)
            for rank, ops in built.pipeline_order.items()}


def schedule_actions(schedule: str, pp: int, virtual: int, n: int) -> dict[int, list[Action]]:
    """Each pipeline rank's compute actions, in order, for one step of `n` micro-batches."""
    if schedule in ("gpipe", "1f1b"):
        return _single_stage_actions(schedule, pp, n)
    return {r: list(a) for r, a in _torch_actions(schedule, pp, virtual, n).items()}


@dataclass(frozen=True)
class Played:
    """A step played out: its length, each rank's busy time and the most activation bytes it held."""

    makespan: float
    busy: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    peak_in_flight: tuple[int, ...]  # micro-batch-stages held at that peak

    @property
    def bubble(self) -> float:
        """Share of rank-time spent waiting on other stages."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _depends_on(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    if action.kind == FORWARD:
        return (FORWARD, action.stage - 1, action.micro_batch) if action.stage > 0 else None
    if action.kind == WEIGHT_BACKWARD:
        return INPUT_BACKWARD, action.stage, action.micro_batch
    if action.stage < last_stage:  # a backward needs the gradient of the stage after it
        return "back", action.stage + 1, action.micro_batch
    return FORWARD, action.stage, action.micro_batch


def play(orders: dict[int, Sequence[Action]], forward_time: Sequence[float],
         stage_bytes: Sequence[float]) -> Played:
    """Play every rank's action list: each action starts when its rank is free and what it depends on is done."""
    last = len(forward_time) - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(orders, 0.0)
    busy = dict.fromkeys(orders, 0.0)
    cursor = dict.fromkeys(orders, 0)
    while any(cursor[r] < len(orders[r]) for r in orders):
        moved = False
        for r, order in orders.items():
            while cursor[r] < len(order):
                action = order[cursor[r]]
                need = _depends_on(action, last)
                if need is not None and need not in done:
                    break
                length = _COST[action.kind] * forward_time[action.stage]
                end = max(clock[r], done.get(need, 0.0)) + length
                clock[r], busy[r] = end, busy[r] + length
                done[(action.kind, action.stage, action.micro_batch)] = end
                if action.kind in (BACKWARD, INPUT_BACKWARD):
                    done[("back", action.stage, action.micro_batch)] = end
                cursor[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule deadlocked: an action waits on one that never runs")
    peaks = [_peak(orders[r], stage_bytes) for r in sorted(orders)]
    return Played(max(clock.values()), tuple(busy[r] for r in sorted(orders)),
                  tuple(p for p, _ in peaks), tuple(c for _, c in peaks))


def _peak(order: Sequence[Action], stage_bytes: Sequence[float]) -> tuple[float, int]:
    held, count, best = 0.0, 0, (0.0, 0)
    for action in order:
        if action.kind == FORWARD:
            held, count = held + stage_bytes[action.stage], count + 1
            best = max(best, (held, count))
        elif action.kind in _FREES:
            held, count = held - stage_bytes[action.stage], count - 1
    return best


def bubble_formula(schedule: str, pp: int, virtual: int, n: int) -> float:
    """The textbook bubble with equal stages: (pp - 1) / (v n + pp - 1) (v = 1 but for interleaving)."""
    v = virtual if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * n + pp - 1)


def p2p_bytes(pp: int, virtual: int, schedule: str, n: int, boundary: float, rank: int) -> float:
    """Bytes `rank` sends per step: each of its stages' output forward (but the last's), its input
    gradient backward (but the first's), per micro-batch."""
    total = n_stages(pp, virtual)
    sends = 0
    for s in range(total):
        if stage_rank(s, pp, schedule) == rank:
            sends += (s < total - 1) + (s > 0)
    return n * sends * boundary
