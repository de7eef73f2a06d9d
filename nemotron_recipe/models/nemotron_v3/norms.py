"""The RMS norms as single autograd nodes: the same forward as the plain compositions in model.py
(`RMSNorm`, `GatedGroupRMSNorm`), rounding included, and a hand-written backward.

Autograd of the plain norms keeps every fp32 intermediate (the upcast input, its normalised form,
the gate's silu) and runs one pass per op and per cast in both directions; a profile of an h1024
bf16 step put a tenth of its CPU time in the norms, and a good part of its copies in their casts.
Here forward saves its inputs (in the model's dtype) and the per-row reciprocal RMS, and backward
recomputes the rest in fp32. DTensor inputs (tensor or sequence parallel) take the plain path,
whose ops DTensor shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float()  # as the plain modules compute, whatever the input dtype


def _rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _norm_backward(gh: torch.Tensor, hn: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d/dh of hn = h * rstd(h) given the gradient `gh` of hn (last axis normalised); `gh` is
    overwritten."""
    return gh.sub_(hn * (gh * hn).mean(-1, keepdim=True)).mul_(rstd)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = _fp32(x)
    rstd = _rstd(h, eps)
    return (_fp32(weight) * (h * rstd)).to(x.dtype), rstd


def _gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = (_fp32(y) * F.silu(_fp32(z))).unflatten(-1, (-1, group_size))
    rstd = _rstd(h, eps)
    return weight * (h * rstd).flatten(-2).to(y.dtype), rstd


class RMSNormFn(torch.autograd.Function):
    """(weight * (x * rsqrt(mean(x^2) + eps))) in fp32, cast to x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        hn = _fp32(x) * rstd
        g = _fp32(grad)
        grad_w = (g * hn).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_x = _norm_backward(g * _fp32(weight), hn, rstd).to(x.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, None


class GatedGroupRMSNormFn(torch.autograd.Function):
    """weight * rmsnorm_per_group(y * silu(z)).to(y's dtype): the normalisation in fp32, the weight
    applied in y's dtype (as the plain module does)."""

    @staticmethod
    def forward(ctx, y, z, weight, group_size, eps):
        out, rstd = _gated_group_rms_norm(y, z, weight, group_size, eps)
        ctx.save_for_backward(y, z, weight, rstd)
        ctx.group_size = group_size
        return out

    @staticmethod
    def backward(ctx, grad):
        y, z, weight, rstd = ctx.saved_tensors
        zf, yf = _fp32(z), _fp32(y)
        gate = F.silu(zf)
        hn = (yf * gate).unflatten(-1, (-1, ctx.group_size)).mul_(rstd)
        grad_w = None
        if ctx.needs_input_grad[2]:  # in y's dtype, as the plain path's product
            grad_w = (grad * hn.flatten(-2).to(y.dtype)).flatten(0, -2).sum(0).to(weight.dtype)
        gh = _norm_backward(_fp32(grad * weight).unflatten(-1, (-1, ctx.group_size)), hn, rstd).flatten(-2)
        grad_y = (gh * gate).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_z = torch.ops.aten.silu_backward(gh.mul_(yf), zf).to(z.dtype) if ctx.needs_input_grad[1] else None
        return grad_y, grad_z, grad_w, None, None


def _plain(*tensors: torch.Tensor) -> bool:
    return not any(isinstance(t, DTensor) for t in tensors)


def _records_graph(*tensors: torch.Tensor) -> bool:
    # Without a graph to record (generation, evaluation) the autograd node's own cost is saved too.
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`RMSNormFn`, or None for DTensor inputs (the caller then runs the plain composition)."""
    if not _plain(x, weight):
        return None
    return RMSNormFn.apply(x, weight, eps) if _records_graph(x, weight) else _rms_norm(x, weight, eps)[0]


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor | None:
    """`GatedGroupRMSNormFn`, or None for DTensor inputs (the caller then runs the plain composition)."""
    if not _plain(y, z, weight):
        return None
    if _records_graph(y, z, weight):
        return GatedGroupRMSNormFn.apply(y, z, weight, group_size, eps)
    return _gated_group_rms_norm(y, z, weight, group_size, eps)[0]
