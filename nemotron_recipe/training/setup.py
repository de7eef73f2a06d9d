"""The recipe's parallel setup: the meshes, the data layout and the one call that parallelizes the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.distributed.fsdp import sum_data_parallel_gradients
from nemotron_recipe.distributed.plan import ParallelMeshes, ParallelPlan
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER


def parallelize_model(
    model: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes,
    reapply_trainability: Callable[[nn.Module], None] | None = None, pipeline: Any = None,
) -> nn.Module:
    """Apply the plan's TP/SP/CP/AC/FSDP2 with the model's own parallelizer. `reapply_trainability`
    (LoRA's freezing) runs once tensor parallel has replaced the parameters, before FSDP. With a
    `pipeline` (training.pipeline.runtime.Pipeline) the model is first cut into this rank's stages,
    each parallelized as a model of its own; the result holds them under the model's names."""
    if pipeline is not None:
        return pipeline.parallelize(model, lambda stage: parallelize_model(stage, plan, meshes, reapply_trainability))
    model = PARALLELIZER.parallelize(model, plan, meshes, reapply_trainability=reapply_trainability)
    # Each micro-batch's loss is already divided by the token count of the whole global batch, so
    # the data-parallel ranks' gradients add up to the batch's gradient: sum them, do not average.
    sum_data_parallel_gradients(model)
    return model


@dataclass(frozen=True)
class DataLayout:
    """How the batch is split across the mesh.

    `dp_rank`/`dp_size`: the data-parallel position (cp and tp ranks of one dp group read the same
    samples). `token_group`: every rank that holds different tokens (dp x cp), over which token
    counts and loss sums add up. `moe_token_group`: every rank whose MoE blocks route different tokens,
    which under sequence parallel are the tp ranks too. `cp`: this rank's context-parallel group, which
    takes a zig-zag part of every sequence, or None.
    """

    dp_rank: int
    dp_size: int
    token_group: Any
    cp: Any
    moe_token_group: Any = None

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [batch, seq] tensor along the sequence."""
        return shard_sequence(t, self.cp)


def data_layout(plan: ParallelPlan, meshes: ParallelMeshes) -> DataLayout:
    cp = None
    if plan.cp > 1:
        cp = ContextParallel(meshes.cp.get_group(), meshes.cp.get_local_rank(), plan.cp)
    token_group = meshes.dp_cp.get_group()
    # Every dim but tp reads different tokens; with sequence parallel the tp ranks route their own shard.
    moe_token_group = meshes.root._flatten("world").get_group() if plan.sequence_parallel and plan.tp > 1 \
        else token_group
    return DataLayout(meshes.dp.get_local_rank(), plan.dp_size, token_group, cp, moe_token_group)
