"""Tensor-parallel building blocks that `torch.distributed.tensor.parallel` lacks.

- `ShardParameters` / `Compose`: styles for parameters a module reads directly, and several styles
  on one module;
- `KeyValueHeadsParallel`: when there are more tensor-parallel ranks than key/value heads, each rank
  keeps the key/value heads its own query heads attend with, and their gradients are summed over
  the ranks that share them;
- `vocab_parallel_cross_entropy`: cross-entropy on vocab-sharded logits whose backward needs no
  collective and no `loss_parallel` context, so a model can return a loss its caller back-propagates
  anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel


class ShardParameters(ParallelStyle):
    """Shards the module's own parameters (not its children's) along `dim` over the tp mesh.

    For parameters a mixer reads directly (conv weights, A_log, D, dt_bias, the gated-norm weight):
    the mixer takes their local shard, matching the heads and groups its projections produced.
    """

    def __init__(self, *names: str, dim: int = 0):
        super().__init__()
        self.names, self.dim = names, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not self.names or name in self.names:
                sharded = distribute_tensor(param.data, device_mesh, [Shard(self.dim)])
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


class Compose(ParallelStyle):
    """Several styles on one module, in order (a plan maps each module to one style)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


class RowwiseParallelOwnOutput(RowwiseParallel):
    """`RowwiseParallel` whose module hands out a tensor of its own, never a view.

    The local part of a sharded output (`DTensor.to_local`, e.g. an embedding's under sequence
    parallel) is a view; a view leaving an FSDP unit would lose FSDP's pre-backward hook to any later
    in-place op on it, and torch warns so on every step. The copy is one activation per forward."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if isinstance(out, torch.Tensor) and out._base is not None else out


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`. For a value every rank computes
    in full but each rank uses only its own part of."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class KeyValueHeadsParallel(ParallelStyle):
    """For a k or v projection when tp is a multiple of the key/value heads.

    The weight stays whole on every tp rank (it is small: a few heads); each rank computes all heads
    and keeps the one its query heads use, rank r's being head r // (tp / kv_heads) since query heads
    are split contiguously. The heads' gradients, each coming from the query heads of several ranks,
    are summed over the tp group before they reach the weight and the input, so the replicated weight
    gets the same, complete gradient on every rank.
    """

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if tp % self.num_heads:
            raise ValueError(f"KeyValueHeadsParallel: tp={tp} is not a multiple of {self.num_heads} key/value heads")
        head = device_mesh.get_local_rank() // (tp // self.num_heads)
        group, width = device_mesh.get_group(), self.head_dim

        def keep_own_head(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
            out = _SumGradients.apply(out, group)
            return out[..., head * width:(head + 1) * width]

        module.register_forward_hook(keep_own_head)
        return module


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of [N, V/tp] logit shards; the softmax statistics are all-reduced in
    forward, and each rank's gradient is its own softmax shard minus the one-hot, with no collective."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        ctx.dtype = logits.dtype
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < logits.shape[-1]) & (targets != ignore_index)
        index = local_target.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(1, index[:, None]).squeeze(1) * here
        stats = torch.stack([sum_exp, target_logit])
        dist.all_reduce(stats, group=group)
        trained = targets != ignore_index
        loss = (stats[0].log() - stats[1]) * trained
        exp.div_(stats[0][:, None])  # this shard of the softmax
        ctx.save_for_backward(exp, index, here, trained)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, here, trained = ctx.saved_tensors
        grad = softmax * (grad_loss * trained)[:, None]
        grad.scatter_add_(1, index[:, None], -(grad_loss * here)[:, None].to(grad.dtype))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses [N] (0 where `targets` is `ignore_index`) of DTensor logits [..., V] sharded
    over the vocabulary on a 1-D mesh; `targets` [...] is a plain tensor of global token ids."""
    (placement,) = logits.placements
    if not (isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1):
        raise ValueError(f"vocab_parallel_cross_entropy: logits must be sharded over the last dim, got {placement}")
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    local = logits.to_local()
    return _VocabParallelCrossEntropy.apply(
        local.flatten(0, -2), targets.flatten().to(local.device), offset[-1], logits.device_mesh.get_group(),
        ignore_index,
    )
