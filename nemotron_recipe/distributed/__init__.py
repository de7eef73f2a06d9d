"""The parallel plan and device meshes, the parallelizer contract and parallel building blocks."""

from .mesh import MeshError, data_parallel_mesh, submesh
from .parallelizer import ModelParallelizer
from .plan import MESH_DIMS, ActivationCheckpointing, ParallelConfigError, ParallelMeshes, ParallelPlan

__all__ = [
    "MESH_DIMS",
    "ActivationCheckpointing",
    "MeshError",
    "ModelParallelizer",
    "ParallelConfigError",
    "ParallelMeshes",
    "ParallelPlan",
    "data_parallel_mesh",
    "submesh",
]
