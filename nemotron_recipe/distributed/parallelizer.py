"""The contract between the recipe and a model's own parallelizer.

A model package ships a `ModelParallelizer` subclass whose `_apply` (the published signature) knows
the model's blocks; the recipe calls `parallelize` with its `ParallelPlan`, which turns the plan into
`_apply`'s arguments.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .plan import ParallelConfigError, ParallelMeshes, ParallelPlan

__all__ = ["ModelParallelizer", "ParallelConfigError"]


class ModelParallelizer(abc.ABC):
    def parallelize(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        meshes: ParallelMeshes,
        *,
        tp_shard_plan: dict[str, ParallelStyle] | str | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Apply every parallelism `plan` asks for over `meshes`; the recipe's single entry point."""
        mp_policy, offload_policy = plan.fsdp_policies(meshes.root.device_type)
        # Expert parallel travels in NeMo AutoModel's keywords, which the published signature takes in **kwargs.
        experts = {"moe_mesh": meshes.moe, "ep_axis_name": "ep", "ep_shard_axis_names": ("ep_shard",)} \
            if meshes.moe is not None else {}
        return self._apply(
            model,
            meshes.root,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            sequence_parallel=plan.sequence_parallel,
            activation_checkpointing=plan.ac,
            tp_shard_plan=tp_shard_plan,
            reshard_after_forward=plan.reshard_after_forward,
            reapply_trainability=reapply_trainability,
            **experts,
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
