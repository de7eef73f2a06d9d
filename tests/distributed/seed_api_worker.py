"""Runs under torchrun: the published `PARALLELIZER._apply` called the way an outside caller calls it.

    torchrun --standalone --nproc-per-node 4 tests/distributed/seed_api_worker.py OUT.json CASE [CASE ...]

A CASE is `model,dtype,plan,ac,mesh`: model is `hf` (transformers' NemotronHForCausalLM), `native`
(nemotron_recipe's) or `backbone` (the remote-code layout: `backbone.*`, its own loss); dtype is `fp32`
(fp32 weights, no policy) or `bf16` (weights stored in bf16, bf16 policy); plan is a `tp_shard_plan`
name; ac is 0 or 1; mesh is one of MESHES. Each case builds its mesh by hand, calls `_apply` with the
page's arguments and no recipe code, and trains three AdamW steps on the model's own `labels=` loss
(a mean), next to one process training an unsharded fp32 copy on the whole batch. Rank 0 writes both
runs' losses and gradient norms, the dtypes the Mamba mixers saw their fp32 terms in, and which FSDP
units stayed gathered after the first forward.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from worker_results import write_and_finish

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER

# (dp_replicate, dp_shard, cp, tp) and whether ("dp_shard", "cp") is flattened to "dp_shard_cp".
MESHES = {
    "fsdp2_tp2": ((1, 2, 1, 2), True),
    "fsdp2_tp2_unflattened": ((1, 2, 1, 2), False),
    "tp4": ((1, 1, 1, 4), True),
    "hsdp2x2": ((2, 2, 1, 1), True),
}
STEPS = 3
BATCH, SEQ_LEN = 4, 24
CFG = NemotronHConfig(
    pattern="M-*-M-", vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8, n_groups=4, ssm_state_size=8, chunk_size=8,
)


class RemoteCodeLayout(nn.Module):
    """The remote-code model's layout: blocks under `backbone.layers`, a loss of its own on `labels`."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.config = hf_model.config
        self.backbone = hf_model.model
        self.lm_head = hf_model.lm_head

    def forward(self, input_ids, labels=None):
        hidden = self.backbone(input_ids).last_hidden_state
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"loss": loss, "logits": logits})


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "native":
        return NemotronHForCausalLM(CFG)
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**CFG.to_hf_dict())).float()
    return RemoteCodeLayout(hf) if kind == "backbone" else hf


def grad_norm(model: nn.Module) -> float:
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            total += g.double().pow(2).sum().item()
    return total**0.5


def gathered(module: nn.Module) -> bool:
    """Whether an FSDP unit holds its parameters unsharded right now."""
    return all(group.is_unsharded for group in module._get_fsdp_state()._fsdp_param_groups)


def watch_mamba_dtypes(model: nn.Module, seen: dict) -> None:
    """Records the dtypes each Mamba mixer's parameters have when its forward runs."""
    def record(mixer, _args):
        for name in ("A_log", "D", "dt_bias", "conv1d.weight", "in_proj.weight"):
            seen.setdefault(name, set()).add(str(mixer.get_parameter(name).dtype))

    for module in model.modules():
        if type(module).__name__.endswith("Mamba2Mixer"):
            module.register_forward_pre_hook(record)


def train(model: nn.Module, ids: torch.Tensor, after_forward=None) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(ids[step], labels=ids[step]).loss
        if step == 0 and after_forward is not None:
            after_forward()
        loss.backward()
        losses.append(loss.detach().float())
        norms.append(grad_norm(model))
        opt.step()
        opt.zero_grad()
    return losses, norms


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    results = {}
    for case in cases:
        kind, dtype, plan, ac, mesh_name = case.split(",")
        ref_losses, ref_norms = train(build_model(kind), ids) if rank == 0 else (None, None)
        shape, flatten = MESHES[mesh_name]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        if flatten:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        model = build_model(kind)
        mp_policy = None
        if dtype == "bf16":
            model.to(torch.bfloat16)
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        PARALLELIZER._apply(model, mesh, mp_policy=mp_policy, tp_shard_plan=plan, activation_checkpointing=ac == "1")
        seen_dtypes, units = {}, {}
        watch_mamba_dtypes(model, seen_dtypes)
        blocks = model.backbone.layers if kind == "backbone" else model.model.layers

        def check_units():
            units.update(root=gathered(model), head=gathered(model.lm_head), first_block=gathered(blocks[0]))

        # Data-parallel rank: the position in (dp_replicate, dp_shard); cp and tp ranks read the same rows.
        dp_size = shape[0] * shape[1]
        dp_rank = rank // (shape[2] * shape[3])
        per_rank = BATCH // dp_size
        losses, norms = train(model, ids[:, dp_rank * per_rank:(dp_rank + 1) * per_rank], check_units)
        # The model's loss is a mean over this rank's tokens; equal token counts make the mean of the
        # ranks' losses the loss of the whole batch (tp ranks hold the same loss, so average all).
        mean_losses = []
        for loss in losses:
            loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).clone()
            dist.all_reduce(loss)
            mean_losses.append(loss.item() / dist.get_world_size())
        if rank == 0:
            results[case] = {"losses": mean_losses, "ref_losses": [x.item() for x in ref_losses],
                             "grad_norms": norms, "ref_grad_norms": ref_norms, "units_gathered": units,
                             "mamba_dtypes": {k: sorted(v) for k, v in seen_dtypes.items()}}
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
