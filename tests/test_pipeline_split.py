"""Pipeline stages split by estimated cost: block costs by kind, the exact min-max split (against every
contiguous split of a small model), the gain over equal block counts on Nano's pattern, hand splits."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.models.nemotron_v3.flops import lm_head_flops, mtp_flops
from nemotron_recipe.training.pipeline.split import (
    TRAINING_BYTES_PER_PARAMETER,
    SplitError,
    equal_starts,
    plan_split,
    split_costs,
)

NANO3 = NemotronHConfig.from_preset("nemotron3_nano_30b_a3b")


def _per_kind(config: NemotronHConfig, seq_len: int) -> tuple[dict[str, float], dict[str, int]]:
    costs = split_costs(config, seq_len=seq_len, micro_batch=1)
    return dict(zip(config.pattern, costs.block_time)), dict(zip(config.pattern, costs.block_memory))


def test_costs_per_kind_are_ordered_as_the_shapes_say() -> None:
    time, memory = _per_kind(NANO3, 2048)
    # 6 of 128 experts plus a shared one outweigh a Mamba2 block, which outweighs a GQA block at 2K tokens
    assert time["E"] > time["M"] > time["*"]
    assert memory["E"] > 30 * memory["M"] and memory["M"] > memory["*"]
    # attention's quadratic term overtakes the others at long sequences; the rest grow linearly
    long_time, _ = _per_kind(NANO3, 32768)
    assert long_time["*"] > long_time["E"] > long_time["M"]
    assert long_time["M"] == pytest.approx(16 * time["M"], rel=0.01)
    dense_time, _ = _per_kind(NemotronHConfig.from_preset("nemotron_h_8b"), 8192)
    assert dense_time["-"] > dense_time["M"] > dense_time["*"]


def test_the_ends_carry_the_embedding_head_and_mtp() -> None:
    costs = split_costs(NANO3, seq_len=1024, micro_batch=2)
    vocab = NANO3.vocab_size * NANO3.hidden_size * TRAINING_BYTES_PER_PARAMETER
    assert (costs.first_time, costs.first_memory) == (0.0, vocab)
    assert costs.last_time == 3 * lm_head_flops(NANO3, 2, 1024)
    mtp = dataclasses.replace(NANO3, num_nextn_predict_layers=1, mtp_pattern="*E")
    with_mtp = split_costs(mtp, seq_len=1024, micro_batch=2)
    assert with_mtp.last_time == costs.last_time + 3 * mtp_flops(mtp, 2, 1024)
    assert with_mtp.last_memory > costs.last_memory + costs.block_memory[1]  # at least its MoE block's state
    untrained = split_costs(dataclasses.replace(mtp, mtp_loss_scale=0.0), seq_len=1024, micro_batch=2)
    assert untrained.last_time == costs.last_time and untrained.last_memory == with_mtp.last_memory


def _every_split(costs, n: int, stages: int):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        starts = (0, *cuts)
        bounds = [*starts, n]
        yield starts, [costs.stage(bounds[s], bounds[s + 1], s, stages) for s in range(stages)]


@pytest.mark.parametrize("pattern, stages", [("MEM*EMEM-E*M", 3), ("M*-EEEEM-*MM", 4), ("MMMMMMMMME", 2)])
def test_the_balanced_split_is_the_best_contiguous_one(pattern: str, stages: int) -> None:
    config = dataclasses.replace(NemotronHConfig.from_preset("tiny"), pattern=pattern)
    split = plan_split(config, stages, seq_len=256, micro_batch=1)
    candidates = list(_every_split(split.costs, len(pattern), stages))
    fastest = min(max(t for t, _ in stage) for _, stage in candidates)
    assert max(split.times) == pytest.approx(fastest, rel=1e-12)
    # among the fastest, the smallest largest state
    tied = [max(m for _, m in stage) for _, stage in candidates
            if max(t for t, _ in stage) <= fastest * (1 + 1e-9)]
    assert max(split.memory) == min(tied)
    assert split.slowest_share <= split.equal_slowest_share + 1e-12
    assert [b for s in range(stages) for b in split.blocks(s)] == list(range(len(pattern)))


@pytest.mark.parametrize("preset", ["nemotron3_nano_30b_a3b", "nemotron_nano_9b_v2", "nemotron3_super_120b_a12b",
                                    "nemotron_h_56b"])
def test_never_slower_than_equal_counts(preset: str) -> None:
    config = NemotronHConfig.from_preset(preset)
    for stages in (2, 4, 8):
        split = plan_split(config, stages, seq_len=2048, micro_batch=1)
        assert split.slowest_share <= split.equal_slowest_share
        assert min(len(split.blocks(s)) for s in range(stages)) >= 1


def test_nano_split_by_cost_beats_equal_counts() -> None:
    """Nano's 52 blocks over 4 stages: equal counts leave lm_head's 4.3 TFLOP on a full last stage."""
    four = plan_split(NANO3, 4, seq_len=2048, micro_batch=1)
    assert 1 - four.slowest_share / four.equal_slowest_share >= 0.15  # 21.7% lower (26.1% vs 33.4%)
    assert four.slowest_share < 0.27
    two = plan_split(NANO3, 2, seq_len=2048, micro_batch=1)
    assert 1 - two.slowest_share / two.equal_slowest_share >= 0.05  # 8.7% lower (51.1% vs 55.9%)
    assert len(four.blocks(3)) < len(four.blocks(0))  # the head's stage holds fewer blocks


def test_hand_split() -> None:
    split = plan_split(NANO3, 2, split_points=[26], seq_len=2048, micro_batch=1)
    assert split.starts == (0, 26) and split.by_hand and split.split_points == [26]
    assert split.blocks(0) == range(26) and split.blocks(1) == range(26, 52)
    assert split.slowest_share == pytest.approx(split.equal_slowest_share)  # [26] is the equal split
    assert equal_starts(52, 2) == (0, 26) and equal_starts(7, 3) == (0, 2, 4)
    lines = split.describe()
    assert lines[0] == "pipeline split over 2 stages (as mesh.pp_split gives it; mesh.pp_split=[26]):"
    assert lines[1].startswith("  stage 0: blocks 0-25 (") and "+ embedding: " in lines[1]
    assert lines[2].startswith("  stage 1: blocks 26-51 (") and "+ head: " in lines[2]
    assert f"{split.shares[1]:.1%} of the time" in lines[2] and "GiB of state" in lines[2]
    assert "equal block counts: " in lines[3]


@pytest.mark.parametrize("stages, points, needle", [
    (2, [26, 30], "mesh.pp_split=[26, 30]: 2 split points for 2 stages"),
    (3, [30, 20], "must be strictly increasing"),
    (2, [52], "must lie in [1, 51]"),
    (53, None, "53 pipeline stages for a model of 52 blocks"),
])
def test_bad_hand_splits_are_refused(stages: int, points, needle: str) -> None:
    with pytest.raises(SplitError, match="Fix:") as e:
        plan_split(NANO3, stages, split_points=points, seq_len=2048, micro_batch=1)
    assert needle in str(e.value)
