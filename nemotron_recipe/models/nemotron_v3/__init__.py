"""Nemotron-H (Nemotron 2 hybrid and Nemotron 3 MoE) models: config, native model, checkpoints."""

from .errors import CheckpointError
from .config import PRESETS, ModelConfigError, NemotronHConfig
from .model import CausalLMOutput, NemotronHForCausalLM, build_meta_model

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "CheckpointError",
    "ModelConfigError",
    "NemotronHConfig",
    "NemotronHForCausalLM",
    "build_meta_model",
]
