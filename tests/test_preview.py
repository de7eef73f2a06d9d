"""`recipes.preview`: the sequences and trained mask it shows are the ones training applies."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers import CONF, REPO, RUN_BASE, SMALL_DIMS, compose_run

from nemotron_recipe.config import ConfigError
from nemotron_recipe.data import IGNORE_INDEX
from nemotron_recipe.training.objectives import sft as sft_objective
from nemotron_recipe.training import loss as loss_module
from nemotron_recipe.training.finetune import run

REASONING = [
    "data.train_file=${nr_asset:tiny_reasoning_train.jsonl}", "data.val_file=${nr_asset:tiny_reasoning_val.jsonl}",
    "data.chat_template=nemotron3", "data.reasoning=answer_only", "data.packing=true", "trainer.seq_len=256",
]


def compose_preview(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="preview", overrides=[*RUN_BASE, *overrides])


def preview(*overrides: str) -> dict | str:
    from recipes.preview import preview_report

    cfg = compose_preview(*overrides)
    out = preview_report(cfg)
    return json.loads(out) if cfg.preview.format == "json" else out


def test_preview_shows_the_mask_training_applies(tmp_path, monkeypatch):
    """One training step records the micro-batches it collates and the targets its loss applies; the
    preview of the same overrides shows those sequences, token for token, and that mask."""
    small = [f"model.{k}={v}" for k, v in {**SMALL_DIMS, "vocab_size": 512}.items()]
    cfg = compose_run(tmp_path, *REASONING, *small, "trainer.max_steps=1", "data.val_file=null")
    batches, targets = [], []
    real_collate, real_ce = sft_objective.collate, loss_module.cross_entropy_sum
    monkeypatch.setattr(sft_objective, "collate", lambda *a, **k: batches.append(real_collate(*a, **k)) or batches[-1])
    monkeypatch.setattr(loss_module, "cross_entropy_sum", lambda logits, t: targets.append(t) or real_ce(logits, t))
    run(cfg)
    assert len(targets) == 2  # global batch 4 in micro-batches of 2
    shown = preview(*REASONING, "data.val_file=null", "preview.n=4", "preview.format=json")["examples"]
    rows = [(b["input_ids"][r], t[r]) for b, t in zip(batches, targets) for r in range(t.shape[0])]
    assert len(shown) == len(rows) == 4
    for example, (ids, trained_targets) in zip(shown, rows):
        n = len(example["tokens"])
        assert example["tokens"] == ids[:n].tolist()
        assert example["trained_mask"] == [0] + (trained_targets[: n - 1] != IGNORE_INDEX).int().tolist()
        assert (trained_targets[n - 1:] == IGNORE_INDEX).all()  # nothing trains past the shown tokens
        assert sum(example["document_lengths"]) == n
        # answer_only: the trained text holds the answers, never a trace.
        assert "<|im_end|>" in example["trained_text"] and "<think>" not in example["trained_text"]
        assert "Recall" not in example["trained_text"] and "think" in example["text"]


def test_dpo_preview_shows_the_pairs_and_masks_a_dpo_step_collates(tmp_path, monkeypatch):
    """One DPO step records the micro-batches it collates (chosen halves first, then rejected); the preview
    of the same overrides shows those pairs in that order, each half's tokens and the mask its log-prob
    sums over, and a prompt both halves start with and that trains nothing."""
    from nemotron_recipe.training.objectives import dpo as dpo_module

    small = [f"model.{k}={v}" for k, v in {**SMALL_DIMS, "vocab_size": 512}.items()]
    common = ["objective=dpo", "peft=lora", "data.val_file=null"]
    batches = []
    begin = dpo_module.DPOObjective.begin_step
    monkeypatch.setattr(dpo_module.DPOObjective, "begin_step",
                        lambda self, mbs: batches.extend(mbs) or begin(self, mbs))
    run(compose_run(tmp_path, *common, *small, "trainer.max_steps=1", "eval.sample_tokens=0"))
    shown = preview(*common, "preview.n=4", "preview.format=json")
    rows = [(b, half, r) for b in batches for r in range(b["pair_index"].numel()) for half in (0, 1)]
    assert [b["pair_index"][r].item() for b, half, r in rows[::2]] == [p["index"] for p in shown["pairs"]]
    for (batch, half, r), (pair, name) in zip(rows, [(p, h) for p in shown["pairs"] for h in ("chosen", "rejected")]):
        row = half * batch["pair_index"].numel() + r
        ids, targets, example = batch["input_ids"][row], batch["targets"][row], pair[name]
        n = len(example["tokens"])
        assert example["tokens"] == ids[:n].tolist()
        assert example["trained_mask"] == [0] + (targets[: n - 1] != IGNORE_INDEX).int().tolist()
        assert (targets[n - 1:] == IGNORE_INDEX).all()
        assert example["text"].startswith(pair["prompt"]) and pair["prompt"] not in example["trained_text"]
    assert shown["summary"][0]["pairs"] == 512 and shown["summary"][0]["split"] == "train"
    assert "--- train pair" in preview(*common, "preview.n=1")


def test_preview_settings_are_checked():
    with pytest.raises(ConfigError, match=r"(?s)preview.format='xml': unknown.*preview.n=0: must be >= 1"):
        preview("preview.format=xml", "preview.n=0")
    with pytest.raises(ConfigError, match="preview.split=val: the run has no validation data"):
        preview("data.val_file=null", "preview.split=val")


def test_preview_cli_marks_trained_tokens_counts_the_file_and_writes_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "recipes.preview", "preview.n=2", "data.max_length_policy=drop", "trainer.seq_len=20",
         "data.reasoning=drop"],
        cwd=tmp_path, check=True, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "built-in chat format, reasoning=drop; trained text between [[ and ]]"
    # The shipped SFT rows have no traces: said once, on stderr.
    assert out.stderr.count("data.reasoning=drop: no row of data.train_file") == 1
    body = [line for line in lines if line.startswith("<s>")]
    assert len(body) == 2 and all(line.count("[[") == 1 and line.endswith("</s>]]") for line in body)
    summary = [line for line in lines if line.startswith(("train:", "val:"))]
    assert len(summary) == 2
    # seq_len=20 under drop leaves out the longer rows, and the count says how many.
    dropped = int(summary[0].split(" dropped as longer")[0].rsplit(" ", 1)[1])
    assert 0 < dropped < 4000
    assert summary[0].startswith(f"train: {4000 - dropped} examples in {4000 - dropped} sequences; ")
    assert not list(tmp_path.iterdir())


def test_preview_config_composes_the_finetune_defaults():
    finetune_defaults = yaml.safe_load((CONF / "finetune.yaml").read_text())["defaults"]
    preview_defaults = yaml.safe_load((CONF / "preview.yaml").read_text())["defaults"]
    groups = [d for d in preview_defaults
              if d != "preview_schema" and not (isinstance(d, dict) and "override hydra/job_logging" in d)]
    assert groups == [d for d in finetune_defaults if d != "finetune_schema"]
