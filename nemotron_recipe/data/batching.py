"""Deterministic global-batch planning, collation and validation sharding.

The global batch size is fixed by config and split over data-parallel ranks and gradient
accumulation, so every parallel layout consumes exactly the same examples per optimizer step
and a run's data order does not depend on how many GPUs it happens to use.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import lru_cache

import torch

from .examples import IGNORE_INDEX, SFTExamples


@lru_cache(maxsize=4)
def _epoch_permutation(num_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed + epoch)
    return tuple(torch.randperm(num_examples, generator=generator).tolist())


def _nearest_multiples(value: int, unit: int) -> list[int]:
    lower = (value // unit) * unit
    return sorted({m for m in (lower, lower + unit) if m > 0})


class GlobalBatchPlan:
    """Which example indices each data-parallel rank consumes at each optimizer step.

    The global stream is one seeded permutation per epoch (seed ``seed + epoch``), read
    sequentially ``global_batch_size`` at a time, running across epoch boundaries without
    dropping or repeating anything. Rank ``r`` takes the ``r``-th contiguous slice of each
    step's global batch and splits it into ``grad_accum_steps`` micro-batches in order.
    Everything is a pure function of the step, so a resumed run can start at any step.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if num_examples <= 0:
            raise ValueError(f"the training set is empty (num_examples={num_examples}); nothing to batch")
        if global_batch_size <= 0 or micro_batch_size <= 0:
            raise ValueError(
                f"trainer.global_batch_size ({global_batch_size}) and trainer.micro_batch_size "
                f"({micro_batch_size}) must both be positive"
            )
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"invalid data-parallel layout: dp_rank={dp_rank}, dp_size={dp_size}")
        unit = micro_batch_size * dp_size
        if global_batch_size % unit != 0:
            per_rank = global_batch_size // dp_size if global_batch_size % dp_size == 0 else None
            micro_options = (
                [m for m in range(1, per_rank + 1) if per_rank % m == 0] if per_rank is not None else []
            )
            hint = f"set trainer.global_batch_size to {' or '.join(map(str, _nearest_multiples(global_batch_size, unit)))}"
            if micro_options:
                nearest_micro = min(micro_options, key=lambda m: (abs(m - micro_batch_size), m))
                hint += f", or trainer.micro_batch_size to {nearest_micro}"
            raise ValueError(
                f"trainer.global_batch_size ({global_batch_size}) must be divisible by "
                f"trainer.micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_size}) = {unit}, "
                f"so every rank runs the same number of whole micro-batches per step; {hint}."
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def steps_per_epoch(self) -> float:
        return self.num_examples / self.global_batch_size

    def global_indices_for_step(self, step: int) -> list[int]:
        """All ``global_batch_size`` example indices of optimizer step ``step``, over all ranks."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        n = self.num_examples
        start = step * self.global_batch_size
        stop = start + self.global_batch_size
        indices: list[int] = []
        for epoch in range(start // n, (stop - 1) // n + 1):
            perm = _epoch_permutation(n, self.seed, epoch)
            lo = max(start - epoch * n, 0)
            hi = min(stop - epoch * n, n)
            indices.extend(perm[lo:hi])
        return indices

    def indices_for_step(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (lists of example indices) for optimizer step ``step``."""
        per_rank = self.global_batch_size // self.dp_size
        mine = self.global_indices_for_step(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        m = self.micro_batch_size
        return [mine[i : i + m] for i in range(0, per_rank, m)]


def padded_length(examples: SFTExamples, indices: Sequence[int], seq_len: int, multiple: int = 1) -> int:
    """The batch's longest row rounded up to `multiple`, at most `seq_len` (itself a multiple)."""
    longest = max((len(examples.input_ids[idx]) for idx in indices), default=1)
    return min(-(-max(longest, 1) // multiple) * multiple, seq_len)


def collate(
    examples: SFTExamples, indices: Sequence[int], seq_len: int, pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Stack the given examples into ``[len(indices), length]`` tensors, ``length`` being the
    batch's longest row rounded up to ``multiple`` (see ``padded_length``).

    Padding only ever trails the real tokens, is never trained on (targets are ``-100``) and the
    model is causal, so a batch trains exactly as if padded to ``seq_len`` while computing no more
    positions than its longest row needs. ``multiple`` is what sequence/context parallel split
    by (``ParallelPlan.seq_len_divisor``); ``multiple=seq_len`` pads every batch to ``seq_len``.
    Ranks that read the same rows (one data-parallel group) thus get the same length.
    Packed examples also get ``document_ids``: document ``j`` of a row is marked ``j`` and the
    row's padding gets the next id, so no real document attends to or carries state from it.
    Unpacked examples get none, which keeps the model on its faster single-document path.
    """
    for idx in indices:
        if len(examples.input_ids[idx]) > seq_len:
            raise ValueError(
                f"example {idx} has {len(examples.input_ids[idx])} tokens but seq_len is {seq_len}; "
                "tokenize with the same seq_len that batches are collated to"
            )
    length = padded_length(examples, indices, seq_len, multiple)
    input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
    targets = torch.full((len(indices), length), IGNORE_INDEX, dtype=torch.long)
    document_ids = torch.zeros((len(indices), length), dtype=torch.long) if examples.packed else None
    for row, idx in enumerate(indices):
        ids = examples.input_ids[idx]
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        targets[row, : len(ids)] = torch.tensor(examples.targets[idx], dtype=torch.long)
        if document_ids is not None:
            lengths = examples.document_lengths[idx]
            marks = torch.arange(len(lengths) + 1).repeat_interleave(torch.tensor([*lengths, length - len(ids)]))
            document_ids[row] = marks
    batch = {"input_ids": input_ids, "targets": targets}
    if document_ids is not None:
        batch["document_ids"] = document_ids
    return batch


class ValBatches:
    """Sized, re-iterable sequence of this rank's validation batches (see ``val_batches``)."""

    def __init__(self, examples: SFTExamples, shard: list[int], num_batches: int, micro_batch_size: int,
                 seq_len: int, pad_id: int, multiple: int = 1) -> None:
        self.examples = examples
        self.shard = shard
        self.num_batches = num_batches
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.multiple = multiple

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        m = self.micro_batch_size
        for b in range(self.num_batches):
            indices = self.shard[b * m : (b + 1) * m]
            batch = collate(self.examples, indices, self.seq_len, self.pad_id, self.multiple)
            missing = m - len(indices)
            if missing:
                fill = {"input_ids": self.pad_id, "targets": IGNORE_INDEX, "document_ids": 0}
                batch = {
                    k: torch.cat([v, torch.full((missing, v.shape[1]), fill[k], dtype=torch.long)])
                    for k, v in batch.items()
                }
            yield batch


def val_batches(
    examples: SFTExamples,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seq_len: int,
    pad_id: int,
    multiple: int = 1,
) -> ValBatches:
    """This rank's share of the whole validation set, as ``[micro_batch_size, length]`` batches,
    each padded like ``collate`` pads (to its longest row, rounded up to ``multiple``).

    Rank ``r`` takes examples ``r, r + dp_size, r + 2*dp_size, ...`` so shard sizes differ by at
    most one. Every rank yields the same number of batches, topped up with fully masked rows,
    so collectives inside the eval loop stay in lockstep. Those rows carry no target tokens:
    average the loss as (sum of token losses) / (number of target tokens) across ranks.
    """
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"invalid data-parallel layout: dp_rank={dp_rank}, dp_size={dp_size}")
    shard = list(range(dp_rank, len(examples), dp_size))
    largest_shard = math.ceil(len(examples) / dp_size)
    num_batches = math.ceil(largest_shard / micro_batch_size)
    return ValBatches(examples, shard, num_batches, micro_batch_size, seq_len, pad_id, multiple)
