"""The config check refuses what nothing would read (unknown keys, with or without Hydra's `+`) and
numbers the optimizer cannot use; `--help` shows the chosen preset's model values."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf, open_dict

from helpers import REPO, compose_run
from nemotron_recipe.config import ConfigError, FinetuneConfig, validate_config
from nemotron_recipe.config_keys import override_key_problems
from recipes.cli import print_help


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    return compose_run(tmp_path_factory.mktemp("run"))


def _with(cfg, key: str, value):
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):  # what Hydra's `+key=value` does
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_hydra_accepts_an_added_key_that_validate_config_then_refuses(tmp_path):
    cfg = compose_run(tmp_path, "+trainer.max_step=5")  # Hydra accepts the `+` form as it is
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert "trainer.max_step" in str(e.value) and "Did you mean max_steps? Fix: trainer.max_steps=5" in str(e.value)


@pytest.mark.parametrize("key, value, needles", [
    ("optim.learning_rate", 1e-4, ["optim.learning_rate", "no such setting"]),
    ("model.hiden_size", 64, ["model.hiden_size", "Did you mean hidden_size?"]),
    ("logger.wandb.projct", "x", ["logger.wandb.projct", "Did you mean project?"]),
    ("seeds", 3, ["seeds", "Did you mean seed?"]),
])
def test_an_added_key_the_schema_does_not_know_is_refused(composed, key, value, needles):
    with pytest.raises(ConfigError) as e:
        validate_config(_with(composed, key, value))
    for needle in needles:
        assert needle in str(e.value)


def test_overrides_are_checked_with_and_without_plus():
    for prefix in ("", "+", "++"):
        [problem] = override_key_problems([f"{prefix}trainer.max_step=5"], FinetuneConfig)
        assert "Did you mean max_steps? Fix: trainer.max_steps=5" in problem
    known = ["model=nemotron_h_8b", "trainer.max_steps=5", "+mesh.tp=2", "hydra.run.dir=x", "hydra/launcher=basic",
             "optim.betas=[0.9,0.99]", "logger.wandb.mode=offline", "--cfg", "job", "~model.pretrained"]
    assert override_key_problems(known, FinetuneConfig) == []
    [problem] = override_key_problems(["optim.beta=[0.9,0.9]"], FinetuneConfig)
    assert "Did you mean betas?" in problem


def test_the_command_line_refuses_an_unknown_key_before_hydra():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "recipes.finetune", "+trainer.max_step=5"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "Did you mean max_steps?" in out.stderr and "Traceback" not in out.stderr


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key, value, field", [
    ("optim.lr", NAN, "optim.lr=nan"),
    ("optim.lr", INF, "optim.lr=inf"),
    ("optim.lr", -1e-4, "optim.lr=-0.0001"),
    ("optim.weight_decay", NAN, "optim.weight_decay=nan"),
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1"),
    ("optim.eps", INF, "optim.eps=inf"),
    ("optim.eps", 0.0, "optim.eps=0.0"),
    ("optim.betas", [NAN, 0.95], "optim.betas=[nan, 0.95]"),
    ("optim.betas", [0.9, 1.0], "optim.betas=[0.9, 1.0]"),
    ("optim.warmup_steps", -1, "optim.warmup_steps=-1"),
    ("optim.min_lr_ratio", NAN, "optim.min_lr_ratio=nan"),
    ("optim.min_lr_ratio", 1.5, "optim.min_lr_ratio=1.5"),
    ("trainer.max_grad_norm", NAN, "trainer.max_grad_norm=nan"),
    ("trainer.max_grad_norm", INF, "trainer.max_grad_norm=inf"),
])
def test_non_finite_or_out_of_range_optimizer_numbers_are_refused(composed, key, value, field):
    with pytest.raises(ConfigError) as e:
        validate_config(_with(composed, key, value))
    assert field in str(e.value) and "Fix:" in str(e.value)


def test_hydra_parses_nan_into_the_check(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr=nan: must be a finite number"):
        validate_config(compose_run(tmp_path, "optim.lr=nan"))


def test_help_shows_the_presets_model_values(capsys):
    print_help(["model=nemotron_h_8b", "mesh.tp=2"], "finetune", "finetune")
    out = capsys.readouterr().out
    assert "model values from preset nemotron_h_8b" in out
    assert "  hidden_size: 4096\n" in out and "  intermediate_size: 21504\n" in out
    assert "  tp: 2\n" in out
    model_part = out[out.index("model:\n"):out.index("mesh:\n")]
    assert "null" not in model_part.replace("pretrained: null", "").replace("weight_dtypes: null", "").replace(
        "moe_latent_size: null", "").replace("mtp_loss_scale: null", "")
