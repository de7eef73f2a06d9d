"""Curves as pictures: `loss.png` of one run and `sweep.png` of a Hydra sweep, drawn from `metrics.jsonl`.

The figure's content is computed first (`run_panels`: panels of named series, plain data a test can
read), then drawn. matplotlib is imported only when a picture is drawn, and draws through Agg
without pyplot, so a machine without a display works and the caller's own plotting is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (panel title, y label, [(metrics key, series label)]) in drawing order; a panel none of whose keys the
# run logged (no MTP layers, no MoE block) is left out.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("loss", "loss per trained token", (("loss", "train"), ("val_loss", "validation"), ("mtp_loss", "MTP"))),
    ("learning rate", "lr", (("lr", "lr"),)),
    ("MoE load imbalance", "busiest expert / mean", (("moe_load_imbalance", "worst block"),)),
)


@dataclass
class Panel:
    """One plot: its title, y label, and each series as (steps, values)."""

    title: str
    ylabel: str
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; a line cut short by a crash mid-write is passed over."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    # A resumed run logs again the steps after its checkpoint: the newer row of a step wins.
    by_step = {r["step"]: float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not r.get("skipped")}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_panels(rows: list[dict[str, Any]]) -> list[Panel]:
    """The panels of a run's metrics rows: every series that has at least one point."""
    panels = []
    for title, ylabel, keys in PANELS:
        panel = Panel(title, ylabel)
        for key, label in keys:
            steps, values = _series(rows, key)
            if steps:
                panel.series[label] = (steps, values)
        if panel.series:
            panels.append(panel)
    return panels


def _figure(**kwargs: Any) -> Any:
    # A bare Figure renders through Agg and is never registered with pyplot: no backend is chosen or
    # switched in the caller's process, and nothing stays alive once the figure is saved.
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _draw(ax: Any, panel: Panel, *, title: str | None = None) -> None:
    for label, (steps, values) in panel.series.items():
        ax.plot(steps, values, label=label, marker="o" if len(steps) < 20 else None, markersize=3)
    ax.set_title(title or panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.title == "learning rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if len(panel.series) > 1:
        ax.legend(fontsize=8)


def _save(fig: Any, out: Path) -> None:
    """Written beside the target and renamed over it, so a reader never sees half a picture."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def plot_run(run_dir: Path, out_name: str = "loss.png") -> Path | None:
    """Draws `run_dir/metrics.jsonl` to `run_dir/loss.png`, one panel per row; None when there is nothing to draw."""
    panels = run_panels(read_metrics(run_dir / "metrics.jsonl"))
    if not panels:
        return None
    fig = _figure(figsize=(7, 2.6 * len(panels)), layout="tight")
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)
    for ax, panel in zip(axes[:, 0], panels):
        _draw(ax, panel)
    for ax in axes[:-1, 0]:  # the panels share their step axis: label it once, at the bottom
        ax.set_xlabel("")
    fig.suptitle(run_dir.name, fontsize=11)
    out = run_dir / out_name
    _save(fig, out)
    return out


def plot_sweep(jobs: dict[str, Path], out: Path) -> Path | None:
    """The jobs' curves side by side, one column per job (`jobs`: column title -> job directory) and one
    row per panel any job has; rows share their y axis, so the columns compare at a glance."""
    job_panels = {name: {p.title: p for p in run_panels(read_metrics(d / "metrics.jsonl"))} for name, d in jobs.items()}
    titles = [t for t, _, _ in PANELS if any(t in panels for panels in job_panels.values())]
    if not titles:
        return None
    fig = _figure(figsize=(3.6 * len(jobs) + 0.6, 2.6 * len(titles)), layout="tight")
    axes = fig.subplots(len(titles), len(jobs), squeeze=False, sharey="row", sharex="col")
    for col, (name, panels) in enumerate(job_panels.items()):
        for row, title in enumerate(titles):
            ax = axes[row, col]
            if title in panels:
                _draw(ax, panels[title], title=f"{name}\n{title}" if row == 0 else title)
            else:
                ax.set_title(f"{name}\n{title}: none" if row == 0 else f"{title}: none", fontsize=10)
            if row < len(titles) - 1:
                ax.set_xlabel("")
    _save(fig, out)
    return out
