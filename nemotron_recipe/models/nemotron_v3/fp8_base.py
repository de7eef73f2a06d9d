"""An FP8 checkpoint's own FP8 weights as the frozen LoRA base (`peft.base_dtype=fp8`).

NVIDIA's FP8 releases (fp8.py) store most base projections as `float8_e4m3fn` with a float32 scale
per tensor (or per output row). With this base those weights stay as they are (held as their bytes, a
uint8 parameter, so that FSDP2 shards and gathers them untouched), 1 byte a weight plus
a float32 scale per output row, instead of becoming bf16 on load (2 bytes a weight): every projection
the checkpoint holds in FP8 (the Mamba and MoE GEMMs of the releases; the routed experts' stacked
[E, out, in] weights with one scale per expert and row) keeps its FP8 values; those the release keeps
in bf16 (`exclude_modules`) stay bf16.

Each GEMM dequantizes its weight exactly as loading would, `(fp8 in float32 * scale)` rounded to bf16
(then in the compute dtype), and its backward dequantizes again instead of keeping that copy: LoRA on this base
computes with the very weights LoRA on the dequantized base does, at half their bytes. (FP8 tensor-core
GEMMs, `torch._scaled_mm`, would quantize the activations too and so compute other numbers; they are
not used.)
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8 import QuantizedCheckpointError, checkpoint_fp8_format, is_fp8

SCALE = "_fp8_scale"  # the buffer suffix of a kept FP8 weight's row scales: `weight` -> `weight_fp8_scale`


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [..., out, in] with its row scales [..., out, 1] as loading reads it (bf16: fp8.py),
    in `dtype`."""
    return (weight.view(torch.float8_e4m3fn).to(torch.float32) * scale).to(torch.bfloat16).to(dtype)


class _LinearFP8(torch.autograd.Function):
    """x @ W^T + b with W kept in FP8: dequantized for the forward and again for the backward."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        ctx.save_for_backward(weight, scale)
        out = x @ dequantize(weight, scale, x.dtype).t()
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        return grad @ dequantize(weight, scale, grad.dtype), None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LinearFP8.apply(x, weight, scale, bias)


class _ExpertsFP8(torch.autograd.Function):
    """rows @ W[e]^T per expert with W [E, out, in] kept in FP8, dequantized in forward and backward."""

    @staticmethod
    def forward(ctx, rows, weight, scale, groups, matmul):
        ctx.save_for_backward(weight, scale, groups if isinstance(groups, torch.Tensor) else rows.new_empty(0))
        ctx.groups, ctx.matmul = groups, matmul
        return matmul(rows, dequantize(weight, scale, rows.dtype), groups)

    @staticmethod
    def backward(ctx, grad):
        weight, scale, _ = ctx.saved_tensors
        w = dequantize(weight, scale, grad.dtype).transpose(-2, -1).contiguous()
        return ctx.matmul(grad, w, ctx.groups), None, None, None, None


def experts_matmul(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups, matmul) -> torch.Tensor:
    return _ExpertsFP8.apply(rows, weight, scale, groups, matmul)


def is_kept(module: nn.Module, name: str) -> bool:
    """Whether `module.name` is an FP8 weight kept as the base (its bytes, with a buffer of row scales)."""
    return hasattr(module, name + SCALE)


def scale_of(module: nn.Module, name: str) -> torch.Tensor:
    return getattr(module, name + SCALE)


def _row_scales(path: str, fmt, name: str, weight: torch.Tensor, state: dict) -> torch.Tensor:
    """The scale of FP8 tensor `name` as one float32 per output row [out, 1] (a per-tensor scale repeated)."""
    if fmt.block is not None:
        raise QuantizedCheckpointError(
            f"{path}: peft.base_dtype=fp8 keeps FP8 weights with a scale per tensor or per row (ModelOpt's FP8), "
            f"and {name!r} has one per {list(fmt.block)} block. Fix: use peft.base_dtype=bf16 (the weights are "
            "dequantized on load), or nf4.")
    if fmt.scale_name(name) not in state:
        raise QuantizedCheckpointError(f"{fmt.source}: FP8 tensor {name!r} has no {fmt.scale_name(name)!r}. Fix: point "
                                       "model.pretrained at the unmodified release, or use peft.base_dtype=bf16.")
    rows, cols = weight.shape[0], weight.shape[-1]
    scale = fmt._expand(state[fmt.scale_name(name)].float(), name, [(0, rows), (0, cols)], tuple(weight.shape))
    return scale.reshape(-1, 1).expand(rows, 1).contiguous()


def read_fp8_weights(path: str, cfg) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every FP8 weight of the checkpoint at `path` by its native name: (the FP8 values in the native
    layout, float32 row scales [.., out, 1]); Mamba rows reordered and experts stacked as for bf16."""
    from .checkpoint import hf_to_native, read_safetensors, safetensors_files  # checkpoint.py imports the model

    fmt = checkpoint_fp8_format(path)
    if fmt is None:
        raise QuantizedCheckpointError(
            f"{path}: peft.base_dtype=fp8 keeps an FP8 checkpoint's weights as the frozen base, and this checkpoint "
            "has no quantization_config (its weights are not FP8). Fix: point model.pretrained at an FP8 release "
            "(e.g. nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8), or set peft.base_dtype=bf16.")
    state = read_safetensors(safetensors_files(path))
    names = [n for n, v in state.items() if is_fp8(v)]
    # Indexing and stacking run on the bytes: FP8 has few CPU kernels, and a byte is a byte.
    codes = hf_to_native({n: state[n].view(torch.uint8) for n in names}, cfg)
    scales = hf_to_native({n: _row_scales(path, fmt, n, state[n], state) for n in names}, cfg)
    return {n: (codes[n].view(torch.float8_e4m3fn), scales[n]) for n in codes}


@torch.no_grad()
def keep_fp8_base(model: nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  targets: list[str]) -> tuple[int, int]:
    """Replaces each base projection of `targets` that `weights` holds in FP8 by its FP8 values (frozen)
    and a buffer of its row scales (`<name>_fp8_scale`). Returns (their bf16 bytes, their bytes now)."""
    before = after = 0
    for name in targets:
        if name not in weights:
            continue  # a projection the release keeps in bf16
        values, scale = weights[name]
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        current = getattr(module, leaf)
        if tuple(current.shape) != tuple(values.shape):
            raise QuantizedCheckpointError(f"{name}: FP8 {tuple(values.shape)} where the model has "
                                           f"{tuple(current.shape)}")
        before += current.numel() * 2  # as the bf16 base holds it
        # Held as their bytes: FSDP2 casts floating parameters to its compute dtype (which would drop the
        # scales) and gathers integer ones as they are.
        setattr(module, leaf, nn.Parameter(values.view(torch.uint8).clone(), requires_grad=False))
        module.register_buffer(leaf + SCALE, scale.clone(), persistent=False)
        after += values.numel() + scale.numel() * scale.element_size()
    return before, after


def fp8_base_problems(cfg) -> list[str]:
    """What keeps a run config from an fp8 base, checked before any heavy work: a base that trains, no
    checkpoint to take FP8 weights from, or a mesh that would split them (tensor and expert parallel
    split bf16 weights; the FP8 ones are sharded by FSDP2 only)."""
    p = cfg.peft
    if p.base_dtype != "fp8":
        return []
    if p.method == "none":
        return ["peft.base_dtype=fp8 with peft.method=none: full fine-tuning trains the base, and the FP8 base is "
                "frozen. Fix: set peft.method=lora, or peft.base_dtype=bf16 (FP8 weights are read as bf16)."]
    errors = []
    if not cfg.model.pretrained:
        errors.append("peft.base_dtype=fp8 keeps an FP8 checkpoint's weights as the base, and model.pretrained is "
                      "not set. Fix: set model.pretrained to an FP8 release, or peft.base_dtype=bf16.")
    for field, size in (("mesh.tp", cfg.mesh.tp), ("mesh.ep", cfg.mesh.ep)):
        if int(size) > 1:
            errors.append(f"peft.base_dtype=fp8 with {field}={size}: the FP8 base is sharded by FSDP2 (mesh.dp_shard, "
                          f"mesh.dp_replicate) only. Fix: set {field}=1, or use peft.base_dtype=nf4 or bf16.")
    return errors
