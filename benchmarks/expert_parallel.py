"""Expert parallel against the same mesh without it, on an MoE-heavy model, in the same run.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.expert_parallel
    torchrun --standalone --nproc-per-node 4 -m benchmarks.expert_parallel --ep 2 --mesh tp=2,sequence_parallel=true

Both copies hold the same weights and train on the same batch (forward, backward, AdamW), steps
interleaved (ep, none, ep, ...) after warmup; each reports its median step time. Per rank it prints
the bytes of expert parameters stored (FSDP shards) and gathered to compute (its ep share, whole), the peak memory of a step (`benchmarks/throughput.py`'s
measure) and the bytes each rank moves per step for the experts: FSDP's all-gather (forward and
backward) and reduce-scatter of the expert weights it holds a shard of, and, with ep, the rows sent
and received by the all-to-alls (forward and backward). The ratio is explained by those bytes
against the expert compute each rank does, which ep leaves unchanged.

Appends its rows to a table in benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.measure import device_name, step_memory, timed
from benchmarks.results import append_row, measured
from benchmarks.throughput import parallel_setup
from nemotron_recipe.distributed.env import distributed
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.setup import parallelize_model

HEADER = ("| date (commit) | device | config | mesh | batch x seq | ep | s/step | vs no ep | expert bytes/rank "
          "stored / gathered | peak mem | expert bytes moved/rank/step | command |")


def moe_heavy(args: argparse.Namespace) -> NemotronHConfig:
    return NemotronHConfig(
        pattern=args.pattern, vocab_size=1024, hidden_size=args.hidden, num_attention_heads=8, num_key_value_heads=2,
        head_dim=args.hidden // 8, intermediate_size=2 * args.hidden, mamba_num_heads=16,
        mamba_head_dim=args.hidden // 16 * 2, n_groups=4, n_routed_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size, moe_shared_expert_intermediate_size=args.expert_size,
    )


def expert_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if ".experts." in n]


def expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of expert parameters this rank stores, bytes of the experts it computes with after FSDP's
    all-gather: its ep share, whole)."""
    stored = gathered = 0
    for p in expert_params(model):
        local = p.to_local() if isinstance(p, DTensor) else p
        stored += local.numel() * local.element_size()
        ep = dict(zip(p.device_mesh.mesh_dim_names or (), p.device_mesh.shape)).get("ep", 1) \
            if isinstance(p, DTensor) else 1
        gathered += p.numel() // ep * local.element_size()
    return stored, gathered


def moved_bytes(model: torch.nn.Module, tokens: int, args: argparse.Namespace, ep: int, fsdp_ranks: int,
                tp_replicas: int) -> int:
    """Expert bytes this rank sends per step: all-gathers (forward, backward) and the gradients'
    reduce-scatter of the experts it computes with, plus the all-to-alls of rows with ep (each row
    leaves for another rank with probability (ep - 1) / ep, there and back, in forward and backward).
    `tokens`: the tokens this rank routes; with sequence parallel the `tp_replicas` tp ranks route
    different ones, and the reduce-scattered gradient shard is all-reduced over them too."""
    _, gathered = expert_bytes(model)
    fsdp = 3 * gathered * (fsdp_ranks - 1) // fsdp_ranks
    fsdp += 2 * gathered // fsdp_ranks * (tp_replicas - 1) // tp_replicas
    blocks = args.pattern.count("E")
    rows = tokens * args.top_k * blocks
    element = 4 if args.dtype == "fp32" else 2
    exchange = 4 * rows * args.hidden * element * (ep - 1) // ep
    return fsdp + exchange


def build(args: argparse.Namespace, world_size: int, ep: int, device: torch.device):
    parallel_args = argparse.Namespace(**{**vars(args), "mesh": ",".join(filter(None, [args.mesh, f"ep={ep}"]))})
    plan, meshes = parallel_setup(parallel_args, world_size, device.type)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(moe_heavy(args)).to(device)
    model = parallelize_model(model, plan, meshes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer, plan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--mesh", default="", help="the rest of the mesh, e.g. tp=2 (dp_shard inferred)")
    p.add_argument("--pattern", default="EE")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-size", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--ac-every", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)

    with distributed() as env:
        device = env.device
        runs = {ep: build(args, env.world_size, ep, device) for ep in (1, args.ep)}
        g = torch.Generator().manual_seed(env.rank)
        ids = torch.randint(0, 1024, (args.batch, args.seq_len), generator=g).to(device)

        def step(model, optimizer) -> None:
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times: dict[int, list[float]] = {ep: [] for ep in runs}
        for i in range(args.warmup + args.steps):
            for ep, (model, optimizer, _) in runs.items():
                seconds, _ = timed(lambda: step(model, optimizer), device)
                if i >= args.warmup:
                    times[ep].append(seconds)
        rows = []
        for ep, (model, optimizer, plan) in runs.items():
            memory = step_memory(lambda: step(model, optimizer), model, device, optimizer)
            stored, gathered = expert_bytes(model)
            fsdp_ranks = plan.dp_shard * plan.cp // ep
            tp_replicas = plan.tp if plan.sequence_parallel else 1  # tp ranks that route different tokens
            moved = moved_bytes(model, args.batch * args.seq_len // plan.cp // tp_replicas, args, ep, fsdp_ranks,
                                tp_replicas)
            stats = torch.tensor([statistics.median(times[ep]), stored, gathered, memory["peak"] or 0, moved],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            rows.append((ep, *stats.tolist()))
        if env.is_main:
            report(args, env.world_size, device, rows)


def report(args: argparse.Namespace, world_size: int, device: torch.device, rows: list[tuple]) -> None:
    base = rows[0][1]
    config = (f"pattern={args.pattern} hidden={args.hidden}, {args.experts} experts x {args.expert_size}, "
              f"top-{args.top_k}, {args.dtype}")
    mesh = f"{world_size} ranks" + (f" {args.mesh}" if args.mesh else "")
    command = "torchrun -m benchmarks.expert_parallel " + shlex.join(sys.argv[1:])
    for ep, seconds, stored, gathered, peak, moved in rows:
        mib = 2**20
        print(f"ep={ep}: {seconds:.3f} s/step ({seconds / base:.2f}x ep=1), expert parameters per rank {stored / mib:.1f} "
              f"MiB stored, {gathered / mib:.1f} MiB gathered to compute; peak {peak / mib:.1f} MiB; experts move "
              f"{moved / mib:.1f} MiB per rank per step")
        if not args.no_record:
            append_row(HEADER, f"| {measured()} | {device_name(device)} | {config} | {mesh} | {args.batch} x "
                                f"{args.seq_len} | {ep} | {seconds:.3f} | {seconds / base:.2f}x | {stored / mib:.1f} / "
                                f"{gathered / mib:.1f} MiB | "
                                f"{peak / mib:.1f} MiB | {moved / mib:.1f} MiB | `{command}` |")


if __name__ == "__main__":
    main()
