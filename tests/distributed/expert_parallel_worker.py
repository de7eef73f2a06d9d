"""Runs under torchrun: routed experts computed through `dispatch`/`combine` on an expert-parallel
group against the same rows computed on every rank with all experts; writes each rank's largest
relative differences of outputs and gradients.

    torchrun --standalone --nproc-per-node N tests/distributed/expert_parallel_worker.py OUT.json
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from worker_results import write_and_finish

from nemotron_recipe.distributed.expert_parallel import combine, dispatch, shard_experts

EXPERTS, D, HIDDEN, TOP_K = 8, 6, 10, 2


def TOKENS(rank: int) -> int:  # noqa: N802 - a constant per rank
    return 5 + 3 * rank


def experts_forward(rows: torch.Tensor, counts: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    parts = rows.split(counts.tolist())
    return torch.cat([F.relu(p @ up[e].T).square() @ down[e].T for e, p in enumerate(parts)])


def routed(x: torch.Tensor, idx: torch.Tensor, up, down, group=None, seen: dict | None = None) -> torch.Tensor:
    order = idx.flatten().argsort(stable=True)
    rows = x[order // TOP_K]
    counts = torch.bincount(idx.flatten(), minlength=EXPERTS)
    if group is None:
        return experts_forward(rows, counts, up, down)[order.argsort()]
    sent = dispatch(rows, counts, group)
    if seen is not None:  # what the exchange did, for the test to check it was exercised
        seen.update(send_splits=sent.send_splits, recv_splits=sent.recv_splits,
                    reordered=not torch.equal(sent.order, torch.arange(sent.order.numel())))
    return combine(experts_forward(sent.rows, sent.counts, up, down), sent)[order.argsort()]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest magnitude (0 for empty tensors)."""
    return (got - want).abs().max().item() / want.abs().max().clamp_min(1e-30).item() if want.numel() else 0.0


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(0)
    up, down = torch.randn(EXPERTS, HIDDEN, D, generator=g), torch.randn(EXPERTS, D, HIDDEN, generator=g)
    # Every rank draws every rank's tokens, so each can compute the reference. Each rank has tokens (a
    # different number each) routed to every rank's experts: every rank sends and receives rows, and the
    # received rows of several sources interleave by expert, so their reordering is exercised.
    tokens = [torch.randn(TOKENS(r), D, generator=g) for r in range(world)]
    idx = [torch.rand(TOKENS(r), EXPERTS, generator=g).argsort(-1)[:, :TOP_K]
           for r in range(world)]

    ref_up, ref_down = up.clone().requires_grad_(), down.clone().requires_grad_()
    ref_x = [t.clone().requires_grad_() for t in tokens]
    ref = [routed(x, i, ref_up, ref_down) for x, i in zip(ref_x, idx)]
    sum((o * (k + 1)).sum() for k, o in enumerate(ref)).backward()

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Parameter(up.clone()), torch.nn.Parameter(down.clone())

    experts = Experts()
    shard_experts(experts, mesh, EXPERTS)
    x = tokens[rank].clone().requires_grad_()
    seen: dict = {}
    out = routed(x, idx[rank], experts.up.to_local(), experts.down.to_local(), mesh.get_group(), seen)
    (out * (rank + 1)).sum().backward()

    local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    results = {
        "out": relative(out, ref[rank]),
        "x_grad": relative(x.grad, ref_x[rank].grad),
        "up_grad": relative(experts.up.grad.to_local(), ref_up.grad[local]),
        "down_grad": relative(experts.down.grad.to_local(), ref_down.grad[local]),
        "up_shape": list(experts.up.to_local().shape),
        "tokens": x.shape[0],
        **seen,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    write_and_finish(out_path, {"ranks": gathered})


if __name__ == "__main__":
    main(sys.argv[1])
