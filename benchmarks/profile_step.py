"""Where a training step's CPU time goes: a `torch.profiler` profile of one step of ours, by op category.

    python -m benchmarks.profile_step                        # h1024, bf16, 4 x 512
    python -m benchmarks.profile_step --batch 1 --seq-len 2048 --dtype fp32
    python -m benchmarks.profile_step --compile              # the blocks compiled (trainer.compile)
    python -m benchmarks.profile_step --copies 15            # also: which ops the copies come from

A step is the recipe's micro-batch step (forward, backward through its loss path, AdamW), as in
`benchmarks.throughput`. Each profiled op's self CPU time falls in one category:

- **matmul**: GEMMs (mm, addmm, bmm, baddbmm, their oneDNN forms).
- **copies & layout**: data movement with no arithmetic: copy_, clone, contiguous, dtype casts
  (to / _to_copy), cat, stack, pad, fill/zero of new buffers, the zero-filled gradients of slices
  and views, and the views themselves (their dispatch cost; a view that must be materialised shows
  up as a copy_).
- **scan elementwise**: the rest of the Mamba2 mixer's conv and scan (decays, exp, cumsum,
  masks, products with broadcasts), forward and backward.
- **norms**: RMSNorm and the gated group norm, forward and backward.
- **softmax/attention**: the fused attention kernels and the loss's (log-)softmax.
- **optimizer**: everything inside AdamW's step.
- **other**: the rest (MLP activations, embedding, residual adds, autograd bookkeeping).

An op inside a norm or the mixer is attributed by the module it ran in; a backward op by the module
whose forward created its autograd node (the profiler's sequence numbers link the two).

MFU is the model FLOPs of the step (`nemotron_v3/flops.py`) over the median of `--steps` unprofiled
steps, against the best bf16/fp32 matmul measured in the same run (`benchmarks.measure`). Each run
appends a row to benchmarks/RESULTS.md (`--no-record` to skip), labelled with `--label`.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import statistics
import sys

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchmarks import results
from benchmarks.measure import device_name, interleaved_times, peak_matmul_flops
from benchmarks.results import append_row, measured
from benchmarks.throughput import (
    DTYPES,
    add_model_arguments,
    build_config,
    build_models,
    describe,
    make_optimizer,
    ours_step,
)
from nemotron_recipe.models.nemotron_v3.flops import training_flops
from nemotron_recipe.training.loss import IGNORE_INDEX

RESULTS = results.RESULTS  # a test points it elsewhere
CATEGORIES = ("matmul", "copies & layout", "scan elementwise", "norms", "softmax/attention", "optimizer", "other")
HEADER = ("| date (commit) | device | config | dtype | batch x seq | run | step s | MFU (measured peak) | "
          + " | ".join(f"{c} %" for c in CATEGORIES) + " | command |")

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation",
              "aten::mkldnn_matmul", "aten::_mkldnn_matmul", "aten::addmv", "aten::mv", "aten::dot"}
COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::cat",
            "aten::stack", "aten::pad", "aten::constant_pad_nd", "aten::fill_", "aten::zero_", "aten::zeros",
            "aten::zeros_like", "aten::new_zeros", "aten::empty_like", "aten::empty", "aten::empty_strided",
            "aten::slice_backward", "aten::select_backward", "aten::as_strided_scatter", "aten::slice_scatter",
            "aten::select_scatter", "aten::repeat_interleave", "aten::repeat", "aten::index_select",
            "aten::_reshape_alias", "aten::resize_", "aten::flip", "aten::split_with_sizes_copy",
            "aten::unbind_copy", "aten::_unsafe_view", "aten::view", "aten::reshape", "aten::permute",
            "aten::transpose", "aten::t", "aten::as_strided", "aten::slice", "aten::select", "aten::split",
            "aten::split_with_sizes", "aten::unbind", "aten::expand", "aten::unsqueeze", "aten::squeeze",
            "aten::unflatten", "aten::flatten", "aten::narrow", "aten::alias", "aten::detach", "aten::detach_",
            "aten::lift_fresh", "aten::numpy_T", "aten::expand_as", "aten::view_as", "aten::chunk",
            "aten::lift", "aten::resolve_conj", "aten::resolve_neg"}
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "softmax", "nll_loss", "cross_entropy")
SCOPES = {"RMSNorm": "norms", "GatedGroupRMSNorm": "norms", "Mamba2Mixer": "scan elementwise"}
SCOPE_PREFIX = "scope::"


def _scope_hooks(model: torch.nn.Module) -> list:
    """Forward hooks that wrap each norm and mixer forward in a profiler range named after its
    category (nested ranges: the innermost wins, so a mixer's norm counts as a norm)."""
    handles = []
    for module in model.modules():
        category = SCOPES.get(type(module).__name__)
        if category is None:
            continue
        stack = []

        def enter(_mod, _args, stack=stack, name=SCOPE_PREFIX + category):
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)

        def leave(_mod, _args, _out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _forward_scope(event) -> str | None:
    """The category of the innermost scope range around `event` (in its forward), or None."""
    for parent in _ancestors(event):
        if parent.name.startswith(SCOPE_PREFIX):
            return parent.name[len(SCOPE_PREFIX):]
    return None


def _backward_node(event):
    """The autograd engine's range of the backward node `event` runs in, or None."""
    for parent in _ancestors(event):
        if parent.name.startswith("autograd::engine::evaluate_function"):
            return parent
    return None


def categorize(events) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """(self CPU microseconds by category, the copy category's time by (op, the op it ran under))."""
    scope_of_node = {}  # forward op sequence number -> scope it ran in
    for e in events:
        if getattr(e, "sequence_nr", -1) >= 0 and not e.name.startswith("autograd::"):
            scope = _forward_scope(e)
            if scope is not None:
                scope_of_node.setdefault(e.sequence_nr, scope)
    by_cat: dict[str, float] = collections.defaultdict(float)
    copies: dict[tuple[str, str], float] = collections.defaultdict(float)
    for e in events:
        t = e.self_cpu_time_total
        if t <= 0 or e.name.startswith(SCOPE_PREFIX):
            by_cat["other"] += max(t, 0)
            continue
        by_cat[_category(e, scope_of_node)] += t
        if _category(e, scope_of_node) == "copies & layout":
            copies[(e.name, _caller(e))] += t
    return by_cat, copies


def _category(e, scope_of_node) -> str:
    name = e.name
    if name in MATMUL_OPS:
        return "matmul"
    if name in COPY_OPS:
        return "copies & layout"
    if any(m in name for m in ATTENTION_MARKERS):
        return "softmax/attention"
    if any(p.name.startswith("Optimizer.step") for p in _ancestors(e)):
        return "optimizer"
    scope = _forward_scope(e)
    if scope is None:
        node = _backward_node(e)
        scope = None if node is None else scope_of_node.get(node.sequence_nr)
    return scope or "other"


def _caller(e) -> str:
    """The nearest enclosing op that is not itself a copy or view (where the copy comes from)."""
    for parent in _ancestors(e):
        if parent.name not in COPY_OPS and not parent.name.startswith(SCOPE_PREFIX):
            return parent.name.replace("autograd::engine::evaluate_function: ", "bwd ")
    return "(top level)"


# ---------------------------------------------------------------------------------------- run
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, preset="h1024", dtype="bf16", seq_len=512)
    p.add_argument("--compile", action="store_true", help="torch.compile each block, as trainer.compile does")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="unprofiled steps timed for the MFU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    p.add_argument("--peak-size", type=int, help="n of the n x n x n peak matmul (default 2048)")
    p.add_argument("--copies", type=int, default=0, metavar="N", help="print the N largest copy sources")
    p.add_argument("--label", default="", help="the row's run label (e.g. before, after)")
    p.add_argument("--no-record", dest="record", action="store_false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv, args.loss_chunk_size, args.tp = argv, 0, 1
    return args


def profile_step(args) -> dict:
    cfg = build_config(args)
    device = torch.device("cpu")
    model, _ = build_models(cfg, device, DTYPES[args.dtype], args.seed, "ours")
    if args.compile:
        from nemotron_recipe.training.compile import compile_blocks

        compile_blocks(model)
    optimizer = make_optimizer(model, "fused")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), IGNORE_INDEX)], dim=1)

    def step():
        ours_step(model, optimizer, ids, targets, args)

    peak = peak_matmul_flops(device, DTYPES[args.dtype], args.peak_size)
    times, _ = interleaved_times({"step": step}, device, args.warmup, args.steps)
    peak = max(peak, peak_matmul_flops(device, DTYPES[args.dtype], args.peak_size))
    handles = _scope_hooks(model)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        for h in handles:
            h.remove()
    by_cat, copies = categorize(prof.events())
    median = statistics.median(times["step"])
    flops = training_flops(cfg, args.batch, args.seq_len)
    return {"cfg": cfg, "device": device, "by_cat": by_cat, "copies": copies, "median": median,
            "mfu": flops / median / peak, "peak": peak, "flops": flops}


def report(args, r) -> None:
    total = sum(r["by_cat"].values())
    shares = {c: 100 * r["by_cat"].get(c, 0.0) / total for c in CATEGORIES}
    print(f"device: {device_name(r['device'])}; config: {describe(r['cfg'], args.preset)}; "
          f"{args.batch} x {args.seq_len}, {args.dtype}{', compiled' if args.compile else ''}")
    print(f"step {r['median']:.3f} s (median of {args.steps}); {r['flops'] / 1e12:.3f} TFLOP; measured peak "
          f"{r['peak'] / 1e12:.2f} TFLOP/s; MFU {100 * r['mfu']:.1f}%")
    print(f"profiled self CPU time {total / 1e6:.3f} s:")
    for c in CATEGORIES:
        print(f"  {c:>18}: {shares[c]:5.1f}%")
    if args.copies:
        print("largest copy sources (op <- the op it ran under), % of the step:")
        for (op, caller), t in sorted(r["copies"].items(), key=lambda kv: -kv[1])[:args.copies]:
            print(f"  {100 * t / total:5.1f}%  {op} <- {caller}")
    if args.record:
        command = "python -m benchmarks.profile_step " + " ".join(shlex.quote(a) for a in args.argv)
        run = args.label or ("compiled" if args.compile else "eager")
        row = (f"| {measured()} | {device_name(r['device'])} | {describe(r['cfg'], args.preset)} | {args.dtype} | "
               f"{args.batch} x {args.seq_len} | {run} | {r['median']:.3f} | {100 * r['mfu']:.1f}% | "
               + " | ".join(f"{shares[c]:.1f}" for c in CATEGORIES) + f" | `{command}` |")
        append_row(HEADER, row, RESULTS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from nemotron_recipe.training.cpu_memory import keep_freed_memory

    keep_freed_memory()
    report(args, profile_step(args))


if __name__ == "__main__":
    main()
