"""The planner's predictions against measurement: one training step's peak memory, per rank.

    python -m benchmarks.plan_validation                              # tiny and h1024, one process
    torchrun --standalone --nproc-per-node 2 -m benchmarks.plan_validation --mesh dp_shard=2
    torchrun --standalone --nproc-per-node 2 -m benchmarks.plan_validation --mesh tp=2

Each row builds the real model, parallelizes it with the recipe's parallelizer, runs one warm-up
step (forward, backward, AdamW, gradients set to None, as the trainer does), then measures the next
step: on CUDA the allocator's peak above the memory allocated before it; on CPU the peak resident set
above the resident set before it (`benchmarks/throughput.py`'s `step_memory`). The resident set counts
what the host allocator holds, not only what tensors hold: run with `MALLOC_MMAP_THRESHOLD_=65536`
(every block above 64 KiB mapped on its own and returned when freed) to measure the tensors' peak,
as CUDA's allocator statistics do; `--keep-freed-memory` measures under the recipe's own setting,
where glibc keeps and fragments freed blocks. The planner predicts
the same quantity from its fake-tensor trace of the step: the activations, temporaries, gathered
parameters and gradients above the sharded parameters and optimizer state. It also checks the
sharded parameter, gradient and optimizer bytes against the live tensors' storages, exactly.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.measure import step_memory
from benchmarks.throughput import BENCH_PRESETS, mesh_sizes
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import (
    PRESETS,
    NemotronHConfig,
    NemotronHForCausalLM,
)
from nemotron_recipe.training.cpu_memory import keep_freed_memory
from nemotron_recipe.training.loss import forward_loss_sum
from nemotron_recipe.training.optim import build_optimizer
from nemotron_recipe.training.setup import parallelize_model

OPTIM = SimpleNamespace(lr=1e-5, weight_decay=0.01, betas=[0.9, 0.95], eps=1e-8)
# One row per model: sizes at which activations dominate the step, as in fine-tuning.
ROWS = {"tiny": {"seq_len": 512, "micro_batch": 8}, "h1024": {"seq_len": 512, "micro_batch": 8}}


def model_config(name: str) -> NemotronHConfig:
    return BENCH_PRESETS[name] if name in BENCH_PRESETS else PRESETS[name]


def plan_for(mesh: str, world_size: int, ac: str, dtype: str, seq_len: int) -> ParallelPlan:
    cfg = SimpleNamespace(
        mesh=SimpleNamespace(**mesh_sizes(mesh)), ac=SimpleNamespace(mode=ac, every=2),
        fsdp=SimpleNamespace(param_dtype=dtype, reduce_dtype="fp32", offload=False, reshard_after_forward=None),
        trainer=SimpleNamespace(seq_len=seq_len),
    )
    return ParallelPlan.from_config(cfg, world_size)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages holding these (local shards of) tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds, read from the live tensors."""
    return {
        "params": _storage_bytes(model.parameters()),
        "grads": _storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": _storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def measure(config: NemotronHConfig, plan: ParallelPlan, *, seq_len: int, micro_batch: int) -> dict[str, Any]:
    """One step's measured peak above its start on this rank (inside a process group of plan's size),
    and the state bytes after a step with gradients kept."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = parallelize_model(NemotronHForCausalLM(config), plan, plan.build_meshes("cpu"))
    optimizer = build_optimizer(model, OPTIM)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len // plan.cp))

    def step() -> None:  # the trainer's, but the gradients are set to None before the next one
        forward_loss_sum(model, ids, ids, backward_denominator=float(ids.numel()))
        optimizer.step()

    step()
    optimizer.zero_grad(set_to_none=True)
    peak = step_memory(step, model, device, saved=False)["peak"]
    state = live_state(model, optimizer)  # gradients still held
    optimizer.zero_grad(set_to_none=True)
    return {"peak": peak, **state}


def predict(config: NemotronHConfig, plan: ParallelPlan, *, seq_len: int, micro_batch: int) -> dict[str, Any]:
    """The planner's figures for the same rank, in a fake world (run it in a process of its own, or
    before any process group)."""
    from nemotron_recipe.training.planner import memory_estimate

    est = memory_estimate(config, plan, micro_batch=micro_batch, seq_len=seq_len, device_type="cpu")
    return {"peak": est.trace.peak, "params": est.state.params, "grads": est.state.grads,
            "optimizer": est.state.optimizer}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,h1024")
    p.add_argument("--mesh", default="")
    p.add_argument("--ac", default="none,full")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--micro-batch", type=int, default=None, help="instead of the row's micro-batch size")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="the recipe's CPU allocator setting: glibc keeps freed blocks up to 1 GiB in its heap")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.keep_freed_memory:
        keep_freed_memory()
    rows = []
    for name in args.models.split(","):
        for ac in args.ac.split(","):
            shape = dict(ROWS.get(name, {"seq_len": 512, "micro_batch": 8}))
            shape["micro_batch"] = args.micro_batch or shape["micro_batch"]
            config, plan = model_config(name), plan_for(args.mesh, world, ac, args.dtype, shape["seq_len"])
            predicted = predict(config, plan, **shape)
            rows.append((name, ac, predicted, shape))
    dist.init_process_group("gloo")
    try:
        for name, ac, predicted, shape in rows:
            plan = plan_for(args.mesh, world, ac, args.dtype, shape["seq_len"])
            measured = measure(model_config(name), plan, **shape)
            if dist.get_rank() == 0:
                ratio = predicted["peak"] / max(measured["peak"] or 1, 1)
                exact = all(predicted[k] == measured[k] for k in ("params", "grads", "optimizer"))
                print(f"{name:6} mesh [{args.mesh or 'single'}] ac {ac:9} {args.dtype}: step peak predicted "
                      f"{predicted['peak'] / 2**20:8.1f} MiB, measured {measured['peak'] / 2**20:8.1f} MiB, "
                      f"ratio {ratio:.3f}; state bytes exact: {exact}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:  # a plain process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    main()
