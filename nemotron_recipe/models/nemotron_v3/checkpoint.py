"""Hugging Face checkpoints <-> the native model.

Two layouts exist in the wild, and both load:
- released checkpoints and what `transformers` 5.x `save_pretrained` writes: `backbone.*`, one
  `experts.{e}.up_proj.weight` per routed expert;
- `transformers`' in-memory layout: `model.*`, experts stacked in `experts.up_proj` [E, I, D].
Export writes the released layout, which both `transformers` and the remote-code model read.

The native model differs from both only in the order of the Mamba2 `in_proj` rows and `conv1d`
channels (group-major, see model.py). Multi-token-prediction layers keep their released names
(`mtp.layers.{i}.*`, experts one tensor each) in every layout.

No weight is left behind: every tensor of a checkpoint is loaded or named in an error, and an export
writes each tensor back in the dtype its checkpoint had (`weight_dtypes`), so importing and exporting
without training reproduces the files' tensors bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from .config import NemotronHConfig
from .errors import CheckpointError
from .fp8 import checkpoint_fp8_format, dequantize_state

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"

_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_INDEX = re.compile(r"\.(layers|experts)\.\d+\.")


# ------------------------------------------------------------------------------- Mamba2 layout
def mamba_in_proj_order(cfg: NemotronHConfig) -> torch.Tensor:
    """For each native (group-major) `in_proj` row, the Hugging Face row it comes from."""
    g, r, p, n = cfg.n_groups, cfg.mamba_heads_per_group, cfg.mamba_head_dim, cfg.ssm_state_size
    d_inner, gn = g * r * p, g * n
    z0, x0, b0, c0, dt0 = 0, d_inner, 2 * d_inner, 2 * d_inner + gn, 2 * d_inner + 2 * gn
    rows = []
    for k in range(g):
        rows += [
            torch.arange(z0 + k * r * p, z0 + (k + 1) * r * p),
            torch.arange(x0 + k * r * p, x0 + (k + 1) * r * p),
            torch.arange(b0 + k * n, b0 + (k + 1) * n),
            torch.arange(c0 + k * n, c0 + (k + 1) * n),
            torch.arange(dt0 + k * r, dt0 + (k + 1) * r),
        ]
    return torch.cat(rows)


def mamba_conv_order(cfg: NemotronHConfig) -> torch.Tensor:
    """For each native `conv1d` channel, the Hugging Face channel it comes from."""
    g, r, p, n = cfg.n_groups, cfg.mamba_heads_per_group, cfg.mamba_head_dim, cfg.ssm_state_size
    d_inner, gn = g * r * p, g * n
    rows = []
    for k in range(g):
        rows += [
            torch.arange(k * r * p, (k + 1) * r * p),
            torch.arange(d_inner + k * n, d_inner + (k + 1) * n),
            torch.arange(d_inner + gn + k * n, d_inner + gn + (k + 1) * n),
        ]
    return torch.cat(rows)


def _mamba_reorders(cfg: NemotronHConfig) -> dict[str, torch.Tensor]:
    conv = mamba_conv_order(cfg)
    return {"in_proj.weight": mamba_in_proj_order(cfg), "in_proj.bias": mamba_in_proj_order(cfg),
            "conv1d.weight": conv, "conv1d.bias": conv}


def mixer_tensor(name: str, cfg: NemotronHConfig) -> tuple[str | None, str]:
    """(block kind, name below `mixer.`) of a native tensor name in a main (`model.layers.{i}`) or MTP
    (`mtp.layers.{i}`) block's mixer; (None, "") for any other tensor or a block past the config's."""
    parts = name.split(".")
    if len(parts) <= 4 or parts[0] not in ("model", "mtp") or parts[1] != "layers" or parts[3] != "mixer":
        return None, ""
    kinds = cfg.block_types if parts[0] == "model" else cfg.mtp_block_types
    i = int(parts[2])
    return (kinds[i] if i < len(kinds) else None), ".".join(parts[4:])


def dtype_template(hf_name: str) -> str:
    """A checkpoint tensor's name with its block and expert numbers as `*`: tensors of one template
    share a dtype in the checkpoints seen in the wild, so a few entries record them all."""
    return _INDEX.sub(lambda m: f".{m.group(1)}.*.", hf_name)


def checkpoint_weight_dtypes(path: str) -> dict[str, str]:
    """The dtype of every tensor template of a Hugging Face directory, read from the file headers."""
    from safetensors import safe_open

    by_name: dict[str, str] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                dtype = str(f.get_slice(name).get_dtype())
                by_name[name] = _SAFETENSORS_DTYPES.get(dtype, dtype)
    dtypes: dict[str, str] = {}
    for name, dtype in by_name.items():
        dtypes.setdefault(dtype_template(name), dtype)
    # A tensor unlike the others of its template is recorded by its own name.
    dtypes |= {name: dtype for name, dtype in by_name.items() if dtypes[dtype_template(name)] != dtype}
    return dtypes


# FP8 weights are read as bf16 (fp8.py) and exported so: an export writes no FP8.
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "F8_E4M3": "bfloat16"}


# ------------------------------------------------------------------------------- state dicts
def native_weight_name(name: str) -> str:
    """A released tensor's native name (`backbone.` -> `model.`; one expert's weight -> the stacked one)."""
    if name.startswith("backbone."):
        name = "model." + name[len("backbone."):]
    m = _EXPERT.match(name)
    return f"{m.group(1)}.{m.group(3)}" if m else name


def hf_to_native(state: dict[str, torch.Tensor], cfg: NemotronHConfig) -> dict[str, torch.Tensor]:
    """Rename and reorder a Hugging Face state dict (either layout) into native names and order."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    reorders = _mamba_reorders(cfg)
    for key, value in state.items():
        if key.startswith("backbone."):
            key = "model." + key[len("backbone."):]
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
            continue
        block, suffix = mixer_tensor(key, cfg)
        if block == "mamba" and suffix in reorders:
            value = value[reorders[suffix]]
        out[key] = value
    for prefix, per_expert in experts.items():
        for proj in ("up_proj", "down_proj"):
            missing = [e for e in range(cfg.n_routed_experts) if proj not in per_expert.get(e, {})]
            if missing:
                raise CheckpointError(f"{prefix}: {proj} missing for experts {missing[:8]}")
            out[f"{prefix}.{proj}"] = torch.stack([per_expert[e][proj] for e in range(cfg.n_routed_experts)])
    return out


def native_to_hf(state: dict[str, torch.Tensor], cfg: NemotronHConfig) -> dict[str, torch.Tensor]:
    """Native state dict -> the released layout (`backbone.*`, one tensor per expert)."""
    reorders = {k: torch.argsort(v) for k, v in _mamba_reorders(cfg).items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        block, suffix = mixer_tensor(key, cfg)
        if block == "mamba" and suffix in reorders:
            value = value[reorders[suffix]]
        if block == "moe" and suffix in ("experts.up_proj", "experts.down_proj"):
            parts = key.split(".")
            base = ("backbone." if parts[0] == "model" else "mtp.") + ".".join(parts[1:-1])
            for e in range(value.shape[0]):
                out[f"{base}.{e}.{parts[-1]}.weight"] = value[e].contiguous()
            continue
        if key.startswith("model."):
            key = "backbone." + key[len("model."):]
        out[key] = value.contiguous()
    return out


# ------------------------------------------------------------------------------- files
def safetensors_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face directory (single file or sharded index)."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
    elif os.path.exists(os.path.join(path, SAFE_SINGLE)):
        files = [os.path.join(path, SAFE_SINGLE)]
    else:
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not found:
            raise CheckpointError(
                f"{path}: no {SAFE_SINGLE}, {SAFE_INDEX} or other .safetensors file; "
                "point at a Hugging Face model directory"
            )
        files = [os.path.join(path, n) for n in found]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise CheckpointError(f"{path}: the index names files that do not exist: {missing}")
    return files


def weight_file_problem(path: str | Path) -> str | None:
    """Why the weights of Hugging Face directory `path` are ambiguous, or None.

    A sharded index beside a single `model.safetensors` it does not name is what an export over an
    older one leaves: this loader would read the index's files and transformers the single file,
    so the two would train and serve different weights."""
    index, single = Path(path) / SAFE_INDEX, Path(path) / SAFE_SINGLE
    if not (index.is_file() and single.is_file()):
        return None
    try:
        named = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{index}: unreadable index ({type(e).__name__}: {e})"
    if named == {SAFE_SINGLE}:
        return None
    return (
        f"{path}: holds both {SAFE_SINGLE} and {SAFE_INDEX} naming other files ({sorted(named)[:3]}), so which "
        "weights load depends on the loader; one of them is left over from an earlier save. Fix: delete the "
        "stale files, or export again with `python -m recipes.export CHECKPOINT OUT --overwrite`."
    )


def safetensors_file_problem(path: str | Path) -> str | None:
    """Why `path` is not a whole safetensors file (missing, cut short, a damaged header), or None. Reads
    the header only: safetensors checks that it covers every byte of the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (OSError, SafetensorError) as e:
        return f"{path}: not a whole safetensors file ({e})"
    return None


def read_safetensors(files: Iterable[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_pretrained(cls, path: str, **config_overrides):
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory; expected a Hugging Face model directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    import dataclasses

    cfg = dataclasses.replace(NemotronHConfig.from_hf(path), weight_dtypes=checkpoint_weight_dtypes(path),
                              **config_overrides)
    model = cls(cfg)
    load_hf_weights(model, path)
    return model


def load_hf_weights(model, path: str) -> None:
    """Copy a Hugging Face checkpoint's tensors into `model` (unsharded), checking names and shapes."""
    state = read_safetensors(safetensors_files(path))
    if (fmt := checkpoint_fp8_format(path)) is not None:
        state = dequantize_state(state, fmt)
    state = hf_to_native(state, model.config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(mismatch_message(path, missing, unexpected))
    bad = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{path}: tensor shapes differ from the model's (name, file, model): {bad[:6]}")
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(state[k])


def mismatch_message(path: str, missing: list[str], unexpected: list[str]) -> str:
    """Why a checkpoint's tensors and the model's differ; with MTP tensors among them, how to match the MTP layers."""
    message = (
        f"{path}: does not match the model built from its config.json: "
        f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
        f"unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
    )
    if any(n.startswith("mtp.") for n in missing + unexpected):
        message += (
            "; the checkpoint's multi-token-prediction tensors (mtp.*) and the model's MTP layers differ, and "
            "tensors the model has no place for would be lost on export. Fix: make num_nextn_predict_layers and "
            "mtp_hybrid_override_pattern in its config.json (or model.num_nextn_predict_layers / model.mtp_pattern) "
            "match its mtp.layers.* tensors"
        )
    return message


def in_saved_dtypes(state: dict[str, torch.Tensor], weight_dtypes: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """Each floating tensor in the dtype its source checkpoint stored it in (when the model came from one)."""
    if not weight_dtypes:
        return state
    out = {}
    for name, value in state.items():
        dtype = weight_dtypes.get(name) or weight_dtypes.get(dtype_template(name))
        out[name] = value.to(getattr(torch, dtype)) if dtype and value.is_floating_point() else value
    return out


def save_pretrained(model, path: str, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = native_to_hf({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.config)
    state = in_saved_dtypes(state, model.config.weight_dtypes)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SAFE_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in state.values())
        with open(os.path.join(path, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    dtype = next(iter(state.values())).dtype
    hf_config = model.config.to_hf_dict()
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
