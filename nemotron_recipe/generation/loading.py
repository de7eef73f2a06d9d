"""A model to generate from, found from one path: a training checkpoint (full or LoRA), a Hugging Face
model directory, or a PEFT adapter directory with its base.

`resolve` is cheap: it reads configs, metadata and the tokenizer, so that bad input is named before
any weight is read; `ModelSource.load` then builds the model. LoRA adapters stay unmerged: the
model computes `W x + scaling * B A x` as in training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError, NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import PEFT_PREFIX, LoRASpec, add_adapters, from_peft, set_full_values

from .sampling import GenerationError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class ModelSource:
    kind: str  # "checkpoint", "lora-checkpoint", "hf", "peft"
    path: Path
    config: NemotronHConfig
    tokenizer: Any | None
    max_length: int | None  # the model's `max_position_embeddings` where its config.json states one
    _build: Callable[[], NemotronHForCausalLM]

    def load(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> NemotronHForCausalLM:
        """The model in eval mode on `device`, in `dtype` (SSM terms and router stay fp32); None keeps the
        checkpoint's dtypes."""
        model = self._build()
        model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)
        return model.eval()


def _not_a_model(path: Path, why: str) -> GenerationError:
    return GenerationError(
        f"{path}: {why}; it is neither a training checkpoint (a step_N directory with meta.json, or a run "
        "directory holding them), a Hugging Face model directory (config.json) nor a PEFT adapter directory "
        f"({ADAPTER_CONFIG}). Fix: point at one of those.")


def resolve(path: str | Path, base: str | Path | None = None, tokenizer: str | Path | None = None) -> ModelSource:
    """What `path` holds, checked without reading weights. `base`: the base model directory of a PEFT
    adapter (default: the adapter's `base_model_name_or_path`). `tokenizer` overrides the tokenizer
    found beside the weights (or recorded by the training run)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise _not_a_model(p, "does not exist")
    if (p / ADAPTER_CONFIG).is_file():
        source = _peft_source(p, base)
    elif (p / "config.json").is_file():
        source = _hf_source(p)
    else:
        source = _checkpoint_source(p)
    if tokenizer is not None:
        source.tokenizer = _tokenizer(Path(tokenizer).expanduser(), required=True)
    return source


def _tokenizer(path: Path | None, required: bool = False):
    if path is None or not ((path / "tokenizer.json").is_file() or path.is_file()):
        if required:
            raise GenerationError(f"--tokenizer {path}: no tokenizer.json there. Fix: point at a tokenizer "
                                  "directory or tokenizer.json file.")
        return None
    from nemotron_recipe.data import load_tokenizer  # transformers and datasets: only needed here

    return load_tokenizer(path)


def _max_length(model_dir: Path | None) -> int | None:
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    return int(value) if value else None


def _hf_config(path: Path) -> NemotronHConfig:
    try:
        return NemotronHConfig.from_hf(str(path))
    except (ModelConfigError, ValueError, TypeError) as e:
        raise _not_a_model(path, f"config.json does not describe a Nemotron-H model ({e})") from None


def _hf_source(path: Path) -> ModelSource:
    return ModelSource("hf", path, _hf_config(path), _tokenizer(path), _max_length(path),
                       lambda: NemotronHForCausalLM.from_pretrained(str(path)))


def _checkpoint_source(path: Path) -> ModelSource:
    from nemotron_recipe.training.checkpoint import find_checkpoint, read_meta

    try:
        found = find_checkpoint(path)
        meta = read_meta(found)
        config = NemotronHConfig(**meta["model"])
    except (CheckpointError, ModelConfigError, TypeError) as e:
        raise _not_a_model(path, str(e).removeprefix(f"{path}: ").rstrip(".")) from None
    recorded = meta.get("tokenizer")
    tokenizer = _tokenizer(Path(recorded)) if recorded else None
    peft = meta.get("peft")
    pretrained = Path(peft["base"]["pretrained"]) if peft and "pretrained" in peft["base"] else None
    if peft:
        return ModelSource("lora-checkpoint", found, config, tokenizer, _max_length(pretrained),
                           lambda: _lora_checkpoint_model(found, meta))
    from nemotron_recipe.training.hf_io import load_checkpoint_model

    return ModelSource("checkpoint", found, config, tokenizer, _max_length(pretrained),
                       lambda: load_checkpoint_model(found)[0])


def _lora_checkpoint_model(path: Path, meta: dict[str, Any]) -> NemotronHForCausalLM:
    """The base the checkpoint records (refused if its content changed) with the adapters added, unmerged."""
    from nemotron_recipe.training.lora import _spec, load_adapters, load_base

    _, values = load_adapters(path, meta)
    model = load_base(meta, path)
    add_adapters(model, _spec(meta))
    set_full_values(model, values)
    return model


def _peft_source(path: Path, base: str | Path | None) -> ModelSource:
    try:
        adapter = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise _not_a_model(path, f"{ADAPTER_CONFIG} is unreadable ({e})") from None
    if adapter.get("peft_type", "LORA") != "LORA":
        raise GenerationError(f"{path}: a {adapter.get('peft_type')} adapter; only LoRA adapters load. "
                              "Fix: use a LoRA adapter.")
    named = base or adapter.get("base_model_name_or_path")
    base_path = Path(named).expanduser() if named else None
    if base_path is None or not (base_path / "config.json").is_file():
        raise GenerationError(
            f"{path}: a PEFT adapter whose base model directory {str(base_path) if base_path else '(none recorded)'} "
            "is not a Hugging Face model directory here. Fix: pass --base DIR, the model it was trained on.")
    config = _hf_config(base_path)
    tokenizer = _tokenizer(path) or _tokenizer(base_path)
    return ModelSource("peft", path, config, tokenizer, _max_length(base_path),
                       lambda: _peft_model(path, base_path, adapter))


def _peft_model(path: Path, base_path: Path, adapter: dict[str, Any]) -> NemotronHForCausalLM:
    """The base with the PEFT adapter's LoRA factors added, unmerged. The modules it saves whole (the
    Mamba2 `out_proj`, which PEFT will not adapt) get their LoRA factors from the file our exports write
    beside it; an adapter without that file has its saved copies replace the base's weights."""
    from safetensors.torch import load_file

    from nemotron_recipe.training.lora import OUT_PROJ_FACTORS, _out_proj_factors

    model = NemotronHForCausalLM.from_pretrained(str(base_path))
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    saved = list(adapter.get("modules_to_save") or ())
    rank = int(adapter["r"])
    projs = tuple(p.rsplit(".", 1)[-1] for p in adapter.get("target_parameters") or ())
    values = from_peft(model.config, tensors, tuple(p for p in ("up_proj", "down_proj") if p in projs), rank,
                       saved=saved)
    if saved and (path / OUT_PROJ_FACTORS).is_file():
        values |= _out_proj_factors(path, saved)
    else:
        with torch.no_grad():
            for name in saved:
                copy = tensors.get(f"{PEFT_PREFIX}{name}.weight")
                if copy is None:
                    raise CheckpointError(f"{path}: modules_to_save names {name}, whose weight the adapter lacks.")
                model.get_submodule(name).weight.copy_(copy)
    add_adapters(model, LoRASpec(rank, float(adapter["lora_alpha"]), 0.0, _adapted_modules(values)))
    set_full_values(model, values)
    return model


def _adapted_modules(values: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The native names of the projections the adapter tensors `values` belong to (exact target patterns)."""
    names = []
    for key in values:
        if key.endswith((".lora_A.weight", ".lora_B.weight")):
            name = key.rsplit(".", 2)[0]
        elif ".lora." in key:  # routed experts (`X.lora.up_proj.A`) and the embedding (`X.lora.lora_embedding_A`)
            owner, _, rest = key.partition(".lora.")
            name = owner if rest.startswith("lora_embedding") else f"{owner}.{rest.split('.')[0]}"
        else:
            continue
        if name not in names:
            names.append(name)
    return tuple(names)
