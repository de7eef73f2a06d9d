"""Incremental decoding: the cache against recomputing the whole sequence, sampling, stopping and errors."""

import pytest
import torch

from nemotron_recipe.generation import DecodeCache, GenerationConfig, GenerationError, cache_bytes, generate
from nemotron_recipe.generation.sampling import filter_logits
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import LoRASpec, add_adapters, init_adapters

from helpers import SMALL_DIMS, perturb_off_init

# Every block kind with group-limited routing; chunk 8 so that 64 steps cross many chunk boundaries.
PATTERN = "M*-EM"
DIMS = {**SMALL_DIMS, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}


def _model(seed: int = 0, **overrides) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(pattern=PATTERN, **{**DIMS, **overrides})).eval()
    perturb_off_init(model)
    return model


def _prompts(lengths, seed=1, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _left_padded(prompts):
    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):] = torch.tensor(p)
        valid[i, length - len(p):] = True
    return ids, valid


def test_cached_decoding_equals_full_recompute():
    """64 greedy steps from left-padded prompts of different lengths, on every block kind with LatentMoE,
    group-limited routing and unmerged LoRA adapters (non-zero, the routed experts' included): each
    step's logits equal those of recomputing the whole sequences from scratch (padding run as a
    document of its own), within 1e-5, across many chunk boundaries of the scan."""
    model = _model(moe_latent_size=16)
    add_adapters(model, LoRASpec(rank=4, alpha=8.0))
    init_adapters(model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_B.weight", ".B")):
                p.normal_(std=0.05)
    ids, valid = _left_padded(_prompts([13, 1, 6]))
    steps = 64
    cache = DecodeCache(valid, ids.shape[1] + steps, len(model.model.layers))
    worst = 0.0
    with torch.no_grad():
        logits = model(ids, cache=cache).logits[:, -1]
        for _ in range(steps):
            full = model(ids, document_ids=valid.long()).logits[:, -1]
            worst = max(worst, (full - logits).abs().max().item())
            token = logits.argmax(-1, keepdim=True)
            ids, valid = torch.cat([ids, token], 1), torch.cat([valid, torch.ones_like(token, dtype=torch.bool)], 1)
            logits = model(token, cache=cache).logits[:, -1]
    assert worst <= 1e-5, worst
    assert cache.length == ids.shape[1]
    assert cache.nbytes() == cache_bytes(model.config, 3, cache.capacity, torch.float32)


def test_completion_does_not_depend_on_batch_or_padding():
    model = _model()
    prompts = _prompts([9, 2, 5, 12])
    config = GenerationConfig(max_new_tokens=10, batch_size=4)
    together = generate(model, prompts, config)
    alone = [generate(model, [p], config)[0] for p in prompts]
    assert [r.completion_ids for r in together] == [r.completion_ids for r in alone]
    assert all(r.finish_reason == "length" and len(r.completion_ids) == 10 and r.text is None for r in together)
