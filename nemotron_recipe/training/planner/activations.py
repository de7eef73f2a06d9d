"""Peak activation memory of one training micro-batch, traced with fake tensors.

The model is built on the meta device, parallelized by the recipe's parallelizer in the fake world,
then given fake storage (`to_empty` under `FakeTensorMode`): every op of the forward and backward
runs for its shapes and dtypes only, and `FSDPMemTracker` (torch.distributed._tools) follows every
storage it creates and frees, FSDP's gathered parameters and reduce-scatter buffers included.

Tracing costs time per op, not per byte, so a model of many blocks is traced reduced to one block of
each kind, and each further block adds what a block of its kind keeps from its forward until its
backward (measured in the same trace, from the tracker's live activations before and after the
block). A peak inside the backward of any block then grows by exactly those kept bytes per extra
block; the tests hold the extrapolation to the full trace.

MoE routing depends on the data, which fake tensors do not have: the router's per-expert counts
are taken as balanced (every expert gets its share of the token-expert pairs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from nemotron_recipe.distributed import tensor_parallel
from nemotron_recipe.distributed.plan import ParallelMeshes, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, kernels
from nemotron_recipe.training.loss import forward_loss_sums

from .state import module_state
from .world import Trainability, sharded_meta_model

if TYPE_CHECKING:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

_aten = torch.ops.aten
# The model's dispatcher ops whose insides allocate: traced through their Python code.
_OPAQUE_OPS = {torch.ops.nemotron_recipe.ssd_scan_forward.default: kernels._scan_forward_op}
# Blocks up to this many are traced whole; longer models are traced reduced and extrapolated.
TRACE_WHOLE_MAX_BLOCKS = 16


@dataclass(frozen=True)
class Workload:
    """One micro-batch as one rank sees it."""

    micro_batch: int  # sequences (objective=dpo: two per pair)
    seq_len: int  # the full sequence; context parallel gives each cp rank seq_len / cp of it
    loss_chunk_size: int | None = None
    # objective=dpo with reference=base or copy: a no-grad forward of the micro-batch before the policy's.
    # Its activations are freed before the policy's forward starts, so only its time counts.
    reference_forward: bool = False


@dataclass(frozen=True)
class ActivationTrace:
    """What a traced step holds above the sharded parameters and optimizer state: activations,
    temporaries, gathered parameters, and the sharded gradients as backward makes them.

    `peak`: the highest of it; `grads_at_peak`: the sharded gradients alive then. Per traced block, in
    order: `kept`, what it keeps from its forward for its backward; `grads`, its sharded gradients;
    `excess`, its own peak above what the blocks before it keep and the blocks after it hold as
    gradients. `head_excess`: the head's peak (logits and their gradient) above what all blocks keep."""

    peak: int
    grads_at_peak: int
    pattern: str
    kept: tuple[int, ...]
    grads: tuple[int, ...]
    excess: tuple[int, ...]
    head_excess: int

    @property
    def activations(self) -> int:
        return self.peak - self.grads_at_peak


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output shape of `torch._grouped_mm` for each layout it takes (2-D x 3-D, 3-D x 2-D,
    2-D x 2-D with groups, 3-D x 3-D)."""
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[-1])
    if a.dim() == 3 and b.dim() == 2:
        return (a.shape[1], b.shape[-1])
    if a.dim() == 2 and b.dim() == 2:
        return (offs.shape[0], a.shape[0], b.shape[1])
    return (a.shape[0], a.shape[1], b.shape[-1])


class _BalancedRouting(TorchDispatchMode):
    """Answers what MoE routing asks of fake tensors: `bincount` of the chosen experts gives each
    expert an equal share, and reading those counts back gives the numbers. Also gives the grouped
    GEMM its output for every dtype the CPU kernel takes (the shape function accepts bf16 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def _remember(self, t: torch.Tensor, values: list[int]) -> torch.Tensor:
        self.values[id(t)] = (t, values)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = self.values.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
        if func is _aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            dtype = kwargs.get("out_dtype") or args[0].dtype
            return torch.empty(_grouped_mm_shape(args[0], args[1], offs), dtype=dtype, device=args[0].device)
        if func in _OPAQUE_OPS:
            # Run the op's own code, so that its temporaries pass the tracker too.
            return _OPAQUE_OPS[func](*args, **kwargs)
        if func is _aten.bincount.default:
            pairs, bins = args[0].numel(), max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), 1)
            counts = [pairs // bins + (1 if i < pairs % bins else 0) for i in range(bins)]
            return self._remember(torch.tensor(counts, dtype=torch.int64, device=args[0].device), counts)
        if known is not None and func is _aten._local_scalar_dense.default:
            return known[1][0]
        if known is not None and func is _aten.select.int:
            out = func(*args, **kwargs)
            return self._remember(out, [known[1][args[2]]])
        if known is not None and func is _aten.unbind.int:
            outs = func(*args, **kwargs)
            return [self._remember(o, [v]) for o, v in zip(outs, known[1], strict=True)]
        return func(*args, **kwargs)


@contextlib.contextmanager
def _shard_offsets_from_the_real_mesh():
    """DTensor computes a shard's global offset from the device mesh's (real) coordinate tensors;
    under fake tensors those would have no values, so that one computation runs outside the fake mode."""
    original = tensor_parallel.compute_local_shape_and_global_offset

    def real(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    tensor_parallel.compute_local_shape_and_global_offset = real
    try:
        yield
    finally:
        tensor_parallel.compute_local_shape_and_global_offset = original


@functools.cache
def _tracking():
    """torch's FSDP memory tracker module, imported on the first trace: it pulls in all of
    torch.distributed._tools, start-up time that a launch with the pre-flight off never uses."""
    from torch.distributed._tools import fsdp2_mem_tracker

    return fsdp2_mem_tracker


@functools.cache
def _not_step() -> tuple:
    """What the tracker counts that a step does not add: the sharded parameters and optimizer state
    (the planner counts them from the model itself) and the input ids."""
    ref = _tracking()._FSDPRefType
    return ref.SHARDED_PARAM, ref.BUFFER, ref.OPT, ref.INP


def _working(snapshot: dict) -> int:
    return sum(v for k, v in snapshot.items() if k != "Total" and k not in _not_step())


def _held(snapshot: dict) -> int:
    """Working memory less FSDP's all-gather buffers: FSDP keeps the last unit's buffer until the next
    unit gathers, so a block's forward ends holding its experts' (or its own) buffer, which the next
    block frees. Counted as kept, that one buffer per block would be multiplied by every block of the
    kind in the extrapolation (its experts' gathered weights under expert parallel with ep_shard > 1)."""
    return _working(snapshot) - snapshot.get(_tracking()._FSDPRefType.ALL_GATHER, 0)


def _module_peak(tracker: FSDPMemTracker, module: nn.Module, device: torch.device) -> int:
    """The module's highest working memory while it ran (forward or backward)."""
    stats = tracker.memory_tracking.get(module)
    if stats is None:
        return 0
    peaks = (_tracking()._FSDPModState.PEAK_FW, _tracking()._FSDPModState.PEAK_BW)
    return max((_working(snap[device]) for state in peaks
                for snap in stats.snapshots.get(state, []) if device in snap), default=0)


def _run_step(model: nn.Module, ids_shape: tuple[int, int], work: Workload, device: torch.device):
    """One traced forward + backward on fake storage; returns the tracker and each block's kept bytes."""
    model.to_empty(device=device)
    ids = torch.zeros(ids_shape, dtype=torch.long)
    tracker = _tracking().FSDPMemTracker(model)
    kept: list[list[int]] = []
    handles = []
    for block in model.model.layers:
        before: list[int] = []
        mine: list[int] = []
        kept.append(mine)
        handles.append(block.register_forward_pre_hook(
            lambda m, a, before=before: before.append(_held(tracker.get_tracker_snapshot()[device]))))
        handles.append(block.register_forward_hook(
            lambda m, a, o, before=before, mine=mine: mine.append(
                _held(tracker.get_tracker_snapshot()[device]) - before.pop())))
    with tracker, _BalancedRouting(), warnings.catch_warnings():
        # FSDP's note on modules that return views concerns in-place use, which a trace never makes.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        # MTP layers run on each depth's shifted tokens, as in training.
        config, mtp = model.config, None
        if config.num_nextn_predict_layers:
            shifted = ids.unsqueeze(-1).expand(*ids.shape, config.num_nextn_predict_layers).contiguous()
            mtp = (shifted, shifted)
        forward_loss_sums(model, ids, ids, loss_chunk_size=work.loss_chunk_size, backward_denominator=1.0,
                          mtp=mtp, mtp_loss_scale=config.effective_mtp_loss_scale)
    for h in handles:
        h.remove()
    # A checkpointed block's forward runs again in backward: the first run is what it keeps.
    return tracker, [values[0] for values in kept]


def trace(config: NemotronHConfig, plan: ParallelPlan, meshes: ParallelMeshes, work: Workload,
          trainability: Trainability | None = None) -> ActivationTrace:
    """Trace one forward + backward of `config`'s model (as given: whole or reduced) on this rank."""
    if config.num_nextn_predict_layers and not config.effective_mtp_loss_scale:
        # MTP layers at scale 0 never run: traced, their idle FSDP units would not finish the backward.
        config = dataclasses.replace(config, num_nextn_predict_layers=0, mtp_loss_scale=None)
    model = sharded_meta_model(config, plan, meshes, trainability or Trainability())
    blocks = list(model.model.layers)
    grads = tuple(module_state(b).grads for b in blocks)
    device = torch.device(meshes.root.device_type)
    with FakeTensorMode(allow_non_fake_inputs=True), _shard_offsets_from_the_real_mesh():
        tracker, kept = _run_step(model, (work.micro_batch, work.seq_len // plan.cp), work, device)
        snapshot = tracker.get_tracker_snapshot("peak")[device]
        excess = tuple(_module_peak(tracker, b, device) - sum(kept[:i]) - sum(grads[i + 1:])
                       for i, b in enumerate(blocks))
        head = _module_peak(tracker, model.lm_head, device) - sum(kept)
    return ActivationTrace(peak=_working(snapshot), grads_at_peak=snapshot.get(_tracking()._FSDPRefType.SHARDED_GRAD, 0),
                           pattern=config.pattern, kept=tuple(kept), grads=grads, excess=excess, head_excess=head)


def extrapolate(full: NemotronHConfig, reduced: ActivationTrace) -> ActivationTrace:
    """The whole model's step from a trace of its reduced form (one block per kind).

    A block's peak is what the blocks before it keep, plus what the blocks after it hold as gradients
    (their backward is done), plus its own excess; the head's is what every block keeps plus its
    excess. The step's peak is the highest of them, never below the reduced model's own."""
    index = [reduced.pattern.index(kind) for kind in full.pattern]
    kept = [reduced.kept[i] for i in index]
    grads = [reduced.grads[i] for i in index]
    peak, grads_at_peak = sum(kept) + reduced.head_excess, 0
    for n, i in enumerate(index):
        here = sum(kept[:n]) + reduced.excess[i] + sum(grads[n + 1:])
        if here > peak:
            peak, grads_at_peak = here, sum(grads[n + 1:])
    if reduced.peak > peak:
        peak, grads_at_peak = reduced.peak, reduced.grads_at_peak
    return ActivationTrace(peak=peak, grads_at_peak=grads_at_peak, pattern=full.pattern, kept=tuple(kept),
                           grads=tuple(grads), excess=tuple(reduced.excess[i] for i in index),
                           head_excess=reduced.head_excess)
