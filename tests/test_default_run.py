"""The README's first command: the default fine-tune learns the shipped task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
