"""A simulated world: torch's fake process group of any size in this one process, and the model
reduced to one block of each kind, parallelized by the recipe's own parallelizer on it.

The fake group answers every collective without communicating, so this process plays one rank (rank
0, which holds the largest shard wherever a dim does not divide evenly) of a world of any size. A
block's shards depend only on its own shapes and the mesh, never on the other blocks, so one block
per kind gives every block's sizes exactly; the planner multiplies them by the pattern's counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from nemotron_recipe.distributed.plan import ParallelMeshes, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.checkpoint import native_weight_name, safetensors_files
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    add_adapters,
    freeze_base,
    nf4_targets,
)
from nemotron_recipe.models.nemotron_v3.nf4 import bytes_per_weight
from nemotron_recipe.training.lora import BASE_DTYPES, lora_spec
from nemotron_recipe.training.moe_balance import freeze_routers
from nemotron_recipe.training.setup import parallelize_model


class PlannerError(RuntimeError):
    """The planner cannot simulate this launch; the message says why and what to do."""


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A default process group of `world_size` fake ranks (this process is rank 0) for the block.

    A group that already exists belongs to a real launch, and its collectives would run on the
    planner's fake tensors: refused."""
    if dist.is_initialized():
        raise PlannerError(
            "a process group already exists in this process; the planner simulates its world in a "
            "process of its own. Fix: plan before init_process_group, or run `python -m recipes.plan`."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by device mesh, and meshes compare equal by shape and names
    alone: a later world (the launch's real one) would be handed this world's process groups."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the dispatcher's own (C++) cache
    clear_redistribute_planner_cache()


def kinds_in_order(pattern: str) -> str:
    """Each block character of `pattern` once, in order of first appearance."""
    return "".join(dict.fromkeys(pattern))


def reduced_config(config: NemotronHConfig) -> NemotronHConfig:
    """The model with one block of each kind its pattern holds."""
    return dataclasses.replace(config, pattern=kinds_in_order(config.pattern))


@dataclass(frozen=True)
class Trainability:
    """What trains, as the trainer sets it up: LoRA adapters over a frozen base stored in `base_dtype`,
    and frozen routers."""

    lora: LoRASpec | None = None
    base_dtype: torch.dtype = torch.float32
    freeze_router: bool = False
    nf4: bool = False  # the base projections in 4-bit NF4 (`peft.base_dtype=nf4`)
    # `peft.base_dtype=fp8`: the native names of the base projections kept in FP8 (all of them: None).
    fp8: frozenset[str] | None = frozenset()

    @classmethod
    def from_config(cls, cfg: Any) -> Trainability:
        spec = lora_spec(cfg)
        base = BASE_DTYPES[cfg.peft.base_dtype] if spec else torch.float32
        fp8 = fp8_weight_names(str(cfg.model.pretrained)) if spec and cfg.peft.base_dtype == "fp8" else frozenset()
        return cls(spec, base, bool(getattr(getattr(cfg, "moe", None), "freeze_router", False)),
                   bool(spec) and cfg.peft.base_dtype == "nf4", fp8)

    def reapply(self) -> Callable[[nn.Module], None] | None:
        freeze = ([freeze_base] if self.lora else []) + ([freeze_routers] if self.freeze_router else [])
        if not freeze:
            return None

        def reapply(model: nn.Module) -> None:
            for f in freeze:
                f(model)

        return reapply


def fp8_weight_names(path: str) -> frozenset[str] | None:
    """The native names of the weights an FP8 checkpoint at `path` stores in FP8, from its files' headers
    (no weight is read); None where `path` is no local directory (a hub id): every base projection."""
    from safetensors import safe_open

    if not Path(path).expanduser().is_dir():
        return None
    names = set()
    for file in safetensors_files(str(Path(path).expanduser())):
        with safe_open(file, framework="pt") as f:
            names |= {n for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"}
    return frozenset(native_weight_name(n) for n in names)


def sharded_meta_model(config: NemotronHConfig, plan: ParallelPlan, meshes: ParallelMeshes,
                       trainability: Trainability | None = None) -> nn.Module:
    """`config`'s model on the meta device, adapted, frozen and parallelized exactly as training does."""
    trainability = trainability or Trainability()
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    if trainability.lora:
        model.to(trainability.base_dtype)
        add_adapters(model, trainability.lora)
    targets = set(nf4_targets(model)) if trainability.lora else set()
    fp8 = targets if trainability.fp8 is None else targets & trainability.fp8
    quantized = {name: tuple(p.shape) for name, p in model.named_parameters()
                 if name in targets and (trainability.nf4 or name in fp8)}
    model = parallelize_model(model, plan, meshes, reapply_trainability=trainability.reapply())
    for name, p in model.named_parameters():
        plain = name.replace("_checkpoint_wrapped_module.", "")
        if (shape := quantized.get(plain)) is not None:  # a meta model is not quantized: state.py counts its bytes
            # NF4: half a byte and the scales; FP8: a byte and a float32 scale per row.
            p.stored_bytes_per_weight = bytes_per_weight(shape, name=plain) if trainability.nf4 else 1 + 4 / shape[-1]
    return model
