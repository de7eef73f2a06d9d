"""Bytes each rank sends per optimizer step, by collective, and the step-time floor they and the
FLOPs imply.

Counted for ring algorithms, per rank: an all-gather or reduce-scatter of a tensor of S bytes over n
ranks sends S (n-1)/n, an all-reduce twice that, an all-to-all S (n-1)/n of what it holds.
- FSDP: every micro-batch gathers each unit's parameters in the compute dtype for forward, again for
  backward where the unit reshards after forward (blocks and embedding), and reduce-scatters the
  gradients in the reduce dtype; HSDP adds an all-reduce of the sharded gradients over replicas.
- Tensor parallel: each sharded block all-reduces its [tokens, hidden] output in forward and its
  input gradient in backward (with sequence parallel an all-gather and a reduce-scatter: the same
  bytes); the vocab-sharded embedding all-reduces its output. Recomputed blocks repeat their forward.
- Context parallel: Mamba2 exchanges its projected sequence all-to-all there and back, forward and
  backward; attention gathers keys and values in forward and reduce-scatters their gradients.
- MoE blocks under sequence parallel: each tp rank routes its own shard through whole blocks, whose
  FSDP units all-reduce their gradient shards over the tp ranks (`moe_tp_all_reduce`).
- Expert parallel: each MoE block sends its routed rows (tokens x top-k, of the experts' input
  width: the latent size under LatentMoE) to their experts' ranks and takes the outputs back, two
  all-to-alls in forward and two in backward, two more where the block is recomputed (selective
  recomputation runs the exchange again too). Routing is taken as balanced, as the traced step
  takes it (`expert_parallel._balanced_guess`): a rank keeps its own share of rows and sends the rest.
- CPU offload (`fsdp.offload`): the sharded state lives in host memory, so every gather first copies
  the rank's parameter shard host-to-device, and every micro-batch's reduced gradient shard goes back
  device-to-host, over the host link (PCIe).
The floor assumes perfect overlap: the larger of compute at `tflops_per_device` and the traffic of
each group over its link (NVLink inside a node, InfiniBand across nodes, PCIe to the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemotron_recipe.distributed.activation_checkpoint import is_checkpointed
from nemotron_recipe.distributed.expert_parallel import even_split
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.models.nemotron_v3.flops import forward_flops, training_flops
from nemotron_recipe.models.nemotron_v3.model import MoE

from .activations import Workload
from .state import StateBytes

_DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2}
_TP_SHARDED_KINDS = ("M", "*", "-")


@dataclass(frozen=True)
class Hardware:
    """Peak dense bf16 TFLOP/s per device; link speeds in Gbit/s per device and direction."""

    tflops_per_device: float = 989.0  # H100/H200 SXM dense bf16
    link_gbps: float = 3600.0  # NVLink 4: 450 GB/s per direction
    ib_gbps: float = 400.0  # one NDR InfiniBand port per GPU
    devices_per_node: int = 8
    pcie_gbps: float = 512.0  # host link: PCIe Gen5 x16, 64 GB/s per direction


def _ring(size: int, n: int) -> float:
    return size * (n - 1) / n if n > 1 else 0.0


def _bytes(dtype) -> int:
    return _DTYPE_BYTES.get(str(dtype), 4)


def fsdp_bytes(plan: ParallelPlan, state: StateBytes, micro_batches: int) -> dict[str, float]:
    """FSDP's gathers and reduce-scatters, from the sharded state: a rank's shard times the group."""
    n = plan.dp_shard * plan.cp
    full = state.elements * n
    gathers = 1 if plan.reshard_after_forward is False else 2
    trained = state.elements * state.grads / max(state.params, 1)  # frozen parameters reduce nothing
    out = {
        "fsdp_all_gather": micro_batches * gathers * _ring(full * _bytes(plan.param_dtype), n),
        "fsdp_reduce_scatter": micro_batches * _ring(trained * n * _bytes(plan.reduce_dtype), n),
    }
    if plan.dp_replicate > 1:
        out["hsdp_all_reduce"] = micro_batches * 2 * _ring(trained * _bytes(plan.reduce_dtype), plan.dp_replicate)
    return out


def offload_bytes(plan: ParallelPlan, state: StateBytes, micro_batches: int) -> dict[str, float]:
    """Host-device copies of CPU offload: the parameter shard in for each gather, the gradient shard out."""
    if not plan.offload:
        return {}
    gathers = 1 if plan.reshard_after_forward is False else 2
    return {"offload_h2d": micro_batches * gathers * state.params, "offload_d2h": micro_batches * state.grads}


def activation_bytes(config: NemotronHConfig, plan: ParallelPlan, work: Workload, micro_batches: int) -> dict[str, float]:
    """Tensor- and context-parallel traffic of one rank's micro-batches."""
    tokens = work.micro_batch * work.seq_len // plan.cp
    act = tokens * config.hidden_size * _bytes(plan.param_dtype)
    recompute = 0 if plan.ac.mode in ("none", "selective") else 1
    out: dict[str, float] = {}
    if plan.tp > 1:
        blocks = sum(config.pattern.count(k) for k in _TP_SHARDED_KINDS)
        per_block = (2 + recompute) * 2 * _ring(act, plan.tp)
        out["tp_all_reduce"] = micro_batches * (blocks * per_block + 2 * _ring(act, plan.tp))
    if plan.cp > 1:
        heads = config.mamba_num_heads // plan.tp
        projected = tokens * (2 * heads * config.mamba_head_dim + 2 * config.n_groups // plan.tp * config.ssm_state_size
                              + heads) * _bytes(plan.param_dtype)
        kv = 2 * tokens * max(config.num_key_value_heads // plan.tp, 1) * config.head_dim * _bytes(plan.param_dtype)
        mamba = config.pattern.count("M") * (2 + recompute) * 2 * _ring(projected, plan.cp)
        attention = config.pattern.count("*") * (2 + recompute) * kv * (plan.cp - 1)
        out["cp_exchange"] = micro_batches * (mamba + attention)
    out["ep_all_to_all"] = micro_batches * ep_bytes(config, plan, work)
    return out


def _stacks(config: NemotronHConfig) -> list[str]:
    """The block patterns that run in training: the decoder's, and the MTP layers' when trained."""
    stacks = [config.pattern]
    if config.num_nextn_predict_layers and config.effective_mtp_loss_scale:
        stacks.append(config.mtp_pattern * config.num_nextn_predict_layers)
    return stacks


def _moe_exchanges(config: NemotronHConfig, plan: ParallelPlan) -> int:
    """All-to-alls of one micro-batch's MoE blocks (decoder and the MTP layers that run): 4 each,
    6 where the block is recomputed. MoE is never the model's pick for `blocks`."""
    return sum(6 if is_checkpointed(plan.ac.mode, i, plan.ac.every, model_choice=False) else 4
               for stack in _stacks(config) for i, kind in enumerate(stack) if kind == "E")


def _routes_sequence_shard(plan: ParallelPlan) -> bool:
    """MoE blocks are whole on every tp rank; with sequence parallel each routes its own shard."""
    return plan.sequence_parallel and plan.tp > 1


def moe_tokens(plan: ParallelPlan, work: Workload) -> int:
    """Tokens one rank routes through each MoE block per micro-batch: its cp part, its tp shard of
    that under sequence parallel."""
    tokens = work.micro_batch * work.seq_len // plan.cp
    return tokens // plan.tp if _routes_sequence_shard(plan) else tokens


def moe_tp_bytes(config: NemotronHConfig, plan: ParallelPlan, state: StateBytes, micro_batches: int) -> float:
    """Under sequence parallel the tp ranks route different tokens through whole MoE blocks, whose
    FSDP units all-reduce their gradient shards over the tp ranks too (trained share as the model's)."""
    if not _routes_sequence_shard(plan):
        return 0.0
    with torch.device("meta"):
        per_block = sum(p.numel() for p in MoE(config).parameters())
    blocks = sum(stack.count("E") for stack in _stacks(config))
    shard = blocks * per_block / (plan.dp_shard * plan.cp)
    trained = state.grads / max(state.params, 1)
    return micro_batches * 2 * _ring(shard * trained * _bytes(plan.reduce_dtype), plan.tp)


def ep_bytes(config: NemotronHConfig, plan: ParallelPlan, work: Workload) -> float:
    """Bytes one rank sends in expert parallel's all-to-alls for one micro-batch."""
    if plan.ep == 1:
        return 0.0
    rows = moe_tokens(plan, work) * config.num_experts_per_tok
    kept = even_split(rows, plan.ep)[0]  # rank 0's own experts' share stays on the rank
    width = config.moe_latent_size or config.hidden_size
    return _moe_exchanges(config, plan) * (rows - kept) * width * _bytes(plan.param_dtype)


def _link(stride: int, size: int, hw: Hardware) -> float:
    """Gbit/s of a group of `size` ranks `stride` apart (tp innermost): NVLink while it fits a node."""
    return hw.link_gbps if stride * size <= hw.devices_per_node else hw.ib_gbps


def extra_forwards(plan: ParallelPlan, work: Workload) -> int:
    """Forwards a micro-batch runs beyond its training one: recomputation, DPO's reference."""
    return int(plan.ac.mode in ("full", "blocks", "every_nth")) + int(work.reference_forward)


def step_floor(config: NemotronHConfig, plan: ParallelPlan, work: Workload, traffic: dict[str, float],
               micro_batches: int, hw: Hardware) -> dict[str, float]:
    """Seconds of compute and of traffic per step on one rank, and their maximum (the floor)."""
    flops = training_flops(config, work.micro_batch, work.seq_len) / (plan.tp * plan.cp)
    if forwards := extra_forwards(plan, work):
        flops += forwards * sum(forward_flops(config, work.micro_batch, work.seq_len).values()) / (plan.tp * plan.cp)
    compute = micro_batches * flops / (hw.tflops_per_device * 1e12)
    comm = comm_seconds(plan, traffic, hw)
    return {"compute_s": compute, "comm_s": comm, "floor_s": max(compute, comm)}


def comm_seconds(plan: ParallelPlan, traffic: dict[str, float], hw: Hardware) -> float:
    """Seconds of each group's traffic over its link, added up (a rank's collectives run one at a time)."""
    dp_stride = plan.tp * plan.cp
    groups = {
        "fsdp_all_gather": _link(plan.tp, plan.dp_shard * plan.cp, hw),
        "fsdp_reduce_scatter": _link(plan.tp, plan.dp_shard * plan.cp, hw),
        "hsdp_all_reduce": _link(dp_stride * plan.dp_shard, plan.dp_replicate, hw),
        "tp_all_reduce": _link(1, plan.tp, hw),
        "moe_tp_all_reduce": _link(1, plan.tp, hw),
        "cp_exchange": _link(plan.tp, plan.cp, hw),
        "ep_all_to_all": _link(plan.tp, plan.ep, hw),
        "offload_h2d": hw.pcie_gbps,
        "offload_d2h": hw.pcie_gbps,
        "pp_p2p": _link(plan.stage_world_size, plan.pp, hw),  # pp outermost: stages a whole stage's ranks apart
    }
    return sum(traffic[k] * 8 / (groups[k] * 1e9) for k in traffic)
