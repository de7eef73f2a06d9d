"""The RMS norms as single autograd nodes: the same forward as the plain compositions in model.py
(`RMSNorm`, `GatedGroupRMSNorm`), rounding included, and a hand-written backward.

Autograd of the plain norms keeps every fp32 intermediate (the upcast input, its normalised form,
the gate's silu) and runs one pass per op and per cast in both directions; a profile of an h1024
bf16 step put a tenth of its CPU time in the norms, and a good part of its copies in their casts.
Here forward saves its inputs (in the model's dtype) and the per-row reciprocal RMS, and backward
recomputes the rest in fp32. DTensor inputs (tensor or sequence parallel) take the plain path,
whose ops DTensor shards.

On CPU both directions run block by block of rows (`ROW_BLOCK_ELEMENTS_PER_THREAD`), so that each
op's fp32 temporaries stay in the caches; every row is computed exactly as in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float()  # as the plain modules compute, whatever the input dtype


# Elements of one row block on CPU, per thread. Every op of a norm is one pass over [rows x width]
# fp32 temporaries; over a whole sequence they outgrow the caches, each pass goes to memory, and the
# time grew faster than the tokens. Per thread, 2^17 elements (512 KiB of fp32) stay in its core's
# caches and leave each op enough work per thread to pay for its parallel region; 2^15-2^16 or
# 2^19-2^21 per thread were slower on 1 and on 2 threads. fwd + bwd, bf16, 2 threads: h1024's
# gated norm (width 2048) 24.6 -> 16 ms at 2048 tokens and 109 -> 60 ms at 8192; a width-8192 gated
# norm at 4096 tokens 277 -> 121 ms. GPUs (one kernel per op over all rows) and compiled code (the ops fused
# into one pass) take the rows whole.
ROW_BLOCK_ELEMENTS_PER_THREAD = 1 << 17


def _block_rows(t: torch.Tensor) -> int | None:
    """Rows per block of a norm of t [..., width]; None: all at once (GPUs, compiled code). Forward
    decides and backward follows, as a compiled backward is traced where `is_compiling()` is False."""
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return max(1, ROW_BLOCK_ELEMENTS_PER_THREAD * torch.get_num_threads() // max(t.shape[-1], 1))


def _row_blocks(rows: int, block_rows: int | None) -> list[slice]:
    if block_rows is None or rows <= block_rows:
        return [slice(None)]
    return [slice(start, start + block_rows) for start in range(0, rows, block_rows)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grad_sum(weight: torch.Tensor) -> torch.Tensor:
    """A zeroed fp32 accumulator for the weight gradient, which adds the row blocks' partial sums."""
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def _rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _norm_backward(gh: torch.Tensor, hn: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d/dh of hn = h * rstd(h) given the gradient `gh` of hn (last axis normalised); `gh` is
    overwritten."""
    return gh.sub_(hn * (gh * hn).mean(-1, keepdim=True)).mul_(rstd)


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = _fp32(x)
    rstd = _rstd(h, eps)
    return (_fp32(weight) * (h * rstd)).to(x.dtype), rstd


def _gated_rows(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = (_fp32(y) * F.silu(_fp32(z))).unflatten(-1, (-1, group_size))
    rstd = _rstd(h, eps)
    return weight * (h * rstd).flatten(-2).to(y.dtype), rstd


def _blockwise(norm, inputs: list[torch.Tensor], block_rows: int | None, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm` (one of the two above) of `inputs` (one shape, [..., width]) by blocks of rows:
    (out in the inputs' shape, rstd [rows, ...] in fp32 as backward reads it)."""
    rows = [_rows(t) for t in inputs]
    blocks = _row_blocks(rows[0].shape[0], block_rows)
    if len(blocks) == 1:
        out, rstd = norm(*rows, *args)
        return out.view(inputs[0].shape), rstd
    out, rstd = None, []
    for block in blocks:
        out_block, rstd_block = norm(*(t[block] for t in rows), *args)
        if out is None:  # the norm decides the output's dtype
            out = out_block.new_empty(rows[0].shape)
        out[block] = out_block
        rstd.append(rstd_block)
    return out.view(inputs[0].shape), torch.cat(rstd)


class RMSNormFn(torch.autograd.Function):
    """(weight * (x * rsqrt(mean(x^2) + eps))) in fp32, cast to x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.block_rows = _block_rows(x)
        out, rstd = _blockwise(_rms_norm_rows, [x], ctx.block_rows, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xs, gs = _rows(x), _rows(grad)
        w = _fp32(weight)
        grad_x = torch.empty(xs.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad_sum(weight) if ctx.needs_input_grad[1] else None
        for block in _row_blocks(xs.shape[0], ctx.block_rows):
            hn = _fp32(xs[block]) * rstd[block]
            g = _fp32(gs[block])
            if grad_w is not None:
                grad_w += (g * hn).sum(0)
            if grad_x is not None:
                grad_x[block] = _norm_backward(g * w, hn, rstd[block])
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return None if grad_x is None else grad_x.view(x.shape), grad_w, None


class GatedGroupRMSNormFn(torch.autograd.Function):
    """weight * rmsnorm_per_group(y * silu(z)).to(y's dtype): the normalisation in fp32, the weight
    applied in y's dtype (as the plain module does)."""

    @staticmethod
    def forward(ctx, y, z, weight, group_size, eps):
        ctx.block_rows = _block_rows(y)
        out, rstd = _blockwise(_gated_rows, [y, z], ctx.block_rows, weight, group_size, eps)
        ctx.save_for_backward(y, z, weight, rstd)
        ctx.group_size = group_size
        return out

    @staticmethod
    def backward(ctx, grad):
        y, z, weight, rstd = ctx.saved_tensors
        ys, zs, gs = _rows(y), _rows(z), _rows(grad)
        need_y, need_z, need_w = ctx.needs_input_grad[:3]
        grad_y = torch.empty(ys.shape, dtype=y.dtype, device=y.device) if need_y else None
        grad_z = torch.empty(zs.shape, dtype=z.dtype, device=z.device) if need_z else None
        grad_w = _weight_grad_sum(weight) if need_w else None
        for block in _row_blocks(ys.shape[0], ctx.block_rows):
            zf, yf = _fp32(zs[block]), _fp32(ys[block])
            gate = F.silu(zf)
            hn = (yf * gate).unflatten(-1, (-1, ctx.group_size)).mul_(rstd[block])
            if need_w:  # the products in y's dtype, as the plain path's; summed in fp32, rounded once
                grad_w += (gs[block] * hn.flatten(-2).to(y.dtype)).sum(0, dtype=torch.float32)
            gh = _norm_backward(_fp32(gs[block] * weight).unflatten(-1, (-1, ctx.group_size)), hn,
                                rstd[block]).flatten(-2)
            if need_y:
                grad_y[block] = gh * gate
            if need_z:
                grad_z[block] = torch.ops.aten.silu_backward(gh.mul_(yf), zf)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return (None if grad_y is None else grad_y.view(y.shape), None if grad_z is None else grad_z.view(z.shape),
                grad_w, None, None)


def _plain(*tensors: torch.Tensor) -> bool:
    return not any(isinstance(t, DTensor) for t in tensors)


def _records_graph(*tensors: torch.Tensor) -> bool:
    # Without a graph to record (generation, evaluation) the autograd node's own cost is saved too.
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`RMSNormFn`, or None for DTensor inputs (the caller then runs the plain composition)."""
    if not _plain(x, weight):
        return None
    if _records_graph(x, weight):
        return RMSNormFn.apply(x, weight, eps)
    return _blockwise(_rms_norm_rows, [x], _block_rows(x), weight, eps)[0]


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor | None:
    """`GatedGroupRMSNormFn`, or None for DTensor inputs (the caller then runs the plain composition)."""
    if not _plain(y, z, weight):
        return None
    if _records_graph(y, z, weight):
        return GatedGroupRMSNormFn.apply(y, z, weight, group_size, eps)
    return _blockwise(_gated_rows, [y, z], _block_rows(y), weight, group_size, eps)[0]
