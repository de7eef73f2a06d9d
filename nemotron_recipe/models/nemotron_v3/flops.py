"""Model FLOPs of Nemotron-H per block kind, for throughput and MFU reports.

Counts are multiply-adds x 2 of the matrix products a step cannot avoid; norms, activations,
softmax and other elementwise work are left out, as is usual for MFU. Causal products (attention's
QK^T and AV, the SSD scan's within-chunk terms) count only the pairs a causal model uses, the
lower triangle with its diagonal, so a kernel that skips the masked half is not penalised and one
that computes it is not rewarded. The SSD terms follow the chunked algorithm: the sequence is
padded to a whole number of chunks. Backward costs twice the forward (one product for the input
gradient, one for the weight gradient), so a training step is three forwards.

A model with multi-token-prediction layers has one more kind, `mtp`: each depth's fusion projection,
its blocks and its pass through the shared head (counted as training runs them: every depth at the
full sequence length).
"""

from __future__ import annotations

from .config import NemotronHConfig

KINDS = ("mamba", "attention", "mlp", "moe", "lm_head")


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def mamba_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    """One Mamba2 block, forward: projections, depthwise conv and the chunked SSD scan."""
    d, h, p, g, n = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    tokens = batch * seq_len
    d_inner = h * p
    conv_channels = d_inner + 2 * g * n
    in_proj = 2 * tokens * d * (d_inner + conv_channels + h)  # z, x, B, C, dt
    conv = 2 * tokens * conv_channels * cfg.conv_kernel
    out_proj = 2 * tokens * d_inner * d

    q = cfg.chunk_size
    chunks = -(-seq_len // q)
    padded = batch * chunks * q
    pairs = batch * chunks * _causal_pairs(q)
    scores = 2 * pairs * g * n  # C_i . B_j per group
    y_diag = 2 * pairs * h * p  # scores applied to x*dt, per head
    chunk_states = 2 * padded * h * p * n  # B^T (x*dt) summed over each chunk
    state_passing = 2 * batch * chunks * h * p * n  # decay-and-add at every chunk boundary
    y_off = 2 * padded * h * p * n  # C against the state entering the chunk
    return in_proj + conv + out_proj + scores + y_diag + chunk_states + state_passing + y_off


def attention_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tokens = batch * seq_len
    projections = 2 * tokens * d * (hq + 2 * hkv) * hd + 2 * tokens * hq * hd * d
    qk_and_av = 2 * (2 * batch * hq * hd * _causal_pairs(seq_len))
    return projections + qk_and_av


def mlp_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    return 2 * 2 * batch * seq_len * cfg.hidden_size * cfg.intermediate_size


def moe_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    """Router, the top-k routed experts each token visits (in the latent space under LatentMoE, with
    the projections into and out of it), and the shared expert."""
    tokens, d = batch * seq_len, cfg.hidden_size
    router = 2 * tokens * d * cfg.n_routed_experts
    routed = cfg.num_experts_per_tok * 2 * 2 * tokens * cfg.moe_hidden_size * cfg.moe_intermediate_size
    latent = 2 * 2 * tokens * d * cfg.moe_latent_size if cfg.moe_latent_size else 0
    shared = 2 * 2 * tokens * d * cfg.moe_shared_expert_intermediate_size
    return router + routed + latent + shared


def lm_head_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    return 2 * batch * seq_len * cfg.hidden_size * cfg.vocab_size


_PER_BLOCK = {"mamba": mamba_flops, "attention": attention_flops, "mlp": mlp_flops, "moe": moe_flops}


def block_flops(cfg: NemotronHConfig, kind: str, batch: int, seq_len: int) -> int:
    """Forward FLOPs of one block of `kind` (a `block_types` name: mamba, attention, mlp or moe)."""
    return _PER_BLOCK[kind](cfg, batch, seq_len)


def mtp_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    """All MTP depths: fusion projection [2d -> d], the depth's blocks and the shared head, per depth."""
    fusion = 2 * batch * seq_len * 2 * cfg.hidden_size * cfg.hidden_size
    blocks = sum(_PER_BLOCK[kind](cfg, batch, seq_len) for kind in cfg.mtp_block_types)
    depths = cfg.num_nextn_predict_layers
    return depths * (fusion + lm_head_flops(cfg, batch, seq_len)) + blocks


def forward_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of the whole model by block kind (summed over the blocks of that kind)."""
    out = dict.fromkeys(KINDS, 0)
    for kind in cfg.block_types:
        out[kind] += _PER_BLOCK[kind](cfg, batch, seq_len)
    out["lm_head"] = lm_head_flops(cfg, batch, seq_len)
    if cfg.num_nextn_predict_layers:
        out["mtp"] = mtp_flops(cfg, batch, seq_len)
    return out


def training_flops(cfg: NemotronHConfig, batch: int, seq_len: int) -> int:
    """FLOPs of one forward + backward pass (the optimizer step's elementwise work is not counted)."""
    return 3 * sum(forward_flops(cfg, batch, seq_len).values())
