"""The `mesh.pp*` settings: every bad layout is refused by the config check, before anything is built,
with the field, the value and a fix; the micro-batch rules are held to torch's own schedules."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import compose_run
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.distributed.pipeline_layout import microbatches_problem, stage_rank
from nemotron_recipe.distributed.plan import ParallelPlan

SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
             "zbv": (ScheduleZBVZeroBubble, 2)}


def _torch_accepts(schedule: str, pp: int, n: int) -> bool:
    """Whether torch builds `schedule` for rank 0 of `pp` with `n` micro-batches and, for the schedules
    that run from their action lists (several stages per rank), every action of every rank names one of them."""
    cls, virtual = SCHEDULES[schedule]
    local = [s for s in range(pp * virtual) if stage_rank(s, pp, schedule) == 0]
    stages = [PipelineStage(nn.Linear(2, 2), s, pp * virtual, torch.device("cpu")) for s in local]
    try:
        built = cls(stages if virtual > 1 else stages[0], n, loss_fn=lambda out, target: out.sum())
    except ValueError:
        return False
    order = built.pipeline_order if virtual > 1 else {}
    return all(a.microbatch_index < n for ops in order.values() for a in ops if a is not None
               and a.microbatch_index is not None)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_micro_batch_rules_are_torchs(pp: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            verdicts = {(s, n): (_torch_accepts(s, pp, n), microbatches_problem(s, pp, n) is None)
                        for s in SCHEDULES for n in range(1, 13)}
    finally:
        logging.disable(logging.NOTSET)
        dist.destroy_process_group()
    assert all(torch_ok == ours for torch_ok, ours in verdicts.values()), verdicts
    assert not verdicts[("1f1b", pp - 1)][0]  # the rules do refuse something
    assert not all(v[0] for (s, _), v in verdicts.items() if s == "interleaved_1f1b")


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    return compose_run(tmp_path_factory.mktemp("run"), "model=tiny", "trainer.global_batch_size=8",
                       "trainer.micro_batch_size=1")


def _problems(cfg, world_size: int, **mesh) -> str:
    cfg = copy.deepcopy(cfg)
    for key, value in mesh.items():
        OmegaConf.update(cfg, f"mesh.{key}", value)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size, weights=False)
    return str(e.value)


@pytest.mark.parametrize("mesh, world, needles", [
    (dict(pp=7), 7, ["mesh.pp=7: 7 stages for a model of 6 blocks", "Fix: mesh.pp <= 6"]),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=4), 2,
     ["mesh.pp=2 x mesh.pp_virtual_stages=4: 8 stages", "Fix: mesh.pp <= 1, or fewer virtual stages"]),
    (dict(pp=2, pp_split=[2, 4]), 2, ["mesh.pp_split=[2, 4]: 2 split points for 2 stages", "e.g. mesh.pp_split=[3]"]),
    (dict(pp=3, pp_split=[4, 2]), 3, ["mesh.pp_split=[4, 2]: split points must be strictly increasing", "Fix:"]),
    (dict(pp=3, pp_split=[2, 2]), 3, ["mesh.pp_split=[2, 2]: split points must be strictly increasing"]),
    (dict(pp=2, pp_split=[6]), 2, ["mesh.pp_split=[6]: split points must lie in [1, 5]", "Fix:"]),
    (dict(pp=2, pp_split=[0]), 2, ["mesh.pp_split=[0]: split points must lie in [1, 5]"]),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2,
     ["mesh.pp_schedule=interleaved_1f1b with mesh.pp_virtual_stages=1", "Fix: mesh.pp_virtual_stages=2"]),
    (dict(pp=2, pp_schedule="zbv", pp_virtual_stages=3), 2,
     ["mesh.pp_schedule=zbv with mesh.pp_virtual_stages=3", "exactly two stages per rank"]),
    (dict(pp=2, pp_schedule="gpipe", pp_virtual_stages=2), 2,
     ["mesh.pp_virtual_stages=2 with mesh.pp_schedule=gpipe", "Fix: mesh.pp_schedule=interleaved_1f1b"]),
    (dict(pp=2, pp_schedule="dualpipe"), 2, ["mesh.pp_schedule='dualpipe': unknown", "'zbv'"]),
    (dict(pp=0), 1, ["mesh.pp=0: must be >= 1"]),
    (dict(pp_split=[3]), 1, ["mesh.pp_split=[3] with mesh.pp=1", "Fix: set mesh.pp>1"]),
])
def test_bad_layouts_are_refused_naming_the_field(composed, mesh: dict, world: int, needles: list[str]) -> None:
    message = _problems(composed, world, **mesh)
    for needle in needles:
        assert needle in message


def _step_micro_batches(cfg, world: int, **mesh) -> int:
    cfg = copy.deepcopy(cfg)
    for key, value in mesh.items():
        OmegaConf.update(cfg, f"mesh.{key}", value)
    plan = ParallelPlan.from_config(cfg, world)
    return cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * plan.dp_size)


@pytest.mark.parametrize("pp, schedule, virtual, batch, needle", [
    (4, "1f1b", 1, 2, "1f1b needs at least mesh.pp=4 micro-batches per step, and the step has 2"),
    (2, "interleaved_1f1b", 2, 5, "interleaved_1f1b runs micro-batches in rounds of mesh.pp=2 and needs a whole "
                                  "number of rounds; the step has 5 (e.g. 4 or 6 would do)"),
])
def test_a_schedule_needing_more_micro_batches_than_the_step_has(composed, pp, schedule, virtual, batch, needle) -> None:
    cfg = copy.deepcopy(composed)
    cfg.trainer.global_batch_size = batch
    message = _problems(cfg, pp, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual)
    assert needle in message and "Fix:" in message and "trainer.global_batch_size" in message
    # the micro-batches are the step's: pp ranks read the same samples, so the data-parallel size is 1 here
    assert _step_micro_batches(cfg, pp, pp=pp) == batch


@pytest.mark.parametrize("mesh, world", [
    (dict(pp=2), 2),
    (dict(pp=2, pp_split=[1]), 2),
    (dict(pp=3, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_split=[1, 2, 3, 4, 5]), 3),
    (dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2), 2),
    (dict(pp=2, dp_shard=-1), 4),
])
def test_good_layouts_pass(composed, mesh: dict, world: int) -> None:
    cfg = copy.deepcopy(composed)
    for key, value in mesh.items():
        OmegaConf.update(cfg, f"mesh.{key}", value)
    _, plan = validate_config(cfg, world, weights=False)
    assert plan.pp == mesh["pp"] and plan.world_size == world and plan.stage_world_size == world // mesh["pp"]
