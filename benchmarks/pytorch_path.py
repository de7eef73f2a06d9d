"""The PyTorch path against the installed kernels (mamba_ssm's Triton scan, causal_conv1d) on a GPU.

    python -m benchmarks.pytorch_path                        # gpu_1b, bf16, 4 x 2048, on CUDA
    python -m benchmarks.pytorch_path --scan-chunks 64,128,256 --no-step
    bash benchmarks/gpu_check.sh --pytorch-path              # on a lent GPU machine

Users who cannot install mamba_ssm and causal_conv1d (aarch64, a new CUDA, no time for a source
build) run the PyTorch scan and conv on their GPUs. This measures what that costs, in one process:

1. **Training step**: one model, forward, backward and AdamW, steps alternating between the kernel
   path and the PyTorch path (the kernels hidden from `nemotron_v3.kernels` for that step, as if they
   were not installed); medians, their ratio, and each path's peak memory. Without the kernels
   installed only the PyTorch path is timed.
2. **The scan alone** (forward and backward at one Mamba2 block's shape): mamba_ssm's Triton scan,
   the PyTorch scan eager, and the PyTorch scan under `torch.compile`, at each `--scan-chunks` chunk
   length (the PyTorch scan's per-device knob, `kernels.SCAN_CHUNK_SIZE`).

Rows go to benchmarks/RESULTS.md (`--no-record` to skip). On CPU it runs the PyTorch path alone
(a smoke test of the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys

import torch

from benchmarks import results
from benchmarks.measure import device_name, interleaved_times, step_memory, timed
from benchmarks.results import append_row, gib, measured
from benchmarks.throughput import (
    DTYPES,
    add_model_arguments,
    build_config,
    build_models,
    describe,
    make_optimizer,
    ours_step,
)
from nemotron_recipe.models.nemotron_v3 import kernels
from nemotron_recipe.training.loss import IGNORE_INDEX

RESULTS = results.RESULTS  # a test points it elsewhere
STEP_HEADER = ("| date (commit) | device | config | dtype | batch x seq | kernels s/step | PyTorch s/step | "
               "PyTorch / kernels | peak mem kernels / PyTorch | command |")
SCAN_HEADER = ("| date (commit) | device | scan shape (b, l, h, p, g, n) | variant | chunk | fwd+bwd ms | "
               "vs PyTorch eager (same chunk) | command |")


@contextlib.contextmanager
def kernels_hidden():
    """`nemotron_v3.kernels` as on a machine without mamba_ssm and causal_conv1d."""
    saved = kernels._triton_scan, kernels._cuda_conv
    kernels._triton_scan = kernels._cuda_conv = lambda: None
    try:
        yield
    finally:
        kernels._triton_scan, kernels._cuda_conv = saved


def hidden(fn):
    def run():
        with kernels_hidden():
            fn()
    return run


def kernels_installed(device: torch.device) -> bool:
    return device.type == "cuda" and kernels._triton_scan() is not None and kernels._cuda_conv() is not None


# ---------------------------------------------------------------------------------------- step
def compare_steps(args, cfg, device) -> dict:
    model, _ = build_models(cfg, device, DTYPES[args.dtype], args.seed, "ours")
    optimizer = make_optimizer(model, "fused")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), IGNORE_INDEX)], dim=1)
    ids, targets = ids.to(device), targets.to(device)
    args.loss_chunk_size, args.tp = 0, 1

    def step():
        ours_step(model, optimizer, ids, targets, args)

    steps = {"kernels": step} if kernels_installed(device) else {}
    steps["pytorch"] = hidden(step)
    times, _ = interleaved_times(steps, device, args.warmup, args.steps)
    out = {name: {"median": statistics.median(ts),
                  "peak": step_memory(steps[name], model, device, optimizer, saved=False)["peak"]}
           for name, ts in times.items()}
    return out


# ---------------------------------------------------------------------------------------- scan
def scan_inputs(cfg, args, device):
    b, l = args.batch, args.seq_len
    h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    x = rand(b, l, h, p).to(dtype).requires_grad_()
    dt = torch.nn.functional.softplus(rand(b, l, h) - 2).requires_grad_()
    A = (-torch.rand(h, generator=gen).to(device) - 0.5).requires_grad_()
    B = rand(b, l, g, n, scale=0.3).to(dtype).requires_grad_()
    C = rand(b, l, g, n, scale=0.3).to(dtype).requires_grad_()
    D = rand(h).requires_grad_()
    return (x, dt, A, B, C, D), rand(b, l, h, p).to(dtype)


def time_scans(args, cfg, device) -> list[dict]:
    """Forward + backward ms of each scan variant at each chunk length, variants interleaved."""
    inputs, grad_y = scan_inputs(cfg, args, device)
    chunks = [int(c) for c in args.scan_chunks.split(",")]
    variants = {}
    if device.type == "cuda" and kernels._triton_scan() is not None:
        variants[("triton", cfg.chunk_size)] = lambda: kernels.ssd_scan(*inputs, cfg.chunk_size)
    for q in chunks:
        variants[("pytorch eager", q)] = lambda q=q: kernels.SSDChunkScan.apply(*inputs, q, None, grad_y.dtype)
        if args.compile:
            compiled = torch.compile(lambda *t, q=q: kernels.SSDChunkScan.apply(*t, q, None, grad_y.dtype))
            variants[("pytorch compiled", q)] = lambda c=compiled: c(*inputs)

    def fwd_bwd(fn):
        def run():
            y = fn()
            torch.autograd.grad(y, inputs, grad_y.to(y.dtype))
        return run

    steps = {f"{name} {q}": hidden(fwd_bwd(fn)) if name != "triton" else fwd_bwd(fn)
             for (name, q), fn in variants.items()}
    times, _ = interleaved_times(steps, device, args.warmup, args.steps)
    rows = []
    for (name, q) in variants:
        ms = 1e3 * statistics.median(times[f"{name} {q}"])
        eager = 1e3 * statistics.median(times[f"pytorch eager {q}"]) if f"pytorch eager {q}" in times else None
        rows.append({"variant": name, "chunk": q, "ms": ms, "vs_eager": None if eager is None else eager / ms})
    return rows


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, preset="gpu_1b", dtype="bf16", seq_len=2048)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-chunks", default="64,128,256", help="chunk lengths of the PyTorch scan to time")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="leave out the compiled scan")
    p.add_argument("--no-step", dest="step", action="store_false", help="time the scan alone")
    p.add_argument("--no-record", dest="record", action="store_false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def report(args, cfg, device, step, scans) -> None:
    command = "python -m benchmarks.pytorch_path " + " ".join(shlex.quote(a) for a in args.argv)
    print(f"device: {device_name(device)}; config: {describe(cfg, args.preset)}; {args.batch} x {args.seq_len}, "
          f"{args.dtype}; kernels installed: {kernels_installed(device)}")
    if step:
        for name, r in step.items():
            print(f"step {name:>8}: {r['median']:.3f} s/step, peak {gib(r['peak'])}")
        ratio = f"{step['pytorch']['median'] / step['kernels']['median']:.2f}x" if "kernels" in step else "-"
        print(f"PyTorch path / kernel path step time: {ratio}")
        if args.record:
            kern = step.get("kernels")
            kern_s, kern_mem = ("-", "-") if kern is None else (f"{kern['median']:.3f}", gib(kern["peak"]))
            row = (f"| {measured()} | {device_name(device)} | {describe(cfg, args.preset)} | {args.dtype} | "
                   f"{args.batch} x {args.seq_len} | {kern_s} | {step['pytorch']['median']:.3f} | {ratio} | "
                   f"{kern_mem} / {gib(step['pytorch']['peak'])} | `{command}` |")
            append_row(STEP_HEADER, row, RESULTS)
    shape = (args.batch, args.seq_len, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size)
    for r in scans:
        vs = "-" if r["vs_eager"] is None else f"{r['vs_eager']:.2f}x"
        print(f"scan {r['variant']:>16} chunk {r['chunk']:>4}: {r['ms']:8.2f} ms fwd+bwd ({vs} of eager's speed)")
        if args.record:
            row = (f"| {measured()} | {device_name(device)} | {shape} | {r['variant']} | {r['chunk']} | "
                   f"{r['ms']:.2f} | {vs} | `{command}` |")
            append_row(SCAN_HEADER, row, RESULTS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev)
    cfg = build_config(args)
    step = compare_steps(args, cfg, device) if args.step else None
    report(args, cfg, device, step, time_scans(args, cfg, device))


if __name__ == "__main__":
    main()
