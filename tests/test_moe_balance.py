"""Aux-loss-free balancing: expert loads over a step's micro-batches, the imbalance metric and the
correction-bias update they drive, the same on every mesh; expert parallel in the recipe."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wandb

from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training import logging as logging_module
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import load_checkpoint_model
from nemotron_recipe.training.moe_balance import RouterBalance

from helpers import RUN_BASE, compose_run, metrics_rows


def _model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return NemotronHForCausalLM(NemotronHConfig(pattern="EME", n_routed_experts=4, num_experts_per_tok=2))


def test_loads_add_up_over_micro_batches_and_move_the_bias_against_the_load():
    model = _model()
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.5)
    first, second = balance.blocks
    for loads in ([6, 2, 0, 0], [2, 2, 4, 0]):
        first.experts.tokens_per_expert = torch.tensor(loads)
        second.experts.tokens_per_expert = torch.tensor([2, 2, 2, 2])
        balance.after_micro_batch()
    metrics = balance.after_step(taken=True)
    # Block 1's loads [8, 4, 4, 0]: mean 4, busiest 8 -> 2.0; block 2 is balanced (1.0).
    assert metrics["moe_load_imbalance"] == pytest.approx(2.0)
    assert metrics["expert_load"] == [[8, 4, 4, 0], [4, 4, 4, 4]]
    assert first.gate.e_score_correction_bias.tolist() == [-0.5, 0.0, 0.0, 0.5]
    assert second.gate.e_score_correction_bias.tolist() == [0.0] * 4
    assert balance.counts is None  # the next step counts afresh


def test_a_step_not_taken_leaves_the_bias_and_rate_zero_only_measures():
    model = _model()
    for rate, taken in ((0.5, False), (0.0, True)):
        balance = RouterBalance(model, token_group=None, bias_update_rate=rate)
        for block in balance.blocks:
            block.experts.tokens_per_expert = torch.tensor([3, 1, 0, 0])
        balance.after_micro_batch()
        assert balance.after_step(taken=taken)["moe_load_imbalance"] == pytest.approx(3.0)
        assert all(not b.gate.e_score_correction_bias.any() for b in balance.blocks)


def test_a_model_without_moe_blocks_has_nothing_to_balance():
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-"))
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.1)
    assert not balance and balance.after_step(taken=True) == {}


# ---------------------------------------------------------------------------------------- recipe
SHORT = ["trainer.val_every=0", "optim.warmup_steps=0", "trainer.log_every=1"]


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if "loss" in r]


def _biases(checkpoint: Path) -> torch.Tensor:
    model, _, _ = load_checkpoint_model(checkpoint)
    return torch.stack([b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")])


def expert_parallel_run(run_dir: Path, *overrides: str) -> None:
    """The recipe at ep 2 on 2 ranks, writing to `run_dir`."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "recipes.finetune", *RUN_BASE, *overrides, "mesh.ep=2", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _skewed_data(path: Path) -> Path:
    """Prompts and responses drawn from three words, one of them three times as often: most tokens
    look alike to the router."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(200):
            words = " ".join(rng.choice(["moon", "moon", "moon", "star", "key"]) for _ in range(rng.randint(8, 30)))
            f.write(json.dumps({"prompt": f"Repeat: {words}", "response": words}) + "\n")
    return path


def test_bias_updates_bring_a_skewed_load_down(tmp_path):
    data = _skewed_data(tmp_path / "skewed.jsonl")
    # A small LR keeps the routers nearly where they start, so the bias alone moves the load.
    common = [*SHORT, "trainer.max_steps=50", f"data.train_file={data}", "data.val_file=null", "optim.lr=1e-5",
              "checkpoint.save_final=false"]
    imbalance = {}
    for rate in (0.0, 0.01):
        run(compose_run(tmp_path / str(rate), *common, f"moe.bias_update_rate={rate}"))
        rows = _rows(tmp_path / str(rate))
        imbalance[rate] = [statistics.mean(r["moe_load_imbalance"] for r in rows[:5]),
                           statistics.mean(r["moe_load_imbalance"] for r in rows[-10:])]
    assert imbalance[0.01][1] < 0.85 * imbalance[0.01][0], imbalance
    assert imbalance[0.01][1] < 0.85 * imbalance[0.0][1], imbalance


@pytest.mark.distributed
def test_expert_parallel_run_matches_one_process_and_resumes_on_one(tmp_path):
    """10 steps at ep 2 on 2 ranks, then 10 more resumed on one process, against 20 straight steps on
    one process: the same losses, gradient norms and correction biases."""
    common = [*SHORT, "trainer.max_steps=20", "checkpoint.every=10", "moe.bias_update_rate=0.01"]
    run(compose_run(tmp_path / "straight", *common))
    split = tmp_path / "split"
    expert_parallel_run(split, *common, "trainer.stop_at_step=10")
    assert json.loads((split / "summary.json").read_text())["mesh"]["ep"] == 2
    resumed = run(compose_run(split, *common))
    assert resumed["resumed_from"] == 10

    got, want = _rows(split), _rows(tmp_path / "straight")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 21))
    # Losses and loads to 1e-5 over all 20 steps; the gradient norm drifts further (2e-5 measured) as
    # AdamW carries fp32 summation-order differences from step to step (5-step parity: test_parallel).
    for key, rel in (("loss", 1e-5), ("moe_load_imbalance", 1e-5), ("grad_norm", 1e-4)):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=rel), key
    for step in ("step_000010", "step_000020"):
        biases = _biases(split / "checkpoints" / step)
        assert biases.abs().max() > 0  # the update ran
        torch.testing.assert_close(biases, _biases(tmp_path / "straight" / "checkpoints" / step), rtol=0, atol=1e-6)


def test_a_frozen_router_keeps_its_weight_and_bias_while_the_experts_train(tmp_path):
    run(compose_run(tmp_path, *SHORT, "trainer.max_steps=2", "checkpoint.every=1", "checkpoint.keep=0",
                    "moe.freeze_router=true"))
    states = [load_checkpoint_model(tmp_path / "checkpoints" / f"step_00000{s}")[0].state_dict() for s in (1, 2)]
    routers = [n for n in states[0] if ".gate." in n]
    assert routers and all(torch.equal(states[0][n], states[1][n]) for n in routers)
    assert not torch.equal(*(s["model.layers.5.mixer.experts.up_proj"] for s in states))


@pytest.mark.parametrize("overrides, needle", [
    (["moe.bias_update_rate=-0.1"], "moe.bias_update_rate=-0.1: must be >= 0"),
    (["moe.bias_update_rate=0.01", "moe.freeze_router=true"], "a frozen router keeps its correction bias too"),
    (["moe.freeze_router=true", "model.pattern=M*M-"], "moe.freeze_router=True: the model (pattern 'M*M-') has no MoE"),
])
def test_moe_options_that_cannot_apply_are_refused(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate_config(compose_run(tmp_path, *overrides))


@pytest.mark.distributed
def test_a_hugging_face_checkpoint_loads_under_expert_parallel_with_the_single_process_loss(tmp_path):
    """Each rank reads its own experts from the files; the first steps equal one process's."""
    run(compose_run(tmp_path / "source", *SHORT, "trainer.max_steps=2", "checkpoint.export_hf=true"))
    common = [*SHORT, "trainer.max_steps=2", f"model.pretrained={tmp_path / 'source' / 'hf'}"]
    run(compose_run(tmp_path / "one", *common))
    expert_parallel_run(tmp_path / "ep2", *common)
    got, want = _rows(tmp_path / "ep2"), _rows(tmp_path / "one")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)


@pytest.mark.distributed
def test_lora_under_expert_parallel_matches_one_process(tmp_path):
    """Adapters on the routed experts split by expert with them; the curve is one process's."""
    common = [*SHORT, "trainer.max_steps=3", "peft=lora"]
    run(compose_run(tmp_path / "one", *common))
    expert_parallel_run(tmp_path / "ep2", *common)
    got, want = _rows(tmp_path / "ep2"), _rows(tmp_path / "one")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key


def test_expert_loads_reach_wandb_as_one_histogram_per_moe_block(tmp_path, monkeypatch):
    logged: list[tuple[dict, int]] = []
    run_dir = tmp_path / "run"

    class FakeRun:
        summary: dict = {}

        def log(self, data: dict, step: int) -> None:
            logged.append((data, step))

        def finish(self, exit_code: int) -> None:
            pass

    monkeypatch.setattr(logging_module, "_init_wandb", lambda *args: FakeRun())
    monkeypatch.setattr(wandb, "Histogram", lambda np_histogram: np_histogram)
    run(compose_run(run_dir, *SHORT, "trainer.max_steps=2", "logger.wandb.mode=offline", "checkpoint.save_final=false"))
    loads = [(data, step) for data, step in logged if any(k.startswith("moe/expert_load/") for k in data)]
    assert [step for _, step in loads] == [1, 2]
    (name, (counts, bins)), = loads[0][0].items()  # the tiny preset has one MoE block
    assert name == "moe/expert_load/block_0" and bins == list(range(9)) and len(counts) == 8
    assert sum(counts) > 0
