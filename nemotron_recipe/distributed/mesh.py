"""Finding the meshes `_apply` needs in a device mesh a caller built (the recipe's own comes from
`ParallelPlan.build_meshes`)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

PP_DIM = "pp"


class MeshError(ValueError):
    """A device mesh without the dims a parallelism needs; names them and a fix."""


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The 1-D mesh `name`: one of `mesh`'s dims or a dim flattened from its root; None if neither.

    A flattened dim is read from the root's bookkeeping rather than sliced from the root, which
    torch deprecates."""
    names = mesh.mesh_dim_names or ()
    if name in names:
        return mesh if mesh.ndim == 1 else mesh[name]
    return mesh._get_root_mesh()._flatten_mapping.get(name)


def data_parallel_mesh(
    mesh: DeviceMesh, replicate_name: str, shard_name: str, model_parallel: tuple[str, ...] = ("tp", "cp")
) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D `shard_name`, or 2-D (replicate, shard) for HSDP.

    `shard_name` (usually the flattened "dp_shard_cp") may be a dim, a flattened dim, or missing: then
    "dp_shard" and "cp" are flattened here, or "dp_shard" alone is used; a 1-D mesh of another name
    than the `model_parallel` dims is taken whole."""
    names = mesh.mesh_dim_names or ()
    shard = submesh(mesh, shard_name)
    if shard is None and {"dp_shard", "cp"} <= set(names):
        shard = mesh["dp_shard", "cp"]._flatten(shard_name)
    if shard is None:
        shard = submesh(mesh, "dp_shard")
    if shard is None and mesh.ndim == 1 and not set(names) & set(model_parallel):
        shard = mesh
    if shard is None:
        raise MeshError(
            f"device mesh with dims {names}: no data-parallel dim {shard_name!r}, no 'dp_shard' to derive it from. "
            f"Fix: add a 'dp_shard' dim (size 1 is fine, e.g. mesh_dim_names=('dp_shard', 'tp')), flatten "
            f"('dp_shard', 'cp') to {shard_name!r}, or pass dp_shard_cp_mesh_name=<its name>."
        )
    replicate = submesh(mesh, replicate_name)
    if replicate is None or replicate.size() == 1:
        return shard
    return DeviceMesh._concatenate([replicate, shard])


def replicated_over(fsdp_mesh: DeviceMesh, extra: DeviceMesh, name: str) -> DeviceMesh:
    """`fsdp_mesh` (FSDP's 1-D shard mesh or 2-D (replicate, shard) HSDP mesh) with the ranks of `extra`
    added to its replicate dim (flattened as `name`): parameters stay sharded as before, and their
    gradients are reduced over `extra`'s ranks too. For modules whose ranks along `extra` (e.g. tp under
    sequence parallel) compute on different tokens with whole copies of the weights."""
    if fsdp_mesh.ndim == 1:
        return DeviceMesh._concatenate([extra, fsdp_mesh])
    replicate_name, shard_name = fsdp_mesh.mesh_dim_names
    replicate = DeviceMesh._concatenate([fsdp_mesh[replicate_name], extra])._flatten(name)
    return DeviceMesh._concatenate([replicate, fsdp_mesh[shard_name]])


def stage_mesh(
    device_type: str, pp: int, shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The device mesh of this rank's pipeline stage (dims `names`) and the 1-D mesh of the ranks that
    hold the other stages of the same pipeline (None without one). With `pp` > 1 the world mesh is
    (pp, *names), pp outermost: every other dim lives inside one stage, so the stages' collectives
    (FSDP, tensor, context and expert parallel) never cross a stage boundary, and only activations and
    their gradients travel between pipeline ranks."""
    if pp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names), None
    world = init_device_mesh(device_type, (pp, *shape), mesh_dim_names=(PP_DIM, *names))
    return world[names], world[PP_DIM]
