"""Linear weights reordered once per `generate` call for oneDNN's CPU matmul, used by every step.

A decoding step multiplies a handful of rows (the batch) by each weight: the time goes to reading the
weights, and how fast a kernel streams them decides the step. On CPU, oneDNN's linear with its
weight reordered ahead of time (the layout inductor's weight prepacking uses) streams the weights
faster than `F.linear`: on two idle cores of an AMD EPYC, one row through all of the h1024 benchmark's
projections (out of cache) ran at 22 GB/s in fp32 against MKL's 15 GB/s, and bf16 projections, in
cache, at 46-70 GB/s against 20-24 GB/s (benchmarks/decode.py measures the effect on whole
generations). The reordered copies exist only inside `packed_linears`; they cost as many bytes as the
weights they mirror: by default they are made only where they take at most half the memory still
free, and `GenerationConfig.prepack_weights=False` turns them off.

Every plain `nn.Linear` of the model (the LM head and the bases of unmerged LoRA projections
included, the adapters running as before) is taken whose weight is an ordinary CPU tensor in fp32 or
bf16; sharded (DTensor) and NF4 weights keep their own path. The results equal `F.linear`'s up to
the order of the fp32 sums.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator

import torch
from torch import nn

from nemotron_recipe.models.nemotron_v3.lora import LoRALinear, LoRALMHead
from nemotron_recipe.models.nemotron_v3.model import LMHead


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packing_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether reordered weights beat `F.linear` for decoding: on CPU, in bf16 and fp32, at one row
    and at eight alike."""
    return device.type == "cpu" and packing_available() and dtype in (torch.bfloat16, torch.float32)


def copy_fits(nbytes: int) -> bool:
    """Whether a copy of `nbytes` leaves room: at most half the physical memory still available
    (where the system says; on systems that do not, it is assumed to fit)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return True
    return nbytes <= available // 2


# The forwards whose matmul this replaces; a subclass with a forward of its own is left alone.
_FORWARDS = (nn.Linear.forward, LMHead.forward, LoRALinear.forward, LoRALMHead.forward)


def packable(module: nn.Module) -> bool:
    """Whether `module` is a linear layer whose weight this module reorders: an ordinary (not
    subclassed) CPU tensor in fp32 or bf16, under a forward it knows."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and type(module).forward in _FORWARDS
            and isinstance(weight, torch.Tensor) and type(weight.data) is torch.Tensor
            and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16))


def _packed_forward(module: nn.Linear, packed: torch.Tensor):
    bias = module.bias
    lora = isinstance(module, LoRALinear)

    def forward(x: torch.Tensor, targets: torch.Tensor | None = None, chunk_size: int = 0) -> torch.Tensor:
        if targets is not None or x.dtype != packed.dtype or torch.is_grad_enabled():
            # Anything but an inference matmul of matching dtype: the module's own path.
            return type(module).forward(module, x, *(() if targets is None else (targets, chunk_size)))
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
        return module.with_adapter(x, out) if lora else out

    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, batch: int, enabled: bool | None = None,
                   skip: Collection[nn.Module] = ()) -> Iterator[int]:
    """Inside: the model's linear layers, those in `skip` aside, run on weights reordered for `batch`
    rows (see the module docstring); yields how many were taken. `enabled` None decides by
    `packing_pays` on the LM head's device and dtype, and by `copy_fits` on the copies' bytes; False
    takes none; True takes every one it can (none where oneDNN is missing)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    skipped = {id(m) for m in skip}
    taken = [m for m in model.modules() if packable(m) and id(m) not in skipped] \
        if enabled is not False and packing_available() else []
    if enabled is None and not (weight is not None and packing_pays(weight.device, weight.dtype)
                                and copy_fits(sum(m.weight.nbytes for m in taken))):
        taken = []
    try:
        with torch.no_grad():
            for m in taken:
                m.forward = _packed_forward(m, torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), batch))
        yield len(taken)
    finally:
        for m in taken:
            m.__dict__.pop("forward", None)
