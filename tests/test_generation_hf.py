"""Greedy generation against transformers' NemotronH `generate` on the same exported directory."""

import pytest
import torch

from nemotron_recipe.generation import GenerationConfig, generate
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM

from helpers import perturb_off_init

transformers = pytest.importorskip("transformers")

HF_DIMS = {
    "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16,
    "chunk_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
}
EOS = 2


@pytest.mark.parametrize("latent", [None, 24], ids=["moe", "latent-moe"])
def test_greedy_ids_equal_transformers_generate(tmp_path, latent):
    """Every block kind (Mamba2, attention, MLP, MoE with group-limited routing, or LatentMoE), fp32, a
    batch of three prompts of different lengths that transformers left-pads with an attention mask:
    the same token ids, and EOS ends a completion on both sides alike."""
    torch.manual_seed(0)
    hf_cfg = transformers.NemotronHConfig(hybrid_override_pattern="M*-EM", moe_latent_size=latent, **HF_DIMS)
    hf = transformers.NemotronHForCausalLM(hf_cfg).float().eval()
    perturb_off_init(hf)
    hf.save_pretrained(tmp_path)
    ours = NemotronHForCausalLM.from_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (13, 4, 9)]
    new = 24
    results = generate(ours, prompts, GenerationConfig(max_new_tokens=new, eos_token_ids=(EOS,)))

    length = max(map(len, prompts))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):], mask[i, length - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0,
                          eos_token_id=EOS)
    for i, result in enumerate(results):
        theirs = out[i, length:].tolist()
        ended = EOS in theirs
        theirs = theirs[:theirs.index(EOS)] if ended else theirs
        assert result.completion_ids == theirs, i
        assert result.finish_reason == ("eos" if ended else "length")
