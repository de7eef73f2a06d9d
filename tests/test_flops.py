"""FLOP counts of the benchmark harness against hand counts."""

from __future__ import annotations

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.models.nemotron_v3.flops import forward_flops, mamba_flops, training_flops

HAND = NemotronHConfig(
    pattern="M*-E", vocab_size=10, hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
    intermediate_size=3, mamba_num_heads=2, mamba_head_dim=2, n_groups=1, ssm_state_size=2, conv_kernel=2,
    chunk_size=2, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=3,
    moe_shared_expert_intermediate_size=5,
)


def test_flops_match_hand_count():
    # batch 1, 3 tokens; the scan pads them to 2 chunks of 2.
    # Mamba: in_proj 4 -> z 4 + xBC (4 + 2 + 2) + dt 2 = 14 outputs; conv over 8 channels, kernel 2.
    in_proj, conv, out_proj = 2 * 3 * 4 * 14, 2 * 3 * 8 * 2, 2 * 3 * 4 * 4
    # 2 chunks x 3 causal pairs; 4 padded positions; 1 group, 2 heads, head dim 2, state 2.
    scores, y_diag = 2 * 6 * 1 * 2, 2 * 6 * 2 * 2
    chunk_states, passing, y_off = 2 * 4 * 2 * 2 * 2, 2 * 2 * 2 * 2 * 2, 2 * 4 * 2 * 2 * 2
    mamba = in_proj + conv + out_proj + scores + y_diag + chunk_states + passing + y_off
    assert mamba == 760
    # Attention: q 2x2, k and v 1x2 from hidden 4, o back to 4; 6 causal pairs for QK^T and AV.
    attention = 2 * 3 * 4 * (2 + 1 + 1) * 2 + 2 * 3 * 4 * 4 + 2 * (2 * 2 * 2 * 6)
    mlp = 2 * 2 * 3 * 4 * 3
    moe = 2 * 3 * 4 * 2 + 1 * 2 * 2 * 3 * 4 * 3 + 2 * 2 * 3 * 4 * 5  # router, 1 of 2 experts, shared
    lm_head = 2 * 3 * 4 * 10
    expected = {"mamba": mamba, "attention": attention, "mlp": mlp, "moe": moe, "lm_head": lm_head}
    assert forward_flops(HAND, 1, 3) == expected
    assert training_flops(HAND, 1, 3) == 3 * sum(expected.values()) == 3 * 1960


def test_mamba_flops_are_linear_in_sequence_length():
    cfg = NemotronHConfig(pattern="M")
    assert mamba_flops(cfg, 1, 8192) == 4 * mamba_flops(cfg, 1, 2048)
    assert mamba_flops(cfg, 3, 512) == 3 * mamba_flops(cfg, 1, 512)

