"""Where to cut the model into pipeline stages: by estimated cost, or where the config says.

A Mamba2, attention, MLP and MoE block cost very different amounts, and the first and last stages
carry more than blocks: the embedding sits on the first, the final norm, lm_head, loss and the MTP
layers (with their passes through lm_head) on the last. Equal block counts per stage leave every
stage waiting on the slowest; the split here minimises the slowest stage's estimated time.

Time is the forward + backward FLOPs of one micro-batch (`flops.py`: backward twice the forward);
the embedding's lookup and the norms and loss are elementwise and count as no time. Memory is the
unsharded training state: parameters, gradients and two AdamW moments, in fp32 by default (what the
planner counts per rank before sharding). Among the splits whose slowest stage is fastest, the one
whose largest stage state is smallest wins; both passes are exact dynamic programs over contiguous
partitions (O(stages x blocks^2), milliseconds at any released size).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemotron_recipe.distributed.pipeline_layout import split_problem
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.models.nemotron_v3.flops import (
    block_flops,
    lm_head_flops,
    mtp_flops,
)
from nemotron_recipe.models.nemotron_v3.model import Block, MultiTokenPrediction

# fp32 parameter + gradient + AdamW's two moments.
TRAINING_BYTES_PER_PARAMETER = 16
_GIB = 2**30


class SplitError(ValueError):
    """A split that cannot be made; the message names the field, the value and a fix."""


@dataclass(frozen=True)
class SplitCosts:
    """Estimated cost of each block (forward + backward FLOPs of one micro-batch, training-state bytes),
    and what the first stage (embedding) and the last stage (final norm, lm_head, loss, MTP) add."""

    pattern: str
    block_time: tuple[float, ...]
    block_memory: tuple[int, ...]
    first_time: float
    first_memory: int
    last_time: float
    last_memory: int

    def stage(self, start: int, stop: int, index: int, stages: int) -> tuple[float, int]:
        """(time, memory) of a stage holding blocks [start, stop), the `index`-th of `stages`."""
        time, memory = sum(self.block_time[start:stop]), sum(self.block_memory[start:stop])
        if index == 0:
            time, memory = time + self.first_time, memory + self.first_memory
        if index == stages - 1:
            time, memory = time + self.last_time, memory + self.last_memory
        return time, memory


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_costs(config: NemotronHConfig, *, seq_len: int, micro_batch: int,
                bytes_per_parameter: int = TRAINING_BYTES_PER_PARAMETER) -> SplitCosts:
    """Per-block costs of `config`'s model (block shapes built on the meta device, never allocated)."""
    kinds = dict.fromkeys(config.block_types)
    with torch.device("meta"):
        params = {kind: _numel(Block(config, kind)) for kind in kinds}
        mtp = _numel(MultiTokenPrediction(config)) if config.num_nextn_predict_layers else 0
    flops = {kind: 3 * block_flops(config, kind, micro_batch, seq_len) for kind in kinds}
    head = 3 * lm_head_flops(config, micro_batch, seq_len)
    if config.num_nextn_predict_layers and config.effective_mtp_loss_scale:  # MTP at scale 0 never runs
        head += 3 * mtp_flops(config, micro_batch, seq_len)
    vocab = config.vocab_size * config.hidden_size
    return SplitCosts(
        pattern=config.pattern,
        block_time=tuple(float(flops[k]) for k in config.block_types),
        block_memory=tuple(params[k] * bytes_per_parameter for k in config.block_types),
        first_time=0.0, first_memory=vocab * bytes_per_parameter,
        last_time=float(head), last_memory=(vocab + config.hidden_size + mtp) * bytes_per_parameter,
    )


@dataclass(frozen=True)
class StageSplit:
    """Stages of contiguous blocks: `starts[s]` is the first block of stage s (starts[0] == 0).
    `times` and `memory` are each stage's estimated cost; `equal_slowest_share` is the slowest stage's
    share of the step under the split into equal block counts, for comparison."""

    starts: tuple[int, ...]
    costs: SplitCosts
    times: tuple[float, ...]
    memory: tuple[int, ...]
    equal_slowest_share: float
    by_hand: bool = False

    @property
    def n_stages(self) -> int:
        return len(self.starts)

    @property
    def n_blocks(self) -> int:
        return len(self.costs.pattern)

    def blocks(self, stage: int) -> range:
        stop = self.starts[stage + 1] if stage + 1 < self.n_stages else self.n_blocks
        return range(self.starts[stage], stop)

    @property
    def shares(self) -> tuple[float, ...]:
        """Each stage's share of the summed estimated time."""
        total = sum(self.times) or 1.0
        return tuple(t / total for t in self.times)

    @property
    def slowest_share(self) -> float:
        return max(self.shares)

    @property
    def split_points(self) -> list[int]:
        """The split as `mesh.pp_split` takes it."""
        return list(self.starts[1:])

    def describe(self) -> list[str]:
        """The lines printed at start: each stage's blocks, kinds, time share and state."""
        how = "as mesh.pp_split gives it" if self.by_hand else "balanced by estimated cost"
        lines = [f"pipeline split over {self.n_stages} stages ({how}; mesh.pp_split={self.split_points}):"]
        for s in range(self.n_stages):
            blocks = self.blocks(s)
            kinds = Counter(self.costs.pattern[blocks.start:blocks.stop])
            counts = " ".join(f"{n}{k}" for k, n in kinds.items())
            ends = (["embedding"] if s == 0 else []) + (["head"] if s == self.n_stages - 1 else [])
            extra = f" + {' + '.join(ends)}" if ends else ""
            lines.append(f"  stage {s}: blocks {blocks.start}-{blocks.stop - 1} ({counts}){extra}: "
                         f"{self.shares[s]:.1%} of the time, {self.memory[s] / _GIB:.2f} GiB of state")
        lower = 1 - self.slowest_share / self.equal_slowest_share if self.equal_slowest_share else 0.0
        lines.append(f"  slowest stage {self.slowest_share:.1%} of the time (ideal {1 / self.n_stages:.1%}); "
                     f"equal block counts: {self.equal_slowest_share:.1%} ({lower:.0%} lower here)")
        return lines


def equal_starts(n_blocks: int, stages: int) -> tuple[int, ...]:
    """Equal block counts (the first stages one fewer where they do not divide)."""
    return tuple(i * n_blocks // stages for i in range(stages))


def _evaluate(costs: SplitCosts, starts: Sequence[int]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    bounds = [*starts, len(costs.pattern)]
    per_stage = [costs.stage(bounds[s], bounds[s + 1], s, len(starts)) for s in range(len(starts))]
    return tuple(t for t, _ in per_stage), tuple(m for _, m in per_stage)


def _min_max(costs: SplitCosts, stages: int, key, limit: float = math.inf) -> tuple[float, tuple[int, ...]]:
    """The contiguous split minimising the largest `key(time, memory)` over stages, among those whose
    every stage's time is within `limit`: (that largest value, the starts)."""
    n = len(costs.pattern)
    time_before = [0.0, *itertools.accumulate(costs.block_time)]  # prefix sums: a stage's cost in O(1)
    memory_before = [0, *itertools.accumulate(costs.block_memory)]
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        first, last = s == 1, s == stages
        # stage s-1 holds blocks [i, j): at least one block for each stage before and after it
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == math.inf:
                    continue
                time = time_before[j] - time_before[i] + first * costs.first_time + last * costs.last_time
                if time > limit:
                    continue
                memory = memory_before[j] - memory_before[i] + first * costs.first_memory + last * costs.last_memory
                value = max(best[s - 1][i], key(time, memory))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return best[stages][n], tuple(reversed(starts))


def balanced_starts(costs: SplitCosts, stages: int) -> tuple[int, ...]:
    """The split whose slowest stage is fastest; among those, the one whose largest state is smallest."""
    slowest, starts = _min_max(costs, stages, lambda t, m: t)
    if slowest > 0:
        _, starts = _min_max(costs, stages, lambda t, m: float(m), limit=slowest * (1 + 1e-9))
    return starts


def plan_split(config: NemotronHConfig, stages: int, *, split_points: Sequence[int] | None = None,
               seq_len: int, micro_batch: int) -> StageSplit:
    """The model's blocks over `stages` stages: by hand at `split_points` (each stage's first block
    after the first), else balanced by estimated cost for micro-batches of `micro_batch` x `seq_len`."""
    n = config.num_layers
    if stages < 1 or stages > n:
        raise SplitError(f"{stages} pipeline stages for a model of {n} blocks: every stage needs at least one "
                         f"block. Fix: mesh.pp x mesh.pp_virtual_stages between 1 and {n}.")
    if problem := split_problem(split_points, n, stages):
        raise SplitError(problem)
    costs = split_costs(config, seq_len=seq_len, micro_batch=micro_batch)
    starts = (0, *split_points) if split_points is not None else balanced_starts(costs, stages)
    times, memory = _evaluate(costs, starts)
    equal_times, _ = _evaluate(costs, equal_starts(n, stages))
    equal_share = max(equal_times) / (sum(equal_times) or 1.0)
    return StageSplit(tuple(starts), costs, times, memory, equal_share, by_hand=split_points is not None)
