"""Expert parallel: the ranks of an expert-parallel group each hold `E / ep` whole routed experts, and
every token row travels to the rank of its expert and back.

Dropless: every row is computed, whatever the routing, so results do not depend on `ep`. The
exchange is plain PyTorch (autograd-aware all-to-alls of `torch.distributed._functional_collectives`),
so it runs on gloo as on NCCL. Its one host sync is the row counts each pair of ranks exchanges, which
`all_to_all_single` needs as Python ints. On fake tensors (memory planning) routing is unknown, and the
exchange assumes balanced loads.

    sent = dispatch(rows, counts, group)        # rows sorted by global expert, counts [E]
    out = my_experts(sent.rows, sent.counts)    # rows grouped by local expert, counts [E / ep]
    back = combine(out, sent)                   # in the order `rows` came in
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@dataclass
class Dispatched:
    """The rows this rank's experts compute, grouped by local expert, and how to send them back."""

    rows: torch.Tensor  # [received, d], expert-major
    counts: torch.Tensor  # [E / ep] rows per local expert, on the rows' device
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    order: torch.Tensor  # received (source-major) position of each expert-major row
    group: dist.ProcessGroup


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> Dispatched:
    """Sends each row of `rows` (sorted by global expert id; `counts[e]` rows for expert e) to the
    rank holding its expert: rank r holds experts [r * E/ep, (r+1) * E/ep)."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    if is_fake(rows):
        send, recv, counts_from = _balanced_guess(rows, ep, local)
    else:
        counts = counts.to(torch.int64)
        # counts_from[src, e]: rows rank `src` sends to this rank's local expert e.
        counts_from = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group)).view(ep, local)
        send, recv = torch.stack([counts.view(ep, local).sum(1), counts_from.sum(1)]).tolist()
    received = funcol.all_to_all_single_autograd(rows, recv, send, group)
    received = funcol.wait_tensor(received) if isinstance(received, funcol.AsyncCollectiveTensor) else received
    # Received rows come source-major (each source's rows by local expert); experts want them expert-major.
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        counts_from.flatten().to(rows.device), output_size=received.shape[0])
    order = expert_of_row.argsort(stable=True)
    return Dispatched(received[order], counts_from.sum(0).to(rows.device), send, recv, order, group)


def even_split(total: int, parts: int) -> list[int]:
    """`total` rows over `parts` ranks as evenly as they go, the first ranks taking one more."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _balanced_guess(rows: torch.Tensor, ep: int, local: int) -> tuple[list[int], list[int], torch.Tensor]:
    """Splits for fake tensors (memory planning), whose routing is unknown: rows spread evenly over
    ranks and experts, as many received as sent."""
    send = even_split(rows.shape[0], ep)
    counts_from = torch.tensor([even_split(n, local) for n in send], dtype=torch.int64, device=rows.device)
    return send, list(send), counts_from


def combine(out: torch.Tensor, sent: Dispatched) -> torch.Tensor:
    """The experts' output rows `out` (expert-major, as `dispatch` gave them) back on the ranks and
    in the order the rows came from."""
    source_major = torch.empty_like(out).index_copy(0, sent.order, out)
    back = funcol.all_to_all_single_autograd(source_major, sent.send_splits, sent.recv_splits, sent.group)
    return funcol.wait_tensor(back) if isinstance(back, funcol.AsyncCollectiveTensor) else back


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh, num_experts: int) -> None:
    """Makes every parameter under `experts` that stacks one slice per expert (first dim `num_experts`:
    the expert weights and any per-expert adapters) a DTensor sharded by expert over `ep_mesh`, so each
    rank keeps its own experts' slices and checkpoints keep the full, unsharded shapes."""
    ep = ep_mesh.size()
    if num_experts % ep:
        raise ValueError(f"{num_experts} routed experts cannot be split evenly over ep={ep} ranks")
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor) or param.dim() == 0 or param.shape[0] != num_experts:
                continue
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
