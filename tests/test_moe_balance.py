"""Aux-loss-free balancing: expert loads over a step's micro-batches, the imbalance metric and the
correction-bias update they drive."""

from __future__ import annotations

import pytest
import torch

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.moe_balance import RouterBalance


def _model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return NemotronHForCausalLM(NemotronHConfig(pattern="EME", n_routed_experts=4, num_experts_per_tok=2))


def test_loads_add_up_over_micro_batches_and_move_the_bias_against_the_load():
    model = _model()
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.5)
    first, second = balance.blocks
    for loads in ([6, 2, 0, 0], [2, 2, 4, 0]):
        first.experts.tokens_per_expert = torch.tensor(loads)
        second.experts.tokens_per_expert = torch.tensor([2, 2, 2, 2])
        balance.after_micro_batch()
    metrics = balance.after_step(taken=True)
    # Block 1's loads [8, 4, 4, 0]: mean 4, busiest 8 -> 2.0; block 2 is balanced (1.0).
    assert metrics["moe_load_imbalance"] == pytest.approx(2.0)
    assert metrics["expert_load"] == [[8, 4, 4, 0], [4, 4, 4, 4]]
    assert first.gate.e_score_correction_bias.tolist() == [-0.5, 0.0, 0.0, 0.5]
    assert second.gate.e_score_correction_bias.tolist() == [0.0] * 4
    assert balance.counts is None  # the next step counts afresh


def test_a_step_not_taken_leaves_the_bias_and_rate_zero_only_measures():
    model = _model()
    for rate, taken in ((0.5, False), (0.0, True)):
        balance = RouterBalance(model, token_group=None, bias_update_rate=rate)
        for block in balance.blocks:
            block.experts.tokens_per_expert = torch.tensor([3, 1, 0, 0])
        balance.after_micro_batch()
        assert balance.after_step(taken=taken)["moe_load_imbalance"] == pytest.approx(3.0)
        assert all(not b.gate.e_score_correction_bias.any() for b in balance.blocks)


def test_a_model_without_moe_blocks_has_nothing_to_balance():
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-"))
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.1)
    assert not balance and balance.after_step(taken=True) == {}
