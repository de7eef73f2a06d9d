"""`model.pretrained` as a hub id (a fake hub or huggingface_hub's own offline cache, never the network),
the learning rate a model brings when `optim.lr` is null, and the note that a preset's weights are random."""

from __future__ import annotations

import logging
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, errors

from helpers import SMALL_DIMS, compose_run
from nemotron_recipe.config import validate_config
from nemotron_recipe.models.hub import CHECKPOINT_PATTERNS, resolve_pretrained
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.config import PRESET_LR, PRESETS, ModelConfigError, NemotronHConfig
from nemotron_recipe.training.finetune import run

REPO_ID = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"
SMALL = {**SMALL_DIMS, "pattern": "M*-E", "vocab_size": 512}  # the bundled tokenizer's 512 tokens
SMALL_OVERRIDES = [f"model.{k}={v}" for k, v in SMALL.items()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A small Hugging Face checkpoint directory."""
    out = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig(**SMALL)).save_pretrained(str(out))
    return out


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_local_directory_is_used_as_it_is(checkpoint, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("no hub for a directory"))
    assert resolve_pretrained(str(checkpoint)) == str(checkpoint)


def test_a_hub_id_is_downloaded_into_the_cache_and_trained_from(checkpoint, tmp_path, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = compose_run(tmp_path, f"model.pretrained={REPO_ID}", "trainer.max_steps=1", "trainer.val_every=0")
    model_config, _ = validate_config(cfg)
    assert calls == [(REPO_ID, {"allow_patterns": CHECKPOINT_PATTERNS, "local_files_only": False})]
    assert cfg.model.pretrained == str(checkpoint) and model_config.hidden_size == SMALL["hidden_size"]
    summary = run(cfg)  # the weights are read from the snapshot the hub returned
    assert summary["num_parameters"] == NemotronHForCausalLM(NemotronHConfig(**SMALL)).num_parameters()


def test_offline_with_an_empty_cache_names_id_cache_and_download_line(offline_cache):
    with pytest.raises(ModelConfigError) as e:
        resolve_pretrained(REPO_ID)
    message = str(e.value)
    for needle in (f"model.pretrained={REPO_ID!r}", str(offline_cache), f"huggingface-cli download {REPO_ID}",
                   "HF_HUB_OFFLINE is set"):
        assert needle in message
    assert message.count("\n") == 0  # one error, one line


def test_an_id_already_in_the_cache_loads_offline(offline_cache, checkpoint):
    # huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = offline_cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in checkpoint.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    assert Path(resolve_pretrained(REPO_ID)) == snapshot


def test_no_network_falls_back_to_the_same_error(tmp_path, monkeypatch):
    def unreachable(repo_id, **kwargs):
        raise errors.LocalEntryNotFoundError("cannot reach the hub and nothing cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelConfigError, match=r"the hub could not be reached .*huggingface-cli download"):
        resolve_pretrained(REPO_ID)


def test_planning_fetches_the_config_alone(checkpoint, monkeypatch):
    seen = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **k: seen.update(k) or str(checkpoint))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    resolve_pretrained(REPO_ID, config_only=True)
    assert seen["allow_patterns"] == ["config.json"]


# ------------------------------------------------------------------------------- learning rates
def test_every_preset_has_its_learning_rates():
    assert set(PRESET_LR) == set(PRESETS)
    assert PRESET_LR["tiny"].full == PRESET_LR["tiny"].lora == 3e-3  # the tiny preset keeps its own
    for name, lr in PRESET_LR.items():
        if name != "tiny":  # the released recipes: full fine-tuning well below LoRA, both far below tiny's
            assert 1e-6 <= lr.full < lr.lora <= 1e-3, name


@pytest.mark.parametrize("overrides, lr", [
    ([], 3e-3),
    (["peft=lora"], 3e-3),
    (["model=nemotron_nano_9b_v2"], PRESET_LR["nemotron_nano_9b_v2"].full),
    (["model=nemotron_nano_9b_v2", "peft=lora"], PRESET_LR["nemotron_nano_9b_v2"].lora),
    (["model=nemotron_nano_9b_v2", "optim.lr=2e-5"], 2e-5),  # an explicit lr always wins
    (["model=nemotron_nano_9b_v2", "peft=lora", "optim.lr=2e-5"], 2e-5),
])
def test_a_null_lr_is_the_models_own(tmp_path, overrides, lr):
    cfg = compose_run(tmp_path, *overrides)
    validate_config(cfg, world_size=1)
    assert cfg.optim.lr == lr


def test_a_released_checkpoint_brings_its_models_lr(tmp_path):
    """model.pretrained with the default (tiny) model group: the checkpoint's shapes pick the rate."""
    (tmp_path / "9b").mkdir()
    from nemotron_recipe.config import model_lr

    cfg = compose_run(tmp_path, f"model.pretrained={tmp_path / '9b'}")
    lr, source = model_lr(cfg, PRESETS["nemotron_nano_9b_v2"])
    assert lr == PRESET_LR["nemotron_nano_9b_v2"].full and "nemotron_nano_9b_v2" in source
    lr, source = model_lr(cfg, NemotronHConfig(**SMALL))
    assert lr == PRESET_LR["tiny"].full and "none of the released shapes" in source


# ------------------------------------------------------------------------------- random weights
def test_a_preset_without_pretrained_says_once_its_weights_are_random(tmp_path, caplog, checkpoint):
    caplog.set_level(logging.INFO, logger="nemotron_recipe")
    base = [*SMALL_OVERRIDES, "trainer.max_steps=1", "trainer.val_every=0", "checkpoint.save_final=false"]
    run(compose_run(tmp_path / "random", *base))
    notes = [r for r in caplog.records if "random weights" in r.getMessage()]
    assert len(notes) == 1 and "model.pretrained=" in notes[0].getMessage()
    caplog.clear()
    run(compose_run(tmp_path / "loaded", *base, f"model.pretrained={checkpoint}"))
    assert not [r for r in caplog.records if "random weights" in r.getMessage()]
