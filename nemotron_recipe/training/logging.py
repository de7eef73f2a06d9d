"""Run outputs: `metrics.jsonl`, `loss.png`, `samples.jsonl`, the console (progress bar or log lines) and Weights & Biases.

Only the main rank builds an active writer; the others get a no-op one, so call sites need no
rank checks. `TrainMetrics` turns training steps into the writer's rows (loss, LR, throughput).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("nemotron_recipe.training")


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Infinity; a diverged loss must still leave a parseable file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsWriter:
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        progress_bar: bool,
        wandb_cfg: Any = None,
        config: dict[str, Any] | None = None,
        resume_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self._file = None
        self._bar = None
        self._wandb_run = None
        self._redirect: contextlib.ExitStack | None = None
        self._unplotted = 0  # rows written since loss.png was last drawn
        self._samples_file = None
        self._sample_rows: list[list[Any]] = []  # every sample so far: wandb replaces its table at each pass
        self._plot_failed = False
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run adds to the rows of the runs before it, never rewrites them.
        self._file = open(run_dir / "metrics.jsonl", "a" if resume_step else "w", encoding="utf-8")
        self._samples_path, self._samples_mode = run_dir / "samples.jsonl", "a" if resume_step else "w"
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            self._wandb_run = _init_wandb(run_dir, wandb_cfg, config)
        if progress_bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)
            # Log lines (validation, warnings) printed while the bar is drawn would break it apart.
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())

    def log_train(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write(row)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", refresh=False)
        else:
            log.info("  ".join(f"{k} {_fmt(v)}" for k, v in row.items()))

    def log_expert_loads(self, step: int, loads: list[list[int]]) -> None:
        """Per MoE block, the rows each expert was routed in `step`, as a wandb histogram whose bins are
        the experts (wandb only: the rows hold the imbalance)."""
        if not self.enabled or self._wandb_run is None:
            return
        import wandb

        self._wandb_run.log({f"moe/expert_load/block_{i}": wandb.Histogram(
            np_histogram=(block, list(range(len(block) + 1)))) for i, block in enumerate(loads)}, step=step)

    def log_val(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write(row)
        log.info("step %d  val_loss %.4f", row["step"], row["val_loss"])

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        """One validation's samples: a line each in samples.jsonl, on the console, and the wandb table."""
        if not self.enabled:
            return
        if self._samples_file is None:  # opened at the first samples: a run without any leaves no file
            self._samples_file = open(self._samples_path, self._samples_mode, encoding="utf-8")
        for i, row in enumerate(rows):
            self._samples_file.write(json.dumps(row) + "\n")
            log.info("step %d  sample %d  %r -> %r (%s)", row["step"], i, row["prompt"], row["completion"],
                     row["finish_reason"])
        self._samples_file.flush()
        if self._wandb_run is not None:
            import wandb

            self._sample_rows += [[r["step"], r["prompt"], r["completion"], r["finish_reason"]] for r in rows]
            table = wandb.Table(columns=["step", "prompt", "completion", "finish_reason"], data=self._sample_rows)
            self._wandb_run.log({"samples": table}, step=rows[0]["step"])

    def plot(self) -> None:
        """Redraws `loss.png` from the rows written so far, unless it already shows them all."""
        if not self.enabled or self._plot_failed or not self._unplotted:
            return
        try:
            from nemotron_recipe.training.plots import plot_run

            plot_run(self.run_dir)
            self._unplotted = 0
        except Exception as e:  # noqa: BLE001 - a picture must never cost the run it pictures
            self._plot_failed = True
            log.warning("loss.png not written (and not retried in this run): %s: %s", type(e).__name__, e)

    def log_eval(self, row: dict[str, Any]) -> None:
        """The row of the `eval.tasks` metrics (`eval/<task>/<metric>`), written and printed."""
        if not self.enabled:
            return
        self._write(row)
        log.info("step %d  %s", row["step"], "  ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k != "step"))

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def _write(self, row: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self._file.flush()
        self._unplotted += 1
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / "summary.json", "w", encoding="utf-8") as f:
            json.dump({k: _jsonable(v) for k, v in summary.items()}, f, indent=2)
            f.write("\n")
        if self._wandb_run is not None:
            self._wandb_run.summary.update({k: v for k, v in summary.items() if not isinstance(v, dict)})

    def close(self, *, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
        for name in ("_file", "_samples_file"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1 if failed else 0)
            self._wandb_run = None


class TrainMetrics:
    """The training rows of the metrics and the throughput totals of the summary.

    A row holds the loss, LR and gradient norm of its step and the throughput of the steps since
    the previous row. Throughput counts input positions (padding included: what the model computes
    on) and, separately, trained tokens. Seconds spent validating inside the loop are kept out of it
    (`exclude`). Called on every rank with the same steps; only the main rank's writer writes.
    """

    def __init__(
        self, writer: MetricsWriter, *, tokens_per_step: int, log_every: int, max_steps: int, started: float
    ) -> None:
        self.writer = writer
        self.tokens_per_step = tokens_per_step  # input positions of one global batch
        self.log_every, self.max_steps = log_every, max_steps
        self.started = started  # the run's start: rows report the seconds since
        self.last_loss = float("nan")  # the newest row's loss; NaN while this run has written none
        self.steps = self.total_trained = 0
        self.window_steps = self.window_trained = 0
        self.excluded = 0.0
        self.train_start = self.window_start = time.perf_counter()

    def start(self) -> None:
        """Starts the training clock: what came before (setup, the first validation) is not training."""
        self.train_start = self.window_start = time.perf_counter()

    def record(self, trained_tokens: int) -> None:
        """One more step done, which trained `trained_tokens` tokens over all ranks."""
        self.steps += 1
        self.window_steps += 1
        self.window_trained += trained_tokens
        self.total_trained += trained_tokens

    def due(self, step: int) -> bool:
        return step == 1 or step % self.log_every == 0 or step == self.max_steps

    def log(
        self, step: int, *, loss: float, lr: float, grad_norm: float, skipped: bool = False,
        mtp_loss: float | None = None, moe: dict[str, float] | None = None, extra: dict[str, float] | None = None,
    ) -> None:
        """The row of `step`; its throughput covers the steps since the previous row. A step that was
        not taken (non-finite, `trainer.nonfinite=skip`) is marked `"skipped": true`. `mtp_loss`: the
        MTP layers' loss (per trained token, averaged over depths, unscaled), when they are trained;
        `moe`: router health (`moe_balance.RouterBalance`): `moe_load_imbalance`, the step's busiest-expert
        load over the mean, worst MoE block, and `moe_aux_loss`, the balance-loss term, when trained; `extra`: the objective's other
        metrics (DPO's rewards), written after the loss."""
        if not skipped:  # the summary's final loss is that of a step that was taken
            self.last_loss = loss
        now = time.perf_counter()
        window_s = max(now - self.window_start, 1e-9)
        self.writer.log_train({
            "step": step,
            "loss": loss,
            **({"mtp_loss": mtp_loss} if mtp_loss is not None else {}),
            **(extra or {}),
            "lr": lr,
            "grad_norm": grad_norm,
            **(moe or {}),
            "tokens_per_s": self.window_steps * self.tokens_per_step / window_s,
            "trained_tokens_per_s": self.window_trained / window_s,
            "elapsed_s": now - self.started,
            **({"skipped": True} if skipped else {}),
        })
        self.window_start, self.window_steps, self.window_trained = now, 0, 0

    def exclude(self, seconds: float) -> None:
        """Keeps `seconds` spent on other work than training out of the throughput."""
        self.excluded += seconds
        self.window_start += seconds

    def train_time(self) -> float:
        """Seconds spent training since `start`."""
        return max(time.perf_counter() - self.train_start - self.excluded, 1e-9)

    def summary(self, train_time: float) -> dict[str, float]:
        """The summary's loss and throughput entries, over this run's steps and `train_time`."""
        return {
            "final_loss": self.last_loss,
            "tokens_per_s": self.steps * self.tokens_per_step / train_time,
            "trained_tokens_per_s": self.total_trained / train_time,
            "train_time_s": train_time,
        }


def _init_wandb(run_dir: Path, wandb_cfg: Any, config: dict[str, Any] | None) -> Any:
    # Imported only when enabled: a disabled logger must not depend on wandb importing cleanly.
    import wandb

    return wandb.init(
        project=wandb_cfg.project,
        name=wandb_cfg.name,
        tags=list(wandb_cfg.tags) or None,
        config=config,
        dir=str(run_dir),
        mode=wandb_cfg.mode,
        # The console stays ours (progress bar); wandb's stdout capture would garble it.
        settings=wandb.Settings(console="off"),
    )


def _clip(text: str, width: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= width else text[:width - 3] + "..."


def print_summary(summary: dict[str, Any]) -> None:
    def f(key: str, fmt: str = "{:.4f}") -> str:
        value = summary.get(key)
        return "n/a" if value is None else fmt.format(value)

    lines = [
        "",
        "==== fine-tuning summary ====",
        f"steps            {summary['steps']}",
        (
            f"val loss         first {f('first_val_loss')}  last {f('last_val_loss')}  "
            f"ratio {f('val_loss_ratio', '{:.3f}')}"
        ),
        f"final train loss {f('final_loss')}",
        (
            f"throughput       {f('tokens_per_s', '{:.0f}')} tokens/s "
            f"({f('trained_tokens_per_s', '{:.0f}')} trained tokens/s)"
        ),
        f"wall time        {f('wall_time_s', '{:.1f}')} s (training {f('train_time_s', '{:.1f}')} s)",
        f"run dir          {summary['run_dir']}",
    ]
    for key, label in (("first_samples", "first samples"), ("last_samples", "last samples")):
        for i, row in enumerate(summary.get(key) or []):
            lines.append(f"{label if i == 0 else '':<17}step {row['step']}: {_clip(row['prompt'])} -> "
                         f"{_clip(row['completion'])}")
    lines += _eval_lines(summary)
    if summary.get("resumed_from") is not None:
        lines.insert(3, f"resumed from     step {summary['resumed_from']}")
    if summary.get("stopped"):
        lines.insert(3, f"stopped early    {summary['stopped']} (checkpoint {summary.get('checkpoint')})")
    elif summary.get("checkpoint"):
        lines.append(f"checkpoint       {summary['checkpoint']}")
    print("\n".join(lines), flush=True)


def _eval_lines(summary: dict[str, Any]) -> list[str]:
    """One summary line per `eval.tasks` task: its metrics without their standard errors."""
    tasks: dict[str, list[str]] = {}
    for key, value in summary.items():
        if key.startswith("eval/") and "stderr" not in key:
            _, task, metric = key.split("/", 2)
            tasks.setdefault(task, []).append(f"{metric} {_fmt(value)}")
    return [f"eval {task:<11} " + "  ".join(metrics) for task, metrics in tasks.items()]


def earlier_val_losses(run_dir: Path, up_to_step: int) -> list[tuple[int, float]]:
    """(step, val_loss) rows that earlier runs of a resumed run wrote to its metrics, up to `up_to_step`."""
    path = run_dir / "metrics.jsonl"
    if not up_to_step or not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if not isinstance(row, dict) or row.get("val_loss") is None:
                continue
            if isinstance(row.get("step"), int) and row["step"] <= up_to_step:
                rows.append((row["step"], row["val_loss"]))
    return rows
