"""Nemotron-H model configuration: pattern strings, Hugging Face configs and named presets.

A model is a stack of pre-norm residual blocks, one mixer each, chosen by one character of
`pattern`: `M` Mamba2, `*` attention, `-` MLP, `E` MoE.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
# Fields config.json spells otherwise (the patterns) or does not hold: the MTP loss weight is a
# training setting, the dtypes come from the weight files.
NOT_IN_HF_CONFIG = ("pattern", "mtp_pattern", "mtp_loss_scale", "weight_dtypes")


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
    # The bounds dt is clamped to after softplus, at run time (config.json's `time_step_limit`; the
    # released models: no bound). `time_step_min`/`max`/`floor` only set the range dt_bias is drawn in.
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # MoE (Nemotron 3).
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    moe_shared_expert_intermediate_size: int = 128
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # LatentMoE (Nemotron 3 Super/Ultra): routed experts run in a `moe_latent_size` space between a
    # hidden -> latent and a latent -> hidden projection; None: they run in the hidden size.
    moe_latent_size: int | None = None
    # Multi-token prediction: `num_nextn_predict_layers` depths, each a stack of blocks in
    # `mtp_pattern` (same characters as `pattern`). Depth k predicts token t+1+k.
    num_nextn_predict_layers: int = 0
    mtp_pattern: str = "*E"
    # Weight of the MTP loss in training; None: 0.1 with MTP layers. 0 keeps the MTP weights untrained.
    mtp_loss_scale: float | None = None
    # Shared.
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    # The dtype of each tensor of the checkpoint the model came from, by name with block and expert
    # numbers as `*` (checkpoint.dtype_template); an export writes every tensor back in it. Not a setting.
    weight_dtypes: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.time_step_limit = _float_pair(self.time_step_limit)
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

    @property
    def mtp_block_types(self) -> list[str]:
        """The block kinds of the MTP layers, depth after depth (`mtp.layers.{i}`)."""
        return [BLOCK_TYPES[c] for c in self.mtp_pattern] * self.num_nextn_predict_layers

    @property
    def moe_hidden_size(self) -> int:
        """The width the routed experts run in."""
        return self.moe_latent_size or self.hidden_size

    @property
    def effective_mtp_loss_scale(self) -> float:
        if self.mtp_loss_scale is not None:
            return float(self.mtp_loss_scale)
        return 0.1 if self.num_nextn_predict_layers else 0.0

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
        self._validate_latent_and_mtp(fail)
        limit = self.time_step_limit
        if not (isinstance(limit, tuple) and len(limit) == 2 and 0.0 <= limit[0] <= limit[1]):
            fail("time_step_limit", limit, "must be two ordered, non-negative bounds for dt",
                 "give [low, high], e.g. [0.0, Infinity] (no bound, as the released models)")
        kinds = self.pattern + (self.mtp_pattern if self.num_nextn_predict_layers else "")
        if "*" in kinds and self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_attention_heads", self.num_attention_heads,
                f"not divisible by num_key_value_heads={self.num_key_value_heads}",
                "choose query heads that are a multiple of the key/value heads",
            )
        if "M" in kinds and self.mamba_num_heads % self.n_groups:
            fail(
                "mamba_num_heads", self.mamba_num_heads,
                f"not divisible by n_groups={self.n_groups}",
                "choose Mamba heads that are a multiple of the number of groups",
            )
        if "E" in kinds:
            self._validate_routing(fail)

    def _validate_routing(self, fail) -> None:
        """The routed experts' counts and group-limited routing (models with MoE blocks)."""
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

    def _validate_latent_and_mtp(self, fail) -> None:
        latent = self.moe_latent_size
        if latent is not None and not 0 < latent <= self.hidden_size:
            fail(
                "moe_latent_size", latent, f"the latent space must be between 1 and hidden_size={self.hidden_size} wide",
                f"set 0 < moe_latent_size <= {self.hidden_size}, or null for experts in the hidden size",
            )
        if self.num_nextn_predict_layers < 0:
            fail("num_nextn_predict_layers", self.num_nextn_predict_layers, "must not be negative",
                 "set 0 (no MTP layers) or the number of MTP depths")
        if self.num_nextn_predict_layers:
            bad = sorted({c for c in self.mtp_pattern if c not in BLOCK_TYPES})
            if not self.mtp_pattern or bad:
                fail("mtp_pattern", self.mtp_pattern, f"MTP layers need block characters, got unknown {bad}"
                     if bad else "MTP layers are on but their block pattern is empty",
                     "use M, *, - and E, e.g. '*E' (attention then MoE, as released)")
        scale = self.mtp_loss_scale
        if scale is not None and (scale < 0 or math.isnan(scale)):
            fail("mtp_loss_scale", scale, "must be a non-negative number", "set 0.1 (the released recipes' value)")
        if scale and not self.num_nextn_predict_layers:
            fail("mtp_loss_scale", scale, "the model has no MTP layers (num_nextn_predict_layers=0) to train",
                 "unset model.mtp_loss_scale, or use a model with MTP layers")

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
        if hf.get("moe_latent_size") == 0:
            hf["moe_latent_size"] = None
        mtp_pattern = _mtp_pattern_from_hf(hf)
        # Older configs spell some Mamba fields with a `mamba_` prefix.
        aliases = {
            "n_groups": "mamba_n_groups",
            "conv_kernel": "mamba_d_conv",
            "chunk_size": "mamba_chunk_size",
            "use_conv_bias": "mamba_conv_bias",
            "time_step_min": "mamba_dt_min",
            "time_step_max": "mamba_dt_max",
            "time_step_floor": "mamba_dt_init_floor",
            "time_step_limit": "mamba_dt_limit",
            "head_dim": "attention_head_dim",
        }
        kwargs: dict[str, Any] = {"pattern": pattern}
        if mtp_pattern is not None:
            kwargs["mtp_pattern"] = mtp_pattern
        for field in dataclasses.fields(cls):
            if field.name in NOT_IN_HF_CONFIG:
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
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_IN_HF_CONFIG}
        out.update(
            architectures=["NemotronHForCausalLM"],
            model_type="nemotron_h",
            layers_block_type=[_TRANSFORMERS_BLOCK_NAMES[c] for c in self.pattern],
            hybrid_override_pattern=self.pattern,
            tie_word_embeddings=False,
            mlp_hidden_act="relu2",
            mamba_hidden_act="silu",
            n_shared_experts=1,
            mtp_layers_block_type=[_TRANSFORMERS_BLOCK_NAMES[c] for c in self.mtp_pattern],
            mtp_hybrid_override_pattern=self.mtp_pattern,
        )
        return out


def _float_pair(value: Any) -> tuple[float, float] | Any:
    """(low, high) as floats from a JSON list, where transformers may spell infinity
    `{"__float__": "Infinity"}`; anything else is left for `validate` to name."""
    try:
        low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    except (TypeError, ValueError, KeyError):
        return value
    return (low, high)


def _mtp_pattern_from_hf(hf: dict[str, Any]) -> str | None:
    """The MTP block pattern of a Hugging Face config: `mtp_hybrid_override_pattern` (released configs)
    or `mtp_layers_block_type` (transformers 5.x); both, when given, must agree."""
    pattern = hf.get("mtp_hybrid_override_pattern")
    kinds = hf.get("mtp_layers_block_type")
    from_kinds = None
    if kinds:
        unknown = sorted({k for k in kinds if k not in _HF_BLOCK_TYPES})
        if unknown:
            raise ModelConfigError(
                f"config mtp_layers_block_type has unknown block types {unknown}; known: {sorted(_HF_BLOCK_TYPES)}."
            )
        from_kinds = "".join(_HF_BLOCK_TYPES[k] for k in kinds)
    if pattern and from_kinds and pattern != from_kinds:
        raise ModelConfigError(
            f"config mtp_hybrid_override_pattern={pattern!r} contradicts mtp_layers_block_type={kinds} "
            f"({from_kinds!r}). Fix: keep one of the two in config.json, or make them agree."
        )
    return pattern or from_kinds


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
    # head/group counts that divide by 2 and 4 for tensor and context parallel. Its widths keep the
    # released models' proportions where a rank-8 adapter is concerned (every projection at least
    # 256 wide on one side, the MLP and experts wider than the residual): at hidden 128 rank 8 would
    # add 9% to the model, not the fraction of a percent it adds to a released one. Its init std is
    # 1/sqrt(hidden): the released shapes' 0.02 suits widths in the thousands; at a few hundred it
    # leaves a frozen random head's logits within +-0.02 x hidden, too flat for adapters to learn.
    "tiny": NemotronHConfig(
        pattern="M*M-ME", hidden_size=256, intermediate_size=1024, head_dim=32, mamba_head_dim=64,
        moe_intermediate_size=512, moe_shared_expert_intermediate_size=512, initializer_range=256**-0.5,
    ),
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
    ),    # config.json of huggingface.co/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 (as reproduced in public
    # repositories; the same values in its NVFP4 release): 88 blocks (40 Mamba2, 40 LatentMoE, 8 attention),
    # 512 experts of which 22 per token in a 1024-wide latent space, one MTP depth of attention + MoE.
    "nemotron3_super_120b_a12b": _released(
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
        hidden=4096, ffn=2688, heads=32, kv=2, m_heads=128, m_head_dim=64, groups=8, state=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, routed_scaling_factor=5.0, n_group=1, topk_group=1,
        moe_latent_size=1024, num_nextn_predict_layers=1, mtp_pattern="*E",
    ),
    # config.json of huggingface.co/nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16 (as reproduced in public
    # Megatron-LM launch scripts for this checkpoint: --num-layers 108 --hidden-size 8192 --mamba-num-heads 256
    # --mamba-head-dim 64 --num-experts 512 --moe-router-topk 22 --moe-latent-size 2048 and this
    # --hybrid-override-pattern, MTP "*E"): 108 blocks (48 Mamba2, 48 LatentMoE, 12 attention), 512 experts of
    # which 22 per token in a 2048-wide latent space, one MTP depth of attention + MoE. "550B-A55B": Megatron-Bridge
    # examples/models/nemotron/nemotron_3/ultra/README.md ("550B total / A55B active").
    "nemotron3_ultra_550b_a55b": _released(
        "MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        hidden=8192, ffn=5120, heads=64, kv=2, m_heads=256, m_head_dim=64, groups=8, state=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=5120,
        moe_shared_expert_intermediate_size=10240, routed_scaling_factor=5.0, n_group=1, topk_group=1,
        moe_latent_size=2048, num_nextn_predict_layers=1, mtp_pattern="*E",
    ),
}


@dataclass(frozen=True)
class PresetLR:
    """The peak learning rates a preset is fine-tuned with when `optim.lr` is unset: all weights, or LoRA adapters."""

    full: float
    lora: float


# Full fine-tuning and LoRA peak learning rates from the SFT and PEFT recipes NVIDIA publishes for each released
# model in Megatron-Bridge (github.com/NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/recipes/). Most recipes
# take them from recipes/common.py: `_sft_common` (max_lr=5e-6, "lower LR for full fine-tuning") and
# `_peft_common` (max_lr=1e-4, "higher LR for adapter training"). tiny's is its own: a randomly drawn model of a
# few million parameters that learns the bundled examples within the default 200 steps.
PRESET_LR: dict[str, PresetLR] = {
    "tiny": PresetLR(full=3e-3, lora=3e-3),
    # nemotronh/h100/nemotronh.py: nemotronh_8b_sft_2gpu_h100_bf16_config, nemotronh_8b_peft_1gpu_h100_bf16_config.
    "nemotron_h_8b": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotronh.py: nemotronh_47b_sft_16gpu_h100_bf16_config, nemotronh_47b_peft_4gpu_h100_bf16_config.
    "nemotron_h_47b": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotronh.py: nemotronh_56b_sft_8gpu_h100_bf16_config, nemotronh_56b_peft_4gpu_h100_bf16_config.
    "nemotron_h_56b": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotron_nano_v2.py: nemotron_nano_9b_v2_sft_2gpu_h100_bf16_config and _peft_1gpu_; NeMo
    # AutoModel's examples/llm_finetune/nemotron/NVIDIA-Nemotron-Nano-9B-v2/*_squad.yaml use 1e-5 for both.
    "nemotron_nano_9b_v2": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotron_3_nano.py: nemotron_3_nano_sft_8gpu_h100_bf16_config and _peft_8gpu_.
    "nemotron3_nano_30b_a3b": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotron_3_super.py: nemotron_3_super_sft_16gpu_h100_bf16_config sets lr 5e-6,
    # nemotron_3_super_peft_1gpu_h100_bf16_config 1e-4.
    "nemotron3_super_120b_a12b": PresetLR(full=5e-6, lora=1e-4),
    # nemotronh/h100/nemotron_3_ultra.py: nemotron_3_ultra_sft_192gpu_h100_bf16_openmathinstruct2_packed_config sets
    # lr 5e-6, nemotron_3_ultra_peft_32gpu_h100_bf16_openmathinstruct2_packed_config 1e-4.
    "nemotron3_ultra_550b_a55b": PresetLR(full=5e-6, lora=1e-4),
}


# The sequence length each preset is fine-tuned at: Megatron-Bridge's SFT recipes (the functions named above;
# `_sft_common` sets 2048, the Nemotron-H recipes their 8K context), tiny the recipe's own default.
PRESET_SEQ_LEN: dict[str, int] = {
    "tiny": 128,
    "nemotron_h_8b": 8192,
    "nemotron_h_47b": 8192,
    "nemotron_h_56b": 8192,
    "nemotron_nano_9b_v2": 2048,
    "nemotron3_nano_30b_a3b": 2048,
    "nemotron3_super_120b_a12b": 2048,
    "nemotron3_ultra_550b_a55b": 4096,  # its SFT recipe's packed OpenMathInstruct-2 sequences
}


def matching_preset(config: NemotronHConfig) -> str | None:
    """The preset whose shapes `config` has (a released checkpoint's own config.json), if any."""
    shape = ("pattern", "hidden_size", "num_attention_heads", "mamba_num_heads", "n_routed_experts")
    for name, preset in PRESETS.items():
        if all(getattr(config, f) == getattr(preset, f) for f in shape):
            return name
    return None
