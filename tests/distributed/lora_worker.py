"""Runs under torchrun: LoRA on several meshes against one process, adapters on every block kind.

    torchrun --standalone --nproc-per-node N tests/distributed/lora_worker.py OUT.json CASE [CASE ...]

A CASE is `dp_replicate,dp_shard,cp,tp,sp,ac[,epN]` (parity_worker's fields without the dtype: the base and
the adapters are fp32 here, so curves must agree to fp32 rounding). Each case adapts parity_worker's
model (Mamba2, attention, MLP and MoE blocks) with LoRA on every projection (Mamba2 out_proj and the
routed experts included), freezes the base through `reapply_trainability`, draws the adapters after
parallelizing, and trains five AdamW steps on the global batch; rank 0 trains the unsharded model in
the same job. Rank 0 writes both loss curves, each adapter's step-5 values against the reference
and which adapters each mesh shards over tp.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from parity_worker import CFG, GLOBAL_BATCH, STEPS, make_batch
from torch.distributed.tensor import DTensor
from worker_results import write_and_finish

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.distributed.fsdp import sum_data_parallel_gradients
from nemotron_recipe.distributed.plan import ActivationCheckpointing, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    adapter_parameters,
    add_adapters,
    freeze_base,
    init_adapters,
)
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER
from nemotron_recipe.training.loss import cross_entropy_sum, local_value

SPEC = LoRASpec(rank=4, alpha=8.0)
SEED = 7


def build_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFG)
    add_adapters(model, SPEC)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, ids, targets, *, dp_rank=0, dp_size=1, dp_group=None, cp=None) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.0)
    per_rank = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(STEPS):
        x = shard_sequence(ids[step, dp_rank * per_rank:(dp_rank + 1) * per_rank], cp)
        y = shard_sequence(targets[step, dp_rank * per_rank:(dp_rank + 1) * per_rank], cp)
        count = (y != -100).sum().float()
        if dp_group is not None:
            dist.all_reduce(count, group=dp_group)
        loss_sum, _ = cross_entropy_sum(model(x).logits, y)
        (loss_sum / count).backward()
        loss_sum = local_value(loss_sum).detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss_sum, group=dp_group)
        losses.append((loss_sum / count).item())
        opt.step()
        opt.zero_grad()
    return losses


def plan_of(case: str) -> ParallelPlan:
    rep, shard, cp, tp, sp, ac, *ep = case.split(",")
    return ParallelPlan(dp_replicate=int(rep), dp_shard=int(shard), cp=int(cp), tp=int(tp),
                        ep=int(ep[0].removeprefix("ep")) if ep else 1, sequence_parallel=sp == "1",
                        ac=ActivationCheckpointing(ac))


def train_on_mesh(case: str, build, ids, targets) -> tuple[torch.nn.Module, list[float]]:
    """The model `build()` gives, parallelized on `case`'s mesh with its base frozen, its adapters drawn
    after parallelizing, and its five-step loss curve on the global batch."""
    plan = plan_of(case)
    meshes = plan.build_meshes()
    model = build()
    PARALLELIZER.parallelize(model, plan, meshes, reapply_trainability=freeze_base)
    sum_data_parallel_gradients(model)
    init_adapters(model, SEED)
    cp_ctx = ContextParallel(meshes.cp.get_group(), meshes.cp.get_local_rank(), plan.cp)
    losses = train(model, ids, targets, dp_rank=meshes.dp.get_local_rank(), dp_size=meshes.dp.size(),
                   dp_group=meshes.dp_cp.get_group(), cp=cp_ctx)
    return model, losses


def reference(ids, targets) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process: the adapted curve, the adapters after it, and the base model's curve."""
    model = build_model()
    freeze_base(model)
    init_adapters(model, SEED)
    losses = train(model, ids, targets)
    adapters = {n: p.detach().clone() for n, p in adapter_parameters(model).items()}
    torch.manual_seed(0)
    base = NemotronHForCausalLM(CFG)
    with torch.no_grad():
        base_losses = [(cross_entropy_sum(base(ids[s]).logits, targets[s])[0] / (targets[s] != -100).sum()).item()
                       for s in range(STEPS)]
    return losses, adapters, base_losses


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, targets = make_batch()
    ref = reference(ids, targets) if rank == 0 else None
    results = {}
    for case in cases:
        model, losses = train_on_mesh(case, build_model, ids, targets)
        adapters = {n: full(p).detach() for n, p in adapter_parameters(model).items()}
        trainable = sorted(n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters()
                           if p.requires_grad)
        tp_sharded = sorted(n for n, p in adapter_parameters(model).items() if isinstance(p, DTensor)
                            and "tp" in (p.device_mesh.mesh_dim_names or ()) and
                            p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard())
        if rank == 0:
            ref_losses, ref_adapters, base_losses = ref
            results[case] = {
                "losses": losses, "ref_losses": ref_losses, "base_losses": base_losses,
                "adapter_rel_err": {n: ((adapters[n] - a).abs().max() / a.abs().max().clamp_min(1e-12)).item()
                                    for n, a in ref_adapters.items()},
                "trainable": trainable, "tp_sharded": tp_sharded,
            }
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
