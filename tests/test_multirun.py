"""Hydra sweeps (`-m`): one job directory per point, in one sweep directory, alone and under torchrun;
the sweep ends with sweep.png and a table of the jobs' final figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SWEEP = [
    "-m",
    "optim.lr=1e-4,3e-4",
    "trainer.max_steps=3",
    "trainer.seq_len=64",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.val_every=0",
    "data.val_max_batches=1",
    "logger.console.progress_bar=false",
    "eval.sample_tokens=2",
]


def launch(cwd: Path, *prefix: str) -> subprocess.CompletedProcess:
    # Without NR_RUN_ID the jobs (and ranks) must agree on the sweep directory by themselves.
    env = {k: v for k, v in os.environ.items() if k != "NR_RUN_ID"}
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *prefix, "-m", "recipes.finetune", *SWEEP],
        cwd=cwd, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240,
    )


def check_sweep(root: Path, world_size: int, stdout: str) -> None:
    sweeps = list((root / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    lrs = []
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["world_size"] == world_size
        assert summary["run_dir"] == str(job)
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        # One writer per job: step 1 and step 3 are logged once each, whatever the world size.
        assert [r["step"] for r in rows if "loss" in r] == [1, 3]
        lrs.append(yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optim"]["lr"])
        assert (job / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lrs == [1e-4, 3e-4]
    # The sweep's end: its picture, and one table (rank 0's) of each job's final figures.
    assert (sweeps[0] / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stdout.count("==== sweep ") == 1, stdout[-3000:]
    table = stdout.split("==== sweep ")[1].splitlines()
    for job, lr in (("0", "optim.lr=0.0001"), ("1", "optim.lr=0.0003")):
        row = next(line.split() for line in table if line.startswith(f"{job}: "))
        summary = json.loads((sweeps[0] / job / "summary.json").read_text())
        assert row[1] == lr and row[2] == "3" and row[3] == f"{summary['final_loss']:.4f}" and row[-1] == "done"


def test_sweep_runs_each_job_in_its_own_directory(tmp_path):
    proc = launch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_sweep(tmp_path, world_size=1, stdout=proc.stdout)


@pytest.mark.distributed
def test_sweep_under_torchrun_sets_up_the_process_group_per_job(tmp_path):
    proc = launch(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr
    check_sweep(tmp_path, world_size=2, stdout=proc.stdout)
