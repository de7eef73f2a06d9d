"""The device mesh: ("dp_replicate", "dp_shard", "cp", "tp"), tp innermost.

Flattened views the rest of the stack names:
- "dp_shard_cp": FSDP shards parameters over data-parallel shards and context-parallel ranks alike;
- "dp": the ranks that read different samples (cp and tp ranks of one dp group read the same);
- "dp_cp": the ranks whose trained tokens add up to the global token count of a step.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


class MeshError(ValueError):
    """A mesh that does not fit the world; names the numbers and a fix."""


def resolve_mesh_shape(mesh_cfg: Any, world_size: int) -> dict[str, int]:
    """Sizes of the four dims, with `dp_shard=-1` inferred from the world size."""
    sizes = {name: int(getattr(mesh_cfg, name)) for name in MESH_DIMS}
    for name, size in sizes.items():
        if size < 1 and not (name == "dp_shard" and size == -1):
            raise MeshError(f"mesh.{name}={size}: must be >= 1 (dp_shard may be -1 to infer it).")
    others = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    if sizes["dp_shard"] == -1:
        if world_size % others:
            raise MeshError(
                f"mesh: dp_replicate={sizes['dp_replicate']} x cp={sizes['cp']} x tp={sizes['tp']} = {others} "
                f"does not divide the world size {world_size}, so dp_shard cannot be inferred. "
                f"Fix: choose dims whose product divides {world_size}."
            )
        sizes["dp_shard"] = world_size // others
    product = others * sizes["dp_shard"]
    if product != world_size:
        raise MeshError(
            f"mesh: dp_replicate={sizes['dp_replicate']} x dp_shard={sizes['dp_shard']} x cp={sizes['cp']} "
            f"x tp={sizes['tp']} = {product}, but the world size is {world_size}. "
            f"Fix: make the product {world_size}, or set mesh.dp_shard=-1 to infer it."
        )
    if getattr(mesh_cfg, "sequence_parallel", False) and sizes["tp"] == 1:
        raise MeshError(
            "mesh.sequence_parallel=true needs tensor parallel: mesh.tp=1. "
            "Fix: set mesh.tp>1 or mesh.sequence_parallel=false."
        )
    return sizes


def build_mesh(mesh_cfg: Any, world_size: int, device_type: str = "cpu") -> DeviceMesh:
    sizes = resolve_mesh_shape(mesh_cfg, world_size)
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh
