"""Pipeline parallel: the split by cost against equal block counts, the bubble, and the measured step
against the planner's estimate.

    python -m benchmarks.pipeline                   # estimates at Nano's shapes, then measured runs
    python -m benchmarks.pipeline --estimate-only   # the estimates alone (seconds)

*Estimates* (Nemotron 3 Nano's released shapes, 2048-token micro-batches, 8 per step, 1F1B): for 2 and 4
stages, the slowest stage's share of the step under the split by cost and under equal block counts, the
bubble of the schedule played with each split's stage times, and the planner's step-time floor (compute
at 989 TFLOP/s per device) of each.

*Measured*: the recipe itself (`recipes.finetune` under torchrun, gloo, one thread per rank) on a small
model of Nano's kind (Mamba2 / MoE pairs, attention every sixth block, a head worth several blocks),
8 micro-batches per step: one process, then 2 and 4 stages, each split by cost and by equal counts.
A step's time is the median over the steps after the first of the differences of `elapsed_s` in
metrics.jsonl. The planner's estimate of a pipeline step is its schedule played with the split's stage
FLOPs at the rate the one-process run of the same launch measured (its step over the model's FLOPs for
8 micro-batches), so the ratio measured / estimate isolates what the pipeline adds or loses: p2p,
waits, and ranks sharing the machine's cores.

Rows are appended to benchmarks/RESULTS.md (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.results import append_row, measured
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.training.pipeline.split import equal_starts, plan_split
from nemotron_recipe.training.planner.pipeline import play, schedule_actions

REPO = Path(__file__).resolve().parents[1]
H100_FLOPS = 989e12
# Nano's kind at CPU size: 17 blocks (8 Mamba2, 7 MoE, 2 attention) and a 4096-token head.
SMALL_PATTERN = "MEMEM*EMEMEM*EMEM"
SMALL = ["model=tiny", f"model.pattern={SMALL_PATTERN}", "model.vocab_size=4096"]

ESTIMATE_HEADER = ("| date (commit) | model | stages | micro-batches | split | slowest stage share | "
                   "equal split's | lower by | bubble | floor at 989 TFLOP/s | equal split's floor |")
MEASURED_HEADER = ("| date (commit) | command | stages | split | slowest stage share (est.) | bubble (est.) | "
                   "step estimate | step measured | measured / estimate | step against one process |")


def _played(split, n: int, schedule: str = "1f1b"):
    """The schedule played with the split's stage times (seconds at 1 FLOP/s: forward = time / 3)."""
    return play(schedule_actions(schedule, split.n_stages, 1, n), [t / 3 for t in split.times],
                [0.0] * split.n_stages)


def estimates(config: NemotronHConfig, name: str, n: int, seq_len: int, record: bool) -> None:
    for stages in (2, 4):
        balanced = plan_split(config, stages, seq_len=seq_len, micro_batch=1)
        equal = plan_split(config, stages, split_points=list(equal_starts(config.num_layers, stages)[1:]),
                           seq_len=seq_len, micro_batch=1)
        ours, theirs = _played(balanced, n), _played(equal, n)
        lower = 1 - balanced.slowest_share / equal.slowest_share
        print(f"{name} over {stages} stages, {n} micro-batches of {seq_len} tokens: split {balanced.split_points}: "
              f"slowest stage {balanced.slowest_share:.1%} (equal counts {equal.slowest_share:.1%}, {lower:.1%} lower); "
              f"bubble {ours.bubble:.1%} ({theirs.bubble:.1%}); floor {ours.makespan / H100_FLOPS:.3f} s "
              f"({theirs.makespan / H100_FLOPS:.3f} s)")
        if record:
            append_row(ESTIMATE_HEADER, f"| {measured()} | {name} | {stages} | {n} | {balanced.split_points} | "
                                        f"{balanced.slowest_share:.1%} | {equal.slowest_share:.1%} | {lower:.1%} | "
                                        f"{ours.bubble:.1%} | {ours.makespan / H100_FLOPS:.3f} s | "
                                        f"{theirs.makespan / H100_FLOPS:.3f} s |")


def _run(overrides: list[str], nproc: int, workdir: Path, name: str) -> float:
    """Median step seconds of one recipe launch (steps after the first)."""
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "recipes.finetune", *overrides, f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NR_RUN_ID": f"pipeline-bench-{name}",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed ({shlex.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["elapsed_s"] for r in rows if "loss" in r]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def measure(args: argparse.Namespace) -> None:
    n = 8
    common = [*SMALL, f"trainer.global_batch_size={n}", "trainer.micro_batch_size=1",
              f"trainer.seq_len={args.seq_len}", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
              "trainer.val_every=0", "checkpoint.save_final=false", "eval.sample_tokens=0", "trainer.preflight=false",
              "logger.console.progress_bar=false", "optim.lr=1e-3"]
    config = NemotronHConfig.from_preset("tiny", pattern=SMALL_PATTERN, vocab_size=4096)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        one = _run(common, 1, workdir, "pp1")
        whole = plan_split(config, 1, seq_len=args.seq_len, micro_batch=1)
        rate = n * sum(whole.times) / one  # FLOP/s this machine ran the one-process step at
        print(f"one process: {one:.2f} s per step of {n} micro-batches ({rate / 1e9:.2f} GFLOP/s)")
        for stages in (2, 4):
            for how in ("cost", "equal"):
                points = None if how == "cost" else list(equal_starts(config.num_layers, stages)[1:])
                split = plan_split(config, stages, split_points=points, seq_len=args.seq_len, micro_batch=1)
                played = _played(split, n)
                estimate = played.makespan / rate
                extra = [f"mesh.pp={stages}", "mesh.dp_shard=1"] + (
                    [f"mesh.pp_split=[{','.join(map(str, points))}]"] if points else [])
                step = _run(common + extra, stages, workdir, f"pp{stages}-{how}")
                command = f"pp={stages} {how}"
                print(f"{stages} stages split by {how} {split.split_points}: slowest {split.slowest_share:.1%}, "
                      f"bubble {played.bubble:.1%}; step {step:.2f} s against {estimate:.2f} s estimated "
                      f"({step / estimate:.2f}x), {step / one:.2f}x one process's")
                if args.record:
                    cmd = f"python -m benchmarks.pipeline --steps {args.steps} --seq-len {args.seq_len} ({command})"
                    append_row(MEASURED_HEADER,
                               f"| {measured()} | `{cmd}` | {stages} | {split.split_points} | "
                               f"{split.slowest_share:.1%} | {played.bubble:.1%} | {estimate:.2f} s | {step:.2f} s | "
                               f"{step / estimate:.2f} | {step / one:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-record", dest="record", action="store_false")
    args = parser.parse_args()
    estimates(NemotronHConfig.from_preset("nemotron3_nano_30b_a3b"), "nemotron3_nano_30b_a3b", 8, 2048, args.record)
    if not args.estimate_only:
        measure(args)


if __name__ == "__main__":
    main()
