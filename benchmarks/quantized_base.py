"""LoRA on a 4-bit NF4 base against LoRA on a bf16 base: step time, peak memory and base bytes.

    python -m benchmarks.quantized_base --preset h1024 --batch 1 --seq-len 512 --ac full

Both models start from the same weights and train the same adapters on the same batch, computing in
bf16, as the recipe runs them (one process: FSDP2 on a group of one); steps are interleaved and the
medians compared. **base bytes**: the frozen projections' storage (NF4: the 4-bit codes, 8-bit scales,
factors and means; bf16: 2 bytes a weight). **peak mem**: the model's resident weights, gradients
and optimizer state plus the allocator's peak above the step's start (CUDA: its peak statistic; CPU:
from the profiler's allocation events, `measure.cpu_allocator_peak`). Appends a row to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics

import torch

from benchmarks.measure import cpu_allocator_peak, interleaved_times, step_memory
from benchmarks.results import append_row, gib, measured, mib
from benchmarks.throughput import (
    _batch,
    build_config,
    build_models,
    describe,
    make_optimizer,
    ours_step,
    parallel_setup,
    parallelize,
)
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    add_adapters,
    freeze_base,
    init_adapters,
    nf4_targets,
    quantize_base,
)
from nemotron_recipe.models.nemotron_v3.nf4 import is_nf4, nf4_bytes

HEADER = ("| date (commit) | device | config | batch x seq | ac | LoRA rank | bf16-base s/step | nf4-base s/step | "
          "nf4/bf16 time | bf16 base bytes | nf4 base bytes | nf4/bf16 bytes | bf16-base peak | nf4-base peak | "
          "nf4/bf16 peak | command |")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return nf4_bytes(t) if is_nf4(t) else t.untyped_storage().nbytes()


def resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters (NF4 ones by their parts), buffers, gradients and optimizer state."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(tensor_bytes(t) for t in tensors)


def base_bytes(model: torch.nn.Module, names: list[str]) -> int:
    params = dict(model.named_parameters())
    return sum(tensor_bytes(params[n]) for n in names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h1024")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--ac", default="full")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-record", action="store_true", help="print only; append no row")
    args = p.parse_args()
    # What benchmarks.throughput's helpers read of its own arguments.
    vars(args).update(hidden=None, pattern=None, vocab=None, set=[], dtype="bf16", mesh="", ac_every=2,
                      loss_chunk_size=0, adamw="foreach")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = build_config(args)
    from nemotron_recipe.distributed.env import init_distributed

    init_distributed(device.type)
    parallel = parallel_setup(args, 1, device.type)
    base, _ = build_models(cfg, torch.device("cpu"), torch.bfloat16, args.seed, "ours")
    models = {}
    for name in ("bf16", "nf4"):
        model = copy.deepcopy(base)
        add_adapters(model, LoRASpec(rank=args.lora_rank))
        if name == "nf4":
            quantize_base(model)
        models[name] = parallelize(model, parallel, args, reapply_trainability=freeze_base)
        init_adapters(models[name], args.seed)
    names = nf4_targets(base)
    del base
    ids, targets, _ = _batch(cfg, args, device, parallel)
    optimizers = {name: make_optimizer(model, args.adamw) for name, model in models.items()}
    steps = {name: functools.partial(ours_step, model, optimizers[name], ids, targets, args)
             for name, model in models.items()}
    times, _ = interleaved_times(steps, device, args.warmup, args.steps)
    out = {}
    for name, model in models.items():
        if device.type == "cuda":
            above = step_memory(steps[name], model, device, optimizers[name], saved=False)["peak_above_start"]
        else:
            above = cpu_allocator_peak(steps[name])
        peak = resident(model, optimizers[name]) + above
        out[name] = {"s": statistics.median(times[name]), "peak": peak,
                     "base": base_bytes(model, [_fsdp_name(model, n) for n in names])}
    b, q = out["bf16"], out["nf4"]
    print(f"{describe(cfg, args.preset)}, {args.batch} x {args.seq_len}, ac={args.ac}, LoRA rank {args.lora_rank}")
    for label, key, fmt in (("step time", "s", lambda v: f"{v:.3f} s"), ("base bytes", "base", mib),
                            ("peak memory", "peak", gib)):
        print(f"  {label:12s} bf16 base {fmt(b[key])}   nf4 base {fmt(q[key])}   nf4/bf16 {q[key] / b[key]:.3f}x")
    if not args.no_record:
        command = "python -m benchmarks.quantized_base " + " ".join(
            f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("preset", "batch", "seq_len", "ac"))
        append_row(HEADER, f"| {measured()} | {device.type} | {describe(cfg, args.preset)} | {args.batch} x "
                   f"{args.seq_len} | {args.ac} | {args.lora_rank} | {b['s']:.3f} | {q['s']:.3f} | {q['s'] / b['s']:.2f}x | "
                   f"{mib(b['base'])} | {mib(q['base'])} | {q['base'] / b['base']:.3f}x | {gib(b['peak'])} | "
                   f"{gib(q['peak'])} | {q['peak'] / b['peak']:.2f}x | `{command}` |")


def _fsdp_name(model: torch.nn.Module, name: str) -> str:
    """`name` as the parallelized model spells it (activation-checkpoint wrappers inserted)."""
    for full in dict(model.named_parameters()):
        if full.replace("_checkpoint_wrapped_module.", "") == name:
            return full
    raise KeyError(name)


if __name__ == "__main__":
    main()
