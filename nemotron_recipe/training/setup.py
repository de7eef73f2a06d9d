"""The device mesh and the single hook that applies parallelism (TP/SP/CP/AC/FSDP2) to the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.distributed.mesh import build_mesh
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER

log = logging.getLogger(__name__)


def build_device_mesh(cfg: Any, world_size: int, device_type: str) -> DeviceMesh:
    return build_mesh(cfg.mesh, world_size, device_type)


def parallelize_model(model: nn.Module, mesh: DeviceMesh, cfg: Any) -> nn.Module:
    """Apply the configured TP/SP/CP/AC/FSDP2 with the model's own parallelizer (which makes FSDP sum,
    not average, data-parallel gradients: the loss is already divided by the global token count)."""
    return PARALLELIZER.parallelize(
        model,
        mesh,
        fsdp_cfg=cfg.fsdp,
        sequence_parallel=cfg.mesh.sequence_parallel,
        ac_mode=cfg.ac.mode,
        ac_every=cfg.ac.every,
    )


@dataclass(frozen=True)
class DataLayout:
    """How the batch is split across the mesh.

    `dp_rank`/`dp_size`: the data-parallel position (cp and tp ranks of one dp group read the same
    samples). `token_group`: every rank that holds different tokens (dp x cp), over which token
    counts and loss sums add up. `cp`: this rank's context-parallel group, which takes a zig-zag
    part of every sequence, or None.
    """

    dp_rank: int
    dp_size: int
    token_group: Any
    cp: Any

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [batch, seq] tensor along the sequence."""
        return shard_sequence(t, self.cp)


def data_layout(mesh: DeviceMesh) -> DataLayout:
    names = mesh.mesh_dim_names or ()
    dp = mesh["dp"] if mesh.ndim > 1 else mesh
    cp = None
    token_mesh = dp
    if "cp" in names and mesh["cp"].size() > 1:
        cp_mesh = mesh["cp"]
        cp = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
        token_mesh = mesh["dp_cp"]
    return DataLayout(dp.get_local_rank(), dp.size(), token_mesh.get_group(), cp)
