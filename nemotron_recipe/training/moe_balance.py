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

Under a pipeline each rank holds some of the MoE blocks: their loads fill their rows of the whole
model's table (`moe_block_names`), counted after each stage's forward, and the table and the balance
loss are summed over the pipeline's ranks as well, so the metrics and expert loads cover every block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemotron_recipe.models.nemotron_v3.model import MoE


def moe_block_names(config) -> list[str]:
    """The names of a whole model's MoE mixers in module order: the decoder's, then the MTP layers'."""
    names = [f"model.layers.{i}.mixer" for i, kind in enumerate(config.block_types) if kind == "moe"]
    if config.num_nextn_predict_layers:
        names += [f"mtp.layers.{j}.mixer" for j, kind in enumerate(config.mtp_block_types) if kind == "moe"]
    return names


def _local_rows(model: nn.Module) -> tuple[list[MoE], list[int], int]:
    """The MoE mixers `model` holds, their rows in the whole model's table, and the table's size."""
    blocks, names = [], []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            blocks.append(module)
            names.append(name.replace("_checkpoint_wrapped_module.", ""))
    config = getattr(model, "config", None)
    everything = moe_block_names(config) if config is not None and hasattr(config, "block_types") else names
    if not set(names) <= set(everything):  # a model of other names: its own blocks make the table
        everything = names
    return blocks, [everything.index(n) for n in names], len(everything)


class RouterBalance:
    """Expert loads of one step over the global batch, and the bias update they drive. `pp_group`: the
    ranks holding the other stages of this rank's pipeline (None without one)."""

    def __init__(self, model: nn.Module, token_group: dist.ProcessGroup | None, bias_update_rate: float,
                 aux_loss_coeff: float = 0.0, sequences_per_step: int = 1, pp_group: Any = None) -> None:
        self.blocks, self.rows, self.num_rows = _local_rows(model)
        self.pp_group = pp_group
        self.num_experts = self.blocks[0].experts.num_experts if self.blocks else \
            int(getattr(getattr(model, "config", None), "n_routed_experts", 0) or 0)
        self.device = next((b.device for b in model.buffers()), torch.device("cpu"))
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
        # Every rank of a pipeline takes part in the step's reductions when any stage has MoE blocks.
        return bool(self.num_rows)

    @property
    def needs_token_mask(self) -> bool:
        """Padding differs between meshes (sequences are padded to what cp and sp split by), so the
        loads and the balance loss count real tokens only."""
        return bool(self.blocks)

    def after_micro_batch(self, within: nn.Module | None = None) -> None:
        """Adds the loads of the last forward (of the MoE blocks inside `within` only, e.g. one stage)."""
        inside = None if within is None else {id(m) for m in within.modules()}
        picked = [(b, r) for b, r in zip(self.blocks, self.rows) if inside is None or id(b) in inside]
        if not picked:
            return
        if self.counts is None:
            self.counts = self._table()
        for block, row in picked:
            self.counts[row] += block.experts.tokens_per_expert
        aux = [b.balance_loss for b, _ in picked if any(b is a for a in self.aux_blocks)]
        if aux:
            part = torch.stack(aux).sum().double()
            self.aux_sum = part if self.aux_sum is None else self.aux_sum + part

    def _table(self) -> torch.Tensor:
        return torch.zeros(self.num_rows, self.num_experts, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def after_step(self, taken: bool) -> dict[str, float | list[list[int]]]:
        """The step's load metrics; moves the correction biases if the step was `taken`."""
        counts, self.counts = self.counts, None
        aux_sum, self.aux_sum = self.aux_sum, None
        if self.pp_group is not None:  # a stage without MoE blocks still joins the sums over the pipeline
            counts = self._table() if counts is None else counts
            if self.aux_blocks or self.aux_weight:
                aux_sum = torch.zeros((), dtype=torch.float64, device=self.device) if aux_sum is None else aux_sum
        if counts is None:
            return {}
        for group in (self.token_group, self.pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
                if aux_sum is not None:
                    dist.all_reduce(aux_sum, group=group)
        load = counts.float()
        mean = load.mean(-1, keepdim=True)
        if taken and self.rate:
            for block, row in zip(self.blocks, self.rows):
                block_load, block_mean = load[row], mean[row]
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
