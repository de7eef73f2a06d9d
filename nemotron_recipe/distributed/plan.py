"""The parallel plan: every parallel setting of a run, built and checked once from the config.

`ParallelPlan.from_config` turns the `mesh`, `ac` and `fsdp` groups (and the sequence length they
constrain) into one frozen object, or raises one error listing every problem, before any process
group, data or model exists. The recipe, the data layout and the parallelizer all read it; nobody
else looks a mesh size up in the config. `build_meshes` makes the device mesh and keeps the named
sub-meshes the rest of the stack uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .activation_checkpoint import AC_MODES
from .mesh import stage_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
# The routed experts' mesh: `ep` ranks split the experts, `ep_shard` ranks shard each expert (FSDP), both
# carved out of the data-parallel ranks dp_shard x cp; tp ranks keep whole copies as they do for MoE blocks.
MOE_MESH_DIMS = ("dp_replicate", "ep_shard", "ep", "tp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ParallelConfigError(ValueError):
    """A parallel setting the model or the launch cannot run with; names the field, the value and a fix."""


@dataclass(frozen=True)
class ActivationCheckpointing:
    """What to recompute in backward: `mode` is one of `AC_MODES`; `every` is every_nth's N."""

    mode: str = "none"
    every: int = 2

    def __post_init__(self) -> None:
        if self.mode not in AC_MODES:
            raise ParallelConfigError(f"ac.mode={self.mode!r}: unknown. Fix: use one of {list(AC_MODES)}.")
        if not isinstance(self.every, int) or self.every < 1:
            raise ParallelConfigError(f"ac.every={self.every}: must be >= 1. Fix: e.g. ac.every=2.")


@dataclass(frozen=True)
class ParallelMeshes:
    """The device mesh (dims `MESH_DIMS`, tp innermost) and the flattened views the stack names:
    `dp` (ranks that read different samples), `dp_cp` (ranks whose trained tokens add up to a step's
    count) and `dp_shard_cp` (what FSDP shards over)."""

    root: DeviceMesh
    dp: DeviceMesh
    dp_cp: DeviceMesh
    dp_shard_cp: DeviceMesh
    moe: DeviceMesh | None = None  # dims MOE_MESH_DIMS, only with expert parallel
    pp: DeviceMesh | None = None  # the ranks of this rank's pipeline, one per stage, only with pp > 1

    @property
    def cp(self) -> DeviceMesh:
        return self.root["cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]


def check_sequence_parallel(sequence_parallel: bool, tp: int) -> str | None:
    if sequence_parallel and tp == 1:
        return ("mesh.sequence_parallel=true needs tensor parallel, but mesh.tp=1: the sequence is sharded "
                "across tensor-parallel ranks. Fix: set mesh.tp>1 or mesh.sequence_parallel=false.")
    return None


@dataclass(frozen=True)
class ParallelPlan:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    ac: ActivationCheckpointing = ActivationCheckpointing()
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    offload: bool = False
    reshard_after_forward: bool | None = None
    pp: int = 1  # pipeline stages (ranks), outermost: every other dim lives within one stage

    def __post_init__(self) -> None:
        # Plans are also made by replacing fields of another (the planner's variants): checked here too.
        if problem := check_expert_parallel(self.ep, self.dp_shard, self.cp):
            raise ParallelConfigError(problem)

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> ParallelPlan:
        """The plan `cfg` (with `mesh`, `ac`, `fsdp` and `trainer.seq_len`) asks for on `world_size`
        processes; raises `ParallelConfigError` listing every problem."""
        errors: list[str] = []
        sizes = _mesh_sizes(cfg.mesh, world_size, errors)
        ac = _activation_checkpointing(cfg.ac, errors)
        dtypes = {name: _dtype(f"fsdp.{name}", getattr(cfg.fsdp, name), errors)
                  for name in ("param_dtype", "reduce_dtype")}
        sp = bool(cfg.mesh.sequence_parallel)
        if problem := check_sequence_parallel(sp, sizes.get("tp", 1)):
            errors.append(problem)
        ep = int(getattr(cfg.mesh, "ep", 1))
        if sizes.get("dp_shard", -1) > 0 and (problem := check_expert_parallel(ep, sizes["dp_shard"], sizes["cp"])):
            errors.append(problem)
        if errors:
            raise ParallelConfigError("invalid parallel settings:\n  " + "\n  ".join(errors))
        plan = cls(**sizes, ep=ep, sequence_parallel=sp, ac=ac, **dtypes, offload=bool(cfg.fsdp.offload),
                   pp=_pipeline_size(cfg.mesh), reshard_after_forward=cfg.fsdp.reshard_after_forward)
        if problem := plan.check_seq_len(cfg.trainer.seq_len):
            raise ParallelConfigError(problem)
        return plan

    @property
    def world_size(self) -> int:
        return self.pp * self.stage_world_size

    @property
    def stage_world_size(self) -> int:
        """Ranks of one pipeline stage (all of them without a pipeline)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples (cp and tp ranks of one dp group read the same)."""
        return self.dp_replicate * self.dp_shard

    @property
    def seq_len_divisor(self) -> int:
        return seq_len_divisor(self.cp, self.tp if self.sequence_parallel else 1)

    def check_seq_len(self, seq_len: int) -> str | None:
        return seq_len_problem(seq_len, self.cp, self.tp if self.sequence_parallel else 1)

    def fsdp_policies(self, device_type: str) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        # Pinned host memory needs a CUDA runtime; on a CPU-only machine pinning fails.
        offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if self.offload else OffloadPolicy()
        return mp, offload

    def build_meshes(self, device_type: str = "cpu") -> ParallelMeshes:
        """The meshes of this rank's pipeline stage (the whole world without a pipeline)."""
        shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root, pp = stage_mesh(device_type, self.pp, shape, MESH_DIMS)
        moe = None
        if self.ep > 1:
            # Rank order matches `root`'s: ep_shard x ep is dp_shard x cp, split the other way.
            moe_shape = (self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            moe, _ = stage_mesh(device_type, self.pp, moe_shape, MOE_MESH_DIMS)
        return ParallelMeshes(
            root=root,
            dp=root["dp_replicate", "dp_shard"]._flatten("dp"),
            dp_cp=root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            dp_shard_cp=root["dp_shard", "cp"]._flatten("dp_shard_cp"),
            moe=moe,
            pp=pp,
        )

    def describe(self) -> dict[str, int]:
        sizes = dict(zip(MESH_DIMS, (self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        sizes = {"pp": self.pp, **sizes} if self.pp > 1 else sizes
        return {**sizes, "ep": self.ep} if self.ep > 1 else sizes


def check_expert_parallel(ep: int, dp_shard: int, cp: int) -> str | None:
    if ep < 1:
        return f"mesh.ep={ep}: must be >= 1. Fix: mesh.ep=1 (every rank holds every expert) or a divisor of dp_shard x cp."
    if (dp_shard * cp) % ep:
        return (f"mesh.ep={ep} does not divide dp_shard x cp = {dp_shard} x {cp} = {dp_shard * cp}: expert-parallel "
                "ranks are carved out of the data-parallel ranks. Fix: choose an ep that divides "
                f"{dp_shard * cp}, or launch more data-parallel ranks (mesh.dp_shard).")
    return None


def check_experts_split(ep: int, n_routed_experts: int, has_moe: bool) -> str | None:
    """Whether the model's routed experts can be split over `ep` ranks."""
    if ep > 1 and not has_moe:
        return f"mesh.ep={ep}: the model has no MoE block, so there are no experts to split. Fix: mesh.ep=1."
    if ep > 1 and n_routed_experts % ep:
        return (f"mesh.ep={ep} does not divide the model's {n_routed_experts} routed experts: each expert-parallel "
                f"rank holds whole experts. Fix: an ep dividing {n_routed_experts}.")
    return None


def seq_len_divisor(cp: int, sequence_parallel_tp: int = 1) -> int:
    """Context parallel cuts every sequence into 2*cp load-balanced chunks, and sequence parallel
    splits each rank's part again over the tp ranks."""
    return (2 * cp if cp > 1 else 1) * sequence_parallel_tp


def seq_len_problem(seq_len: int, cp: int, sequence_parallel_tp: int = 1) -> str | None:
    unit = seq_len_divisor(cp, sequence_parallel_tp)
    if seq_len % unit == 0:
        return None
    parts = [f"2 x mesh.cp={cp}"] if cp > 1 else []
    if sequence_parallel_tp > 1:
        parts.append(f"mesh.tp={sequence_parallel_tp} for sequence parallel")
    return (f"trainer.seq_len={seq_len} is not divisible by {unit} ({' x '.join(parts)}). "
            f"Fix: use a multiple of {unit}, e.g. {max(unit, seq_len // unit * unit)}.")


def processes_needed(mesh_cfg: Any) -> int:
    """The fewest processes the `mesh` group runs on: the product of its sizes, an inferred dp_shard
    (-1) counting as the fewest ranks that make dp_shard x cp a multiple of `ep`."""
    errors: list[str] = []
    sizes = _given_sizes(mesh_cfg, errors)
    if errors:
        raise ParallelConfigError("\n".join(errors))
    ep = max(int(getattr(mesh_cfg, "ep", 1)), 1)
    dp_shard = sizes["dp_shard"] if sizes["dp_shard"] > 0 else ep // math.gcd(ep, sizes["cp"])
    return _pipeline_size(mesh_cfg) * sizes["dp_replicate"] * sizes["cp"] * sizes["tp"] * dp_shard


def _pipeline_size(mesh_cfg: Any) -> int:
    """`mesh.pp` (the config check names a value below 1; counted as 1 until then)."""
    return max(int(getattr(mesh_cfg, "pp", 1)), 1)


def _given_sizes(mesh_cfg: Any, errors: list[str]) -> dict[str, int]:
    sizes = {name: int(getattr(mesh_cfg, name)) for name in MESH_DIMS}
    errors.extend(f"mesh.{n}={v}: must be >= 1{', or -1 to infer it from the world size' if n == 'dp_shard' else ''}."
                  for n, v in sizes.items() if v < 1 and not (n == "dp_shard" and v == -1))
    return sizes


def _mesh_sizes(mesh_cfg: Any, world_size: int, errors: list[str]) -> dict[str, int]:
    """The four dims' sizes, `dp_shard=-1` inferred from the world size."""
    found: list[str] = []
    sizes = _given_sizes(mesh_cfg, found)
    if found:
        errors.extend(found)
        return {}
    pp = _pipeline_size(mesh_cfg)
    others = pp * sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    pp_text = f"pp={pp} x " if pp > 1 else ""
    needed = processes_needed(mesh_cfg)
    if world_size == 1 and needed > 1:
        errors.append(_launch_hint({"pp": pp, **sizes, "ep": int(getattr(mesh_cfg, "ep", 1))}, needed))
    elif sizes["dp_shard"] == -1:
        if world_size % others:
            errors.append(
                f"mesh: {pp_text}dp_replicate={sizes['dp_replicate']} x cp={sizes['cp']} x tp={sizes['tp']} = {others} "
                f"does not divide the world size {world_size}, so dp_shard cannot be inferred. "
                f"Fix: choose dims whose product divides {world_size}."
            )
        sizes["dp_shard"] = max(world_size // others, 1)
    elif needed != world_size:
        errors.append(
            f"mesh: {pp_text}dp_replicate={sizes['dp_replicate']} x dp_shard={sizes['dp_shard']} x cp={sizes['cp']} "
            f"x tp={sizes['tp']} = {needed}, but the world size is {world_size}. "
            f"Fix: make the product {world_size}, or set mesh.dp_shard=-1 to infer it."
        )
    return sizes


def _launch_hint(sizes: dict[str, int], needed: int) -> str:
    """A single process asked for a mesh of several: the user meant to launch that many."""
    mesh_args = " ".join(f"mesh.{n}={v}" for n, v in sizes.items() if v != 1 and not (n == "dp_shard" and v == -1))
    return (
        f"mesh: {mesh_args} needs {needed} processes, but this is a single process. Fix: launch {needed}, "
        f"e.g. `torchrun --standalone --nproc-per-node {needed} -m recipes.finetune {mesh_args} ...` or "
        f"`NPROC_PER_NODE={needed} launch/torchrun.sh {mesh_args} ...`."
    )


def _activation_checkpointing(ac_cfg: Any, errors: list[str]) -> ActivationCheckpointing:
    try:
        return ActivationCheckpointing(ac_cfg.mode, ac_cfg.every)
    except ParallelConfigError as err:
        errors.append(str(err))
        return ActivationCheckpointing()


def _dtype(field: str, name: str, errors: list[str]) -> torch.dtype:
    if name == "fp16":
        errors.append(f"{field}='fp16': not supported; fp16 is very slow on CPU and numerically fragile "
                      "(it needs loss scaling). Fix: use bf16 (or fp32).")
    elif name not in DTYPES:
        errors.append(f"{field}={name!r}: unknown dtype. Fix: use one of {list(DTYPES)}.")
    return DTYPES.get(name, torch.float32)
