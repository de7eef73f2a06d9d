"""The Nemotron-H mixers under context parallel: each rank holds a zig-zag part of every sequence
(nemotron_recipe/distributed/context_parallel.py) and the mixers exchange what they need.

- Attention: keys and values of all ranks are gathered in one autograd-aware collective; each of a
  rank's two query chunks then attends the keys up to its end with a plain causal kernel (no dense
  mask, so memory stays linear in the sequence).
- Mamba2: the scan is sequential in time but independent across heads, so the mixer trades its
  sequence shard for a head shard, runs the causal conv and the scan over the whole sequence for
  those heads, and trades back. The exchange hands out whole groups, so that a group's heads and its
  B and C stay together; when a rank holds fewer groups than cp, each group is split by heads into
  virtual groups that each carry the group's B and C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemotron_recipe.distributed.context_parallel import (
    ContextParallel,
    all_gather_sequence,
    device_cached,
    gather_sequence,
    heads_of_rank,
    heads_to_sequence,
    sequence_to_heads,
    zigzag_chunks,
)

from .ops import causal_attention

__all__ = ["check_mamba", "context_parallel_attention", "context_parallel_conv_and_scan"]


# ------------------------------------------------------------------------------- attention
def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact causal attention of local queries over all ranks' keys. q [b,hq,l,d], k/v [b,hkv,l,d];
    `document_ids` [b,l] (local, like q) confine each query to its packed document."""
    c = q.shape[2] // 2
    # One collective for both: gathering k and v in separate autograd calls has given wrong gradients.
    # The collective gathers along dim 0, so the sequence goes first: [l, 2, b, hkv, d].
    kv = all_gather_sequence(torch.stack([k, v]).permute(3, 0, 1, 2, 4), cp)
    k_all, v_all = kv.permute(1, 2, 3, 0, 4).unbind(0)
    docs = None if document_ids is None else gather_sequence(document_ids, cp)
    outs = []
    for part, chunk in enumerate(zigzag_chunks(cp)):
        # Chunk `chunk` attends keys [0, end) causally. Zero queries in front make that a square causal
        # problem, which the fused kernels run without materialising a mask; their rows are dropped and,
        # with no gradient flowing into them, add nothing to dK or dV.
        end = (chunk + 1) * c
        q_chunk = F.pad(q[:, :, part * c:(part + 1) * c], (0, 0, end - c, 0))
        if docs is None:
            out = causal_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end])
        else:
            # The padded queries take the documents of the positions they stand in for, so every
            # row keeps at least its own key.
            out = causal_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end], docs[:, :end])
        outs.append(out[:, :, end - c:])
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------------------- Mamba2
def check_mamba(heads: int, groups: int, cp: int) -> None:
    """heads and groups are a rank's after tensor parallel."""
    if heads % cp or (groups % cp and cp % groups):
        raise ValueError(
            f"mesh.cp={cp} cannot split the Mamba2 heads of a rank ({heads} heads in {groups} groups after tensor "
            "parallel): heads must divide by cp, and groups must divide by cp or cp by groups. "
            "Fix: choose mesh.cp (and mesh.tp) accordingly."
        )


def context_parallel_conv_and_scan(
    mixer: nn.Module, xbc: torch.Tensor, dt: torch.Tensor, cp: ContextParallel,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The context-parallel twin of `Mamba2Mixer.conv_and_scan`: xbc [b,l,g,conv_group] and dt [b,l,g,r]
    (and `document_ids` [b,l]) of the local tokens -> y [b,l,g,d_group] of the local tokens."""
    b, l, g, _ = xbc.shape
    r, p, n = mixer.heads_per_group, mixer.head_dim, mixer.state_size
    check_mamba(g * r, g, cp.size)
    # Virtual groups: each rank gets whole ones. With fewer groups than ranks, a group's heads are
    # split into `rep` parts that each carry the group's B and C.
    rep = max(1, cp.size // g)
    rv = r // rep
    x, B, C = xbc.split([r * p, n, n], dim=-1)
    if rep > 1:
        x = x.reshape(b, l, g * rep, rv * p)
        B = B.repeat_interleave(rep, dim=2)
        C = C.repeat_interleave(rep, dim=2)
        dt = dt.reshape(b, l, g * rep, rv)
    packed = torch.cat([x, B, C, dt], dim=-1)  # [b, l, V, rv*p + 2n + rv], V = g*rep virtual groups

    got = sequence_to_heads(packed, cp)  # [b, L, V/cp, ...] in time order
    channels, heads = _virtual_channels(mixer, rep, heads_of_rank(packed.shape[2], cp), packed.device)
    xbc_v, dt_v = got.split([rv * p + 2 * n, rv], dim=-1)
    docs = None if document_ids is None else gather_sequence(document_ids, cp)
    y = mixer.conv_and_scan(xbc_v, dt_v, channels=channels, heads=heads, document_ids=docs)  # [b, L, V/cp, rv*p]

    y = heads_to_sequence(y, cp)  # [b, l, V, rv*p], virtual groups in head order
    return y.reshape(b, l, g, r * p)


def _virtual_channels(mixer: nn.Module, rep: int, mine: slice,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv channels (of the rank's local, group-major conv weight) and heads of the virtual groups
    `mine`, as index tensors on `device` (made once, see `_virtual_indices`)."""
    return _virtual_indices(mixer.heads_per_group, mixer.head_dim, mixer.state_size, rep, mine.start, mine.stop,
                            device)


@device_cached
def _virtual_indices(r: int, p: int, n: int, rep: int, start: int, stop: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Made on the device and cached: host-made indices would be copied for every layer's call and
    again on every activation-checkpoint recompute. Read only."""
    rv = r // rep
    width = r * p + 2 * n
    channels, heads = [], []
    for vg in range(start, stop):
        parent, part = divmod(vg, rep)
        base = parent * width
        channels += [
            torch.arange(base + part * rv * p, base + (part + 1) * rv * p, device=device),
            torch.arange(base + r * p, base + r * p + 2 * n, device=device),
        ]
        heads.append(torch.arange(parent * r + part * rv, parent * r + (part + 1) * rv, device=device))
    return torch.cat(channels), torch.cat(heads)
