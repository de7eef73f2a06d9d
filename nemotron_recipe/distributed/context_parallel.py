"""Context parallel in plain PyTorch (CPU/gloo and GPU/NCCL alike): the sequence layout and the
collectives that move a sequence across the group. What a model does with them lives with its mixers.

Every sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r ("zig-zag"), so
under a causal mask each rank does the same amount of attention work.

Two exchanges give a mixer what a sequence shard lacks:
- `all_gather_sequence`: every rank's tokens, in time order (attention keys and values);
- `sequence_to_heads` / `heads_to_sequence`: an all-to-all that trades the sequence shard
  [b, L/cp, H, w] for a head shard [b, L, H/cp, w] in time order, and back (a scan that is
  sequential in time but independent across heads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._guards import detect_fake_mode

from .plan import seq_len_problem

T = TypeVar("T")


@dataclass
class ContextParallel:
    """The context-parallel group a mixer runs in."""

    group: dist.ProcessGroup
    rank: int
    size: int


# ------------------------------------------------------------------------------- sequence layout
def device_cached(fn: Callable[..., T]) -> Callable[..., T]:
    """Caches index tensors made on the device they index, once per argument set: made on the host
    they would be copied to the GPU on every call, and again on every activation-checkpoint
    recompute. They are read only. Tensors made under a fake-tensor mode (the memory planner's trace)
    are not kept: a later real run with the same arguments would index with them."""
    cached = lru_cache(maxsize=256)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any) -> T:
        return fn(*args) if detect_fake_mode() is not None else cached(*args)

    wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return wrapper


@device_cached
def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions held by `rank`: chunk `rank`, then chunk `2*cp-1-rank`, of 2*cp chunks."""
    if problem := seq_len_problem(seq_len, cp):
        raise ValueError(problem)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def zigzag_chunks(cp: ContextParallel) -> tuple[int, int]:
    """The indices, among 2*cp chunks, of this rank's first and second halves."""
    return cp.rank, 2 * cp.size - 1 - cp.rank


def shard_sequence(t: torch.Tensor, cp: ContextParallel | None, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag part of a full-length tensor (inputs, targets, masks)."""
    if cp is None or cp.size == 1:
        return t
    return t.index_select(dim, zigzag_positions(t.shape[dim], cp.size, cp.rank, t.device))


@device_cached
def _gathered_positions(local_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Global position of each element of a rank-ordered gather of the local sequences."""
    return torch.cat([zigzag_positions(local_len * cp, cp, r, device) for r in range(cp)])


@device_cached
def _time_order(local_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Indices that put a rank-ordered gather of the local sequences in time order."""
    return torch.argsort(_gathered_positions(local_len, cp, device))


def _to_time_order(local_len: int, cp: ContextParallel, device: torch.device) -> torch.Tensor:
    return _time_order(local_len, cp.size, device)


# ------------------------------------------------------------------------------- gathers
def gather_sequence(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The full sequence, in time order, of a [b, l] tensor that needs no gradient (document ids)."""
    local_len = t.shape[1]
    out = torch.empty(cp.size * local_len, t.shape[0], dtype=t.dtype, device=t.device)
    # Recent torch names it all_gather_single and deprecates all_gather_into_tensor; 2.11 has only the latter.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.t().contiguous(), group=cp.group)
    return out.index_select(0, _to_time_order(local_len, cp, t.device)).t()


def all_gather_sequence(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[l, ...] local tokens (sequence first) -> [cp*l, ...] every rank's tokens in time order, with
    autograd: the gradient of each gathered token goes back to the rank that holds it."""
    gathered = funcol.all_gather_single_autograd(t.contiguous(), gather_dim=0, group=cp.group)
    return gathered.index_select(0, _to_time_order(t.shape[0], cp, t.device))


# ------------------------------------------------------------------------------- sequence <-> heads
def _all_to_all(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Exchange equal slices along dim 0 (slice j goes to rank j), with autograd."""
    return funcol.all_to_all_single_autograd(t.contiguous(), None, None, cp.group)


def heads_of_rank(num_heads: int, cp: ContextParallel) -> slice:
    """The heads (of `num_heads`, in order) that `sequence_to_heads` hands this rank."""
    per_rank = num_heads // cp.size
    return slice(cp.rank * per_rank, (cp.rank + 1) * per_rank)


def sequence_to_heads(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[b, l, H, w] local tokens of all heads -> [b, cp*l, H/cp, w] all tokens, in time order, of
    the heads `heads_of_rank(H, cp)`. H must divide by cp."""
    heads = t.shape[2]
    # [b, l, H, w] -> [cp, b, l, H/cp, w] (slice j for rank j) -> exchange -> [b, cp*l, H/cp, w].
    sent = t.unflatten(2, (cp.size, heads // cp.size)).permute(2, 0, 1, 3, 4)
    got = _all_to_all(sent, cp).permute(1, 0, 2, 3, 4).flatten(1, 2)
    return got.index_select(1, _to_time_order(t.shape[1], cp, got.device))


def heads_to_sequence(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: [b, L, H/cp, w] in time order -> [b, L/cp, H, w] of this
    rank's tokens, heads in order."""
    local_len = t.shape[1] // cp.size
    t = t.index_select(1, _gathered_positions(local_len, cp.size, t.device))  # the ranks' zig-zag order
    back = _all_to_all(t.unflatten(1, (cp.size, local_len)).permute(1, 0, 2, 3, 4), cp)
    return back.permute(1, 2, 0, 3, 4).flatten(2, 3)
