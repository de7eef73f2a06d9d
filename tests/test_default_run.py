"""The README's first command: the default fine-tune learns the shipped task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from matplotlib.image import imread

from nemotron_recipe.training.plots import read_metrics, run_panels

REPO = Path(__file__).resolve().parents[1]


def test_default_finetune_halves_the_validation_loss(tmp_path):
    # Every Python warning is shown (not only the first of each), so none can hide behind a filter.
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-m", "recipes.finetune", f"hydra.run.dir={tmp_path}",
         "logger.console.progress_bar=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "Warning:" in line]
    assert not warnings, warnings
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["last_val_loss"] <= 0.6 * summary["first_val_loss"], summary
    val_rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert val_rows[0]["step"] == 0 and val_rows[-1]["step"] == summary["steps"]
    # loss.png: a PNG that decodes, drawn from these rows (the tiny model has an MoE block, no MTP layer).
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(tmp_path / "loss.png").shape[:2] == (780, 700)  # three panels of 2.6 in, 7 in wide, at 100 dpi
    panels = run_panels(read_metrics(tmp_path / "metrics.jsonl"))
    assert [(p.title, list(p.series)) for p in panels] == [
        ("loss", ["train", "validation"]), ("learning rate", ["lr"]), ("MoE load imbalance", ["worst block"])]
    assert panels[0].series["validation"][0] == [r["step"] for r in val_rows]
    # samples.jsonl: the first two validation prompts, continued at every validation; the summary
    # (and its printout) holds the first and the last.
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    val_prompts = [json.loads(line)["prompt"] for line in (REPO / "nemotron_recipe/data/assets/tiny_sft_val.jsonl")
                   .read_text().splitlines()[:2]]
    assert [(r["step"], r["prompt"]) for r in samples] == [(v["step"], p) for v in val_rows for p in val_prompts]
    assert all(r["completion_ids"] and r["finish_reason"] in ("eos", "length") for r in samples)
    assert summary["first_samples"] == samples[:2] and summary["last_samples"] == samples[-2:]
    assert "first samples" in proc.stdout and "last samples" in proc.stdout
