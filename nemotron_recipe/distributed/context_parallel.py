"""Context parallel for Mamba2 and attention in plain PyTorch (CPU/gloo and GPU/NCCL alike).

Every sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r ("zig-zag"), so
under a causal mask each rank does the same amount of attention work.

- Attention: keys and values of all ranks are gathered in one autograd-aware collective and put
  back in time order; each of a rank's two query chunks then attends the keys up to its end with a
  plain causal kernel (no dense mask, so memory stays linear in the sequence).
- Mamba2: the scan is sequential in time but independent across heads, so the mixer trades its
  sequence shard for a head shard: an all-to-all turns [L/cp tokens, all heads] into
  [L tokens, heads/cp]; the zig-zag order is undone, the causal conv and the scan run over the
  whole sequence for those heads, and everything goes back the same way. When a rank holds fewer
  groups than cp, each group is split by heads and its B and C are repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from nemotron_recipe.models.nemotron_v3.ops import causal_attention


@dataclass
class ContextParallel:
    """The context-parallel group a mixer runs in, and the sequence mixing it does across it."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def attention(self, q, k, v, document_ids=None):
        return attention(q, k, v, self, document_ids)

    def mamba_conv_and_scan(self, mixer, xbc, dt, document_ids=None):
        return mamba_conv_and_scan(mixer, xbc, dt, self, document_ids)


# ------------------------------------------------------------------------------- sequence layout
@lru_cache(maxsize=64)
def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by `rank`: chunk `rank`, then chunk `2*cp-1-rank`, of 2*cp chunks."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"trainer.seq_len={seq_len} is not divisible by 2 x mesh.cp = {2 * cp}, which context parallel "
            f"needs for its load-balanced chunks. Fix: use a multiple of {2 * cp}."
        )
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard_sequence(t: torch.Tensor, cp: ContextParallel | None, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag part of a full-length tensor (inputs, targets, masks)."""
    if cp is None or cp.size == 1:
        return t
    return t.index_select(dim, zigzag_positions(t.shape[dim], cp.size, cp.rank).to(t.device))


@lru_cache(maxsize=64)
def _gathered_positions(local_len: int, cp: int) -> torch.Tensor:
    """Global position of each element of a rank-ordered gather of the local sequences."""
    return torch.cat([zigzag_positions(local_len * cp, cp, r) for r in range(cp)])


# ------------------------------------------------------------------------------- attention
def gather_sequence(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The full sequence, in time order, of a [b, l] tensor that needs no gradient (document ids)."""
    local_len = t.shape[1]
    out = torch.empty(cp.size * local_len, t.shape[0], dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.t().contiguous(), group=cp.group)
    to_time = torch.argsort(_gathered_positions(local_len, cp.size)).to(t.device)
    return out.index_select(0, to_time).t()


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact causal attention of local queries over all ranks' keys. q [b,hq,l,d], k/v [b,hkv,l,d];
    `document_ids` [b,l] (local, like q) confine each query to its packed document."""
    local_len = q.shape[2]
    c = local_len // 2
    # One collective for both: gathering k and v in separate autograd calls has given wrong gradients.
    # The collective gathers along dim 0, so the sequence goes first: [l, 2, b, hkv, d].
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()
    kv = funcol.all_gather_single_autograd(kv, gather_dim=0, group=cp.group)
    to_time = torch.argsort(_gathered_positions(local_len, cp.size)).to(q.device)
    k_all, v_all = kv.index_select(0, to_time).permute(1, 2, 3, 0, 4).unbind(0)
    docs = None if document_ids is None else gather_sequence(document_ids, cp)
    outs = []
    for part, chunk in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
        # Chunk `chunk` attends keys [0, end) causally. Zero queries in front make that a square causal
        # problem, which the fused kernels run without materialising a mask; their rows are dropped and,
        # with no gradient flowing into them, add nothing to dK or dV.
        end = (chunk + 1) * c
        q_chunk = F.pad(q[:, :, part * c:(part + 1) * c], (0, 0, end - c, 0))
        if docs is None:
            out = F.scaled_dot_product_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end], is_causal=True,
                                                 enable_gqa=True)
        else:
            # The padded queries take the documents of the positions they stand in for, so every
            # row keeps at least its own key.
            out = causal_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end], docs[:, :end])
        outs.append(out[:, :, end - c:])
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------------------- Mamba2
def _all_to_all(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Exchange equal slices along dim 0 (slice j goes to rank j), with autograd."""
    return funcol.all_to_all_single_autograd(t.contiguous(), None, None, cp.group)


def check_mamba(heads: int, groups: int, cp: int) -> None:
    """heads [and groups] are this rank's after tensor parallel."""
    if heads % cp or (groups % cp and cp % groups):
        raise ValueError(
            f"mesh.cp={cp} cannot split the Mamba2 heads of a rank ({heads} heads in {groups} groups after tensor "
            "parallel): heads must divide by cp, and groups must divide by cp or cp by groups. "
            "Fix: choose mesh.cp (and mesh.tp) accordingly."
        )


def mamba_conv_and_scan(
    mixer, xbc: torch.Tensor, dt: torch.Tensor, cp: ContextParallel, document_ids: torch.Tensor | None = None
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
    packed = torch.cat([x, B, C, dt], dim=-1)  # [b, l, V, rv*p + 2n + rv]
    v = packed.shape[2]

    # [b, l, V, w] -> [cp, b, l, V/cp, w] (slice j for rank j) -> exchange -> [b, cp*l, V/cp, w].
    sent = packed.unflatten(2, (cp.size, v // cp.size)).permute(2, 0, 1, 3, 4)
    got = _all_to_all(sent, cp).permute(1, 0, 2, 3, 4).flatten(1, 2)
    order = _gathered_positions(l, cp.size).to(got.device)
    to_time = torch.argsort(order)
    got = got.index_select(1, to_time)  # true time order

    mine = slice(cp.rank * (v // cp.size), (cp.rank + 1) * (v // cp.size))
    channels, heads = _virtual_channels(mixer, g, rep, mine)
    xbc_v, dt_v = got.split([rv * p + 2 * n, rv], dim=-1)
    docs = None if document_ids is None else gather_sequence(document_ids, cp)
    y = mixer.conv_and_scan(xbc_v, dt_v, channels=channels, heads=heads, document_ids=docs)  # [b, L, V/cp, rv*p]

    y = y.index_select(1, order)  # back to the ranks' zig-zag order
    back = _all_to_all(y.unflatten(1, (cp.size, l)).permute(1, 0, 2, 3, 4), cp)
    y = back.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [b, l, V, rv*p], virtual groups in head order
    return y.reshape(b, l, g, r * p)


def _virtual_channels(mixer, g: int, rep: int, mine: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv channels (of the rank's local, group-major conv weight) and heads of the virtual groups `mine`."""
    r, p, n = mixer.heads_per_group, mixer.head_dim, mixer.state_size
    rv = r // rep
    width = r * p + 2 * n
    channels, heads = [], []
    for vg in range(mine.start, mine.stop):
        parent, part = divmod(vg, rep)
        base = parent * width
        channels += [
            torch.arange(base + part * rv * p, base + (part + 1) * rv * p),
            torch.arange(base + r * p, base + r * p + 2 * n),
        ]
        heads.append(torch.arange(parent * r + part * rv, parent * r + (part + 1) * rv))
    return torch.cat(channels), torch.cat(heads)
