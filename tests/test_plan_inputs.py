"""The planner's inputs and advice: nonsense numbers refused, a released preset planned at its own sizes,
expert and sequence parallel suggested, CPU offload's host traffic in the floor, and only changes that fit."""

from __future__ import annotations

import math
import tempfile

import pytest
from hydra import compose, initialize_config_dir

from helpers import CONF, SMALL_DIMS
from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3.config import PRESET_SEQ_LEN, PRESETS
from nemotron_recipe.training.planner.activations import Workload
from nemotron_recipe.training.planner.comms import Hardware, offload_bytes, step_floor
from nemotron_recipe.training.planner.state import StateBytes
from recipes.plan import plan_report, released_defaults


def plan_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        # The planner writes nothing; run_dir only has to resolve outside a Hydra launch.
        return compose(config_name="plan", overrides=[f"run_dir={tempfile.gettempdir()}", *overrides])


@pytest.mark.parametrize("override, needle", [
    ("plan.world_size=0", "plan.world_size=0: must be >= 1"),
    ("plan.world_size=-4", "plan.world_size=-4: must be >= 1"),
    ("plan.device_memory_gib=-80", "plan.device_memory_gib=-80.0: must be a positive finite number"),
    ("plan.device_memory_gib=nan", "plan.device_memory_gib=nan"),
    ("plan.tflops_per_device=0", "plan.tflops_per_device=0.0: must be a positive finite number"),
    ("plan.link_gbps=nan", "plan.link_gbps=nan"),
    ("plan.ib_gbps=inf", "plan.ib_gbps=inf"),
    ("plan.ib_gbps=-1", "plan.ib_gbps=-1.0"),
    ("plan.devices_per_node=0", "plan.devices_per_node=0: must be >= 1"),
])
def test_nonsense_hardware_and_world_sizes_are_refused(override, needle):
    with pytest.raises(ConfigError) as e:
        plan_report(plan_cfg(override))
    assert needle in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("preset, world, mesh, dp", [
    ("nemotron_h_8b", 8, [], 8),
    ("nemotron3_nano_30b_a3b", 16, ["mesh.tp=2"], 8),
    ("nemotron_nano_9b_v2", 4, [], 4),
])
def test_a_released_preset_is_planned_at_its_own_sizes(preset, world, mesh, dp):
    cfg = plan_cfg(f"model={preset}", f"plan.world_size={world}", *mesh)
    line = released_defaults(cfg, world, {"model", "plan.world_size", *(m.split("=")[0] for m in mesh)})
    t = cfg.trainer
    assert (t.seq_len, t.micro_batch_size, t.global_batch_size) == (PRESET_SEQ_LEN[preset], 1, dp)
    assert f"sequences of {PRESET_SEQ_LEN[preset]} tokens, micro-batch 1, global batch {dp}" in line
    validate_config(cfg, world, weights=False)  # the first question passes the batch check


def test_explicit_sizes_and_the_tiny_preset_keep_their_values():
    cfg = plan_cfg("model=nemotron_h_8b", "trainer.seq_len=4096", "trainer.global_batch_size=64")
    line = released_defaults(cfg, 8, {"model", "trainer.seq_len", "trainer.global_batch_size"})
    assert (cfg.trainer.seq_len, cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size) == (4096, 1, 64)
    assert "trainer.micro_batch_size" in line and "trainer.seq_len" not in line
    tiny = plan_cfg()
    assert released_defaults(tiny, 2, set()) is None and tiny.trainer.seq_len == PRESET_SEQ_LEN["tiny"]
    assert set(PRESET_SEQ_LEN) == set(PRESETS)


def test_cpu_offload_counts_its_host_copies_in_the_floor():
    config = PRESETS["tiny"]
    state = StateBytes(params=4 * 2**30, grads=4 * 2**30, optimizer=8 * 2**30, elements=2**30)
    work, hw = Workload(1, 128, None), Hardware(pcie_gbps=512.0)
    on_gpu = ParallelPlan(dp_shard=8)
    offloaded = ParallelPlan(dp_shard=8, offload=True)
    assert offload_bytes(on_gpu, state, 2) == {}
    traffic = offload_bytes(offloaded, state, 2)
    # Two micro-batches: the parameter shard in for forward and again for backward, the gradient shard out.
    assert traffic == {"offload_h2d": 2 * 2 * state.params, "offload_d2h": 2 * state.grads}
    base = step_floor(config, offloaded, work, {}, 2, hw)
    with_copies = step_floor(config, offloaded, work, traffic, 2, hw)
    assert with_copies["comm_s"] - base["comm_s"] == pytest.approx(6 * state.params * 8 / 512e9)
    assert with_copies["floor_s"] > 0.1  # 24 GiB over a 64 GB/s link: the copies, not the FLOPs, set it


SMALL_MOE = [f"model.{k}={v}" for k, v in {**SMALL_DIMS, "pattern": "M*-E"}.items()]


def test_a_fitting_moe_launch_is_offered_expert_and_sequence_parallel():
    launch = [*SMALL_MOE, "mesh.tp=2", "plan.world_size=4", "trainer.seq_len=32", "trainer.global_batch_size=4",
              "trainer.micro_batch_size=2"]
    report, text = plan_report(plan_cfg(*launch), set())
    assert report["fits"]
    changes = [s["change"] for s in report["suggestions"]]
    assert "mesh.ep=2" in changes and "mesh.sequence_parallel=true" in changes
    assert all(s["fits"] for s in report["suggestions"]) and "faster layouts that also fit" in text
    assert math.isfinite(report["step_time_s"]["floor_s"])


def test_the_fastest_fitting_change_is_offered_with_expert_parallel_on_top():
    """Expert parallel seldom saves memory, so alone it rarely makes a launch fit: the fastest change that
    does is offered with it too (the list `suggest` returns holds only changes that fit)."""
    from nemotron_recipe.training.planner.estimate import Planner
    from nemotron_recipe.training.planner.launch import GIB, Launch, evaluate
    from nemotron_recipe.training.planner.suggest import Suggestion, _faster

    cfg = plan_cfg(*SMALL_MOE, "plan.world_size=2", "trainer.seq_len=32", "trainer.global_batch_size=4",
                   "trainer.micro_batch_size=2")
    launch = Launch.from_config(cfg, 2, 80 * GIB)
    planner = Planner(launch.config, launch.work, launch.trainability)
    best = Suggestion("fsdp=bf16", evaluate(planner, launch))
    extra = _faster({(id(launch.config), launch.trainability, launch.work): planner}, [best])
    assert [s.change for s in extra] == ["fsdp=bf16 mesh.ep=2"]
    assert extra[0].outcome.fits and extra[0].outcome.launch.plan.ep == 2
