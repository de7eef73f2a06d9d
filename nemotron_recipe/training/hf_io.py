"""Hugging Face checkpoints straight into the sharded model, and training checkpoints back out.

Import: the model is built on the meta device (no storage, no random init), parallelized, given
storage for its local shards only (`to_empty`), and then every rank reads from the safetensors
files just the slices behind its own shards. No rank ever holds the whole model. Two layout
differences are resolved while reading:
- Mamba2 `in_proj`/`conv1d` rows are group-major in the native model; a local row range maps to a
  few contiguous runs of Hugging Face rows (`mamba_in_proj_order` / `mamba_conv_order`);
- released checkpoints store one tensor per routed expert; a shard of the stacked [E, ...] expert
  tensor reads its experts' tensors (a stacked `model.*` tensor is sliced directly).

Export: a DCP training checkpoint is loaded into an unsharded model in one process without any
process group (DCP reassembles the shards of whatever mesh saved it) and written by the model's
own `save_pretrained`, with the run's tokenizer next to it, carrying the chat template training
rendered with, and a generation_config.json. `export_hf` is the whole export (the
`recipes.export` command); `export_run_checkpoint` is the end of a training run, where every rank
calls it and rank 0 alone exports.

This module reads checkpoints through `checkpoint.py`; that module never imports this one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nemotron_recipe.models.nemotron_v3 import (
    CheckpointError,
    ModelConfigError,
    NemotronHConfig,
    NemotronHForCausalLM,
    build_meta_model,
)
from nemotron_recipe.models.nemotron_v3.checkpoint import (
    mamba_conv_order,
    mamba_in_proj_order,
    mismatch_message,
    mixer_tensor,
    safetensors_files,
    weight_file_problem,
)
from nemotron_recipe.models.nemotron_v3.fp8 import auxiliary as fp8_auxiliary
from nemotron_recipe.models.nemotron_v3.fp8 import checkpoint_fp8_format, is_fp8
from nemotron_recipe.training.checkpoint import (
    Checkpointer,
    check_tensors,
    find_checkpoint,
    load_here,
    rank0_reads,
    read_dcp_metadata,
    read_meta,
    verify_checksums,
)
from nemotron_recipe.training.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, DRAWN_BASE, OUT_PROJ_FACTORS, export_lora

log = logging.getLogger(__name__)

# The weight files of a Hugging Face directory, which an export replaces as a whole.
MODEL_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")

_MAMBA_ROWS = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj", "conv1d.weight": "conv", "conv1d.bias": "conv"}


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """This rank's local tensor and the [start, stop) range it covers in each global dim."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"local shard of shape {tuple(local.shape)} where {tuple(shape)} was computed")
        return local, [(o, o + s) for o, s in zip(offset, shape, strict=True)]
    return t, [(0, s) for s in t.shape]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive integers merged into [start, stop) ranges, order kept."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


class _SafetensorsIndex:
    """Lazy access to the tensors of a Hugging Face directory, by name, one slice at a time."""

    def __init__(self, path: str, stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open

        self.path = path
        self.handles: dict[str, Any] = {}
        for file in safetensors_files(path):
            handle = stack.enter_context(safe_open(file, framework="pt"))
            for name in handle.keys():
                self.handles[name] = handle
        self.used: set[str] = set()
        self.fp8 = checkpoint_fp8_format(path)  # FP8 weights are read as float32 (fp8.py)
        self.dequantized: set[str] = set()  # the FP8 tensors read so far

    def find(self, native: str) -> str | None:
        """The file name of a native tensor name: released (`backbone.*`) or transformers (`model.*`) layout."""
        candidates = [native]
        if native.startswith("model."):
            candidates.insert(0, "backbone." + native[len("model."):])
        return next((c for c in candidates if c in self.handles), None)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name].get_slice(name).get_shape())

    def read(self, name: str, box: list[tuple[int, int]]) -> torch.Tensor:
        self.used.add(name)
        piece = self.handles[name].get_slice(name)[tuple(slice(a, b) for a, b in box)]
        if self.fp8 is not None and is_fp8(piece):
            self.dequantized.add(name)
            piece = self.fp8.dequantize(name, piece, box, self._whole, self.shape(name))
        return piece

    def _whole(self, name: str) -> torch.Tensor:
        if name not in self.handles:
            raise KeyError(name)
        return self.handles[name].get_tensor(name)

    def unexpected(self) -> list[str]:
        """The checkpoint's tensors nothing read; an FP8 checkpoint's scales are read with their weights."""
        left = self.handles.keys() - self.used
        return sorted(n for n in left if self.fp8 is None or not fp8_auxiliary(n))


def _load_per_expert(files: _SafetensorsIndex, name: str, shape: tuple[int, ...], local: torch.Tensor, box,
                     missing: list[str], bad: list) -> None:
    """Fills a stacked expert weight [E, ...] (this rank's `box` of it) from transformers' per-expert
    tensors (`...experts.{e}.up_proj.weight`), or adds what is absent or misshapen to `missing`/`bad`."""
    parts = name.split(".")
    per_expert = [files.find(f"{'.'.join(parts[:-1])}.{e}.{parts[-1]}.weight") for e in range(shape[0])]
    absent = [e for e, n in enumerate(per_expert) if n is None]
    if absent:
        missing.append(f"{name} (experts {absent[:8]})")
        return
    wrong = [(n, files.shape(n), shape[1:]) for n in per_expert if files.shape(n) != shape[1:]]
    if wrong:
        bad.extend(wrong)
        return
    files.used.update(per_expert)
    if local.numel():
        local.copy_(torch.stack([files.read(per_expert[e], box[1:]) for e in range(*box[0])]))


@torch.no_grad()
def load_hf_sharded(
    model: nn.Module, path: str, device: torch.device | str, skip: Callable[[str], bool] | None = None
) -> None:
    """Allocate `model`'s local shards on `device` and fill every parameter and buffer from `path`.

    `model` is a meta-built, parallelized NemotronHForCausalLM; tensors whose names `skip` accepts (LoRA
    adapters) are allocated but not read. Raises `CheckpointError` naming the
    directory and what is missing, left over or of the wrong shape; the same on every rank.
    """
    cfg: NemotronHConfig = model.config
    problem = weight_file_problem(path)
    if problem:
        raise CheckpointError(problem)
    model.to_empty(device=device)
    orders = {"in_proj": mamba_in_proj_order(cfg), "conv": mamba_conv_order(cfg)}
    # keep_vars: the parameters themselves (DTensors under FSDP/TP), named without wrapper prefixes.
    targets = model.state_dict(keep_vars=True)
    missing: list[str] = []
    bad: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    with contextlib.ExitStack() as stack:
        files = _SafetensorsIndex(path, stack)
        for name, target in targets.items():
            if skip is not None and skip(name):
                continue
            local, box = _local_box(target)
            shape = tuple(target.shape)
            kind, suffix = mixer_tensor(name, cfg)  # main and MTP blocks alike
            source = files.find(name)

            if source is None and kind == "moe" and suffix in ("experts.up_proj", "experts.down_proj"):
                _load_per_expert(files, name, shape, local, box, missing, bad)
                continue
            if source is None:
                missing.append(name)
                continue
            if files.shape(source) != shape:
                bad.append((source, files.shape(source), shape))
                continue
            files.used.add(source)
            if not local.numel():
                continue
            if kind == "mamba" and suffix in _MAMBA_ROWS:
                rows = orders[_MAMBA_ROWS[suffix]][box[0][0]:box[0][1]].tolist()
                value = torch.cat([files.read(source, [run, *box[1:]]) for run in _runs(rows)])
            else:
                value = files.read(source, box)
            local.copy_(value)

        unexpected = files.unexpected()
        if files.fp8 is not None:
            log.info("FP8 checkpoint (%s): %d weights dequantized (fp8 x scale) as they were read",
                     files.fp8.source, len(files.dequantized))
    if bad:
        raise CheckpointError(
            f"{path}: tensor shapes differ from the model's (name, file, model): {bad[:6]}"
            f"{' ...' if len(bad) > 6 else ''}"
        )
    if missing or unexpected:  # every tensor of the checkpoint is loaded or named here
        raise CheckpointError(mismatch_message(path, missing, unexpected))


def load_checkpoint_model(checkpoint: str | Path) -> tuple[NemotronHForCausalLM, dict[str, Any], Path]:
    """The unsharded model stored in a training checkpoint, read in this process alone."""
    path = find_checkpoint(checkpoint)
    meta = read_meta(path)
    try:
        config = NemotronHConfig(**meta["model"])
    except (TypeError, ModelConfigError) as e:
        raise CheckpointError(f"{path}: meta.json's model config does not build a model: {e}") from None
    model = build_meta_model(config)
    model.to_empty(device="cpu")
    state = model.state_dict()
    check_tensors(path, read_dcp_metadata(path), {"model": state})
    verify_checksums(path, meta)
    try:
        load_here({"model": state}, path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own type is not an Exception
        raise CheckpointError(f"{path}: loading failed: {type(e).__name__}: {e}") from None
    return model, meta, path


def _check_export_dir(out: Path, overwrite: bool) -> None:
    """Refuses an `out` that is a file, or a non-empty directory unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory. Fix: export to a directory.")
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if existing and not overwrite:
        raise CheckpointError(
            f"{out}: not empty ({existing[:6]}{' ...' if len(existing) > 6 else ''}); an export into it would leave "
            "its older weight files beside the new ones. Fix: export to a new directory, or pass --overwrite to "
            "replace the model files there."
        )


def _remove_model_files(out: Path) -> None:
    """Deletes the weight files of an earlier export in `out`, so none of them outlives this one."""
    for pattern in MODEL_FILE_PATTERNS:
        for file in out.glob(pattern):
            file.unlink()


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False, merge: bool = False,
              out_proj: str = "save") -> Path:
    """Write a training checkpoint as a consolidated Hugging Face directory; returns it.

    A non-empty `out_dir` is refused unless `overwrite`, which deletes its weight files (only once
    the checkpoint has loaded) before the new ones are written. A checkpoint holding non-finite
    values (saved by a diverged run of an older version) is refused before anything is written.
    A LoRA checkpoint becomes a PEFT adapter, or with `merge` a model with the adapters folded in;
    `out_proj="skip"` leaves its Mamba2 out_proj adapters out of both (training/lora.py)."""
    out = Path(out_dir).expanduser()
    _check_export_dir(out, overwrite)
    path = find_checkpoint(checkpoint)
    meta = read_meta(path)
    if meta.get("peft") or merge:
        return _export_lora(path, meta, out, merge=merge, out_proj=out_proj)
    model, meta, path = load_checkpoint_model(path)
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        raise CheckpointError(
            f"{path}: non-finite values in {bad[:6]}{' ...' if len(bad) > 6 else ''}; the run had diverged when it "
            "saved this checkpoint. Fix: export an earlier checkpoint."
        )

    def write(staging: Path) -> None:
        model.save_pretrained(str(staging))
        save_tokenizer(meta, path, staging)

    _publish(out, write, _tensor_bytes(model.state_dict().values()) + _tokenizer_bytes(meta))
    log.info("exported %s (step %d) to %s", path, meta["step"], out)
    return out


def _export_lora(path: Path, meta: dict[str, Any], out: Path, *, merge: bool, out_proj: str) -> Path:
    """A LoRA checkpoint as a PEFT adapter, or merged into its base (training/lora.py)."""
    if not meta.get("peft"):
        raise CheckpointError(
            f"{path}: --merge applies to LoRA checkpoints; this one is a full fine-tuning checkpoint, which holds "
            "the whole model already. Fix: export it without --merge."
        )
    verify_checksums(path, meta)
    read_dcp_metadata(path)
    # All is loaded and merged before a file is written; the adapter names its export directory, not the staging one.
    staged, nbytes = export_lora(path, meta, merge=merge, out_proj=out_proj, out_dir=out)

    def write(staging: Path) -> None:
        staged(staging)
        save_tokenizer(meta, path, staging)

    _publish(out, write, nbytes + _tokenizer_bytes(meta), replaces=(ADAPTER_CONFIG, ADAPTER_WEIGHTS, OUT_PROJ_FACTORS, DRAWN_BASE))
    log.info("exported %s (step %d, LoRA%s) to %s", path, meta["step"], ", merged" if merge else "", out)
    return out


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tokenizer_bytes(meta: dict[str, Any]) -> int:
    tokenizer = Path(meta.get("tokenizer") or "")
    files = [tokenizer] if tokenizer.is_file() else tokenizer.rglob("*") if tokenizer.is_dir() else []
    return sum(f.stat().st_size for f in files if f.is_file())


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error behind it, is a full disk (safetensors reports it as text)."""
    seen: list[BaseException] = []
    while error is not None and not any(error is s for s in seen):
        seen.append(error)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _no_space(out: Path, needed: int, free: int, when: str) -> CheckpointError:
    return CheckpointError(
        f"{out}: no space left on the device {when}: the export needs about {_size(needed)}, {_size(free)} free. "
        f"Nothing was written to {out}. Fix: free space there, or export to a disk with room."
    )


def _publish(out: Path, write: Callable[[Path], None], needed: int, replaces: tuple[str, ...] = ()) -> None:
    """Writes the export with `write` into a new directory beside `out`, then moves its files into `out`:
    a full disk or any failure leaves `out` as it was. Refused at once when the disk has less room than
    `needed` bytes. An earlier export's weight files (and `replaces`) in `out` go only once the new ones
    are complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if (free := shutil.disk_usage(out.parent).free) < needed:
        raise _no_space(out, needed, free, "before writing")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        write(staging)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, Exception) and _disk_full(e):
            raise _no_space(out, needed, shutil.disk_usage(out.parent).free, "while writing") from None
        raise
    if not out.is_dir():
        os.replace(staging, out)
        return
    _remove_model_files(out)
    for name in replaces:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    for file in staging.iterdir():
        os.replace(file, out / file.name)
    staging.rmdir()


def save_tokenizer(meta: dict[str, Any], path: Path, out: Path) -> None:
    """The run's tokenizer, carrying the chat template training rendered with (`data.chat_template`) in
    tokenizer_config.json, and a generation_config.json with its special ids, so that transformers'
    `apply_chat_template` and `generate` work the way training did."""
    tokenizer = meta.get("tokenizer")
    if not (tokenizer and Path(tokenizer).exists()):
        log.warning("tokenizer %r recorded in %s no longer exists: exported the weights without it", tokenizer, path)
        return
    # Imported here: the data package loads transformers and datasets, which only this export needs.
    from transformers import GenerationConfig

    from nemotron_recipe.data import load_tokenizer
    from nemotron_recipe.data.chat_templates import training_template

    tok = load_tokenizer(tokenizer)
    setting = (meta.get("data") or {}).get("chat_template", "auto")
    template = training_template(tok, setting)
    if template is None:
        log.warning("data.chat_template=%s: the tokenizer carries no Jinja of this format, so the export has no "
                    "chat template; apply_chat_template will not render the training format.", setting)
    tok.chat_template = template
    # An earlier export's template file would win over the one in tokenizer_config.json on loading.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(str(out), save_jinja_files=False)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(out))


def export_run_checkpoint(checkpointer: Checkpointer, out_dir: Path) -> Path:
    """Rank 0 exports this run's newest checkpoint (the last one saved, else the one resumed from) to
    `out_dir` while the others wait; called on every rank, which all get the directory or the same error.
    The directory belongs to the run, so an earlier export of it there is replaced."""
    source = checkpointer.last_saved or checkpointer.resume_from
    if source is None:
        raise CheckpointError("no checkpoint was saved or resumed by this run, so there is nothing to export")
    with rank0_reads():
        return Path(checkpointer.on_rank0(lambda: str(export_hf(source, out_dir, overwrite=True))))
