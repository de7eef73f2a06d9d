"""A 4-bit NF4 frozen base for LoRA (QLoRA: Dettmers et al., 2023).

Every frozen base projection (Mamba2 in/out, attention q/k/v/o, MLP and shared-expert up/down, the
routed experts' stacked weights, LatentMoE's latent projections) is stored as torchao's `NF4Tensor`:
blocks of 64 weights, each a 4-bit index into the NF4 code book times the block's absmax; the absmax
values themselves are double-quantized (8 bits each, with one factor per up to 256 blocks,
`_scaler_block`, and one mean per tensor). The embedding, lm_head, norms, the conv, A_log, D, dt_bias and the router keep their dtypes.

Each GEMM dequantizes its weight in the compute dtype, and its backward dequantizes again instead of
keeping the dequantized copy (`LinearNF4` in torchao for the linears, `_ExpertsNF4` here for the
routed experts' grouped GEMM). A stacked expert weight [E, out, in] is stored as the 2-D NF4 tensor
[E*out, in] (torchao's NF4 is 2-D); blocks never straddle a row, so no block mixes two experts.

The base is quantized once, whole, before any sharding (its double quantization uses one mean over the
whole tensor), and every split cuts those bits along whole groups of scales: every mesh then holds the
same bits as one process, and the loss curves agree to rounding.
- FSDP2 (and HSDP): torchao's NF4 tensor implements FSDP2's all-gather extension: each rank stores its
  dim-0 shard of the 4-bit data and 8-bit scales, and the all-gathers move those, not bf16.
- Tensor parallel: `shard` cuts the NF4 tensor by rows (colwise projections) or by columns (rowwise
  ones: `COLUMN_SPLIT`) into an NF4 tensor of this rank's part; its GEMM computes the local product
  and hands it on as the DTensor the plain projection would give (`linear`).
- Expert parallel: the stacked [E*out, in] tensor is cut by rows at expert boundaries
  (`shard_experts`).
Groups of scales are sized so that no cut straddles one (`_scaler_block`).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from .config import ModelConfigError

BLOCK = 64           # weights per absmax block (QLoRA's)
SCALER_BLOCK = 256   # absmax values per double-quantization factor (QLoRA's)
MAX_TP = 8           # the widest tensor-parallel split of a projection's columns that its groups allow
# Projections that tensor parallel splits by input columns (rowwise: parallelization.block_plan).
COLUMN_SPLIT = ("o_proj", "down_proj", "out_proj")
PIP_LINE = "pip install -e '.[quant]' (or pip install 'torchao>=0.12')"


class NF4Error(ModelConfigError):
    """An NF4 base that cannot be built here; names the field or tensor and a fix."""


@functools.cache
def nf4_tensor_type() -> type:
    """torchao's `NF4Tensor`, or an error naming the pip line that installs it."""
    try:
        from torchao.quantization import NF4Tensor  # torchao >= 0.15
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor  # older torchao
        except ImportError:
            raise NF4Error(f"peft.base_dtype=nf4 needs torchao's NF4 tensor, and torchao is not installed. "
                           f"Fix: {PIP_LINE}, or set peft.base_dtype=bf16.") from None
    _gather_whole_on_one_rank(NF4Tensor)
    return NF4Tensor


def _gather_whole_on_one_rank(cls: type) -> None:
    """FSDP2 on a one-rank mesh (torch 2.13) skips the all-gather and hands a tensor extension only its
    first all-gather input back, with which torchao's NF4 cannot rebuild itself. There the shard is the
    whole tensor: the metadata carries it, and the unsharded parameter is the shard itself."""
    if getattr(cls, "_one_rank_gather", False):
        return
    pre, post = cls.fsdp_pre_all_gather, cls.fsdp_post_all_gather

    def fsdp_pre_all_gather(self, mesh):
        inputs, metadata = pre(self, mesh)
        return inputs, (metadata, self if mesh.size() == 1 else None)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        metadata, whole = metadata
        if whole is None:
            return post(self, outputs, metadata, param_dtype, out=out)
        return None if out is not None else (whole, tuple(outputs))

    cls.fsdp_pre_all_gather, cls.fsdp_post_all_gather = fsdp_pre_all_gather, fsdp_post_all_gather
    cls._one_rank_gather = True


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (a parameter or a plain tensor) is an NF4 tensor; no torchao import for plain ones."""
    return type(t).__name__ == "NF4Tensor" and isinstance(t, nf4_tensor_type())


def _scaler_block(rows: int, cols: int, parts: int = 1) -> int:
    """Absmax values per double-quantization factor: QLoRA's 256 where the shape allows. A split must
    hold whole factor groups, chosen from the shape alone so that every mesh quantizes alike:
    - by rows (FSDP2, colwise tensor parallel, experts) on up to 64 ranks (as many as divide `rows`): a
      group divides the blocks of rows / 64 rows;
    - by columns into `parts` > 1 (rowwise tensor parallel) a group lies within one row's part: it
      divides that part's blocks (and so splits by rows too)."""
    if parts > 1:
        return math.gcd(cols // BLOCK // parts, SCALER_BLOCK)
    shards = math.gcd(rows, 64)
    blocks = rows // shards * cols // BLOCK
    return math.gcd(blocks, SCALER_BLOCK)


def column_parts(name: str, cols: int) -> int:
    """Into how many parts tensor parallel may split the columns of `name` (1: never by columns)."""
    parts = name.split(".")
    split = len(parts) >= 2 and parts[-2] in COLUMN_SPLIT
    return math.gcd(cols // BLOCK, MAX_TP) if split and cols % BLOCK == 0 else 1


def quantize(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """`weight` (2-D, or stacked experts [E, out, in]) as an NF4 tensor of its 2-D view."""
    cls = nf4_tensor_type()
    flat = weight.detach().reshape(-1, weight.shape[-1]).contiguous()
    if flat.shape[1] % BLOCK:
        raise NF4Error(f"{name}: {tuple(weight.shape)} has rows of {flat.shape[1]} weights, not a multiple of the "
                       f"NF4 block ({BLOCK}), so blocks would straddle rows and shards. Fix: use peft.base_dtype=bf16 "
                       "for this model.")
    return cls.from_tensor(flat, BLOCK, _scaler_block(*flat.shape, column_parts(name, flat.shape[1])))


CHUNK_BLOCKS = 16384  # blocks dequantized at a time: besides its result, a GEMM holds ~3 MiB of transients


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NF4 tensor `weight` in `dtype`: code book[code] * (int8 scale / factor + mean), blockwise.
    Written into its result a few thousand blocks at a time, each byte (two codes) looked up at once in
    a 256-entry table of code pairs: besides the result (2 bytes a weight in bf16) a GEMM's transient
    is that of one chunk, where torchao's dequantization (int64 codes) holds about 16 bytes a weight."""
    data = weight.quantized_data
    nf4 = weight.nf4.to(dtype)
    byte = torch.arange(256, device=data.device)
    # Both codes of a byte as one integer of twice the width: one 1-D gather a byte.
    wide = {1: torch.int16, 2: torch.int32, 4: torch.int64}[nf4.element_size()]
    pairs = torch.stack((nf4[byte >> 4], nf4[byte & 0b1111]), dim=-1).view(wide).view(-1)
    groups = weight.quantized_scalers.numel() // weight.quantization_factor.numel()
    scalers = weight.quantized_scalers.view(-1, groups).to(torch.float32)
    absmax = (scalers / weight.quantization_factor.to(torch.float32).unsqueeze(-1)).view(-1).to(weight.dtype)
    absmax = (absmax + weight.scaler_mean).to(dtype).unsqueeze(-1)
    out = torch.empty(weight.numel(), dtype=dtype, device=data.device)
    half = weight.block_size // 2
    for start in range(0, absmax.shape[0], CHUNK_BLOCKS):
        stop = min(start + CHUNK_BLOCKS, absmax.shape[0])
        part = out[start * weight.block_size:stop * weight.block_size]
        torch.index_select(pairs, 0, data[start * half:stop * half].int(), out=part.view(wide))
        part.view(-1, weight.block_size).mul_(absmax[start:stop])
    return out.view(weight.shape)


class _LinearNF4(torch.autograd.Function):
    """x @ W^T + b with W an NF4 tensor, dequantized in x's dtype for the forward and again for the
    backward (W is frozen: only x's gradient). Only the NF4 tensor is kept for the backward, never its
    dequantized copy."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        out = x @ dequantize(weight, x.dtype).t()
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad @ dequantize(ctx.weight, grad.dtype), None, None


@dataclass(frozen=True)
class TensorParallelNF4:
    """How a tensor-parallel projection's NF4 shard computes: over `mesh`, its local product is the
    DTensor `output` placement (Shard(-1) colwise, Partial() rowwise) the plain projection would give."""

    mesh: DeviceMesh
    output: Placement


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           tp: TensorParallelNF4 | None = None) -> torch.Tensor:
    if tp is None:
        return _LinearNF4.apply(x, weight, bias)
    colwise = not tp.output.is_partial()
    if isinstance(x, DTensor):
        # A replicated input's gradient from this rank's rows alone is a partial sum over the ranks.
        replicated = all(p.is_replicate() for p in x.placements)
        x = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim if replicated else None)
    local_x = x
    local_bias = bias.to_local() if colwise and isinstance(bias, DTensor) else None
    out = DTensor.from_local(_LinearNF4.apply(local_x, weight, local_bias), tp.mesh, [tp.output], run_check=False)
    return out + bias if bias is not None and not colwise else out


def shard(weight: torch.Tensor, dim: int, index: int, parts: int, name: str = "weight") -> torch.Tensor:
    """Part `index` of `parts` of the NF4 tensor `weight` along `dim` (0: rows, 1: columns) as an NF4
    tensor of its own holding exactly those bits: its codes, its blocks' int8 scales, their groups'
    factors and the whole tensor's mean, so it dequantizes to that part of the whole's dequantization."""
    rows, cols = weight.shape
    blocks, group = cols // BLOCK, weight.scaler_block_size
    size = (rows, cols)[dim] // parts
    whole = (size * blocks if dim == 0 else size // BLOCK) if (rows, cols)[dim] % parts == 0 else 0
    if whole == 0 or (dim == 1 and size % BLOCK) or whole % group:
        what = f"{parts} parts of {(rows, cols)[dim]} {('rows', 'columns')[dim]}"
        raise NF4Error(f"{name}: NF4 {(rows, cols)} cannot be split into {what}: a part must hold whole blocks of "
                       f"{BLOCK} weights and whole groups of {group} blocks' scales. Fix: choose a mesh size that "
                       f"splits the {('rows', 'columns')[dim]} into such parts, or use peft.base_dtype=bf16.")
    if dim == 0:
        cut = slice(index * size, (index + 1) * size)
        codes = weight.quantized_data.view(rows, cols // 2)[cut]
        scalers = weight.quantized_scalers.view(rows, blocks)[cut]
        factors = weight.quantization_factor.view(-1)[index * whole // group:(index + 1) * whole // group]
        shape = (size, cols)
    else:
        def columns(t: torch.Tensor, width: int) -> torch.Tensor:
            return t.reshape(rows, width * parts)[:, index * width:(index + 1) * width]
        codes = columns(weight.quantized_data, size // 2)
        scalers = columns(weight.quantized_scalers, size // BLOCK)
        factors = columns(weight.quantization_factor, size // BLOCK // group)
        shape = (rows, size)
    cls = nf4_tensor_type()
    meta_type = sys.modules[cls.__module__].SubclassTensorArgs
    meta = meta_type(torch.Size(shape), (shape[1], 1), 0, weight.dtype, weight.device, False)
    return cls(meta, BLOCK, codes.numel() * 2 // BLOCK, group, scalers.contiguous().view(-1),
               factors.contiguous().view(-1), weight.scaler_mean.clone(), codes.contiguous().view(-1), weight.nf4)


def shard_experts(experts: torch.nn.Module, index: int, parts: int) -> None:
    """This expert-parallel rank's experts of each NF4 stacked weight of `experts` (rows [E*out, in] cut
    at expert boundaries): part `index` of `parts`, and the stacked shape the GEMMs read, updated."""
    for proj, (e, out, inp) in dict(getattr(experts, "nf4_shapes", {})).items():
        local = shard(getattr(experts, proj), 0, index, parts, proj)
        setattr(experts, proj, torch.nn.Parameter(local, requires_grad=False))
        experts.nf4_shapes = experts.nf4_shapes | {proj: (e // parts, out, inp)}


def bytes_per_weight(shape: tuple[int, ...], factor_bytes: int = 2, name: str = "weight") -> float:
    """What an NF4 tensor of `shape` stores a weight: half a byte of code, an int8 scale per block,
    a factor per group of scales, in the dtype it was quantized from (bf16 for an nf4 base; the
    per-tensor mean aside)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return 0.5 + 1 / BLOCK + factor_bytes / (BLOCK * _scaler_block(rows, cols, column_parts(name, cols)))


def nf4_bytes(t: torch.Tensor) -> int:
    """Bytes an NF4 tensor stores: the 4-bit data, 8-bit scales, fp32 factors and the mean."""
    return sum(x.numel() * x.element_size() for x in (t.quantized_data, t.quantized_scalers,
                                                        t.quantization_factor, t.scaler_mean))


# ------------------------------------------------------------------------------- routed experts
class _ExpertsNF4(torch.autograd.Function):
    """rows @ W[e]^T per expert with W an NF4 [E*out, in]: dequantized for the forward and again for
    the backward, so no bf16 copy of the experts' weights waits for the backward."""

    @staticmethod
    def forward(ctx, rows, weight, shape, groups, matmul):
        ctx.save_for_backward(rows.new_empty(0), groups if isinstance(groups, torch.Tensor) else rows.new_empty(0))
        ctx.weight, ctx.shape, ctx.groups, ctx.matmul = weight, shape, groups, matmul
        return matmul(rows, dequantize(weight, rows.dtype).view(shape), groups)

    @staticmethod
    def backward(ctx, grad):
        w = dequantize(ctx.weight, grad.dtype).view(ctx.shape)
        return ctx.matmul(grad, w.transpose(-2, -1).contiguous(), ctx.groups), None, None, None, None


def experts_matmul_nf4(rows: torch.Tensor, weight: torch.Tensor, shape: tuple[int, ...], groups,
                       matmul) -> torch.Tensor:
    return _ExpertsNF4.apply(rows, weight, shape, groups, matmul)


def nf4_problems(cfg) -> list[str]:
    """What keeps a run config (`peft`) from an nf4 base, checked before any heavy work: a base that
    trains, or no torchao. (A mesh that cannot cut a 4-bit tensor along whole groups is named where it is
    cut, `shard`, on every rank before the first step.)"""
    p = cfg.peft
    if p.base_dtype != "nf4":
        return []
    if p.method == "none":
        return [("peft.base_dtype=nf4 with peft.method=none: full fine-tuning trains the base, and a 4-bit base "
                 "cannot train. Fix: set peft.method=lora, or peft.base_dtype=bf16 for full fine-tuning.")]
    errors = []
    try:
        nf4_tensor_type()
    except NF4Error as e:
        errors.append(str(e))
    return errors
