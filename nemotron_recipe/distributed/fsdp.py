"""FSDP2 helpers for any model: units grouped by dtype, the gradient-reduction convention, prefetch.

FSDP2 needs every parameter of a unit to share one storage dtype, and casts a whole unit to one
compute dtype. A model stored in bf16 usually keeps a few parameters in fp32 (state-space decays,
router weights), and those should compute in fp32 even under a bf16 policy, so a block may need
several units. `shard_by_dtype` finds the fewest: a module becomes a unit of its own only where its
parameters' (storage, compute) dtypes differ from those of the unit around it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

# (storage dtype, compute dtype) of a parameter.
DtypeKey = tuple[torch.dtype, torch.dtype]

_FP32_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def policy_compute_dtype(mp_policy: MixedPrecisionPolicy | None) -> torch.dtype | None:
    return None if mp_policy is None else mp_policy.param_dtype


def _key(param: torch.Tensor, keep_fp32: bool, policy_dtype: torch.dtype | None) -> DtypeKey:
    if keep_fp32 and policy_dtype not in (None, torch.float32):
        return param.dtype, torch.float32
    return param.dtype, policy_dtype or param.dtype


def dtype_units(
    module: nn.Module, keep_fp32: Callable[[str], bool], policy_dtype: torch.dtype | None
) -> list[tuple[nn.Module, DtypeKey]]:
    """(module, dtype key) of each unit `module` needs, innermost first, `module` itself last.

    `keep_fp32(name)` says whether the parameter `name` (relative to `module`) computes in fp32.
    The outer unit takes the key holding most parameter elements; below it, a module whose own
    parameters have another key than its enclosing unit becomes a unit, and its children inherit its key.
    """
    # Parameters of modules sharded earlier belong to their units already. Names come from walking
    # the children (wrappers may rename what `named_parameters` reports); shared ones count once.
    taken = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    keys: dict[int, DtypeKey] = {}
    sizes: Counter = Counter()
    for prefix, m in _unsharded_modules("", module):
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in taken and id(p) not in keys:
                keys[id(p)] = _key(p, keep_fp32(prefix + name), policy_dtype)
                sizes[keys[id(p)]] += p.numel()
    outer = sizes.most_common(1)[0][0] if sizes else (torch.float32, policy_dtype or torch.float32)
    units: list[tuple[nn.Module, DtypeKey]] = []

    def visit(prefix: str, m: nn.Module, enclosing: DtypeKey) -> None:
        own = {keys[id(p)] for p in m.parameters(recurse=False) if id(p) in keys}
        if len(own) > 1:
            names = sorted(prefix + n for n, _ in m.named_parameters(recurse=False))
            raise ValueError(
                f"{type(m).__name__} at {prefix.rstrip('.') or '<root>'} holds parameters of different dtypes "
                f"({', '.join(names)}), which FSDP cannot shard as one unit. Fix: store them in one dtype."
            )
        key = own.pop() if own else enclosing
        if key != enclosing:
            units.append((m, key))
        for child_name, child in m.named_children():
            if not isinstance(child, FSDPModule):
                visit(f"{prefix}{child_name}.", child, key)

    visit("", module, outer)
    return [*reversed(units), (module, outer)]


def _unsharded_modules(prefix: str, module: nn.Module):
    """(name prefix, module) for `module` and its descendants, stopping at FSDP units."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FSDPModule):
            yield from _unsharded_modules(f"{prefix}{name}.", child)


def shard_by_dtype(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool,
    keep_fp32: Callable[[str], bool] = lambda name: False,
) -> None:
    """`fully_shard` `module` as the units `dtype_units` finds. Units of fp32-computing parameters
    under a low-precision policy compute and reduce in fp32 and leave their inputs' dtype alone."""
    policy_dtype = policy_compute_dtype(mp_policy)
    for unit, (storage, compute) in dtype_units(module, keep_fp32, policy_dtype):
        policy = mp_policy or MixedPrecisionPolicy()
        if compute != (policy_dtype or storage):
            policy = _FP32_COMPUTE
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload_policy or OffloadPolicy(),
                    reshard_after_forward=reshard_after_forward)


def sum_data_parallel_gradients(model: nn.Module) -> None:
    """Make FSDP sum gradients over the data-parallel ranks instead of averaging them.

    For a loss already divided by the token count of the whole global batch (every rank's tokens),
    whose gradient is the sum of the ranks' gradients. A plain SUM (not NCCL's pre-multiplied
    average) also runs on gloo.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_prefetch(units: Sequence[nn.Module], forward_depth: int, backward_depth: int) -> None:
    """Explicit prefetch: each unit all-gathers the next `forward_depth` units' parameters when its
    forward starts and the previous `backward_depth` ones' when its backward starts."""
    units = [u for u in units if isinstance(u, FSDPModule)]
    for i, unit in enumerate(units):
        if forward_depth > 0 and units[i + 1:i + 1 + forward_depth]:
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + forward_depth])
        if backward_depth > 0 and units[max(0, i - backward_depth):i]:
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward_depth):i][::-1])
