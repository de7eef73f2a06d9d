"""What a run leaves to look at: loss.png, sweep.png and the sweep's table, drawn from the metrics rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemotron_recipe.training.plots import plot_run, plot_sweep, run_panels
from nemotron_recipe.training.sweep_report import find_jobs, job_labels, report_sweep, sweep_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_shape(path: Path) -> tuple[int, ...]:
    """The decoded picture's shape: the file is a PNG that decodes, not only named like one."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return imread(path).shape


def write_rows(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


MOE_MTP_ROWS = [
    {"step": 0, "val_loss": 7.0, "elapsed_s": 1.0},
    {"step": 1, "loss": 6.5, "mtp_loss": 6.7, "lr": 1e-4, "grad_norm": 3.0, "moe_load_imbalance": 1.9},
    {"step": 2, "loss": 9.9, "mtp_loss": 9.9, "lr": 2e-4, "grad_norm": 3.0, "moe_load_imbalance": 1.5},
    # A resumed run logs step 2 again; its row replaces the first one's.
    {"step": 2, "loss": 6.0, "mtp_loss": 6.1, "lr": 2e-4, "grad_norm": 2.0, "moe_load_imbalance": 1.6},
    {"step": 3, "loss": None, "lr": 3e-4, "grad_norm": None, "skipped": True},
    {"step": 4, "loss": 5.0, "mtp_loss": 5.2, "lr": 4e-4, "grad_norm": 1.0, "moe_load_imbalance": 1.4},
    {"step": 4, "val_loss": 5.5, "elapsed_s": 9.0},
]


def test_run_panels_hold_each_logged_series_once_per_step():
    panels = {p.title: p.series for p in run_panels(MOE_MTP_ROWS)}
    assert list(panels) == ["loss", "learning rate", "MoE load imbalance"]
    assert panels["loss"] == {
        "train": ([1, 2, 4], [6.5, 6.0, 5.0]),
        "validation": ([0, 4], [7.0, 5.5]),
        "MTP": ([1, 2, 4], [6.7, 6.1, 5.2]),
    }
    assert panels["learning rate"] == {"lr": ([1, 2, 4], [1e-4, 2e-4, 4e-4])}  # the skipped step is left out
    assert panels["MoE load imbalance"] == {"worst block": ([1, 2, 4], [1.9, 1.6, 1.4])}


def test_a_dense_model_without_mtp_gets_loss_and_lr_panels_only():
    rows = [{"step": 1, "loss": 3.0, "lr": 1e-3}, {"step": 1, "val_loss": 2.5}]
    panels = run_panels(rows)
    assert [(p.title, list(p.series)) for p in panels] == [("loss", ["train", "validation"]), ("learning rate", ["lr"])]
    assert run_panels([]) == []


def test_plot_run_writes_a_png_with_one_panel_row_per_panel(tmp_path):
    write_rows(tmp_path / "a", MOE_MTP_ROWS)
    write_rows(tmp_path / "b", [{"step": 1, "loss": 3.0, "lr": 1e-3}])
    with (tmp_path / "a" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 4')  # cut short by a crash
    three, two = png_shape(plot_run(tmp_path / "a")), png_shape(plot_run(tmp_path / "b"))
    assert three[1] == two[1] == 700 and three[0] > two[0]  # 7 in wide at 100 dpi; taller with more panels
    assert plot_run(tmp_path / "empty") is None and not (tmp_path / "empty" / "loss.png").exists()


def test_sweep_report_draws_the_jobs_side_by_side_and_tables_their_summaries(tmp_path):
    for job, lr in (("0", "1e-4"), ("1", "3e-4"), ("2", "1e-3")):
        d = tmp_path / job
        write_rows(d, MOE_MTP_ROWS[:2] if job != "2" else [])
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n- trainer.max_steps=3\n")
        if job != "2":  # job 2 failed before writing its summary
            (d / "summary.json").write_text(json.dumps(
                {"steps": 3, "final_loss": 1.23456, "first_val_loss": 7.0, "last_val_loss": 3.5,
                 "val_loss_ratio": 0.5, "tokens_per_s": 1234.4, "stopped": None}))
    jobs = job_labels(find_jobs(tmp_path), tmp_path)
    assert list(jobs) == ["0: optim.lr=1e-4", "1: optim.lr=3e-4", "2: optim.lr=1e-3"]  # shared overrides left out
    table = report_sweep(tmp_path)
    assert table == sweep_table(jobs)
    lines = table.splitlines()
    assert lines[0].split() == ["job", "steps", "train", "loss", "val", "first", "val", "last", "val", "ratio",
                                "tokens/s", "status"]
    assert lines[2].split() == ["0:", "optim.lr=1e-4", "3", "1.2346", "7.0000", "3.5000", "0.500", "1234", "done"]
    assert lines[4].split()[:3] == ["2:", "optim.lr=1e-3", "-"] and lines[4].endswith("no summary (failed?)")
    # One column per job at 3.6 in each: wider than one run's picture.
    height, width, _ = png_shape(tmp_path / "sweep.png")
    assert width >= 3 * 360 and height >= 3 * 260


@pytest.mark.parametrize("rows", [[], [{"step": 1, "loss": 2.0, "lr": 1e-3}]])
def test_plot_sweep_with_nothing_to_draw_writes_nothing(tmp_path, rows):
    write_rows(tmp_path / "0", rows)
    out = plot_sweep({"0": tmp_path / "0"}, tmp_path / "sweep.png")
    assert (out is None) == (not rows) and (tmp_path / "sweep.png").exists() == bool(rows)
