"""What a Hydra sweep leaves when it ends: `sweep.png` (the jobs' curves side by side) in the sweep
directory and a table of the jobs' final figures on the console.

`SweepReport` is a Hydra callback (conf/finetune.yaml, `hydra.callbacks`); it runs in the process
that launched the sweep, once every job has returned, on rank 0 alone under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

# (column, summary.json key, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("steps", "steps", "{}"),
    ("train loss", "final_loss", "{:.4f}"),
    ("val first", "first_val_loss", "{:.4f}"),
    ("val last", "last_val_loss", "{:.4f}"),
    ("val ratio", "val_loss_ratio", "{:.3f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
)


def _job_number(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, str(path))


def find_jobs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep: those holding Hydra's record of the job or a metrics file, in job order."""
    found = {p.parent for p in sweep_dir.rglob("metrics.jsonl")}
    found |= {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    return sorted(found, key=_job_number)


def job_overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    return [str(o) for o in (yaml.safe_load(path.read_text(encoding="utf-8")) or [])]


def job_labels(jobs: list[Path], sweep_dir: Path) -> dict[str, Path]:
    """Each job named by its directory and the overrides that tell it apart from the other jobs."""
    overrides = {job: job_overrides(job) for job in jobs}
    shared = set.intersection(*(set(o) for o in overrides.values())) if len(jobs) > 1 else set()
    labels = {}
    for job in jobs:
        own = [o for o in overrides[job] if o not in shared]
        labels[f"{job.relative_to(sweep_dir)}: {' '.join(own) or '(defaults)'}"] = job
    return labels


def _cell(summary: dict[str, Any] | None, key: str, fmt: str) -> str:
    if summary is None:
        return "-"
    value = summary.get(key)
    return "n/a" if value is None else fmt.format(value)


def sweep_table(jobs: dict[str, Path]) -> str:
    """The jobs' final figures (summary.json), one line each; a job without a summary did not finish."""
    header = ["job", *(c for c, _, _ in COLUMNS), "status"]
    lines = []
    for label, job in jobs.items():
        path = job / "summary.json"
        summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        status = "no summary (failed?)" if summary is None else (f"stopped: {summary['stopped']}"
                                                                  if summary.get("stopped") else "done")
        lines.append([label, *(_cell(summary, key, fmt) for _, key, fmt in COLUMNS), status])
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    fmt_row = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt_row(header), fmt_row(["-" * w for w in widths]), *map(fmt_row, lines)])


def report_sweep(sweep_dir: Path) -> str | None:
    """Draws `sweep_dir/sweep.png` and returns the table of the sweep's jobs (None: no job found)."""
    jobs = find_jobs(sweep_dir)
    if not jobs:
        return None
    labelled = job_labels(jobs, sweep_dir)
    try:
        from nemotron_recipe.training.plots import plot_sweep

        plot_sweep(labelled, sweep_dir / "sweep.png")
    except Exception as e:  # noqa: BLE001 - a picture that cannot be drawn must not fail a finished sweep
        log.warning("sweep.png not written: %s: %s", type(e).__name__, e)
    return sweep_table(labelled)


class SweepReport(Callback):
    """Writes sweep.png and prints the jobs' table when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank ran the sweep
            return
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        table = report_sweep(sweep_dir)
        if table is not None:
            print(f"\n==== sweep {sweep_dir} ====\n{table}\nsweep.png: {sweep_dir / 'sweep.png'}", flush=True)
