"""Nemotron-H model configuration: pattern strings, Hugging Face configs and named presets.

A model is a stack of pre-norm residual blocks, one mixer each, chosen by one character of
`pattern`: `M` Mamba2, `*` attention, `-` MLP, `E` MoE.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

BLOCK_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
PATTERN_CHARS = {v: k for k, v in BLOCK_TYPES.items()}

# Block-type names used by released checkpoints (and the remote-code model) and by transformers 5.x.
_HF_BLOCK_TYPES = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}
_TRANSFORMERS_BLOCK_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


class ModelConfigError(ValueError):
    """A model configuration that cannot build a model; the message names the field and a fix."""


@dataclass
class NemotronHConfig:
    pattern: str = "M*-E"
    vocab_size: int = 512
    hidden_size: int = 128
    # Attention (GQA, no positional encoding).
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 16
    # Dense MLP (ReLU^2, not gated).
    intermediate_size: int = 384
    # Mamba2.
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    n_groups: int = 4
    ssm_state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 64
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # MoE (Nemotron 3).
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    moe_shared_expert_intermediate_size: int = 128
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Shared.
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def block_types(self) -> list[str]:
        return [BLOCK_TYPES[c] for c in self.pattern]

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_heads_per_group(self) -> int:
        return self.mamba_num_heads // self.n_groups

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        def fail(field: str, value: Any, why: str, fix: str) -> None:
            raise ModelConfigError(f"model.{field}={value!r}: {why}. Fix: {fix}.")

        if not self.pattern:
            fail("pattern", self.pattern, "the block pattern is empty", "give one character per block, e.g. 'M*-M'")
        for i, c in enumerate(self.pattern):
            if c not in BLOCK_TYPES:
                fail(
                    "pattern",
                    self.pattern,
                    f"unknown block character {c!r} at position {i}",
                    "use only M (Mamba2), * (attention), - (MLP) and E (MoE)",
                )
        for field in (
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
            "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group", "topk_group",
        ):
            if getattr(self, field) <= 0:
                fail(field, getattr(self, field), "must be positive", "set a positive integer")
        if "*" in self.pattern and self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_attention_heads", self.num_attention_heads,
                f"not divisible by num_key_value_heads={self.num_key_value_heads}",
                "choose query heads that are a multiple of the key/value heads",
            )
        if "M" in self.pattern and self.mamba_num_heads % self.n_groups:
            fail(
                "mamba_num_heads", self.mamba_num_heads,
                f"not divisible by n_groups={self.n_groups}",
                "choose Mamba heads that are a multiple of the number of groups",
            )
        if "E" in self.pattern:
            if self.num_experts_per_tok > self.n_routed_experts:
                fail(
                    "num_experts_per_tok", self.num_experts_per_tok,
                    f"more than n_routed_experts={self.n_routed_experts}", "route to at most all experts",
                )
            if self.n_routed_experts % self.n_group:
                fail(
                    "n_routed_experts", self.n_routed_experts, f"not divisible by n_group={self.n_group}",
                    "choose a number of expert groups that divides the experts",
                )
            if self.topk_group > self.n_group:
                fail("topk_group", self.topk_group, f"more than n_group={self.n_group}", "set topk_group <= n_group")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                fail(
                    "n_group", self.n_group,
                    "group-limited routing scores each group by its two best experts, but groups hold fewer than 2",
                    "use fewer expert groups",
                )
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                fail(
                    "topk_group", self.topk_group,
                    f"the chosen groups hold fewer experts than num_experts_per_tok={self.num_experts_per_tok}",
                    "raise topk_group or lower num_experts_per_tok",
                )

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_pattern(cls, pattern: str, **dims: Any) -> NemotronHConfig:
        return cls(pattern=pattern, **dims)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> NemotronHConfig:
        if name not in PRESETS:
            raise ModelConfigError(
                f"model.preset={name!r}: no such preset. Fix: choose one of {sorted(PRESETS)}."
            )
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_hf(cls, hf: Any) -> NemotronHConfig:
        """Build from a Hugging Face config: a dict (config.json), a path to one, or a `transformers` config."""
        if isinstance(hf, (str, os.PathLike)):
            path = os.path.join(hf, "config.json") if os.path.isdir(hf) else os.fspath(hf)
            with open(path) as f:
                hf = json.load(f)
        elif not isinstance(hf, dict):
            hf = hf.to_dict()
        hf = dict(hf)

        if hf.get("layers_block_type"):
            kinds = hf["layers_block_type"]
            unknown = sorted({k for k in kinds if k not in _HF_BLOCK_TYPES})
            if unknown:
                raise ModelConfigError(
                    f"config layers_block_type has unknown block types {unknown}; "
                    f"known: {sorted(_HF_BLOCK_TYPES)}."
                )
            pattern = "".join(_HF_BLOCK_TYPES[k] for k in kinds)
        elif hf.get("hybrid_override_pattern"):
            pattern = hf["hybrid_override_pattern"]
        else:
            raise ModelConfigError(
                "Hugging Face config has neither 'layers_block_type' nor 'hybrid_override_pattern'; "
                "it does not describe a Nemotron-H model."
            )
        if hf.get("moe_latent_size") not in (None, 0):
            raise ModelConfigError(
                f"config moe_latent_size={hf['moe_latent_size']}: latent MoE projections are not supported."
            )
        # Older configs spell some Mamba fields with a `mamba_` prefix.
        aliases = {
            "n_groups": "mamba_n_groups",
            "conv_kernel": "mamba_d_conv",
            "chunk_size": "mamba_chunk_size",
            "use_conv_bias": "mamba_conv_bias",
            "time_step_min": "mamba_dt_min",
            "time_step_max": "mamba_dt_max",
            "time_step_floor": "mamba_dt_init_floor",
            "head_dim": "attention_head_dim",
        }
        kwargs: dict[str, Any] = {"pattern": pattern}
        for field in dataclasses.fields(cls):
            if field.name == "pattern":
                continue
            for key in (field.name, aliases.get(field.name)):
                if key is not None and hf.get(key) is not None:
                    kwargs[field.name] = hf[key]
                    break
        if "head_dim" not in kwargs and "hidden_size" in kwargs and "num_attention_heads" in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = kwargs[key][0]
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that `transformers.AutoConfig` reads as a NemotronH config."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "pattern"}
        out.update(
            architectures=["NemotronHForCausalLM"],
            model_type="nemotron_h",
            layers_block_type=[_TRANSFORMERS_BLOCK_NAMES[c] for c in self.pattern],
            hybrid_override_pattern=self.pattern,
            tie_word_embeddings=False,
            mlp_hidden_act="relu2",
            mamba_hidden_act="silu",
            moe_latent_size=None,
            n_shared_experts=1,
        )
        return out


def _released(
    pattern: str, *, hidden: int, ffn: int, heads: int, kv: int, m_heads: int, m_head_dim: int,
    groups: int, state: int, **extra: Any,
) -> NemotronHConfig:
    return NemotronHConfig(
        pattern=pattern, vocab_size=131072, hidden_size=hidden, intermediate_size=ffn,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, mamba_num_heads=m_heads,
        mamba_head_dim=m_head_dim, n_groups=groups, ssm_state_size=state, chunk_size=128, **extra,
    )


# The released shapes. A checkpoint's own config.json is authoritative when loading one; these build
# the same model from scratch (benchmarks, smoke tests on real sizes).
PRESETS: dict[str, NemotronHConfig] = {
    # Small enough to fine-tune on two CPU cores in a couple of minutes, yet with every block kind and
    # head/group counts that divide by 2 and 4 for tensor and context parallel.
    "tiny": NemotronHConfig(pattern="M*M-ME"),
    "nemotron_h_8b": _released(
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        hidden=4096, ffn=21504, heads=32, kv=8, m_heads=128, m_head_dim=64, groups=8, state=128,
    ),
    "nemotron_h_47b": _released(
        "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-M-",
        hidden=8192, ffn=30720, heads=64, kv=8, m_heads=256, m_head_dim=64, groups=8, state=256,
    ),
    "nemotron_h_56b": _released(
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
        "M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        hidden=8192, ffn=32768, heads=64, kv=8, m_heads=256, m_head_dim=64, groups=8, state=256,
    ),
    "nemotron_nano_9b_v2": _released(
        "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        hidden=4480, ffn=15680, heads=40, kv=8, m_heads=128, m_head_dim=80, groups=8, state=128,
    ),
    "nemotron3_nano_30b_a3b": _released(
        "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        hidden=2688, ffn=1856, heads=32, kv=2, m_heads=64, m_head_dim=64, groups=8, state=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    ),
}
