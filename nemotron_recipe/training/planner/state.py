"""Bytes of parameters, gradients and optimizer state per rank, read off the sharded model.

Each parameter's local shard (a DTensor's `_local_tensor`, or the plain tensor) gives its size;
FSDP2 keeps every shard in a storage padded to an equal split of dim 0, and that storage is what a
rank holds. Gradients take the padded shard's size and the parameter's dtype (FSDP2 hands them out
as views of one padded reduce-scatter output per unit); AdamW keeps two moments of the unpadded
local shard in the parameter's dtype plus a 4-byte step per tensor. Frozen parameters
(`requires_grad=False`, e.g. a LoRA base) hold neither gradients nor optimizer state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig

from .world import kinds_in_order

ADAM_MOMENTS = 2
ADAM_STEP_BYTES = 4


@dataclass(frozen=True)
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    elements: int = 0  # parameter elements in the (padded) shards: what FSDP gathers, times the group

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer,
                          self.elements + other.elements)

    def __sub__(self, other: StateBytes) -> StateBytes:
        return self + other * -1

    def __mul__(self, n: int) -> StateBytes:
        return StateBytes(self.params * n, self.grads * n, self.optimizer * n, self.elements * n)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def parameter_state(p: nn.Parameter) -> StateBytes:
    """What one parameter costs this rank."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    held = local.untyped_storage().nbytes()
    elements = held // local.element_size()
    if (per_weight := getattr(p, "stored_bytes_per_weight", None)) is not None:
        # An NF4 or FP8 base weight: FSDP holds and gathers its codes and scales, counted here as the
        # bf16 elements of the same bytes.
        held = int(elements * per_weight)
        return StateBytes(params=held, elements=held // local.element_size())
    if not p.requires_grad:
        return StateBytes(params=held, elements=elements)
    moments = ADAM_MOMENTS * local.numel() * local.element_size()
    return StateBytes(params=held, grads=held, optimizer=moments + ADAM_STEP_BYTES, elements=elements)


def module_state(module: nn.Module) -> StateBytes:
    total = StateBytes()
    for p in module.parameters():
        total = total + parameter_state(p)
    return total


def model_state(reduced: nn.Module, config: NemotronHConfig) -> tuple[StateBytes, dict[str, StateBytes]]:
    """(whole model's state on this rank, state of one block of each kind) from the sharded
    `reduced` model (one block per kind in order of first appearance, as `reduced_config` builds)."""
    blocks = reduced.model.layers
    per_kind = {kind: module_state(blocks[i]) for i, kind in enumerate(kinds_in_order(config.pattern))}
    total = module_state(reduced)
    for state in per_kind.values():
        total = total - state
    for kind, count in Counter(config.pattern).items():
        total = total + per_kind[kind] * count
    return total, per_kind
