"""Device mesh, the parallelizer contract and parallel building blocks."""

from .mesh import MESH_DIMS, MeshError, build_mesh, resolve_mesh_shape
from .parallelizer import ModelParallelizer, ParallelConfigError, fsdp_policies

__all__ = [
    "MESH_DIMS",
    "MeshError",
    "ModelParallelizer",
    "ParallelConfigError",
    "build_mesh",
    "fsdp_policies",
    "resolve_mesh_shape",
]
