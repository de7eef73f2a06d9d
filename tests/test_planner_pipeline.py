"""The planner with pipeline parallel: schedules played out against their textbook bubbles and torch's own
warm-up counts, stage costs that lengthen the step, each pipeline rank's state adding up to the whole
model's, the micro-batches each schedule keeps in flight, the report, the suggestions and the pre-flight."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import PREFLIGHT_ON, compose_run
from nemotron_recipe.config import validate_config
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.training.pipeline.split import equal_starts, plan_split
from nemotron_recipe.training.planner import Planner
from nemotron_recipe.training.planner.comms import Hardware
from nemotron_recipe.training.planner.launch import Launch, evaluate
from nemotron_recipe.training.planner.pipeline import bubble_formula, play, schedule_actions
from nemotron_recipe.training.planner.pipeline_estimate import PipelineLayout, boundary_bytes
from nemotron_recipe.training.planner.report import as_dict, as_text
from nemotron_recipe.training.planner.state import StateBytes
from nemotron_recipe.training.planner.suggest import speedups

GIB = 2**30


@pytest.mark.parametrize("schedule, pp, virtual", [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 2, 1),
                                                    ("interleaved_1f1b", 4, 2), ("interleaved_1f1b", 2, 3)])
def test_equal_stages_play_the_textbook_bubble(schedule: str, pp: int, virtual: int) -> None:
    n = 8
    played = play(schedule_actions(schedule, pp, virtual, n), [1.0] * (pp * virtual), [1.0] * (pp * virtual))
    assert played.bubble == pytest.approx(bubble_formula(schedule, pp, virtual, n), abs=1e-12)
    assert played.makespan == pytest.approx(3 * n * virtual / (1 - played.bubble))


def test_micro_batches_in_flight_per_schedule() -> None:
    n, pp = 8, 4
    def held(schedule: str, virtual: int = 1) -> tuple[int, ...]:
        return play(schedule_actions(schedule, pp, virtual, n), [1.0] * pp * virtual, [1.0] * pp * virtual).peak_in_flight
    assert held("gpipe") == (n,) * pp  # every forward before any backward
    assert held("1f1b") == (4, 3, 2, 1)  # rank r: pp - r
    # torch's interleaved warm-up: (v - 1) x (micro-batches per round) + 2 (pp - 1 - r) forwards, then one
    # more before the first backward; rounds of max(1, n // pp)
    per_round = n // max(1, n // pp)
    assert held("interleaved_1f1b", 2) == tuple((2 - 1) * per_round + 2 * (pp - 1 - r) + 1 for r in range(pp))
    zbv = play(schedule_actions("zbv", pp, 2, n), [1.0] * 8, [1.0] * 8)
    one = play(schedule_actions("1f1b", pp, 1, n), [1.0] * 4, [1.0] * 4)
    assert zbv.bubble < one.bubble / 3  # the weight gradients fill the bubble: 5.9% against 27.3%


def test_the_slowest_stage_sets_the_step() -> None:
    """Nano over 4 stages, 8 micro-batches of 2048 tokens: the step played with each split's stage times."""
    nano = NemotronHConfig.from_preset("nemotron3_nano_30b_a3b")
    balanced = plan_split(nano, 4, seq_len=2048, micro_batch=1)
    equal = plan_split(nano, 4, split_points=list(equal_starts(52, 4)[1:]), seq_len=2048, micro_batch=1)
    orders = schedule_actions("1f1b", 4, 1, 8)
    steps = {name: play(orders, [t / 3 for t in s.times], [0.0] * 4).makespan for name, s in
             (("balanced", balanced), ("equal", equal))}
    for name, split in (("balanced", balanced), ("equal", equal)):
        assert steps[name] >= 8 * max(split.times)  # the slowest stage runs every micro-batch
    assert steps["balanced"] < 0.85 * steps["equal"]


@pytest.fixture(scope="module")
def tiny_pp2(tmp_path_factory):
    cfg = compose_run(tmp_path_factory.mktemp("run"), "model=tiny", "mesh=pp2", "trainer.global_batch_size=8",
                      "trainer.micro_batch_size=1")
    launch = Launch.from_config(cfg, 2, 80 * GIB)
    planner = Planner(launch.config, launch.work, launch.trainability)
    return launch, planner, evaluate(planner, launch)


def test_pipeline_ranks_hold_the_whole_models_state_between_them(tiny_pp2) -> None:
    launch, planner, outcome = tiny_pp2
    whole = planner.state(dataclasses.replace(launch.plan, pp=1))  # one process: the stage world of pp 2 x 1
    ranks = sum(outcome.pipeline.rank_states, StateBytes())
    assert (ranks.params, ranks.grads, ranks.optimizer) == (whole.params, whole.grads, whole.optimizer)
    assert all(0 < s.params < whole.params for s in outcome.pipeline.rank_states)


def test_each_schedule_keeps_its_micro_batches_in_flight(tiny_pp2) -> None:
    launch, planner, outcome = tiny_pp2
    trace = planner.trace(dataclasses.replace(launch.plan, pp=1))
    boundary = boundary_bytes(launch.config, launch.plan, launch.work)
    split = outcome.pipeline.split
    kept = [sum(trace.kept[b] for b in split.blocks(s)) + boundary for s in range(2)]
    assert outcome.pipeline.played.peak_bytes == pytest.approx((2 * kept[0], 1 * kept[1]))  # 1F1B: pp - r
    gpipe = evaluate(planner, dataclasses.replace(launch, pipeline=PipelineLayout("gpipe")))
    assert gpipe.pipeline.played.peak_bytes == pytest.approx((8 * kept[0], 8 * kept[1]))  # all 8
    assert gpipe.estimate.activations > outcome.estimate.activations
    assert outcome.estimate.device_total == max(outcome.pipeline.rank_totals)


def test_the_report_shows_the_split_bubble_and_p2p(tiny_pp2) -> None:
    _, _, outcome = tiny_pp2
    text, report = as_text(outcome, []), as_dict(outcome, [])
    assert "pipeline: pp=2, 2 stages, 1f1b over 8 micro-batches per step: bubble" in text
    assert "pipeline split over 2 stages (balanced by estimated cost; mesh.pp_split=[" in text
    assert report["mesh"]["pp"] == 2 and report["pipeline"]["bubble"] == pytest.approx(outcome.time["bubble"], abs=1e-4)
    assert outcome.traffic["pp_p2p"] == 8 * 1 * boundary_bytes(outcome.launch.config, outcome.launch.plan,
                                                                outcome.launch.work)  # one boundary, each way


def test_pipeline_is_suggested_where_it_shortens_the_floor(tiny_pp2, monkeypatch) -> None:
    """2 ranks on nodes of 1 behind a slow link: FSDP over both crosses it every micro-batch for every block,
    a pipeline of 2 only a boundary's activations."""
    from nemotron_recipe.training.planner import suggest

    monkeypatch.setattr(suggest, "_expert_parallel", lambda *args: iter(()))  # the pipeline's candidates only
    launch, planner, _ = tiny_pp2
    wide = dataclasses.replace(launch, plan=dataclasses.replace(launch.plan, pp=1, dp_shard=2), grad_accum=4,
                               hardware=Hardware(ib_gbps=1.0, devices_per_node=1))
    found = {s.change: s for s in speedups(planner, wide)}
    assert list(found) == ["mesh.pp=2"]  # 8 micro-batches per step, each through both stages: 1F1B
    assert found["mesh.pp=2"].outcome.time["floor_s"] < evaluate(planner, wide).time["floor_s"]


def test_the_preflight_plans_a_pipeline(tmp_path, monkeypatch) -> None:
    from nemotron_recipe.training.planner import preflight as preflight_module
    from nemotron_recipe.training.planner.preflight import PreflightError, preflight

    monkeypatch.setattr(preflight_module, "suggest", lambda *args, **kwargs: [])
    cfg = compose_run(tmp_path, "trainer.device=cpu", PREFLIGHT_ON, "mesh=pp2", "trainer.global_batch_size=4",
                      "trainer.micro_batch_size=1")
    validated = validate_config(cfg, 2)
    monkeypatch.setenv("NR_DEVICE_MEMORY_GIB", "0.01")  # less than a rank's state: refused untraced
    with pytest.raises(PreflightError, match="needs at least 0.0[0-9] GiB per rank .* on pipeline rank 1 of 2"):  # the head's
        preflight(cfg, validated, 2)
