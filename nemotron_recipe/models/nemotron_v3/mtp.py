"""Multi-token prediction (MTP): extra blocks after the main model that predict tokens further ahead.

Depth k (1-based, `num_nextn_predict_layers` of them) sees, at position t, the hidden state the
previous depth left there (the main model's final-norm output for k = 1) and the embedding of token
t+k, and predicts token t+1+k through the model's own `lm_head`:

    h_k = blocks_k(eh_proj([enorm(embed(token[t+k])) | hnorm(h_{k-1})]))

`blocks_k` is one block per character of `mtp_pattern`; the first carries the fusion (`enorm`,
`hnorm`, `eh_proj`), the last a `final_layernorm`. The layers of all depths sit in one flat list,
`mtp.layers.{depth * len(mtp_pattern) + j}`, which are the names released checkpoints use.

The shifted tokens and targets of every depth are made from the whole sequence before it is split
over context-parallel ranks (`shift_for_mtp`): a rank's zig-zag part of the sequence does not hold
the tokens that follow its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import NemotronHConfig
from .model import Block, RMSNorm

IGNORE_INDEX = -100


class MTPLayer(Block):
    """A block of an MTP depth: the fusion of embedding and hidden state before it (first block of a
    depth), a final norm after it (last block of a depth)."""

    def __init__(self, config: NemotronHConfig, block_type: str, *, fuses: bool, final_norm: bool):
        super().__init__(config, block_type)
        d, eps = config.hidden_size, config.layer_norm_epsilon
        self.fuses, self.has_final_norm = fuses, final_norm
        if fuses:
            self.enorm = RMSNorm(d, eps)
            self.hnorm = RMSNorm(d, eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        if final_norm:
            self.final_layernorm = RMSNorm(d, eps)

    def forward(
        self, x: torch.Tensor, document_ids: torch.Tensor | None = None, embedded: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Fusion and final norm run inside this module's call, so FSDP has gathered their weights.
        if self.fuses:
            x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(x)], dim=-1))
        x = super().forward(x, document_ids=document_ids, token_mask=token_mask)
        return self.final_layernorm(x) if self.has_final_norm else x


class MultiTokenPrediction(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        per_depth = len(config.mtp_pattern)
        self.depths, self.per_depth = config.num_nextn_predict_layers, per_depth
        self.layers = nn.ModuleList(
            MTPLayer(config, kind, fuses=i % per_depth == 0, final_norm=i % per_depth == per_depth - 1)
            for i, kind in enumerate(config.mtp_block_types)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        shifted_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        document_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """hidden [b, l, d] (the main model's output), shifted_ids [b, l, depths] (`shift_for_mtp`)
        -> each depth's hidden states [b, l, d]. `token_mask`: the main sequence's real tokens, which
        MoE blocks count their loads over (positions, like the padding, are the main sequence's)."""
        out = []
        for depth in range(self.depths):
            embedded = embed(shifted_ids[..., depth].contiguous())
            for j in range(self.per_depth):
                layer = self.layers[depth * self.per_depth + j]
                hidden = layer(hidden, document_ids=document_ids, token_mask=token_mask,
                               embedded=embedded if j == 0 else None)
            out.append(hidden)
        return out


def _shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """t [b, l] moved k positions to the left, the last k filled with `fill`."""
    out = torch.full_like(t, fill)
    n = max(t.shape[1] - k, 0)
    out[:, :n] = t[:, k:k + n]
    return out


def shift_for_mtp(
    input_ids: torch.Tensor, targets: torch.Tensor, depths: int, document_ids: torch.Tensor | None = None,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each depth's input tokens and targets, [b, l, depths] each, from whole sequences.

    `targets` are pre-shifted (targets[t] is token t+1, or IGNORE_INDEX), so depth k's target at t is
    targets[t+k], token t+1+k. A target past the end of the row or in another packed document than
    position t is IGNORE_INDEX; the input token there is `pad_id` (never the source of a trained target).
    """
    ids, tgts = [], []
    for k in range(1, depths + 1):
        tgt = _shift_left(targets, k, IGNORE_INDEX)
        if document_ids is not None:
            tgt = tgt.masked_fill(_shift_left(document_ids, k, -1) != document_ids, IGNORE_INDEX)
        ids.append(_shift_left(input_ids, k, pad_id))
        tgts.append(tgt)
    return torch.stack(ids, dim=-1), torch.stack(tgts, dim=-1)
