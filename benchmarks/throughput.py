"""Training-step throughput of the native Nemotron-H against `transformers.NemotronHForCausalLM`.

    python -m benchmarks.throughput --preset tiny --batch 4 --seq-len 512 --dtype fp32
    python -m benchmarks.throughput --preset h1024 --dtype bf16
    python -m benchmarks.throughput --preset tiny --hidden 256 --pattern 'M*M-' --set chunk_size=128
    python -m benchmarks.throughput --sweep-seq --preset h1024 --pattern MMMM --batch 1
    torchrun --standalone --nproc-per-node 2 -m benchmarks.throughput --mesh dp_shard=2
    python -m benchmarks.throughput --ac --preset tiny
    python -m benchmarks.throughput --peft lora --preset h1024 --dtype bf16 --batch 1 --ac full

Both models are built from one config (`transformers.NemotronHConfig(**cfg.to_hf_dict())`) and hold
the same weights: ours is loaded from transformers' state dict. A step is forward, backward and an
AdamW step, each stack computing its loss its own way. After warmup the two run alternately (ours,
theirs, ours, ...) and each reports its median, so a machine that other jobs load at times slows
both alike and the ratio stays meaningful.

MFU divides the model FLOPs (`nemotron_v3/flops.py`) per second by a peak measured in the same run
on the same device: the best of several large matmuls of the benchmark's dtype. On a GPU of
`NOMINAL_BF16_FLOPS` running bf16, MFU against the datasheet's dense peak is printed beside it.

Memory, per rank: on CUDA, each model's peak as if it were alone on the device: its own weights and
optimizer state plus the allocator's peak during one step above the step's start (both models and
their optimizers share the device, so the allocator's absolute peak would count the other one). On CPU, the peak resident set
during one step above the resident set before it (Linux `/proc/self/status` VmHWM, reset through
`/proc/self/clear_refs`), and the bytes autograd saves for backward (activations).

`--peft lora` times our LoRA step against our full fine-tuning step (same weights and batch; fp32
master weights against a base stored in `--dtype`, both computing in `--dtype`) under `--ac MODE`, and
reports each one's step time and peak memory (resident weights and optimizer state plus the step's peak).

`--ac` times ours alone under every activation-checkpointing mode instead (same weights and batch,
the recipe's parallelizer on a one-process group, or on `--mesh` under torchrun), steps interleaved
across modes, and reports each mode's step time and the memory its forward keeps for backward
against `none` measured in the same run.

Each run appends a row to benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import results
from benchmarks.measure import (
    cpu_bf16_support, device_name, interleaved_times, kept_for_backward, nominal_peak_flops, peak_matmul_flops,
    resident_bytes, step_memory, timed,
)
from benchmarks.results import append_row, gib, measured, mib
from nemotron_recipe.models.nemotron_v3 import PRESETS, NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.checkpoint import hf_to_native
from nemotron_recipe.models.nemotron_v3.flops import forward_flops, training_flops
from nemotron_recipe.training.loss import IGNORE_INDEX, cross_entropy_sum, forward_loss_sum

RESULTS = results.RESULTS  # a test points it elsewhere
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Benchmark shapes that are not released models. `h1024`: 12 blocks at hidden 1024 with the shipped
# tokenizer's vocabulary, a model that fine-tunes on the shipped data. `gpu_1b`: 1.1B parameters
# (0.6B outside the 128k-vocabulary embedding and head), every block kind but MoE, for a one-GPU check.
BENCH_PRESETS: dict[str, NemotronHConfig] = {
    "h1024": dataclasses.replace(
        PRESETS["tiny"], pattern="M-M*M-M-M*M-", hidden_size=1024, vocab_size=512,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2816,
        mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=64, chunk_size=128,
    ),
    "gpu_1b": dataclasses.replace(
        PRESETS["tiny"], pattern="M-M-M*-M-M-M-M*-M-M-", vocab_size=131072, hidden_size=2048,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
        mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128,
    ),
}


# ---------------------------------------------------------------------------------------- config
def _parse_value(field: dataclasses.Field, text: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if kind == "bool":
        if text.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"--set {field.name}={text}: expected true or false")
        return text.lower() in ("true", "1")
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text


def add_model_arguments(p: argparse.ArgumentParser, *, preset: str, dtype: str, seq_len: int, batch: int = 4) -> None:
    """The model and batch shape every benchmark takes: what `build_config` reads, with these defaults."""
    p.add_argument("--preset", default=preset, help=f"a model preset or one of {sorted(BENCH_PRESETS)}")
    p.add_argument("--hidden", type=int, help="override hidden_size")
    p.add_argument("--pattern", help="override the block pattern")
    p.add_argument("--vocab", type=int, help="override vocab_size")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override any model field")
    p.add_argument("--batch", type=int, default=batch, help="sequences per step (per data-parallel rank)")
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=dtype, help="parameter and compute dtype")


def build_config(args: argparse.Namespace) -> NemotronHConfig:
    presets = {**PRESETS, **BENCH_PRESETS}
    if args.preset not in presets:
        raise SystemExit(f"--preset {args.preset!r}: unknown; choose one of {sorted(presets)}")
    overrides: dict[str, Any] = {}
    for name, value in (("hidden_size", args.hidden), ("pattern", args.pattern), ("vocab_size", args.vocab)):
        if value is not None:
            overrides[name] = value
    fields = {f.name: f for f in dataclasses.fields(NemotronHConfig)}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        overrides[key] = _parse_value(fields[key], text)
    return dataclasses.replace(presets[args.preset], **overrides)


def describe(cfg: NemotronHConfig, preset: str) -> str:
    base = {**PRESETS, **BENCH_PRESETS}[preset]
    changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(base, f.name)]
    return preset + (f" ({', '.join(changed)})" if changed else "")


# ---------------------------------------------------------------------------------------- models
def build_models(cfg: NemotronHConfig, device: torch.device, dtype: torch.dtype, seed: int, impl: str):
    """(ours, theirs) with identical weights; either is None when `impl` leaves it out."""
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.NemotronHConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    theirs = transformers.NemotronHForCausalLM(hf_cfg)
    ours = None
    if impl in ("both", "ours"):
        ours = NemotronHForCausalLM(cfg)
        ours.load_state_dict(hf_to_native(theirs.state_dict(), cfg))
        ours = ours.to(device=device, dtype=dtype).train()
    if impl == "ours":
        return ours, None
    return ours, theirs.to(device=device, dtype=dtype).train()


def mesh_sizes(spec: str) -> dict[str, Any]:
    """`--mesh` (e.g. "tp=2,sequence_parallel=true") as the recipe's `mesh` group, dp_shard inferred."""
    sizes: dict[str, Any] = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "sequence_parallel": False}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        sizes[key] = value.lower() == "true" if key == "sequence_parallel" else int(value)
    return sizes


def parallel_setup(args: argparse.Namespace, world_size: int, device_type: str):
    """The recipe's (ParallelPlan, ParallelMeshes) for `--mesh` on `world_size` ranks."""
    from types import SimpleNamespace

    from nemotron_recipe.distributed.plan import ParallelPlan

    cfg = SimpleNamespace(
        mesh=SimpleNamespace(**mesh_sizes(args.mesh)),
        ac=SimpleNamespace(mode="none", every=args.ac_every),
        fsdp=SimpleNamespace(param_dtype=args.dtype, reduce_dtype="fp32", offload=False, reshard_after_forward=None),
        trainer=SimpleNamespace(seq_len=args.seq_len),
    )
    plan = ParallelPlan.from_config(cfg, world_size)
    return plan, plan.build_meshes(device_type)


def parallelize(model: torch.nn.Module, parallel, args: argparse.Namespace, **kwargs) -> torch.nn.Module:
    """The recipe's parallelization (FSDP2, TP/SP, CP, AC) as `--mesh` and `--ac` say; transformers'
    model gets the reference plan the parallelizer gives it. `kwargs` go to `parallelize_model`."""
    from nemotron_recipe.distributed.plan import ActivationCheckpointing
    from nemotron_recipe.training.setup import parallelize_model

    plan, meshes = parallel
    plan = dataclasses.replace(plan, ac=ActivationCheckpointing(args.ac, args.ac_every))
    return parallelize_model(model, plan, meshes, **kwargs)


# ---------------------------------------------------------------------------------------- steps
def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=kind == "fused", foreach=kind == "foreach")


def ours_step(model, optimizer, ids, targets, options) -> None:
    """The recipe's micro-batch step: its loss path (chunked with --loss-chunk-size), then AdamW."""
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    forward_loss_sum(model, ids, targets, loss_chunk_size=options.loss_chunk_size, backward_denominator=count)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def theirs_step(model, optimizer, ids, targets, options) -> None:
    if isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor) and options.tp > 1:
        # Vocab-sharded logits: transformers' own loss cannot take them, the recipe's can.
        logits = model(input_ids=ids).logits
        loss_sum, count = cross_entropy_sum(logits, targets)
        (loss_sum / count.clamp(min=1)).backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def compare(args, cfg, device, parallel) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    ours, theirs = build_models(cfg, device, dtype, args.seed, args.impl or "both")
    if ours is not None and args.compile:
        from nemotron_recipe.training.compile import compile_blocks

        compile_blocks(ours)
    if parallel is not None:
        ours = parallelize(ours, parallel, args) if ours is not None else None
        try:
            theirs = parallelize(theirs, parallel, args) if theirs is not None else None
        except Exception as e:  # noqa: BLE001 - the reference plan may not support this mesh
            if rank0:
                print(f"transformers' model cannot run on this mesh ({e}); timing ours alone")
            theirs = None

    args.tp = 1 if parallel is None else parallel[0].tp
    ids, targets, theirs_ids = _batch(cfg, args, device, parallel)
    dp = 1 if parallel is None else parallel[0].dp_size

    steps: dict[str, Callable[[], None]] = {}
    models = {}
    optimizers = {}
    if ours is not None:
        opt_o = make_optimizer(ours, args.adamw)
        steps["ours"] = lambda: ours_step(ours, opt_o, ids, targets, args)
        models["ours"], optimizers["ours"] = ours, opt_o
    if theirs is not None:
        opt_t = make_optimizer(theirs, args.adamw)
        steps["theirs"] = lambda: theirs_step(theirs, opt_t, theirs_ids, targets, args)
        models["theirs"], optimizers["theirs"] = theirs, opt_t

    peak = peak_matmul_flops(device, dtype, args.peak_size)
    times, cpu_times = interleaved_times(steps, device, args.warmup, args.steps)
    peak = max(peak, peak_matmul_flops(device, dtype, args.peak_size))
    memory = {name: step_memory(step, models[name], device, optimizers[name]) for name, step in steps.items()}

    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = args.batch * args.seq_len * dp
    flops = training_flops(cfg, args.batch * dp, args.seq_len)
    nominal = nominal_peak_flops(device_name(device), dtype) if device.type == "cuda" else None
    result: dict[str, Any] = {"peak_flops": peak * world, "flops": flops, "tokens": tokens,
                              "nominal_flops": None if nominal is None else nominal * world}
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = {
            "median_s": med, "times": ts, "tokens_per_s": tokens / med, "tflops": flops / med / 1e12,
            "mfu": flops / med / (peak * world), "memory": memory[name], "cpu_s": statistics.median(cpu_times[name]),
            "mfu_nominal": None if nominal is None else flops / med / (nominal * world),
        }
    if "ours" in result and "theirs" in result:
        result["ratio"] = result["ours"]["tokens_per_s"] / result["theirs"]["tokens_per_s"]
        result["cpu_ratio"] = result["theirs"]["cpu_s"] / result["ours"]["cpu_s"]
    if dist.is_initialized() and world > 1:
        peaks = [None] * world
        dist.all_gather_object(peaks, {k: memory[k]["peak"] for k in memory})
        result["per_rank_peak"] = peaks
    return result


def sweep(args, cfg, device) -> dict[str, Any]:
    """Per-step time of ours (and of theirs with --impl both/theirs) at each sequence length, interleaved."""
    dtype = DTYPES[args.dtype]
    lens = sorted(int(x) for x in args.sweep_lens.split(","))
    ours, theirs = build_models(cfg, device, dtype, args.seed, args.impl or "ours")
    args.tp = 1
    gen = torch.Generator().manual_seed(args.seed)
    batches = {}
    for n in lens:
        ids = torch.randint(0, cfg.vocab_size, (args.batch, n), generator=gen)
        targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), IGNORE_INDEX)], dim=1)
        batches[n] = (ids.to(device), targets.to(device))
    impls = {"ours": (ours, ours_step)} if ours is not None else {}
    if theirs is not None:
        impls["theirs"] = (theirs, theirs_step)
    opts = {name: make_optimizer(m, args.adamw) for name, (m, _) in impls.items()}
    times = {(name, n): [] for name in impls for n in lens}
    for rep in range(args.warmup + args.steps):
        for n in lens:
            for name, (model, fn) in impls.items():
                ids, targets = batches[n]
                t, _ = timed(functools.partial(fn, model, opts[name], ids, targets, args), device)
                if rep >= args.warmup:
                    times[(name, n)].append(t)
    out = {"lens": lens, "medians": {k: statistics.median(v) for k, v in times.items()}}
    for name in impls:
        out[f"{name}_ratio"] = out["medians"][(name, lens[-1])] / out["medians"][(name, lens[0])]
    return out


def _batch(cfg: NemotronHConfig, args, device: torch.device, parallel):
    """This rank's (ids, targets) of one random batch (its data-parallel rank's, its sequence part
    under context parallel), and the whole sequences' ids (transformers' model has no context parallel)."""
    if parallel is None:
        dp_rank, shard = 0, lambda t: t
    else:
        from nemotron_recipe.training.setup import data_layout

        layout = data_layout(*parallel)
        dp_rank, shard = layout.dp_rank, layout.shard
    gen = torch.Generator().manual_seed(args.seed + dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((args.batch, 1), IGNORE_INDEX)], dim=1)
    return shard(ids).to(device), shard(targets).to(device), ids.to(device)


def _kept_by_step(model, ids, targets, args) -> int:
    """What the forward of one of ours' steps keeps for backward (`kept_for_backward`; its logits, or
    its chunked loss, included); then the step's backward, so that nothing is left behind."""
    chunked = {"targets": targets, "loss_chunk_size": args.loss_chunk_size} if args.loss_chunk_size else {}
    kept, out = kept_for_backward(lambda: model(ids, **chunked), model)
    if getattr(out, "loss_sum", None) is not None:
        out.loss_sum.backward()
    else:
        cross_entropy_sum(out.logits, targets)[0].backward()
    model.zero_grad(set_to_none=True)
    return kept


def compare_ac(args, cfg, device, parallel) -> dict[str, Any]:
    """Ours under every activation-checkpointing mode, from the same weights on the same batch: median
    step time (steps interleaved across modes) and the memory each forward keeps for backward."""
    from nemotron_recipe.distributed.activation_checkpoint import AC_MODES

    from nemotron_recipe.training.compile import compile_blocks

    base, _ = build_models(cfg, device, DTYPES[args.dtype], args.seed, "ours")
    if parallel is None:  # one process: a group of one, so FSDP units and all run as in the recipe
        from nemotron_recipe.distributed.env import init_distributed

        init_distributed(device.type)
        parallel = parallel_setup(args, 1, device.type)
    args.tp = parallel[0].tp
    ids, targets, _ = _batch(cfg, args, device, parallel)
    models, steps = {}, {}
    for mode in AC_MODES:
        args.ac = mode
        models[mode] = model = parallelize(copy.deepcopy(base), parallel, args)
        if args.compile:  # as the recipe does: the blocks inside their wrappers
            compile_blocks(model)
        steps[mode] = functools.partial(ours_step, model, make_optimizer(model, args.adamw), ids, targets, args)
    times, cpu_times = interleaved_times(steps, device, args.warmup, args.steps)
    result = {}
    for mode, model in models.items():
        kept = _kept_by_step(model, ids, targets, args)
        result[mode] = {"median_s": statistics.median(times[mode]), "times": times[mode],
                        "cpu_s": statistics.median(cpu_times[mode]), "kept": kept,
                        "peak": step_memory(steps[mode], model, device)["peak"]}
    return result


def compare_peft(args, cfg, device, parallel) -> dict[str, Any]:
    """Our LoRA step against our full fine-tuning step, as the recipe runs each: the same weights and
    batch, fp32 master weights for full fine-tuning and the base stored in `--dtype` for LoRA, both
    computing in `--dtype`. Step time (interleaved, median) and peak memory: the model's resident
    weights and optimizer state plus the step's peak above its start."""
    from nemotron_recipe.models.nemotron_v3.lora import LoRASpec, add_adapters, freeze_base, init_adapters

    full, _ = build_models(cfg, device, torch.float32, args.seed, "ours")
    lora = copy.deepcopy(full).to(DTYPES[args.dtype])
    add_adapters(lora, LoRASpec(rank=args.lora_rank))
    if parallel is None:  # one process: a group of one, so FSDP units and all run as in the recipe
        from nemotron_recipe.distributed.env import init_distributed

        init_distributed(device.type)
        parallel = parallel_setup(args, 1, device.type)
    args.tp = parallel[0].tp
    models = {"full": parallelize(full, parallel, args),
              "lora": parallelize(lora, parallel, args, reapply_trainability=freeze_base)}
    init_adapters(models["lora"], args.seed)
    ids, targets, _ = _batch(cfg, args, device, parallel)
    optimizers = {name: make_optimizer(model, args.adamw) for name, model in models.items()}
    steps = {name: functools.partial(ours_step, model, optimizers[name], ids, targets, args)
             for name, model in models.items()}
    times, cpu_times = interleaved_times(steps, device, args.warmup, args.steps)
    result = {}
    for name, model in models.items():
        resident = resident_bytes(model, optimizers[name])
        above = step_memory(steps[name], model, device, optimizers[name])
        peak = above["peak"] if device.type == "cuda" else resident + (above["peak"] or 0)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result[name] = {"median_s": statistics.median(times[name]), "cpu_s": statistics.median(cpu_times[name]),
                        "times": times[name], "peak": peak, "resident": resident, "trained": trained}
    return result


# ---------------------------------------------------------------------------------------- report
PEFT_HEADER = ("| date (commit) | device | config | dtype | mesh | batch x seq | ac | LoRA rank | trained params | "
               "full s/step | LoRA s/step | LoRA/full time | full peak mem | LoRA peak mem | LoRA/full mem | command |")
COMPARE_HEADER = (
    "| date (commit) | device | config | dtype | mesh | batch x seq | ours tok/s | theirs tok/s | ours/theirs | "
    "ours TFLOP/s (MFU) | theirs TFLOP/s (MFU) | peak mem ours / theirs | fast paths | command |"
)
SWEEP_HEADER = ("| date (commit) | device | config | dtype | batch | seq lengths | ours s/step | time ratio (tokens ratio) | "
                "fast paths | command |")
AC_HEADER = ("| date (commit) | device | config | dtype | mesh | batch x seq | ac | ours s/step | time vs none | "
             "kept for backward | vs none | peak mem | fast paths | command |")


def _command(argv: list[str]) -> str:
    launcher = "torchrun ... " if "TORCHELASTIC_RUN_ID" in os.environ else ""
    return launcher + "python -m benchmarks.throughput " + " ".join(shlex.quote(a) for a in argv)


def fast_paths(args) -> str:
    on = []
    if args.compile:
        on.append("compile")
    if args.loss_chunk_size:
        on.append(f"loss_chunk={args.loss_chunk_size}")
    on.append(f"adamw={args.adamw}")
    if getattr(args, "malloc_kept", False):
        on.append("malloc keeps freed blocks (both)")
    return ", ".join(on)


def _mfu_text(r: dict) -> str:
    """MFU against the measured matmul peak, and against the datasheet's when the device has one."""
    text = f"MFU {100 * r['mfu']:.1f}% of measured peak"
    if r.get("mfu_nominal") is not None:
        text += f", {100 * r['mfu_nominal']:.1f}% of nominal"
    return text


def report_compare(args, cfg, device, result, mesh_desc) -> None:
    print(f"device: {device_name(device)}" + (f" (bf16 matmul: {cpu_bf16_support()})" if device.type == "cpu" else ""))
    print(f"config: {describe(cfg, args.preset)}; batch {args.batch} x seq {args.seq_len}, {args.dtype}, mesh {mesh_desc}")
    fwd = forward_flops(cfg, args.batch, args.seq_len)
    print("forward GFLOP by kind: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in fwd.items() if v))
    nominal = result.get("nominal_flops")
    print(f"training step: {result['flops'] / 1e12:.3f} TFLOP; measured peak {result['peak_flops'] / 1e12:.2f} TFLOP/s "
          f"({args.dtype} matmul)" + ("" if nominal is None else f"; nominal peak {nominal / 1e12:.0f} TFLOP/s "
                                      "(datasheet, dense bf16)"))
    for name in ("ours", "theirs"):
        if name not in result:
            continue
        r = result[name]
        mem = r["memory"]
        kind = "CUDA peak alone (own state + step)" if device.type == "cuda" else "peak RSS above step start"
        print(f"{name:>6}: {r['median_s']:.3f} s/step (median of {len(r['times'])}, range {min(r['times']):.3f}-"
              f"{max(r['times']):.3f}; CPU {r['cpu_s']:.3f} s), {r['tokens_per_s']:,.0f} tok/s, "
              f"{r['tflops']:.3f} TFLOP/s, {_mfu_text(r)}, {kind} {gib(mem['peak'])}, "
              f"saved activations {gib(mem['activations'])}")
    if "per_rank_peak" in result:
        print("per-rank peak: " + "; ".join(
            f"rank {i}: " + ", ".join(f"{k} {gib(v)}" for k, v in p.items()) for i, p in enumerate(result["per_rank_peak"])))
    if "ratio" in result:
        print(f"ours/theirs tokens/s: {result['ratio']:.2f}x (by process CPU time: {result['cpu_ratio']:.2f}x)")
    if args.record:
        def cell(name: str, fmt: Callable[[dict], str]) -> str:
            return fmt(result[name]) if name in result else "-"

        def tok(r):
            return f"{r['tokens_per_s']:,.0f}"

        def tf(r):
            return f"{r['tflops']:.3f} ({_mfu_text(r)})"

        def mem(r):
            return gib(r["memory"]["peak"])

        ratio = f"{result['ratio']:.2f}x (cpu {result['cpu_ratio']:.2f}x)" if "ratio" in result else "-"
        row = (f"| {measured()} | {device_name(device)} | {describe(cfg, args.preset)} | {args.dtype} | "
               f"{mesh_desc} | {args.batch} x {args.seq_len} | {cell('ours', tok)} | {cell('theirs', tok)} | {ratio} | "
               f"{cell('ours', tf)} | {cell('theirs', tf)} | {cell('ours', mem)} / {cell('theirs', mem)} | "
               f"{fast_paths(args)} | `{_command(args.argv)}` |")
        append_row(COMPARE_HEADER, row, RESULTS)


def report_sweep(args, cfg, device, out) -> None:
    lens = out["lens"]
    print(f"device: {device_name(device)}; config: {describe(cfg, args.preset)}; batch {args.batch}, {args.dtype}")
    for (name, n), t in sorted(out["medians"].items()):
        print(f"{name:>6} seq {n:>6}: {t:.3f} s/step, {args.batch * n / t:,.0f} tok/s")
    for name in ("ours", "theirs"):
        if f"{name}_ratio" in out:
            print(f"{name}: time({lens[-1]})/time({lens[0]}) = {out[f'{name}_ratio']:.2f} "
                  f"(tokens ratio {lens[-1] / lens[0]:.1f})")
    if args.record:
        per = ", ".join(f"{out['medians'][('ours', n)]:.3f}" for n in lens) if ("ours", lens[0]) in out["medians"] else "-"
        ratio = f"{out['ours_ratio']:.2f}" if "ours_ratio" in out else "-"
        row = (f"| {measured()} | {device_name(device)} | {describe(cfg, args.preset)} | {args.dtype} | "
               f"{args.batch} | {', '.join(map(str, lens))} | {per} | {ratio} ({lens[-1] / lens[0]:.1f}) | "
               f"{fast_paths(args)} | `{_command(args.argv)}` |")
        append_row(SWEEP_HEADER, row, RESULTS)


def report_ac(args, cfg, device, result, mesh_desc) -> None:
    ref = result["none"]
    print(f"device: {device_name(device)}; config: {describe(cfg, args.preset)}; batch {args.batch} x seq "
          f"{args.seq_len}, {args.dtype}, mesh {mesh_desc}; every_nth: ac.every={args.ac_every}")
    print(f"{'ac':>10}  {'s/step':>7}  {'vs none':>22}  {'kept for backward':>17}  {'vs none':>7}  peak mem")
    rows = []
    for mode, r in result.items():
        time_ratio = f"{r['median_s'] / ref['median_s']:.2f}x (cpu {r['cpu_s'] / ref['cpu_s']:.2f}x)"
        kept_ratio = f"{r['kept'] / ref['kept']:.2f}x"
        print(f"{mode:>10}  {r['median_s']:7.3f}  {time_ratio:>22}  {mib(r['kept']):>17}  {kept_ratio:>7}  "
              f"{gib(r['peak'])}")
        rows.append(f"| {measured()} | {device_name(device)} | {describe(cfg, args.preset)} | {args.dtype} | "
                    f"{mesh_desc} | {args.batch} x {args.seq_len} | {_ac_name(mode, args)} | {r['median_s']:.3f} | "
                    f"{time_ratio} | {mib(r['kept'])} | {kept_ratio} | {gib(r['peak'])} | {fast_paths(args)} | "
                    f"`{_command(args.argv)}` |")
    if args.record:
        for row in rows:
            append_row(AC_HEADER, row, RESULTS)


def report_peft(args, cfg, device, result, mesh_desc) -> None:
    full, lora = result["full"], result["lora"]
    time_ratio = f"{lora['median_s'] / full['median_s']:.2f}x (cpu {lora['cpu_s'] / full['cpu_s']:.2f}x)"
    mem_ratio = f"{lora['peak'] / full['peak']:.2f}x"
    print(f"device: {device_name(device)}; config: {describe(cfg, args.preset)}; batch {args.batch} x seq "
          f"{args.seq_len}, {args.dtype} compute, ac={args.ac}, mesh {mesh_desc}; LoRA rank {args.lora_rank}")
    for name, r in result.items():
        print(f"{name:>5}: {r['median_s']:.3f} s/step, peak {gib(r['peak'])} (resident {gib(r['resident'])}), "
              f"{r['trained'] / 1e6:.2f}M trained parameters")
    print(f"LoRA/full: time {time_ratio}, peak memory {mem_ratio}")
    if args.record:
        row = (f"| {measured()} | {device_name(device)} | {describe(cfg, args.preset)} | {args.dtype} | {mesh_desc} | "
               f"{args.batch} x {args.seq_len} | {_ac_name(args.ac, args)} | {args.lora_rank} | "
               f"{lora['trained'] / 1e6:.2f}M of {full['trained'] / 1e6:.1f}M | {full['median_s']:.3f} | "
               f"{lora['median_s']:.3f} | {time_ratio} | {gib(full['peak'])} | {gib(lora['peak'])} | {mem_ratio} | "
               f"`{_command(args.argv)}` |")
        append_row(PEFT_HEADER, row, RESULTS)


def _ac_name(mode: str, args) -> str:
    return f"every_nth (every={args.ac_every})" if mode == "every_nth" else mode


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, preset="tiny", dtype="fp32", seq_len=512)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--impl", choices=("both", "ours", "theirs"),
                   help="which models to time (default: both; ours alone with --sweep-seq)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each implementation")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--peak-size", type=int, help="n of the n x n x n peak matmul (default 2048 on CPU, 8192 on GPU)")
    p.add_argument("--adamw", choices=("fused", "foreach"), default="fused",
                   help="AdamW implementation, the same for both so the ratio measures the models")
    p.add_argument("--compile", action="store_true", help="ours: torch.compile each block")
    p.add_argument("--loss-chunk-size", type=int, default=0, help="ours: chunked lm_head + cross-entropy")
    p.add_argument("--mesh", default="", help="under torchrun: e.g. dp_shard=2 or tp=2,sequence_parallel=true")
    p.add_argument("--ac", nargs="?", const="all", default="none",
                   help="activation checkpointing mode under --mesh; alone (or 'all'): time ours under every mode")
    p.add_argument("--ac-every", type=int, default=2, help="N of ac=every_nth")
    p.add_argument("--peft", choices=("lora",), help="time our LoRA step against our full fine-tuning step "
                   "(fp32 master weights; the LoRA base stored in --dtype), under --ac")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--sweep-seq", action="store_true", help="time ours at each of --sweep-lens and print the ratio")
    p.add_argument("--sweep-lens", default="2048,8192")
    p.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                   help="leave glibc malloc's defaults (large blocks are then unmapped and page-faulted anew "
                        "every step, which slows both implementations on CPU)")
    p.add_argument("--no-record", dest="record", action="store_false", help="do not append to RESULTS.md")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.malloc_kept = False
    if args.keep_freed_memory:
        from nemotron_recipe.training.cpu_memory import keep_freed_memory

        args.malloc_kept = keep_freed_memory()
    cfg = build_config(args)
    if args.sweep_seq and args.pattern is None:
        cfg = dataclasses.replace(cfg, pattern="M" * max(cfg.pattern.count("M"), 1))
    if args.sweep_seq and set(cfg.pattern) != {"M"}:
        raise SystemExit(f"--sweep-seq measures Mamba-only models; pattern {cfg.pattern!r} has other blocks")

    parallel = None
    mesh_desc = "1 process"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from nemotron_recipe.distributed.env import init_distributed

        env = init_distributed(args.device)
        device = env.device
        parallel = parallel_setup(args, env.world_size, device.type)
        sizes = mesh_sizes(args.mesh)
        mesh_desc = f"{env.world_size} ranks " + ",".join(f"{k}={v}" for k, v in sizes.items() if k != "dp_shard" or v != -1)
        rank0 = env.is_main
    else:
        dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(dev)
        rank0 = True

    try:
        if args.sweep_seq:
            if parallel is not None:
                raise SystemExit("--sweep-seq runs in one process")
            out = sweep(args, cfg, device)
            report_sweep(args, cfg, device, out)
        elif args.peft:
            if args.ac == "all":
                raise SystemExit("--peft compares under one activation-checkpointing mode: give --ac MODE")
            result = compare_peft(args, cfg, device, parallel)
            if rank0:
                report_peft(args, cfg, device, result, mesh_desc)
        elif args.ac == "all":
            result = compare_ac(args, cfg, device, parallel)
            if rank0:
                report_ac(args, cfg, device, result, mesh_desc)
        else:
            result = compare(args, cfg, device, parallel)
            if rank0:
                args.record = args.record and rank0
                report_compare(args, cfg, device, result, mesh_desc)
    finally:
        if dist.is_initialized():
            from nemotron_recipe.distributed.env import teardown

            teardown()


if __name__ == "__main__":
    main()
