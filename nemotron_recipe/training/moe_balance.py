"""Router health and aux-loss-free load balancing of a model's MoE blocks.

Each MoE block's experts count the rows routed to each expert in every forward (of this rank's
tokens, before any expert-parallel exchange). After each optimizer step the counts of the step's
micro-batches are summed over every rank that holds different tokens, so what follows is the same on
every mesh:
- `moe_load_imbalance`: over the blocks, the largest busiest-expert load / mean expert load;
- with `moe.bias_update_rate > 0`, each router's correction bias moves by the rate times the sign of
  (mean load - expert load): busy experts become less likely to be picked, idle ones more (DeepSeek-V3's
  auxiliary-loss-free balancing). The bias only steers which experts are chosen, not their weights.
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

    def __init__(self, model: nn.Module, token_group: dist.ProcessGroup | None, bias_update_rate: float) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, MoE)]
        self.token_group, self.rate = token_group, bias_update_rate
        self.counts: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def after_micro_batch(self) -> None:
        loads = torch.stack([block.experts.tokens_per_expert for block in self.blocks])
        self.counts = loads if self.counts is None else self.counts + loads

    @torch.no_grad()
    def after_step(self, taken: bool) -> dict[str, float | list[list[int]]]:
        """The step's load metrics; moves the correction biases if the step was `taken`."""
        counts, self.counts = self.counts, None
        if counts is None:
            return {}
        if self.token_group is not None and dist.get_world_size(self.token_group) > 1:
            dist.all_reduce(counts, group=self.token_group)
        load = counts.float()
        mean = load.mean(-1, keepdim=True)
        if taken and self.rate:
            for block, block_load, block_mean in zip(self.blocks, load, mean):
                bias = block.gate.e_score_correction_bias
                bias = bias.to_local() if isinstance(bias, DTensor) else bias
                bias.add_(self.rate * torch.sign(block_mean - block_load).to(bias.dtype))
        imbalance = (load.max(-1).values / mean.squeeze(-1).clamp_min(1e-9)).max().item()
        return {"moe_load_imbalance": imbalance, "expert_load": counts.tolist()}


def freeze_routers(model: nn.Module) -> None:
    """`moe.freeze_router`: the routers' weights take no gradient (their correction biases are buffers,
    moved only by `RouterBalance`)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.gate.weight.requires_grad_(False)
