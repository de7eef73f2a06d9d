"""The fine-tuning recipe end to end, on CPU, with settings small enough for seconds per run."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from nemotron_recipe.config import ConfigError, ModelConfig, build_model_config, run_id
from nemotron_recipe.models.nemotron_v3.config import PRESETS, ModelConfigError, NemotronHConfig
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.loss import cross_entropy_sum
from nemotron_recipe.training.optim import clip_grad_norm_, lr_factor

from helpers import PREFLIGHT_ON, RUN_BASE, compose_run, metrics_rows

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

TINY = [*RUN_BASE, "trainer.max_steps=4", "trainer.val_every=2"]


make_cfg = functools.partial(compose_run, base=TINY)
read_rows = metrics_rows

def cli(*args: str, cwd: Path = REPO, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "recipes.finetune", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


# ---------------------------------------------------------------------------------------- runs
def test_run_writes_metrics_summary_and_learns(tmp_path):
    summary = run(make_cfg(tmp_path))
    rows = read_rows(tmp_path)

    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    # Warmup: lr climbs linearly over the first optimizer steps.
    assert train[0]["lr"] < train[1]["lr"] < train[2]["lr"]

    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 2, 4]
    assert val[-1]["val_loss"] < val[0]["val_loss"]

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 4
    assert on_disk["first_val_loss"] == pytest.approx(val[0]["val_loss"])
    assert on_disk["last_val_loss"] == pytest.approx(val[-1]["val_loss"])
    assert on_disk["val_loss_ratio"] == pytest.approx(val[-1]["val_loss"] / val[0]["val_loss"])
    assert on_disk["run_dir"] == str(tmp_path)
    assert on_disk["tokens_per_s"] > 0 and on_disk["wall_time_s"] > 0


def test_loss_does_not_depend_on_micro_batching(tmp_path):
    """Normalising by the step's global token count makes gradient accumulation exact."""
    common = ["trainer.max_steps=2", "trainer.val_every=0", "optim.warmup_steps=0"]
    run(make_cfg(tmp_path / "a", *common, "trainer.micro_batch_size=4"))
    run(make_cfg(tmp_path / "b", *common, "trainer.micro_batch_size=1"))
    a = [r["loss"] for r in read_rows(tmp_path / "a") if "loss" in r]
    b = [r["loss"] for r in read_rows(tmp_path / "b") if "loss" in r]
    assert a == pytest.approx(b, rel=1e-4)


def test_cli_run_uses_hydra_run_dir(tmp_path):
    out = tmp_path / "run"
    proc = cli(*TINY, "trainer.max_steps=2", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "fine-tuning summary" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_dir"] == str(out) and summary["steps"] == 2
    assert (out / ".hydra" / "config.yaml").is_file()
    assert any("val_loss" in r for r in read_rows(out))


def test_wandb_offline_writes_under_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Unroutable endpoint: an attempt to reach the network would fail rather than silently succeed.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run(make_cfg(tmp_path, "trainer.max_steps=2", "logger.wandb.mode=offline", "logger.wandb.tags=[test]"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_pretrained_checkpoint_is_fine_tuned(tmp_path):
    from nemotron_recipe.models.nemotron_v3 import CheckpointError, NemotronHForCausalLM

    torch.manual_seed(0)
    saved = NemotronHForCausalLM(NemotronHConfig.from_preset("tiny", hidden_size=64))
    saved.save_pretrained(str(tmp_path / "ckpt"))
    summary = run(make_cfg(tmp_path / "run", f"model.pretrained={tmp_path / 'ckpt'}", "trainer.max_steps=2"))
    assert summary["num_parameters"] == saved.num_parameters()
    with pytest.raises(CheckpointError, match="shapes differ"):
        run(make_cfg(tmp_path / "bad", f"model.pretrained={tmp_path / 'ckpt'}", "model.hidden_size=32"))


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> Path:
    """The one-process run the torchrun launches are compared with (once per module)."""
    run_dir = tmp_path_factory.mktemp("single")
    run(make_cfg(run_dir, *TORCHRUN_STEPS))
    return run_dir


TORCHRUN_STEPS = ["trainer.max_steps=5", "trainer.val_every=0", "data.val_max_batches=null", "eval.sample_tokens=8"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mesh, expected",
    [
        ([], {"dp_shard": 2}),
        (["mesh.cp=2"], {"cp": 2, "dp_shard": 1}),
        # With the pre-flight on both ranks: it plans the tp + SP launch and lets it through.
        (["mesh.tp=2", "mesh.sequence_parallel=true", "ac=blocks", PREFLIGHT_ON], {"tp": 2, "dp_shard": 1}),
    ],
    ids=["fsdp2", "cp2", "tp2-sp-ac"],
)
def test_torchrun_ranks_share_one_run_dir_and_match_one_process(tmp_path, single_process_run, mesh, expected):
    reference = single_process_run
    env = {k: v for k, v in os.environ.items() if k != "NR_RUN_ID"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.finetune", *TINY, *TORCHRUN_STEPS, *mesh],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    # A clean exit: every rank returned 0 (no abort at teardown).
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1, run_dirs
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert {k: summary["mesh"][k] for k in expected} == expected

    def losses(d):
        return [r.get("loss", r.get("val_loss")) for r in read_rows(d)]

    # Same seed, same global batch: the same curve on any mesh (fp32), and the same gradients: the
    # pre-clipping norm of every step (AdamW alone would hide a gradient off by a constant factor).
    assert losses(run_dirs[0]) == pytest.approx(losses(reference), rel=1e-5)
    grad_norms = [[r["grad_norm"] for r in read_rows(d) if "grad_norm" in r] for d in (run_dirs[0], reference)]
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-5)
    # Rank 0 alone writes: one metrics file, one row per logged step, one log line per event.
    assert len(read_rows(run_dirs[0])) == len(read_rows(reference))
    assert (run_dirs[0] / ".hydra" / "config.yaml").is_file()
    assert (run_dirs[0] / "finetune.log").read_text().count("val_loss") == 2
    assert ("pre-flight: " in (run_dirs[0] / "finetune.log").read_text()) == (PREFLIGHT_ON in mesh)
    # The samples of each validation (every rank decoding under the mesh) are one process's.
    samples = [[(r["step"], r["completion_ids"]) for r in map(json.loads, (d / "samples.jsonl").read_text().splitlines())]
               for d in (run_dirs[0], reference)]
    assert samples[0] == samples[1] and [s for s, _ in samples[1]] == [0, 0, 5, 5]


@pytest.mark.distributed
def test_bad_parallel_config_fails_on_every_rank_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.finetune", *TINY, "mesh.tp=2", "model.num_attention_heads=6", "model.num_key_value_heads=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("mesh.tp=2 does not divide model.num_key_value_heads=3") == 2, proc.stderr[-3000:]
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl"))


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.max_stpes=3", "trainer.max_stpes: no such setting"),
        ("trainer.max_steps=abc", "could not be converted to Integer"),
        ("model=doesnotexist", "Could not find 'model/doesnotexist'"),
    ],
)
def test_bad_overrides_fail_with_hydras_message(override, expected, tmp_path):
    proc = cli(override, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert expected in proc.stderr
    if override.startswith("trainer.max_stpes"):
        assert "Did you mean max_steps? Fix: trainer.max_steps=3" in proc.stderr
    if override.startswith("model="):
        assert "Available options in 'model'" in proc.stderr and "tiny" in proc.stderr


def test_user_error_exits_nonzero_with_message_only(tmp_path):
    proc = cli("data.train_file=/nope.jsonl", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1
    assert "data.train_file='/nope.jsonl'" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "overrides, error, needles",
    [
        (["model.preset=doesnotexist"], ModelConfigError, ["model.preset='doesnotexist'", "tiny"]),
        (["model.pattern=MXM"], ModelConfigError, ["model.pattern", "'X'"]),
        (["data.train_file=/nope.jsonl"], ConfigError, ["data.train_file", "/nope.jsonl"]),
        (["data.val_file=/nope.jsonl"], ConfigError, ["data.val_file"]),
        (
            ["trainer.global_batch_size=6", "trainer.micro_batch_size=4"],
            ConfigError,
            ["trainer.global_batch_size=6", "trainer.micro_batch_size=4"],
        ),
        (["trainer.seq_len=1"], ConfigError, ["trainer.seq_len=1"]),
        (["ac.mode=sometimes"], ConfigError, ["ac.mode='sometimes'", "selective"]),
        (["fsdp.param_dtype=fp16"], ConfigError, ["fsdp.param_dtype='fp16'", "slow on CPU", "bf16"]),
        (["fsdp.reduce_dtype=int8"], ConfigError, ["fsdp.reduce_dtype='int8'"]),
        (["logger.wandb.mode=sometimes"], ConfigError, ["logger.wandb.mode"]),
    ],
)
def test_invalid_settings_are_named(tmp_path, overrides, error, needles):
    with pytest.raises(error) as info:
        run(make_cfg(tmp_path, *overrides))
    for needle in needles:
        assert needle in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_compose_rejects_unknown_key_and_wrong_type(tmp_path):
    with pytest.raises(ConfigCompositionException, match="max_stpes"):
        make_cfg(tmp_path, "trainer.max_stpes=3")
    with pytest.raises(ConfigCompositionException, match="hidden_size"):
        make_cfg(tmp_path, "model.hidden_size=wide")


# ---------------------------------------------------------------------------------------- config
def test_model_group_has_one_option_per_preset():
    assert {p.stem for p in (CONF / "model").glob("*.yaml")} == set(PRESETS)


def test_model_overrides_cover_every_model_field_and_apply(tmp_path):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {f.name for f in dataclasses.fields(NemotronHConfig)} | {"preset", "pretrained"} == fields
    cfg = make_cfg(tmp_path, "model.hidden_size=64", "model.pattern=M*")
    built = build_model_config(cfg.model)
    assert built == NemotronHConfig.from_preset("tiny", hidden_size=64, pattern="M*")


def test_run_id_is_shared_by_torchrun_ranks(monkeypatch):
    monkeypatch.delenv("NR_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert run_id() == "abc123"
    monkeypatch.setenv("NR_RUN_ID", "mine")
    assert run_id() == "mine"


# ---------------------------------------------------------------------------------------- pieces
def test_cross_entropy_sum_matches_mean_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :2] = -100
    loss_sum, count = cross_entropy_sum(logits, targets)
    assert count.item() == 8
    mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert (loss_sum / count).item() == pytest.approx(mean.item(), rel=1e-6)


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)


def test_lr_schedule_warms_up_then_decays_to_floor():
    f = functools.partial(lr_factor, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    assert f(20) == pytest.approx(0.1)


def test_optimizer_is_fused_adamw_with_decay_on_matrices_only():
    from types import SimpleNamespace

    from nemotron_recipe.training.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    cfg = SimpleNamespace(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"]
    assert [[p.ndim for p in g["params"]] for g in opt.param_groups] == [[2], [1, 1, 1]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # The same update as the per-op path, up to rounding (each step moves a weight by about lr = 1e-2).
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW([{"params": [ref_model[0].weight], "weight_decay": 0.1},
                             {"params": [ref_model[0].bias, *ref_model[1].parameters()], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    x = torch.randn(4, 8)
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
