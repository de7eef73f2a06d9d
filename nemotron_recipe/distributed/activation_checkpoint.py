"""Activation checkpointing: the modes `ac.mode` offers, and op-level selective checkpointing.

Modes, applied per decoder block by the model's parallelizer:
- none: autograd keeps everything backward reads;
- blocks: the model's choice of blocks is recomputed in backward (for Nemotron-H the Mamba and MLP ones);
- full: every block is recomputed;
- selective: every block, op by op: the outputs of matmuls, attention and any op the model names
  (e.g. its own scan) are kept, and everything else in the block (norms, activations, casts,
  elementwise ops) is recomputed from them and the block's input;
- every_nth: every `ac.every`-th block (0, N, 2N, ...) is recomputed whole.

All of them use non-reentrant checkpointing. This module knows no model: a model package passes the
ops of its own that selective checkpointing should keep. A block compiled inside its checkpoint
wrapper reaches the policy as one op (the compiled code), which selective recomputes whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "blocks", "full", "selective", "every_nth")

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the aten ops this torch build has (some exist only on some builds)."""
    return frozenset(getattr(_aten, name).default for name in names if hasattr(_aten, name))


# Outputs worth keeping: producing them costs far more than storing them. Linear layers reach the
# dispatcher as mm/addmm (bmm/baddbmm when batched), F.grouped_mm as _grouped_mm.
MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm")
ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
SAVED_BY_DEFAULT = MATMUL_OPS | ATTENTION_OPS

# Selective checkpointing matches each op of the recompute to the same op's call in the forward, by
# count. FSDP's hooks open profiler ranges (ops of their own), and when a block holds FSDP units of
# its own (the parameters that stay fp32 under a bf16 policy) they run inside its region, not as
# often in recompute as in forward. The ranges hold no tensors: leave them out of the matching, as
# torch leaves out `detach`.
_PROFILER_RANGES = frozenset(
    getattr(packet, overload)
    for packet in (torch.ops.profiler._record_function_enter, torch.ops.profiler._record_function_enter_new,
                   torch.ops.profiler._record_function_exit)
    for overload in packet.overloads()
)


def is_checkpointed(mode: str, index: int, every: int, model_choice: bool) -> bool:
    """Whether the block at `index` is wrapped; `model_choice` is the model's pick for `blocks`,
    `every` (>= 1) the N of `every_nth`."""
    if mode == "blocks":
        return model_choice
    if mode == "every_nth":
        return index % every == 0
    return mode in ("full", "selective")


def save_policy(ops_to_save: Iterable) -> Callable[..., CheckpointPolicy]:
    """A selective-checkpointing policy: keep the outputs of `ops_to_save`, recompute every other op."""
    saved = frozenset(ops_to_save)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(ops_to_save: Iterable) -> Callable:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for op-level selective checkpointing:
    a fresh pair of contexts (and cache) per checkpointed call."""
    SAC_IGNORED_OPS.update(_PROFILER_RANGES)
    return functools.partial(create_selective_checkpoint_contexts, save_policy(ops_to_save))


def wrap(module: nn.Module, mode: str, model_ops: Iterable = ()) -> nn.Module:
    """`module` under non-reentrant checkpointing: whole (blocks, full, every_nth) or op by op
    (selective, keeping `SAVED_BY_DEFAULT` and the model's own `model_ops`)."""
    if mode not in AC_MODES or mode == "none":
        raise ValueError(f"ac.mode={mode!r} does not checkpoint a module; one of {list(AC_MODES[1:])} does.")
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = selective_context_fn(SAVED_BY_DEFAULT | frozenset(model_ops))
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)

