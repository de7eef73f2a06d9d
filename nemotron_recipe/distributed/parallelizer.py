"""The contract between the recipe and a model's own parallelizer.

A model package ships a `ModelParallelizer` subclass whose `_apply` knows the model's blocks; the
recipe calls `parallelize`, which turns the config groups into policies and calls `_apply`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
AC_MODES = ("none", "blocks", "full", "selective")


class ParallelConfigError(ValueError):
    """A parallel setting the model cannot run with; names the field, the value and a fix."""


def fsdp_policies(fsdp_cfg: Any, device_type: str) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    def dtype(field: str) -> torch.dtype:
        value = getattr(fsdp_cfg, field)
        if value not in DTYPES:
            raise ParallelConfigError(
                f"fsdp.{field}={value!r}: unknown dtype. Fix: use one of {sorted(DTYPES)} "
                "(fp16 is not offered: it is fragile in training and very slow on CPU)."
            )
        return DTYPES[value]

    mp = MixedPrecisionPolicy(param_dtype=dtype("param_dtype"), reduce_dtype=dtype("reduce_dtype"))
    # Pinned host memory needs a CUDA runtime; on a CPU-only machine pinning fails.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if fsdp_cfg.offload else OffloadPolicy()
    return mp, offload


class ModelParallelizer(abc.ABC):
    def parallelize(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        *,
        fsdp_cfg: Any,
        sequence_parallel: bool = False,
        ac_mode: str = "none",
        ac_every: int = 2,
        tp_shard_plan: dict[str, ParallelStyle] | str | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Apply every parallelism the config asks for; the recipe's single entry point."""
        if ac_mode not in AC_MODES:
            raise ParallelConfigError(f"ac.mode={ac_mode!r}: unknown. Fix: use one of {list(AC_MODES)}.")
        if ac_mode == "selective" and ac_every < 1:
            raise ParallelConfigError(f"ac.every={ac_every}: must be >= 1 for selective checkpointing.")
        mp_policy, offload_policy = fsdp_policies(fsdp_cfg, device_mesh.device_type)
        return self._apply(
            model,
            device_mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=ac_mode != "none",
            tp_shard_plan=tp_shard_plan,
            reshard_after_forward=fsdp_cfg.reshard_after_forward,
            reapply_trainability=reapply_trainability,
            ac_mode=ac_mode,
            ac_every=ac_every,
        )

    @abc.abstractmethod
    def _apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool = False,
        tp_shard_plan: dict[str, ParallelStyle] | str | None = None,
        dp_replicate_mesh_name: str = "dp_replicate",
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        tp_mesh_name: str = "tp",
        reshard_after_forward: bool | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        **kwargs,
    ) -> nn.Module:
        """Apply every requested parallelism to the model; returns it."""
