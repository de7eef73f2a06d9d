"""The planner (nemotron_recipe/training/planner, recipes/plan.py) and the launch's pre-flight.

State bytes are checked to the byte against the real sharded model on simulated worlds of 8 ranks;
the traced step against the allocations of the real step (what CUDA's allocator peak reports) and,
on CPU, against the measured resident set; the reduced-model extrapolation against the whole trace;
and the pre-flight against an 8B launch that must stop before allocating anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import yaml

from benchmarks.plan_validation import OPTIM, live_state, model_config, plan_for
from benchmarks.throughput import mesh_sizes
from nemotron_recipe.distributed import expert_parallel
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import LoRASpec, add_adapters
from nemotron_recipe.models.nemotron_v3.mtp import shift_for_mtp
from nemotron_recipe.training.loss import forward_loss_sum, forward_loss_sums
from nemotron_recipe.training.optim import build_optimizer
from nemotron_recipe.training.planner import Planner, Workload, fake_world
from nemotron_recipe.training.planner import activations
from nemotron_recipe.training.planner.activations import extrapolate, trace
from nemotron_recipe.training.planner.world import Trainability, reduced_config
from nemotron_recipe.training.setup import parallelize_model
from tests.helpers import CONF, PREFLIGHT_ON, REPO, compose_run

# A vocabulary that no mesh here divides evenly, so FSDP's padding is part of what is checked.
ODD_TINY = dataclasses.replace(NemotronHConfig.from_preset("tiny"), vocab_size=520)
MESHES_OF_8 = {
    "fsdp": "dp_shard=8",
    "tp": "tp=2",
    "cp": "cp=2",
    "tp_cp": "tp=2,cp=2",
    "hsdp": "dp_replicate=2",
    "hsdp_tp": "dp_replicate=2,tp=2",
    "ep": "dp_shard=8,ep=4",  # 2 experts per rank, each sharded over 2 (ep_shard)
    "hsdp_ep": "dp_replicate=2,ep=2",
}
LORA = Trainability(LoRASpec(8, 16.0, 0.0, ("*.in_proj", "*.out_proj", "*.q_proj", "*.up_proj", "*.down_proj")),
                    torch.bfloat16)


def _real_state(config: NemotronHConfig, plan, trainability: Trainability | None = None) -> dict[str, int]:
    """Bytes of the live shards after a real step with gradients kept, in the same fake world, with
    the model adapted and frozen as the trainer does. The fake world carries no data between ranks, so
    expert parallel's row counts are taken balanced, as in the planner's trace."""
    trainability = trainability or Trainability()
    torch.manual_seed(0)
    with fake_world(plan.world_size), mock.patch.object(expert_parallel, "is_fake", lambda t: True):
        model = NemotronHForCausalLM(config)
        if trainability.lora:
            model.to(trainability.base_dtype)
            add_adapters(model, trainability.lora)
        model = parallelize_model(model, plan, plan.build_meshes("cpu"), reapply_trainability=trainability.reapply())
        optimizer = build_optimizer(model, OPTIM)
        ids = torch.randint(0, config.vocab_size, (2, 32 // plan.cp))
        depths = config.num_nextn_predict_layers  # MTP layers train as in the trainer
        forward_loss_sums(model, ids, ids, backward_denominator=1.0, mtp=shift_for_mtp(ids, ids, depths) if depths else None,
                          mtp_loss_scale=config.effective_mtp_loss_scale)
        optimizer.step()
        return live_state(model, optimizer)


def _assert_state_exact(plan, trainability: Trainability | None = None, config: NemotronHConfig = ODD_TINY) -> None:
    predicted = Planner(config, Workload(2, 32), trainability).state(plan)
    real = _real_state(config, plan, trainability)
    assert (predicted.params, predicted.grads, predicted.optimizer) == (real["params"], real["grads"], real["optimizer"])


@pytest.mark.parametrize("mesh", MESHES_OF_8, ids=list(MESHES_OF_8))
def test_state_bytes_exact_on_8_simulated_ranks(mesh):
    _assert_state_exact(plan_for(MESHES_OF_8[mesh], 8, "none", "bf16", 32))


@pytest.mark.parametrize("mesh", ["fsdp", "tp", "ep"])
def test_latent_moe_and_mtp_state_bytes_exact_on_8_simulated_ranks(mesh):
    """LatentMoE's projections, and an MTP layer (fusion, its own blocks) trained as the trainer does."""
    config = dataclasses.replace(ODD_TINY, moe_latent_size=32, num_nextn_predict_layers=1)
    _assert_state_exact(plan_for(MESHES_OF_8[mesh], 8, "none", "bf16", 32), config=config)


@pytest.mark.parametrize("mesh", ["fsdp", "tp", "ep"])
def test_lora_state_bytes_exact_on_8_simulated_ranks(mesh):
    """LoRA adapters (fp32, routed experts' per-expert adapters included) over a frozen bf16 base."""
    _assert_state_exact(plan_for(MESHES_OF_8[mesh], 8, "none", "bf16", 32), LORA)


def test_frozen_parameters_hold_no_gradients_or_optimizer_state():
    plan = plan_for("dp_shard=2", 2, "none", "bf16", 32)
    full = Planner(ODD_TINY, Workload(2, 32)).state(plan)
    lora = Trainability(LoRASpec(4, 8.0, 0.0, ("*.in_proj", "*.up_proj")), torch.bfloat16)
    adapted = Planner(ODD_TINY, Workload(2, 32), lora).state(plan)
    assert adapted.grads < full.grads / 20 and adapted.optimizer < full.optimizer / 20
    assert adapted.params < full.params  # a bf16 base


@pytest.mark.parametrize("ac", ["none", "full"])
def test_traced_step_equals_the_real_steps_allocations(ac):
    """The fake trace against torch's tracker on the real tensors of the same step: the peak the CUDA
    allocator would report (no allocator slack), to the byte up to the input ids."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    config, plan = model_config("tiny"), plan_for("", 1, ac, "fp32", 128)
    predicted = Planner(config, Workload(4, 128)).estimate(plan).trace.peak
    torch.manual_seed(0)
    with fake_world(1):
        model = parallelize_model(NemotronHForCausalLM(config), plan, plan.build_meshes("cpu"))
        ids = torch.randint(0, config.vocab_size, (4, 128))
        tracker = FSDPMemTracker(model)
        with tracker:
            forward_loss_sum(model, ids, ids, backward_denominator=1.0)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    measured = peak["Total"] - peak[_FSDPRefType.SHARDED_PARAM] - peak[_FSDPRefType.INP]
    assert abs(predicted - measured) <= 0.01 * measured


class _CountingAllToAll(activations._BalancedRouting):
    """The traced step's routing, also adding up what rank 0 sends in every all-to-all: each row
    not in its own (first) split."""

    sent: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            rows, splits = args[0], args[2]
            row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
            self.sent.append((sum(splits) - splits[0]) * row_bytes)
        return super().__torch_dispatch__(func, types, args, kwargs)


# (model, mesh, ac, dtype, micro-batch x tokens, all-to-alls counted by hand, bytes each). tiny: one MoE
# block of 8 experts, top-2 routing, rows of the hidden width H. Recomputation (full, selective) runs its
# exchanges again.
H = ODD_TINY.hidden_size
LATENT_MTP_TINY = dataclasses.replace(NemotronHConfig.from_preset("tiny"), moe_latent_size=32,
                                      num_nextn_predict_layers=1)
EP_CASES = {
    # 512 rows over 2 ranks: 256 sent, H fp32 each.
    "ep2": (ODD_TINY, "dp_shard=4,ep=2", "none", "fp32", (2, 128), 4, 256 * H * 4),
    # 254 rows over 4 ranks as 64, 64, 63, 63: rank 0 keeps 64 and sends 190.
    "ep4_uneven_full_ac": (ODD_TINY, "dp_shard=4,ep=4", "full", "fp32", (1, 127), 6, 190 * H * 4),
    # tp 2 with sequence parallel: each tp rank routes its own half of the sequence, 256 rows, sends 128.
    "tp2_sp": (ODD_TINY, "dp_shard=2,tp=2,sequence_parallel=true,ep=2", "none", "fp32", (2, 128), 4, 128 * H * 4),
    # Latent MoE with an MTP layer (pattern *E): two MoE blocks, rows of the latent width 32 in bf16.
    "latent_mtp_selective": (LATENT_MTP_TINY, "dp_shard=2,ep=2", "selective", "bf16", (2, 64), 12, 128 * 32 * 2),
}


@pytest.mark.parametrize("case", EP_CASES, ids=list(EP_CASES))
def test_expert_all_to_all_bytes_are_what_the_traced_step_sends(case, monkeypatch):
    """The planner's expert-parallel traffic against a hand count and against the all-to-alls the
    traced step issues (forward, backward, recomputation), to the byte."""
    from nemotron_recipe.training.planner.comms import ep_bytes

    config, mesh, ac, dtype, (micro_batch, seq_len), exchanges, each = EP_CASES[case]
    sizes = mesh_sizes(mesh)
    plan = plan_for(mesh, sizes["dp_shard"] * sizes["tp"], ac, dtype, seq_len)
    work = Workload(micro_batch, seq_len)
    monkeypatch.setattr(activations, "_BalancedRouting", _CountingAllToAll)
    monkeypatch.setattr(_CountingAllToAll, "sent", [])
    Planner(config, work).estimate(plan)
    assert len(_CountingAllToAll.sent) == exchanges and set(_CountingAllToAll.sent) == {each}
    assert ep_bytes(config, plan, work) == exchanges * each


def test_moe_gradients_are_all_reduced_over_tp_only_under_sequence_parallel():
    """Whole MoE blocks on every tp rank: with sequence parallel each routes its own tokens, so the
    blocks' FSDP gradient shards (one block: up and down of 8 experts, the router's 8 rows and the shared
    expert, over dp_shard 2, fp32) are all-reduced over the 2 tp ranks per micro-batch; without, nothing."""
    from nemotron_recipe.training.planner.comms import moe_tp_bytes
    from nemotron_recipe.training.planner.state import StateBytes

    config = NemotronHConfig.from_preset("tiny")
    h, experts = config.hidden_size, config.n_routed_experts
    per_block = (2 * experts * config.moe_intermediate_size * h + experts * h
                 + 2 * h * config.moe_shared_expert_intermediate_size)
    full = StateBytes(params=1, grads=1)
    sp = plan_for("dp_shard=2,tp=2,sequence_parallel=true", 4, "none", "fp32", 128)
    assert config.pattern.count("E") == 1 and experts == 8
    assert moe_tp_bytes(config, sp, full, micro_batches=3) == 3 * 2 * (per_block / 2 * 4) / 2
    assert moe_tp_bytes(config, plan_for("dp_shard=2,tp=2", 4, "none", "fp32", 128), full, 3) == 0


def test_expert_parallel_activations_do_not_grow_with_the_world():
    """At a fixed per-rank batch a rank's experts receive as many rows at any world size; more ranks
    only shard each expert further (ep_shard), whose gathered weights are transient like any unit's,
    and whose gradient shards (part of an MoE block's backward peak) shrink: the peak may fall with the
    world, never rise. An 18-block MoE model is extrapolated from its reduced trace, and the result
    held to the whole trace at the largest world."""
    config = dataclasses.replace(ODD_TINY, pattern="ME" * 9)
    work = Workload(2, 128)
    planner = Planner(config, work)
    plans = {w: plan_for(f"dp_shard={w},ep=2", w, "none", "fp32", 128) for w in (2, 4, 8)}
    acts = {w: planner.estimate(plan).activations for w, plan in plans.items()}
    assert max(acts[4], acts[8]) <= 1.01 * acts[2], acts
    with fake_world(8):
        whole = trace(config, plans[8], plans[8].build_meshes("cpu"), work)
    assert abs(whole.peak - planner.estimate(plans[8]).trace.peak) <= 0.03 * whole.peak


@pytest.mark.parametrize("ac", ["none", "full", "blocks"])
def test_reduced_model_extrapolates_to_the_whole_trace(ac):
    config, plan = model_config("h1024"), plan_for("", 1, ac, "bf16", 256)
    work = Workload(2, 256)
    with fake_world(1):
        meshes = plan.build_meshes("cpu")
        whole = trace(config, plan, meshes, work)
        reduced = extrapolate(config, trace(reduced_config(config), plan, meshes, work))
    assert abs(reduced.peak - whole.peak) <= 0.03 * whole.peak


# Every block above 64 KiB mapped on its own and unmapped when freed: the resident set then follows what
# the tensors hold (as CUDA's allocator statistics do), not what glibc's heap keeps of freed blocks.
TENSOR_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def _measured_rows(launcher: list[str], mesh: str = "") -> list[tuple[float, float]]:
    """(predicted, measured) MiB of tiny's rows of benchmarks/plan_validation (rank 0's), at micro-batch
    2 x 512 tokens to keep it short; state bytes exact."""
    out = subprocess.run(
        [*launcher, "-m", "benchmarks.plan_validation", "--models", "tiny", "--ac", "none,full", "--mesh", mesh,
         "--micro-batch", "2"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **TENSOR_RSS},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if "step peak predicted" in line]
    assert len(rows) == 2, out.stdout
    assert all("state bytes exact: True" in line for line in rows), out.stdout
    return [tuple(float(r.split(key)[1].split("MiB")[0]) for key in ("predicted", "measured")) for r in rows]


def test_predicted_peak_within_15_percent_of_measured_rss_one_process():
    """tiny on one process, with and without recomputation: the resident set above the step's start
    (benchmarks/measure.py's measure). h1024's rows are the benchmark's (docs/planner-validation.md): they
    take a minute."""
    rows = _measured_rows([sys.executable])
    assert all(abs(predicted - measured) <= 0.15 * measured for predicted, measured in rows), rows


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["dp_shard=2", "tp=2", "dp_shard=2,ep=2"])
def test_predicted_peak_within_15_percent_of_measured_rss_two_ranks(mesh):
    """tiny on fsdp 2, tp 2 and under expert parallel over the 2 ranks (each rank's experts receive its
    peer's rows as the balanced trace assumes; the tiny model routes near-evenly). h1024's two-rank rows
    are the benchmark's (docs/planner-validation.md)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rows = _measured_rows(torchrun, mesh)
    assert all(abs(predicted - measured) <= 0.15 * measured for predicted, measured in rows), rows


def test_a_mesh_that_cannot_work_fails_with_the_launch_message(tmp_path):
    """tp=3 divides nothing in the tiny model: the planner's error is the parallelizer's at launch."""
    from hydra import compose, initialize_config_dir

    from nemotron_recipe.distributed import ParallelConfigError
    from recipes.plan import plan_report

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="plan", overrides=["mesh.tp=3", "plan.world_size=6", "trainer.global_batch_size=48",
                                                     f"run_dir={tmp_path}"])
    with pytest.raises(ParallelConfigError) as planned:
        plan_report(cfg)
    plan = plan_for("tp=3", 6, "none", "fp32", 128)
    with fake_world(6), pytest.raises(ParallelConfigError) as launched:
        parallelize_model(NemotronHForCausalLM(model_config("tiny")), plan, plan.build_meshes("cpu"))
    assert str(planned.value) == str(launched.value)
    assert "mesh.tp=3" in str(planned.value)


def test_plan_json_reports_every_figure(tmp_path):
    out = subprocess.run(
        # One block of each kind: every figure and suggestion of the report, with fewer ops to trace.
        [sys.executable, "-m", "recipes.plan", "--json", "mesh.tp=2", "plan.world_size=8", "model.pattern=M*-E",
         "trainer.global_batch_size=32", "plan.device_memory_gib=0.01"],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2, out.stderr[-3000:]  # does not fit in 10 MiB
    report = json.loads(out.stdout)
    per_rank = report["per_rank_gib"]
    assert report["fits"] is False and report["world_size"] == 8 and report["mesh"]["tp"] == 2
    assert per_rank["total"] >= per_rank["params"] + per_rank["optimizer"]
    assert report["bytes_per_rank_per_step"]["tp_all_reduce"] > 0
    assert report["step_time_s"]["floor_s"] > 0
    assert all(s["fits"] for s in report["suggestions"])  # a change that does not fit is never listed
    assert not list(tmp_path.iterdir())  # nothing written


def test_plan_config_composes_the_finetune_defaults():
    finetune = yaml.safe_load((CONF / "finetune.yaml").read_text())["defaults"]
    plan = yaml.safe_load((CONF / "plan.yaml").read_text())["defaults"]
    groups = [d for d in plan if d != "plan_schema" and not (isinstance(d, dict) and "override hydra/job_logging" in d)]
    assert groups == [d for d in finetune if d != "finetune_schema"]


def test_preflight_stops_an_8b_launch_before_allocating(tmp_path):
    """`recipes.finetune model=nemotron_h_8b` on a device of 4 GiB (the override keeps the test safe on
    any machine): exit 1 with the estimate and fixes, never the kernel's kill."""
    out = subprocess.run(
        [sys.executable, "-m", "recipes.finetune", "model=nemotron_h_8b", "trainer.max_steps=1", f"run_dir={tmp_path}"],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NR_DEVICE_MEMORY_GIB": "4"},
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "pre-flight: this launch needs at least 90.5" in out.stderr
    # Nothing fits 4 GiB, one change at a time, up to 64 ranks: said so, no non-fitting change listed.
    assert "4.00 GiB per rank" in out.stderr and "no single change tried fits" in out.stderr
    assert "does not fit)" not in out.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_preflight_modes(tmp_path, monkeypatch, caplog):
    from nemotron_recipe.config import validate_config
    from nemotron_recipe.training.planner import preflight as preflight_module
    from nemotron_recipe.training.planner.preflight import PreflightError, preflight

    # The modes, not the suggestions (the 8B launch and the JSON report check those): none searched.
    monkeypatch.setattr(preflight_module, "suggest", lambda *args, **kwargs: [])
    monkeypatch.setenv("NR_DEVICE_MEMORY_GIB", "0.001")
    cfg = compose_run(tmp_path, "trainer.device=cpu", PREFLIGHT_ON)
    validated = validate_config(cfg)
    with pytest.raises(PreflightError, match="GiB per rank"):
        preflight(cfg, validated, 1)
    cfg.trainer.preflight = "warn"
    preflight(cfg, validated, 1)
    assert "pre-flight" in caplog.text
    cfg.trainer.preflight = False
    monkeypatch.setenv("NR_DEVICE_MEMORY_GIB", "not used")
    preflight(cfg, validated, 1)
    monkeypatch.setenv("NR_DEVICE_MEMORY_GIB", "64")
    cfg.trainer.preflight = True
    preflight(cfg, validated, 1)  # fits


def test_preflight_refuses_an_unknown_mode(tmp_path):
    from nemotron_recipe.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="trainer.preflight='maybe'"):
        validate_config(compose_run(tmp_path, "trainer.preflight=maybe"))




@pytest.mark.parametrize("scale", ["0", "0.1"])
def test_preflight_traces_models_with_mtp_layers_trained_or_not(tmp_path, monkeypatch, scale):
    from nemotron_recipe.config import validate_config
    from nemotron_recipe.training.planner.preflight import preflight

    monkeypatch.setenv("NR_DEVICE_MEMORY_GIB", "64")
    cfg = compose_run(tmp_path, "trainer.device=cpu", "model.num_nextn_predict_layers=1", f"model.mtp_loss_scale={scale}",
                      PREFLIGHT_ON)
    preflight(cfg, validate_config(cfg), 1)  # fits, and the trace finished
