"""The default run's step time on a busy machine and on an idle one, per thread setting, in one run.

    python -m benchmarks.threads
    python -m benchmarks.threads --steps 60 --rounds 2 --variants ours omp1 torch passive1

Each setting runs `python -m recipes.finetune` (the default run, `--steps` steps) in a process of its own:

- ours:   the recipe's own choice (nemotron_recipe/training/threads.py: OpenMP's passive wait policy)
- omp1:   OMP_NUM_THREADS=1
- torch:  torch's defaults (NR_THREADS=torch: no choice made)
- passive1: the passive wait policy with one thread (an ablation: fewer threads on busy cores)

first on the machine as it is ("idle"), then while two other PyTorch processes multiply matrices with
torch's default threads ("loaded"). Rounds alternate the settings, so a machine that other jobs load at
times slows all of them alike; each setting reports the median over rounds of its training time per
step (the summary's `train_time_s`: setup and validation left out). Under load the goal is ours within
1.25x of the best setting; idle, ours no slower than torch's defaults.

Appends its rows to a table in benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADER = ("| date (commit) | device | run | machine | ours s/step | OMP_NUM_THREADS=1 | torch defaults | "
          "ours / best | ours / torch defaults | load average | command |")
VARIANTS = {
    "ours": {},
    "omp1": {"OMP_NUM_THREADS": "1"},
    "torch": {"NR_THREADS": "torch"},
    "passive1": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
}
_THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "NR_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")
# A matmul loop with torch's default threads and wait policy: what other PyTorch jobs do to the cores.
_LOAD = "import torch\na = torch.randn(768, 768)\nwhile True:\n    a @ a\n"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any thread setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, "WANDB_SILENT": "true", **extra}


@contextlib.contextmanager
def background_load(processes: int) -> Iterator[None]:
    """`processes` PyTorch matmul loops with torch's default threads, for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD], env=clean_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(processes)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def seconds_per_step(variant: str, steps: int, run_dir: Path, timeout: float) -> float:
    """Training seconds per step of the default run under `variant`'s thread settings."""
    log = run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "recipes.finetune", f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}",
           "trainer.val_every=0", "data.val_max_batches=1", "checkpoint.save_final=false",
           "logger.console.progress_bar=false"]
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=clean_env(**VARIANTS[variant]), stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"{variant}: the run did not finish in {timeout:.0f} s (log {log})")
    if proc.returncode != 0:
        sys.exit(f"{variant}: the run failed with exit code {proc.returncode} (log {log})")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["train_time_s"] / summary["steps"]


def measure(args: argparse.Namespace, tmp: Path) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]]]:
    """Seconds per step by (machine, variant), over rounds, and the load averages seen per machine state."""
    times: dict[tuple[str, str], list[float]] = {}
    loads: dict[str, list[float]] = {"idle": [], "loaded": []}
    for r in range(args.rounds):
        for machine in ("idle", "loaded"):
            with background_load(args.load_processes if machine == "loaded" else 0):
                for variant in args.variants:
                    t = seconds_per_step(variant, args.steps, tmp / f"{machine}_{variant}_{r}", args.timeout)
                    times.setdefault((machine, variant), []).append(t)
                    loads[machine].append(os.getloadavg()[0])
                    print(f"round {r + 1}, {machine}, {variant}: {t:.3f} s/step (load average "
                          f"{loads[machine][-1]:.1f})", flush=True)
    return times, loads


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(f"stopped by signal {signum}")  # so that the background load is killed on the way out


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--load-processes", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["ours", "omp1", "torch"], choices=sorted(VARIANTS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    for needed in ("ours", "omp1", "torch"):
        if needed not in args.variants:
            args.variants.append(needed)

    with tempfile.TemporaryDirectory() as tmp:
        times, loads = measure(args, Path(tmp))
    med = {k: statistics.median(v) for k, v in times.items()}
    command = "python -m benchmarks.threads " + shlex.join(argv if argv is not None else sys.argv[1:])
    met = True
    for machine in ("idle", "loaded"):
        ours = med[(machine, "ours")]
        best = min(med[(machine, v)] for v in ("ours", "omp1", "torch"))
        vs_torch = ours / med[(machine, "torch")]
        extra = "".join(f", {v} {med[(machine, v)]:.3f}" for v in args.variants if v not in ("ours", "omp1", "torch"))
        load = f"{min(loads[machine]):.1f}-{max(loads[machine]):.1f}"
        print(f"{machine}: ours {ours:.3f} s/step, OMP_NUM_THREADS=1 {med[(machine, 'omp1')]:.3f}, torch defaults "
              f"{med[(machine, 'torch')]:.3f}{extra}; ours/best {ours / best:.2f}x, ours/torch {vs_torch:.2f}x "
              f"(load average {load})")
        met &= ours / best <= 1.25 if machine == "loaded" else vs_torch <= 1.0
        if not args.no_record:
            from benchmarks.throughput import _append_row, _measured, device_name

            import torch

            _append_row(HEADER, f"| {_measured()} | {device_name(torch.device('cpu'))} | default run, {args.steps} steps, "
                                f"{args.rounds} round(s) | {machine} | {ours:.3f} | {med[(machine, 'omp1')]:.3f} | "
                                f"{med[(machine, 'torch')]:.3f} | {ours / best:.2f}x | {vs_torch:.2f}x | {load} | "
                                f"`{command.strip()}` |")
    print("goal met" if met else "goal NOT met: loaded ours within 1.25x of the best, idle no slower than torch's")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
