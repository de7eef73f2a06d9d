"""Top-k routing on ties: exact ties go to the lower expert index on any device and kernel; without
ties the choice is torch.topk's (docs/moe-routing.md)."""

from __future__ import annotations

import torch

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig
from nemotron_recipe.models.nemotron_v3.model import Router, top_indices


def _router(**overrides) -> Router:
    config = NemotronHConfig(pattern="E", hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, **overrides)
    router = Router(config)
    torch.nn.init.normal_(router.weight, std=0.1, generator=torch.Generator().manual_seed(0))
    return router


def test_without_ties_the_choice_is_topks():
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(top_indices(values, 5).sort(-1).values, values.topk(5).indices.sort(-1).values,
                               rtol=0, atol=0)


def test_exact_ties_go_to_the_lower_expert_index():
    values = torch.tensor([[0.1, 0.7, 0.3, 0.7, 0.7, 0.2]])
    assert top_indices(values, 2).tolist() == [[1, 3]]
    router = _router()
    with torch.no_grad():
        router.weight[6] = router.weight[2] = 10.0  # both saturate the sigmoid: scores of exactly 1.0
    x = torch.rand(32, 16, generator=torch.Generator().manual_seed(2)) + 0.5
    scores, _, idx = router(x)
    assert bool((scores[:, 2] == scores[:, 6]).all()) and bool((scores[:, 2] == 1.0).all())
    assert idx[:, 0].tolist() == [2] * 32 and idx[:, 1].tolist() == [6] * 32
    router.top_k = 1  # one place for two tied experts: the lower index takes it on every token
    assert router(x)[2].flatten().tolist() == [2] * 32


def test_group_limited_routing_breaks_group_ties_the_same_way():
    router = _router(n_group=4, topk_group=1)
    with torch.no_grad():
        router.weight.zero_()  # every score 0.5: every group and every expert tied
    _, _, idx = router(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)))
    assert idx.tolist() == [[0, 1]] * 8
