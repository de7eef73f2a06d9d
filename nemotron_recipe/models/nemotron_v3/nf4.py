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

torchao's NF4 tensor implements FSDP2's all-gather extension: each rank stores its dim-0 shard of the
4-bit data and 8-bit scales, and the all-gathers move those, not bf16. Its double quantization uses one
mean over the whole tensor, so the base is quantized once, whole, before sharding: every mesh then
holds the same bits. Tensor and expert parallel would need a DTensor of NF4 shards, which torchao does
not provide; they are refused, as is HSDP (`nf4_problems`).
"""

from __future__ import annotations

import functools
import math

import torch

from .config import ModelConfigError

BLOCK = 64           # weights per absmax block (QLoRA's)
SCALER_BLOCK = 256   # absmax values per double-quantization factor (QLoRA's)
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


def _scaler_block(rows: int, cols: int) -> int:
    """Absmax values per double-quantization factor: QLoRA's 256 where the shape allows. FSDP2 splits an
    NF4 tensor by rows, and every part must hold whole factor groups, so a group never straddles the
    boundary of a dim-0 shard on up to 64 ranks (as many as divide `rows`): the largest power of two up
    to 256 dividing the blocks of rows / 64 rows. Chosen from the shape alone, so every mesh quantizes
    alike."""
    shards = math.gcd(rows, 64)
    blocks = rows // shards * cols // BLOCK
    return math.gcd(blocks, SCALER_BLOCK)


def quantize(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """`weight` (2-D, or stacked experts [E, out, in]) as an NF4 tensor of its 2-D view."""
    cls = nf4_tensor_type()
    flat = weight.detach().reshape(-1, weight.shape[-1]).contiguous()
    if flat.shape[1] % BLOCK:
        raise NF4Error(f"{name}: {tuple(weight.shape)} has rows of {flat.shape[1]} weights, not a multiple of the "
                       f"NF4 block ({BLOCK}), so blocks would straddle rows and shards. Fix: use peft.base_dtype=bf16 "
                       "for this model.")
    return cls.from_tensor(flat, BLOCK, _scaler_block(*flat.shape))


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NF4 tensor `weight` in `dtype`: code book[code] * (int8 scale / factor + mean), blockwise.
    torchao's own dequantization indexes with int64 codes (16 bytes of temporaries a weight); here the
    codes are int32 and the code book and scales are cast once, so a GEMM's transient is about 6 bytes
    a weight besides its result."""
    data = weight.quantized_data
    codes = torch.stack((data >> 4, data & 0b1111), dim=-1).view(-1).int()
    values = weight.nf4.to(dtype).index_select(0, codes)
    groups = weight.quantized_scalers.numel() // weight.quantization_factor.numel()
    scalers = weight.quantized_scalers.view(-1, groups).to(torch.float32)
    absmax = (scalers / weight.quantization_factor.to(torch.float32).unsqueeze(-1)).view(-1).to(weight.dtype)
    absmax = (absmax + weight.scaler_mean).to(dtype)
    return (values.view(-1, weight.block_size) * absmax.unsqueeze(-1)).view(weight.shape)


class _LinearNF4(torch.autograd.Function):
    """x @ W^T + b with W an NF4 tensor, dequantized in x's dtype for the forward and again for the
    backward (W is frozen: only x's gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        out = x @ dequantize(weight, x.dtype).t()
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad @ dequantize(ctx.weight, grad.dtype), None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LinearNF4.apply(x, weight, bias)


def bytes_per_weight(shape: tuple[int, ...], factor_bytes: int = 2) -> float:
    """What an NF4 tensor of `shape` stores a weight: half a byte of code, an int8 scale per block,
    a factor per group of scales, in the dtype it was quantized from (bf16 for an nf4 base; the
    per-tensor mean aside)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return 0.5 + 1 / BLOCK + factor_bytes / (BLOCK * _scaler_block(rows, cols))


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
    """What keeps a run config (`peft`, `mesh`) from an nf4 base, checked before any heavy work: a base
    that trains, a mesh that would split the 4-bit tensors as bf16 ones, or no torchao."""
    p = cfg.peft
    if p.base_dtype != "nf4":
        return []
    if p.method == "none":
        return [("peft.base_dtype=nf4 with peft.method=none: full fine-tuning trains the base, and a 4-bit base "
                 "cannot train. Fix: set peft.method=lora, or peft.base_dtype=bf16 for full fine-tuning.")]
    errors = []
    mesh = cfg.mesh
    for field, size in (("mesh.tp", mesh.tp), ("mesh.ep", mesh.ep), ("mesh.dp_replicate", mesh.dp_replicate)):
        if int(size) > 1:
            errors.append(f"peft.base_dtype=nf4 with {field}={size}: the 4-bit base shards under FSDP2 "
                          f"(mesh.dp_shard) only; tensor and expert parallel split bf16 weights, and torchao's NF4 tensor has no "
                          f"replicated (HSDP) all-gather. Fix: set {field}=1 "
                          "and shard with mesh.dp_shard, or use peft.base_dtype=bf16.")
    try:
        nf4_tensor_type()
    except NF4Error as e:
        errors.append(str(e))
    return errors
