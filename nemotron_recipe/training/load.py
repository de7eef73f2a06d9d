"""Any model this project writes or reads, loaded whole in one process for inference.

`load_for_inference(PATH)` takes:
- a training checkpoint: a `step_N` directory, or a run or checkpoints directory holding them (the
  newest complete one is taken, as `recipes.export` does). A full fine-tuning checkpoint is read
  with DCP into an unsharded model; a LoRA checkpoint rebuilds the base it recorded (and checks
  its hash) and carries its adapters unmerged, so the model computes what training did;
- a Hugging Face directory (an export of ours or a released Nemotron-H checkpoint): config.json and
  safetensors.

The tokenizer is the one the run recorded in its checkpoint, or the directory's own. `source_kind`
tells which of the two PATH is without reading any weight, so a wrong PATH fails at once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemotron_recipe.models.nemotron_v3 import CheckpointError, NemotronHForCausalLM
from nemotron_recipe.training.checkpoint import META, find_checkpoint, read_dcp_metadata, read_meta, verify_checksums

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# transformers' NemotronH reports this context length for a config.json that names none (ours do not:
# attention has no positional encoding); the same default keeps a checkpoint and its export alike.
DEFAULT_CONTEXT_LENGTH = 4096


@dataclass
class LoadedModel:
    model: NemotronHForCausalLM  # eval mode, on the requested device and dtype
    tokenizer: Any  # a transformers fast tokenizer
    kind: str  # "checkpoint" (full), "lora checkpoint" or "hf"
    path: Path  # the checkpoint or directory actually read
    context_length: int

    def describe(self) -> str:
        return f"{self.kind} {self.path} ({self.model.config.pattern}, {self.model.num_parameters() / 1e6:.2f}M parameters)"


def source_kind(path: str | Path) -> str:
    """'checkpoint' or 'hf' for what PATH holds, read from its small files only; a `CheckpointError`
    naming PATH and what is accepted otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"PATH {p}: does not exist. Fix: pass a training checkpoint (a step_N directory or "
                              "its run directory) or a Hugging Face model directory.")
    if (p / "config.json").is_file():
        return "hf"
    try:
        find_checkpoint(p)
        return "checkpoint"
    except CheckpointError:
        pass
    what = "a file" if p.is_file() else "a directory with no config.json and no complete checkpoint"
    if (p / "adapter_config.json").is_file():
        what = ("a PEFT adapter directory; evaluate the training checkpoint it was exported from, or its "
                "`recipes.export --merge` export")
    raise CheckpointError(
        f"PATH {p}: neither a training checkpoint nor a model directory ({what}). Fix: pass a step_N directory "
        f"holding {META}, a run directory holding checkpoints/, or a Hugging Face directory holding config.json "
        "and safetensors."
    )


def load_for_inference(path: str | Path, *, device: str | torch.device = "cpu", dtype: str = "fp32") -> LoadedModel:
    """The model PATH holds and its tokenizer, unsharded, in eval mode on `device` in `dtype` (fp32 or
    bf16; the SSM terms and router stay fp32 as in training)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: unknown. Fix: use one of {sorted(DTYPES)}.")
    kind = source_kind(path)
    if kind == "hf":
        p = Path(path).expanduser()
        tokenizer = _tokenizer(p, p)  # before the weights: a missing one fails fast
        model, found, length = NemotronHForCausalLM.from_pretrained(str(p)), p, _hf_context_length(p)
    else:
        model, tokenizer, found, kind = _load_checkpoint(path)
        length = DEFAULT_CONTEXT_LENGTH
    model.to(device=device, dtype=DTYPES[dtype]).eval()
    return LoadedModel(model, tokenizer, kind, found, length)


def _load_checkpoint(path: str | Path) -> tuple[NemotronHForCausalLM, Any, Path, str]:
    from nemotron_recipe.models.nemotron_v3.lora import LoRASpec, add_adapters, set_full_values
    from nemotron_recipe.training.hf_io import load_checkpoint_model
    from nemotron_recipe.training.lora import load_adapters, load_base

    found = find_checkpoint(path)
    meta = read_meta(found)
    tokenizer = _tokenizer(meta.get("tokenizer"), found)  # before the weights: a missing one fails fast
    if not meta.get("peft"):
        model, meta, found = load_checkpoint_model(found)
        return model, tokenizer, found, "checkpoint"
    verify_checksums(found, meta)
    read_dcp_metadata(found)
    _, values = load_adapters(found, meta)
    model = load_base(meta, found)
    peft = meta["peft"]
    add_adapters(model, LoRASpec(peft["rank"], peft["alpha"], peft["dropout"], tuple(peft["target_modules"])))
    set_full_values(model, values)
    return model, tokenizer, found, "lora checkpoint"


def _tokenizer(where: str | Path | None, owner: Path) -> Any:
    """The tokenizer at `where` (a directory holding tokenizer.json, or the file), else an error naming `owner`."""
    from nemotron_recipe.data import load_tokenizer

    path = Path(where).expanduser() if where else None
    if path is None or not (path.is_file() or (path / "tokenizer.json").is_file()):
        raise CheckpointError(
            f"{owner}: no tokenizer (looked for {where or 'a recorded tokenizer'}). Fix: save the model's tokenizer "
            "there (tokenizer.json, tokenizer_config.json), or export the checkpoint with `python -m recipes.export`, "
            "which writes it."
        )
    return load_tokenizer(path)


def _hf_context_length(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
