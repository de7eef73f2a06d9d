"""Runs under torchrun with 2 ranks: a model with LatentMoE and two MTP depths trains on fsdp 2, tp 2 +
sequence parallel, cp 2, fsdp 2 and tp 2 + SP with every block checkpointed, fsdp 2 with expert
parallel 2, and on one process; writes each case's losses, MTP losses and first-step gradients to a
JSON file for tests/test_latent_moe_mtp.py.

    torchrun --standalone --nproc-per-node 2 tests/distributed/latent_mtp_worker.py OUT.json

The MTP inputs and targets are shifted from the whole sequences before they are split over cp ranks,
as the recipe does.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from worker_results import write_and_finish

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.distributed.fsdp import sum_data_parallel_gradients
from nemotron_recipe.distributed.plan import ActivationCheckpointing, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.mtp import shift_for_mtp
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER
from nemotron_recipe.training.loss import forward_loss_sums, local_value

STEPS = 3
GLOBAL_BATCH = 4
SEQ_LEN = 24  # divisible by 2 * cp and by tp
CFG = NemotronHConfig(
    pattern="M*-EM", vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8, n_groups=4, ssm_state_size=8, chunk_size=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_latent_size=12, num_nextn_predict_layers=2,
    mtp_pattern="*E", mtp_loss_scale=0.3,
)
# name: (dp_shard, cp, tp, sequence_parallel, ac, ep)
# AC "full": every block, MTP layers included, is recomputed. ep 2: the routed experts (the MTP
# layer's too) split over the two fsdp ranks.
CASES = {"fsdp2": (2, 1, 1, False, "none", 1), "tp2_sp": (1, 1, 2, True, "none", 1), "cp2": (1, 2, 1, False, "none", 1),
         "fsdp2_ac": (2, 1, 1, False, "full", 1), "tp2_sp_ac": (1, 1, 2, True, "full", 1),
         "fsdp2_ep2": (2, 1, 1, False, "none", 2)}


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ_LEN), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ_LEN), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    targets[:, 0, : SEQ_LEN // 2] = -100
    return ids, targets


def build_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFG)
    with torch.no_grad():  # a non-zero correction bias, so grouped routing depends on it
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, ids, targets, *, dp_rank=0, dp_size=1, token_group=None, cp=None):
    """AdamW steps on (loss sum + scale * MTP loss sum) / global token count; returns the losses, the
    MTP losses (per token) and the first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    per_rank = GLOBAL_BATCH // dp_size
    losses, mtp_losses, grads = [], [], {}
    for step in range(STEPS):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        x, y = ids[step, rows], targets[step, rows]
        mtp = tuple(shard_sequence(t, cp) for t in shift_for_mtp(x, y, CFG.num_nextn_predict_layers))
        x, y = shard_sequence(x, cp), shard_sequence(y, cp)
        count = (y != -100).sum().float()
        if token_group is not None:
            dist.all_reduce(count, group=token_group)
        sums = forward_loss_sums(model, x, y, mtp=mtp, mtp_loss_scale=CFG.mtp_loss_scale, backward_denominator=count)
        both = torch.stack([local_value(sums.loss_sum).detach(), local_value(sums.mtp_loss_sum).detach()])
        if token_group is not None:
            dist.all_reduce(both, group=token_group)
        losses.append((both[0] / count).item())
        mtp_losses.append((both[1] / count).item())
        if step == 0:
            grads = {n.replace("_checkpoint_wrapped_module.", ""): full(p.grad).detach().clone()
                     for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, mtp_losses, grads


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, targets = make_batch()
    reference = train(build_model().train(), ids, targets) if rank == 0 else None
    results = {}
    for case, (shard, cp, tp, sp, ac, ep) in CASES.items():
        plan = ParallelPlan(dp_shard=shard, cp=cp, tp=tp, ep=ep, sequence_parallel=sp, ac=ActivationCheckpointing(ac))
        meshes = plan.build_meshes()
        model = build_model()
        PARALLELIZER.parallelize(model, plan, meshes)
        sum_data_parallel_gradients(model)
        cp_ctx = ContextParallel(meshes.cp.get_group(), meshes.cp.get_local_rank(), plan.cp)
        losses, mtp_losses, grads = train(model.train(), ids, targets, dp_rank=meshes.dp.get_local_rank(),
                                          dp_size=meshes.dp.size(), token_group=meshes.dp_cp.get_group(), cp=cp_ctx)
        if rank == 0:
            ref_losses, ref_mtp_losses, ref_grads = reference
            errs = {n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                    for n, g in ref_grads.items() if n in grads}
            results[case] = {"losses": losses, "mtp_losses": mtp_losses, "ref_losses": ref_losses,
                             "ref_mtp_losses": ref_mtp_losses, "grad_rel_err": errs,
                             "missing_grads": sorted(set(ref_grads) - set(grads))}
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
