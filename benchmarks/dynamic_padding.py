"""Step time of a large `trainer.seq_len` on short data, against a small one, in the same run.

    python -m benchmarks.dynamic_padding
    python -m benchmarks.dynamic_padding --seq-lens 128 4096 --steps 30 --rounds 3

Batches are padded to their longest row, so a `trainer.seq_len` far above the data's lengths should
cost (almost) nothing. The recipe runs on the shipped data once per `seq_len`, in rounds that alternate
the settings (a machine that other jobs load at times slows both alike); each setting reports the
median over rounds of its training time per step, and the ratio to the first setting.
It also runs the largest setting once with every batch padded to `seq_len` (`--padded-steps` steps), the
cost dynamic padding avoids.

Appends its rows to a table in benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks.measure import device_name
from benchmarks.results import append_row, measured
from nemotron_recipe.data import batching
from nemotron_recipe.training import finetune
from nemotron_recipe.training.finetune import run

CONF = Path(__file__).resolve().parents[1] / "conf"
HEADER = "| date (commit) | device | config | seq_len | batches padded to | ms/step | vs first | command |"


def train_seconds_per_step(seq_len: int, steps: int, run_dir: Path, pad_to_seq_len: bool = False) -> float:
    overrides = [f"run_dir={run_dir}", f"trainer.seq_len={seq_len}", f"trainer.max_steps={steps}",
                 "trainer.val_every=0", "checkpoint.save_final=false", "checkpoint.every=0",
                 "logger.console.progress_bar=false"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="finetune", overrides=overrides)
    original = finetune.collate
    if pad_to_seq_len:
        finetune.collate = lambda examples, indices, seq_len, pad_id, multiple=1: batching.collate(
            examples, indices, seq_len, pad_id, multiple=seq_len)
    try:
        summary = run(cfg)
    finally:
        finetune.collate = original
    return summary["train_time_s"] / summary["steps"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--padded-steps", type=int, default=2)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)

    settings = [(n, False) for n in args.seq_lens]
    times: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (seq_len, padded) in enumerate(settings):
                times[(seq_len, padded)].append(train_seconds_per_step(seq_len, args.steps, Path(tmp) / f"r{r}_{i}"))
        if args.padded_steps:
            padded = (max(args.seq_lens), True)
            settings.append(padded)
            times[padded] = [train_seconds_per_step(padded[0], args.padded_steps, Path(tmp) / "padded", True)]

    base = statistics.median(times[settings[0]])
    command = "python -m benchmarks.dynamic_padding " + shlex.join(argv if argv is not None else sys.argv[1:])
    for seq_len, padded in settings:
        t = statistics.median(times[(seq_len, padded)])
        how = "seq_len" if padded else "the longest row"
        print(f"seq_len={seq_len}, padded to {how}: {1e3 * t:.1f} ms/step, {t / base:.2f}x seq_len={settings[0][0]}")
        if not args.no_record:
            append_row(HEADER, f"| {measured()} | {device_name(torch.device('cpu'))} | tiny, shipped data, 1 process | "
                                f"{seq_len} | {how} | {1e3 * t:.1f} | {t / base:.2f}x | `{command.strip()}` |")

if __name__ == "__main__":
    main()
