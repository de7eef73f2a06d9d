"""`trainer.compile=true` against eager: the same model, weights and batch, steps interleaved.

    python -m benchmarks.compile_ab                          # h1024, bf16, 4 x 512
    python -m benchmarks.compile_ab --dtype fp32 --steps 5

Two copies of ours start from identical weights; one has its blocks compiled as the recipe compiles
them (`training.compile.compile_blocks`). After warmup (the compiled copy's warmup includes the
compilation) they step alternately, each with its own AdamW, so both see the same batches and
weights evolve alike; each step's loss is kept. The row gives the median step times, the speed-up
(wall and process CPU time), the largest relative loss difference between the two over all steps,
and each one's peak memory in one step (on CPU: the peak resident set above the step's start).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys

import torch

from benchmarks import results
from benchmarks.measure import device_name, step_memory, timed
from benchmarks.results import append_row, gib, measured
from benchmarks.throughput import DTYPES, add_model_arguments, build_config, build_models, describe, make_optimizer
from nemotron_recipe.training.loss import IGNORE_INDEX, forward_loss_sum

RESULTS = results.RESULTS  # a test points it elsewhere
HEADER = ("| date (commit) | device | config | dtype | batch x seq | eager s/step | compiled s/step | "
          "compiled speed-up | max loss difference (rel.) | peak mem eager / compiled | command |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, preset="h1024", dtype="bf16", seq_len=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--no-record", dest="record", action="store_false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def run(args) -> dict:
    from nemotron_recipe.training.compile import compile_blocks

    cfg = build_config(args)
    device = torch.device("cpu")
    eager, _ = build_models(cfg, device, DTYPES[args.dtype], args.seed, "ours")
    compiled = copy.deepcopy(eager)
    if not compile_blocks(compiled):
        raise SystemExit("torch.compile failed on this machine (see the warning above)")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), IGNORE_INDEX)], dim=1)
    count = (targets != IGNORE_INDEX).sum()
    models = {"eager": eager, "compiled": compiled}
    optimizers = {name: make_optimizer(m, "fused") for name, m in models.items()}
    losses: dict[str, list[float]] = {name: [] for name in models}

    def step(name):
        loss_sum, _ = forward_loss_sum(models[name], ids, targets, backward_denominator=count)
        losses[name].append((loss_sum / count).item())
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    times = {name: [] for name in models}
    cpu = {name: [] for name in models}
    for i in range(args.warmup + args.steps):
        for name in models:
            wall, cpu_s = timed(lambda: step(name), device)
            if i >= args.warmup:
                times[name].append(wall)
                cpu[name].append(cpu_s)
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["eager"], losses["compiled"]))
    memory = {name: step_memory(lambda name=name: step(name), models[name], device, saved=False)["peak"]
              for name in models}
    return {"cfg": cfg, "device": device, "median": {k: statistics.median(v) for k, v in times.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()}, "loss_diff": diff, "memory": memory,
            "losses": losses}


def report(args, r) -> None:
    eager, comp = r["median"]["eager"], r["median"]["compiled"]
    speed = f"{eager / comp:.2f}x (cpu {r['cpu']['eager'] / r['cpu']['compiled']:.2f}x)"
    mem = f"{gib(r['memory']['eager'])} / {gib(r['memory']['compiled'])}"
    print(f"device: {device_name(r['device'])}; config: {describe(r['cfg'], args.preset)}; "
          f"{args.batch} x {args.seq_len}, {args.dtype}")
    print(f"eager {eager:.3f} s/step, compiled {comp:.3f} s/step: compiled speed-up {speed}")
    print(f"losses eager {r['losses']['eager']}\n      compiled {r['losses']['compiled']}")
    print(f"max relative loss difference {r['loss_diff']:.2e}; peak memory eager / compiled {mem}")
    if args.record:
        command = "python -m benchmarks.compile_ab " + " ".join(shlex.quote(a) for a in args.argv)
        row = (f"| {measured()} | {device_name(r['device'])} | {describe(r['cfg'], args.preset)} | {args.dtype} | "
               f"{args.batch} x {args.seq_len} | {eager:.3f} | {comp:.3f} | {speed} | {r['loss_diff']:.1e} | "
               f"{mem} | `{command}` |")
        append_row(HEADER, row, RESULTS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from nemotron_recipe.training.cpu_memory import keep_freed_memory

    keep_freed_memory()
    report(args, run(args))


if __name__ == "__main__":
    main()
