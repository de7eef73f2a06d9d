"""Router health and aux-loss-free load balancing of a model's MoE blocks.

Each MoE block's experts count the rows routed to each expert in every forward (of this rank's
real tokens, padding left out, before any expert-parallel exchange). After each optimizer step the
counts of the step's micro-batches are summed over every rank that holds different tokens, so what
follows is the same on every mesh:
- `moe_load_imbalance`: over the blocks, the largest busiest-expert load / mean expert load;
- with `moe.bias_update_rate > 0`, each router's correction bias moves by the rate times the sign of
  (mean load - expert load): busy experts become less likely to be picked, idle ones more (DeepSeek-V3's
  auxiliary-loss-free balancing). The bias only steers which experts are chosen, not their weights.
- with `moe.aux_loss_coeff > 0`, each MoE block of the decoder adds the sequence-wise balance loss
  (`models.nemotron_v3.model.sequence_balance_loss`) times coefficient / (sequences per step) to the
  objective, through its own backward; `moe_aux_loss` is that term summed over the blocks. MTP layers'
  MoE blocks take no balance loss (their inputs are shifted copies of the same sequences).
An activation-checkpointing recompute routes the same tokens the same way, so counts read after each
micro-batch's backward are that micro-batch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemotron_recipe.models.nemotron_v3.model import MoE


class RouterBalance:
    """Expert loads of one step over the global batch, and the bias update they drive."""

    def __init__(self, model: nn.Module, token_group: dist.ProcessGroup | None, bias_update_rate: float,
                 aux_loss_coeff: float = 0.0, sequences_per_step: int = 1) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, MoE)]
        self.token_group, self.rate = token_group, bias_update_rate
        self.counts: torch.Tensor | None = None
        mtp = getattr(model, "mtp", None)
        in_mtp = {id(m) for m in mtp.modules()} if mtp is not None else set()
        self.aux_blocks = [m for m in self.blocks if id(m) not in in_mtp] if aux_loss_coeff else []
        self.aux_weight = aux_loss_coeff / sequences_per_step
        for block in self.aux_blocks:
            block.balance_loss_weight = self.aux_weight
        self.aux_sum: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks)

    @property
    def needs_token_mask(self) -> bool:
        """Padding differs between meshes (sequences are padded to what cp and sp split by), so the
        loads and the balance loss count real tokens only."""
        return bool(self.blocks)

    def after_micro_batch(self) -> None:
        loads = torch.stack([block.experts.tokens_per_expert for block in self.blocks])
        self.counts = loads if self.counts is None else self.counts + loads
        if self.aux_blocks:
            part = torch.stack([block.balance_loss for block in self.aux_blocks]).sum().double()
            self.aux_sum = part if self.aux_sum is None else self.aux_sum + part

    @torch.no_grad()
    def after_step(self, taken: bool) -> dict[str, float | list[list[int]]]:
        """The step's load metrics; moves the correction biases if the step was `taken`."""
        counts, self.counts = self.counts, None
        aux_sum, self.aux_sum = self.aux_sum, None
        if counts is None:
            return {}
        if self.token_group is not None and dist.get_world_size(self.token_group) > 1:
            dist.all_reduce(counts, group=self.token_group)
            if aux_sum is not None:
                dist.all_reduce(aux_sum, group=self.token_group)
        load = counts.float()
        mean = load.mean(-1, keepdim=True)
        if taken and self.rate:
            for block, block_load, block_mean in zip(self.blocks, load, mean):
                bias = block.gate.e_score_correction_bias
                bias = bias.to_local() if isinstance(bias, DTensor) else bias
                bias.add_(self.rate * torch.sign(block_mean - block_load).to(bias.dtype))
        imbalance = (load.max(-1).values / mean.squeeze(-1).clamp_min(1e-9)).max().item()
        metrics = {"moe_load_imbalance": imbalance, "expert_load": counts.tolist()}
        if aux_sum is not None:
            metrics["moe_aux_loss"] = aux_sum.item() * self.aux_weight
        return metrics


def freeze_routers(model: nn.Module) -> None:
    """`moe.freeze_router`: the routers' weights take no gradient (their correction biases are buffers,
    moved only by `RouterBalance`)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.gate.weight.requires_grad_(False)
