"""Runs under torchrun: trains the same model on several meshes and on one process, and writes
the per-step losses and step-1 gradients of each to a JSON file for the tests to compare.

    torchrun --standalone --nproc-per-node N tests/distributed/parity_worker.py OUT.json CASE [CASE ...]

A CASE is `dp_replicate,dp_shard,cp,tp,sp,ac,dtype[,model[,epN]]`, e.g. `1,2,1,1,0,none,fp32`; dtype
is fp32, bf16 or bf16_offload (CPU-offloaded parameters); model is native (default), groups2 (native
with 2 Mamba groups, so that a cp larger than a rank's groups splits them) or hf (`transformers`);
epN splits the routed experts over N expert-parallel ranks; a 10th field `mean` keeps FSDP averaging
gradients over the data-parallel ranks (each rank's loss is scaled up by their number to compare).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from worker_results import write_and_finish

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.distributed.fsdp import sum_data_parallel_gradients
from nemotron_recipe.distributed.plan import DTYPES, ActivationCheckpointing, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.model import Mamba2Mixer
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER
from nemotron_recipe.training.loss import cross_entropy_sum, local_value

STEPS = 5
GLOBAL_BATCH = 4
SEQ_LEN = 24  # not a power of two; divisible by 2 * cp * tp for every case here
CFG = NemotronHConfig(
    pattern="M*-EM-", vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8, n_groups=4, ssm_state_size=8, chunk_size=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
    n_group=2, topk_group=1, routed_scaling_factor=2.5,
)
# MoE-heavy: three MoE blocks of 8 experts, top-2; "moe_grouped" routes within the best 2 of 4 groups.
MOE_CFG = dataclasses.replace(CFG, pattern="EM*E-E", n_routed_experts=8, n_group=1, topk_group=1)
NATIVE_CONFIGS = {
    "native": CFG, "groups2": dataclasses.replace(CFG, n_groups=2),
    "moe": MOE_CFG, "moe_grouped": dataclasses.replace(MOE_CFG, n_group=4, topk_group=2), "moe_aux": MOE_CFG,
}
# "moe_aux" trains with the sequence-wise balance loss at this weight (large, so a wrong gradient shows).
AUX_LOSS_WEIGHT = 0.05


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ_LEN), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ_LEN), generator=g)
    # Untrained positions, unevenly spread over samples, so ranks hold different token counts.
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100
    targets[:, 0, : SEQ_LEN // 2] = -100
    return ids, targets


def build_model(name: str):
    torch.manual_seed(0)
    if name == "hf":
        import transformers

        hf_cfg = transformers.NemotronHConfig(**{**CFG.to_hf_dict(), "use_mamba_kernels": False})
        return transformers.NemotronHForCausalLM(hf_cfg).float()
    model = NemotronHForCausalLM(NATIVE_CONFIGS[name])
    if name == "moe_aux":
        for module in model.modules():
            if hasattr(module, "balance_loss_weight"):
                module.balance_loss_weight = AUX_LOSS_WEIGHT
    return model


def count_split_group_scans(counter: list[int]) -> None:
    """Count the Mamba2 scans that get fewer heads per group than the mixer has: context parallel
    splits each group into virtual ones only when a rank holds fewer groups than cp."""
    conv_and_scan = Mamba2Mixer.conv_and_scan

    def counted(self, xbc, dt, *args, **kwargs):
        if dt.shape[-1] < self.heads_per_group:
            counter[0] += 1
        return conv_and_scan(self, xbc, dt, *args, **kwargs)

    Mamba2Mixer.conv_and_scan = counted


def clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_fraction(p: torch.Tensor, tp: int) -> float:
    """The share of a parameter a rank holds because of tensor parallel (FSDP shards excluded)."""
    names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
    if "tp" in names and p.placements[names.index("tp")].is_shard():
        return 1 / tp
    return 1.0


def local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def moe_token_share(model, tokens: int) -> float | None:
    """Rows this rank's MoE blocks routed in the last forward over top_k x the rank's tokens: 1 where
    every rank of a tp group routes its whole sequence, 1/tp where each routes its sequence shard."""
    experts = [m for m in model.modules() if hasattr(m, "tokens_per_expert")]
    if not experts:
        return None
    rows = sum(m.tokens_per_expert.sum().item() for m in experts)
    return rows / (len(experts) * model.config.num_experts_per_tok * tokens)


def train(model, ids, targets, *, dp_rank=0, dp_size=1, dp_group=None, cp=None, loss_scale=1.0):
    """Five AdamW steps; the loss of a step is its global token-loss sum over the global token count.

    `dp_group` spans every rank that holds different tokens (data and context parallel)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    per_rank = GLOBAL_BATCH // dp_size
    losses, grads, first_logits = [], {}, None
    for step in range(STEPS):
        x = ids[step, dp_rank * per_rank:(dp_rank + 1) * per_rank]
        y = targets[step, dp_rank * per_rank:(dp_rank + 1) * per_rank]
        x, y = shard_sequence(x, cp), shard_sequence(y, cp)
        count = (y != -100).sum().float()
        if dp_group is not None:
            dist.all_reduce(count, group=dp_group)
        logits = model(x).logits
        if step == 0:
            first_logits = full(logits).detach().clone()
        loss_sum, _ = cross_entropy_sum(logits, y)
        (loss_sum / count * loss_scale).backward()
        loss_sum = local_value(loss_sum).detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss_sum, group=dp_group)
        losses.append((loss_sum / count).item())
        if step == 0:
            grads = {clean_name(n): full(p.grad).detach().float().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, first_logits


def parse_case(case: str) -> tuple[ParallelPlan, str, bool]:
    """(the case's parallel plan, its model's name, whether FSDP averages the gradients)."""
    fields = case.split(",")
    rep, shard, cp, tp, sp, ac, dtype = fields[:7]
    model_name = fields[7] if len(fields) > 7 else "native"
    ep = int(fields[8].removeprefix("ep")) if len(fields) > 8 else 1
    mean = len(fields) > 9 and fields[9] == "mean"  # FSDP's own averaging, the published default
    plan = ParallelPlan(
        dp_replicate=int(rep), dp_shard=int(shard), cp=int(cp), tp=int(tp), ep=ep, sequence_parallel=sp == "1",
        ac=ActivationCheckpointing(ac), param_dtype=DTYPES[dtype.removesuffix("_offload")],
        offload=dtype.endswith("_offload"),
    )
    return plan, model_name, mean


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, targets = make_batch()
    results = {}
    references = {}
    split_group_scans = [0]
    count_split_group_scans(split_group_scans)
    for case in cases:
        plan, model_name, mean = parse_case(case)
        if model_name not in references and rank == 0:
            references[model_name] = train(build_model(model_name), ids, targets)
        meshes = plan.build_meshes()
        model = build_model(model_name)
        PARALLELIZER.parallelize(model, plan, meshes, tp_shard_plan="mlp" if model_name == "hf" else None)
        if not mean:
            sum_data_parallel_gradients(model)  # the loss is divided by the global token count
        dp = meshes.dp
        cp_ctx = ContextParallel(meshes.cp.get_group(), meshes.cp.get_local_rank(), plan.cp)
        split_group_scans[0] = 0
        losses, grads, logits = train(model, ids, targets, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                                      dp_group=meshes.dp_cp.get_group(), cp=cp_ctx,
                                      loss_scale=meshes.dp_cp.size() if mean else 1.0)
        # Step-0 logits of this rank's samples and positions against the unsharded model's.
        per_rank = GLOBAL_BATCH // dp.size()
        with torch.no_grad():
            ref = build_model(model_name)(ids[0]).logits
        ref = shard_sequence(ref[dp.get_local_rank() * per_rank:(dp.get_local_rank() + 1) * per_rank], cp_ctx)
        logits_err = torch.tensor((logits - ref).abs().max().item() / ref.abs().max().item())
        dist.all_reduce(logits_err, op=dist.ReduceOp.MAX)
        split_scans = torch.tensor(split_group_scans[0])  # the fewest of any rank
        dist.all_reduce(split_scans, op=dist.ReduceOp.MIN)
        # Fraction of each block's parameters this rank holds under tensor parallel (FSDP excluded).
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        expert_elements = torch.tensor([sum(local_numel(p) for p in experts)])
        dist.all_reduce(expert_elements, op=dist.ReduceOp.MAX)
        held = {
            f"{i}:{NATIVE_CONFIGS.get(model_name, CFG).block_types[i]}": sum(p.numel() * tp_fraction(p, plan.tp) for p in block.parameters())
            / sum(p.numel() for p in block.parameters())
            for i, block in enumerate(model.model.layers)
        }
        if rank == 0:
            ref_losses, ref_grads, _ = references[model_name]
            errs = {name: ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                    for name, g in ref_grads.items()}
            results[case] = {"logits_rel_err": logits_err.item(), "losses": losses, "ref_losses": ref_losses, "grad_rel_err": errs,
                             "missing_grads": sorted(set(ref_grads) - set(grads)), "tp_held_fraction": held,
                             "split_group_scans": split_scans.item(),
                             "expert_elements": [expert_elements.item(), sum(p.numel() for p in experts)],
                             "moe_token_share": moe_token_share(model, per_rank * ids.shape[2] // plan.cp)}
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
