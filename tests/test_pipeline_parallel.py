"""Pipeline parallel against one process: the recipe's metrics rows (loss, gradient norm, MTP loss, MoE
balance) of five fp32 steps, checkpoints resumed across pipeline sizes, and the export of a pipeline's
checkpoint.

The model holds every block kind (pattern ME*M-ME: MoE blocks on both stages) with tiny dims, trains with
the MoE bias updates and the sequence-wise balance loss, and is split by estimated cost, which here
differs from the equal split. Every variant of one world size runs in one torchrun launch
(tests/distributed/pipeline_worker.py); the single-process references run in this process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, RUN_BASE, SMALL_DIMS, compose_run, metrics_rows
from safetensors.torch import load_file

from nemotron_recipe.config import ConfigError, build_model_config, pipeline_problems, validate_config
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import export_hf
from nemotron_recipe.training.pipeline.split import equal_starts, plan_split

WORKER = REPO / "tests" / "distributed" / "pipeline_worker.py"
RTOL = 1e-5  # losses and gradient norms, relative, per step
PARAM_ATOL = 1e-5  # the trained parameters after five steps
MODEL = [f"model.{k}={v}" for k, v in SMALL_DIMS.items() if k != "vocab_size"] + ["model.pattern=ME*M-ME"]
BASE = [*RUN_BASE, "eval.sample_tokens=0", "trainer.micro_batch_size=1", "trainer.max_steps=5", "trainer.val_every=0",
        "optim.warmup_steps=2", "moe.bias_update_rate=0.01", "moe.aux_loss_coeff=0.01", "checkpoint.every=3", *MODEL]
# lm-eval's task at the end of training (on the final checkpoint, loaded whole on rank 0).
EVAL = ["eval.tasks=[tiny_sft_mc]", "eval.limit=6"]
MTP_LORA = ["model.num_nextn_predict_layers=1", "peft=lora"]  # LoRA adapters on a model with MTP layers
COMPARED = ("loss", "grad_norm", "mtp_loss", "moe_aux_loss", "moe_load_imbalance")
# Samples (greedy, before and after training) decoded through the stages: their ids equal one process's.
SAMPLES = ["eval.sample_tokens=4"]

TWO_RANK = {  # name: (overrides, plant)
    "pp2": (["mesh=pp2", *SAMPLES], None),
    "interleaved": (["mesh=pp2", "mesh.pp_schedule=interleaved_1f1b", "mesh.pp_virtual_stages=2", *EVAL,
                     "checkpoint.export_hf=true", *SAMPLES], None),
    "gpipe_mtp_lora": (["mesh=pp2", "mesh.pp_schedule=gpipe", *MTP_LORA], None),
    # Zero bubble: four stages in a V on two ranks (rank 0 holds stages 0 and 3), each backward split
    # into an input-gradient and a weight-gradient pass.
    "zbv": (["mesh=pp2", "mesh.pp_schedule=zbv", "mesh.pp_virtual_stages=2", *SAMPLES], None),
    "drop_block": (["mesh=pp2", "trainer.max_steps=2", "checkpoint.every=0", *SAMPLES], "drop_block"),
    "no_normaliser": (["mesh=pp2", "trainer.max_steps=2", "checkpoint.every=0"], "no_normaliser"),
    "nan_first_stage": (["mesh=pp2", "trainer.max_steps=3", "checkpoint.every=0", "trainer.nonfinite=skip"],
                        "nan_first_stage"),
}
FOUR_RANK = {
    "pp2_fsdp2": (["mesh=pp2_fsdp"], None),
    "pp2_tp2_sp": (["mesh=pp2", "mesh.tp=2", "mesh.sequence_parallel=true", *SAMPLES], None),
    "pp2_ep2": (["mesh=pp2", "mesh.dp_shard=2", "mesh.ep=2"], None),
}

# Pipeline composed with context parallel, HSDP and activation checkpointing: three steps each, with
# each rank's checkpointed blocks recorded (the worker's "checkpointed" record) to show the wrapping
# happened on the stages and recomputed in the backward. name: (overrides, ranks, record)
SHORT = ["trainer.max_steps=3", "checkpoint.every=0"]
COMPOSED = {
    "pp2_ac_full": (["mesh=pp2", "ac=full", *SHORT], 2, "checkpointed"),
    "pp2_ac_selective": (["mesh=pp2", "ac=selective", *SHORT], 2, "checkpointed"),
    "pp2_ac_blocks": (["mesh=pp2", "ac=blocks", *SHORT], 2, "checkpointed"),
    "pp2_cp2": (["mesh=pp2", "mesh.cp=2", *SHORT], 4, None),
    "pp2_hsdp_ac_every_nth": (["mesh=pp2", "mesh.dp_replicate=2", "ac=every_nth", *SHORT], 4, "checkpointed"),
}


def composed_jobs(base: Path, ranks: int) -> list[dict]:
    return [{"overrides": [*BASE, *o, f"run_dir={base / name}"], "plant": None, "record": record}
            for name, (o, n, record) in COMPOSED.items() if n == ranks]


def torchrun(nproc: int, jobs: list[dict], cwd: Path, timeout: int = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(WORKER), json.dumps(jobs)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def train_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics_rows(run_dir) if "loss" in r}


def sample_ids(run_dir: Path) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["completion_ids"]) for r in map(json.loads, (run_dir / "samples.jsonl").open())]


def worst(rows: dict[int, dict], ref: dict[int, dict], keys=COMPARED) -> dict[str, float]:
    """The largest relative difference of each metric over the steps both runs logged."""
    assert set(rows) <= set(ref) and rows, (sorted(rows), sorted(ref))
    out = {}
    for key in keys:
        pairs = [(r[key], ref[s][key]) for s, r in rows.items() if key in ref[s]]
        assert len(pairs) == sum(key in r for r in rows.values()), f"{key}: logged by one run only"
        if pairs:
            out[key] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process references, then one 2-rank and one 4-rank launch; returns the base dir and timings."""
    base = tmp_path_factory.mktemp("pipeline")
    began = time.perf_counter()
    run(compose_run(base / "ref", *BASE, *EVAL, *SAMPLES))
    run(compose_run(base / "ref_mtp_lora", *BASE, *MTP_LORA))
    times = {"references_s": time.perf_counter() - began}

    def jobs(variants):
        return [{"overrides": [*BASE, *o, f"run_dir={base / name}"], "plant": plant} for name, (o, plant) in
                variants.items()]

    began = time.perf_counter()
    torchrun(2, [*jobs(TWO_RANK), *composed_jobs(base, 2)], base)
    times["two_rank_s"] = time.perf_counter() - began
    step3 = base / "ref" / "checkpoints" / "step_000003"
    began = time.perf_counter()
    resumed = {"overrides": [*BASE, "mesh=pp2_fsdp", f"checkpoint.resume={step3}",
                             f"run_dir={base / 'resumed_pp2_fsdp2'}"], "plant": None}
    torchrun(4, [*jobs(FOUR_RANK), *composed_jobs(base, 4), resumed], base)
    times["four_rank_s"] = time.perf_counter() - began
    (base / "times.json").write_text(json.dumps(times))
    return base


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["pp2", "interleaved", "gpipe_mtp_lora", "zbv", "pp2_fsdp2", "pp2_tp2_sp", "pp2_ep2"])
def test_pipeline_matches_one_process(runs, name):
    ref = train_rows(runs / ("ref_mtp_lora" if "mtp" in name else "ref"))
    rows = train_rows(runs / name)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    errors = worst(rows, ref)
    assert {"loss", "grad_norm", "moe_aux_loss", "moe_load_imbalance"} <= set(errors)
    if "mtp" in name:
        assert "mtp_loss" in errors
    assert max(errors.values()) <= RTOL, errors
    summary = json.loads((runs / name / "summary.json").read_text())
    assert summary["mesh"]["pp"] == 2
    if name == "interleaved":  # the end-of-training evaluation and export of a pipeline run
        reference = json.loads((runs / "ref" / "summary.json").read_text())
        scores = {k: v for k, v in reference.items() if k.startswith("eval/")}
        assert scores and {k: summary[k] for k in scores} == pytest.approx(scores, abs=1e-6)
        assert (runs / name / "hf" / "config.json").is_file()
    if "eval.sample_tokens=4" in (TWO_RANK | FOUR_RANK)[name][0]:  # samples decoded through the stages
        ours, reference = sample_ids(runs / name), sample_ids(runs / "ref")
        assert [s for s, _ in reference] == [0, 0, 5, 5] and all(ids for _, ids in reference), reference
        assert ours == reference
    # Validation before and after training runs through the stages too (data-parallel ranks would each
    # validate data.val_max_batches batches of their own: compared where there is one).
    if summary["mesh"].get("dp_shard", 1) * summary["mesh"].get("dp_replicate", 1) == 1:
        val = lambda d: [r["val_loss"] for r in metrics_rows(d) if "val_loss" in r]
        assert val(runs / name) == pytest.approx(val(runs / ("ref_mtp_lora" if "mtp" in name else "ref")), rel=RTOL)


def checkpointed_blocks(model_cfg, mode: str, every: int) -> set[int]:
    """The blocks one process wraps for recomputation (distributed/activation_checkpoint.py's modes)."""
    pattern = build_model_config(model_cfg).pattern
    if mode == "blocks":  # the model's pick: the Mamba and MLP blocks
        return {i for i, kind in enumerate(pattern) if kind in "M-"}
    return {i for i in range(len(pattern)) if mode != "every_nth" or i % every == 0}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(COMPOSED))
def test_pipeline_composes_with_cp_hsdp_and_activation_checkpointing(runs, name, tmp_path):
    overrides, ranks, record = COMPOSED[name]
    ref, rows = train_rows(runs / "ref"), train_rows(runs / name)
    assert sorted(rows) == [1, 2, 3]
    errors = worst(rows, ref)
    assert {"loss", "grad_norm", "moe_aux_loss", "moe_load_imbalance"} <= set(errors)
    assert max(errors.values()) <= RTOL, errors
    summary = json.loads((runs / name / "summary.json").read_text())
    assert summary["mesh"]["pp"] == 2 and summary["world_size"] == ranks
    if summary["mesh"].get("dp_replicate", 1) * summary["mesh"].get("dp_shard", 1) == 1:  # validation at step 0
        val = lambda d: {r["step"]: r["val_loss"] for r in metrics_rows(d) if "val_loss" in r}
        ours, reference = val(runs / name), val(runs / "ref")
        assert 0 in ours and ours[0] == pytest.approx(reference[0], rel=RTOL)
    if record:  # the stages wrapped what one process wraps, and recomputed it in every training backward
        cfg = compose_run(tmp_path, *BASE, *overrides)
        per_rank = [json.loads((runs / name / f"checkpointed_rank{r}.json").read_text()) for r in range(ranks)]
        stage_of = {r: r // (ranks // 2) for r in range(ranks)}  # pp is the outermost mesh dim
        by_stage = {stage: {b for r, rec in enumerate(per_rank) if stage_of[r] == stage for b in rec["blocks"]}
                    for stage in (0, 1)}
        assert not by_stage[0] & by_stage[1]
        assert by_stage[0] | by_stage[1] == checkpointed_blocks(cfg.model, cfg.ac.mode, cfg.ac.get("every", 1))
        for rec in per_rank:
            recomputed = rec.get("inner", 0) - rec.get("outer", 0)
            assert recomputed > 0 and recomputed % len(rec["blocks"]) == 0, rec


@pytest.mark.distributed
def test_planted_faults_are_caught(runs):
    ref = train_rows(runs / "ref")
    # A wrong stage boundary (a block left out) changes the loss far beyond the tolerance ...
    assert worst(train_rows(runs / "drop_block"), ref, ("loss",))["loss"] > 100 * RTOL
    # ... and the samples decoded through those stages (the ids of the untrained model, step 0, included);
    assert [ids for s, ids in sample_ids(runs / "drop_block") if s == 0] != [ids for s, ids in
                                                                           sample_ids(runs / "ref") if s == 0]
    # ... and a missing normalisation by the step's tokens the gradient norm (the logged loss is the sums').
    assert worst(train_rows(runs / "no_normaliser"), ref, ("grad_norm",))["grad_norm"] > 100 * RTOL


@pytest.mark.distributed
def test_a_nan_on_the_first_stage_skips_the_step_on_every_stage(runs):
    """The first stage's NaN reaches the last stage's loss and the first stage's gradients: every rank
    agrees the step is not finite, none takes it, and the next step trains on the weights before it."""
    rows = train_rows(runs / "nan_first_stage")
    assert [rows[s].get("skipped", False) for s in (1, 2, 3)] == [False, True, False]
    assert json.loads((runs / "nan_first_stage" / "summary.json").read_text())["skipped_steps"] == 1
    assert abs(rows[1]["loss"] - train_rows(runs / "ref")[1]["loss"]) <= RTOL * rows[1]["loss"]
    assert math.isfinite(rows[3]["loss"])  # finite again: no stage kept a NaN weight


@pytest.mark.distributed
def test_cost_split_differs_from_equal_split(tmp_path):
    config = build_model_config(compose_run(tmp_path, *BASE).model)
    assert set(config.pattern) == set("ME*-")
    split = plan_split(config, 2, seq_len=64, micro_batch=1)
    assert split.starts != equal_starts(config.num_layers, 2)


@pytest.mark.distributed
def test_resume_across_pipeline_sizes(runs, tmp_path):
    ref = train_rows(runs / "ref")
    # Saved by a 2-stage pipeline, resumed on one process.
    step3 = runs / "pp2" / "checkpoints" / "step_000003"
    assert json.loads((step3 / "meta.json").read_text())["mesh"]["pp"] == 2
    summary = run(compose_run(tmp_path, *BASE, f"checkpoint.resume={step3}"))
    assert summary["resumed_from"] == 3
    assert max(worst(train_rows(tmp_path), ref).values()) <= RTOL
    # Saved by one process, resumed on pp 2 x fsdp 2.
    resumed = train_rows(runs / "resumed_pp2_fsdp2")
    assert sorted(resumed) == [4, 5]
    assert max(worst(resumed, ref).values()) <= RTOL


@pytest.mark.distributed
@pytest.mark.parametrize("name,ref", [("pp2", "ref"), ("gpipe_mtp_lora", "ref_mtp_lora")])
def test_export_from_a_pipeline_checkpoint(runs, tmp_path, name, ref):
    """The Hugging Face export (full fine-tuning) and the PEFT adapter export (LoRA) of a pipeline's final
    checkpoint: every stage's tensors, under the same names and within 1e-5 of the single-process run's
    export (router biases, which the bias updates moved on both stages, included)."""
    ours = export_hf(runs / name / "checkpoints" / "step_000005", tmp_path / name)
    theirs = export_hf(runs / ref / "checkpoints" / "step_000005", tmp_path / ref)
    files = sorted(p.name for p in theirs.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in ours.glob("*.safetensors"))
    for file in files:
        mine, reference = load_file(ours / file), load_file(theirs / file)
        assert mine.keys() == reference.keys()
        diffs = {k: (mine[k].float() - reference[k].float()).abs().max().item() for k in reference}
        assert max(diffs.values()) <= PARAM_ATOL, max(diffs.items(), key=lambda kv: kv[1])
        if name == "pp2":
            moved = [k for k in reference if "e_score_correction_bias" in k and reference[k].abs().sum() > 0]
            assert len(moved) == 2  # one MoE block on each stage


def test_pipeline_refuses_what_it_cannot_run(tmp_path):
    assert pipeline_problems(compose_run(tmp_path, *BASE, "mesh=pp2")) == []
    assert pipeline_problems(compose_run(tmp_path, *BASE, "mesh=pp2", *SAMPLES)) == []  # samples run under pp
    assert pipeline_problems(compose_run(tmp_path, *BASE, "mesh=pp2", "mesh.pp_schedule=zbv",
                                         "mesh.pp_virtual_stages=2")) == []
    for overrides, field in ((["objective=dpo"], "objective.name=dpo"),
                             (["trainer.compile=true"], "trainer.compile=true")):
        problems = pipeline_problems(compose_run(tmp_path, *BASE, "mesh=pp2", *overrides))
        assert len(problems) == 1 and problems[0].startswith(field) and "Fix:" in problems[0], problems
        assert pipeline_problems(compose_run(tmp_path, *BASE, *overrides)) == []  # without a pipeline: fine
        with pytest.raises(ConfigError, match=re.escape(field)):  # the config check says so, as for every field
            validate_config(compose_run(tmp_path, *BASE, "mesh=pp2", *overrides), world_size=2)
