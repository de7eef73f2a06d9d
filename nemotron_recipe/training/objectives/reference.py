"""DPO's reference model: what log ref(y|x) is computed with (`objective.reference`).

- `base`: the policy itself with its LoRA adapters switched off, under no_grad: the frozen base, with
  no second model and no parameter memory added.
- `copy`: a frozen copy of the run's starting weights, built, sharded and loaded like the policy
  (full fine-tuning; its parameters cost what the policy's do, without gradients or optimizer state).
- `precomputed`: the starting policy's log-probs of every training and validation pair, computed once
  before the first step and cached in the run directory (`reference_logps.pt`); a resumed run reads
  them back, so no reference forward runs during training.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nemotron_recipe.config import ConfigError
from nemotron_recipe.data.preference import PreferencePairs
from nemotron_recipe.models.nemotron_v3.lora import adapters_disabled

log = logging.getLogger(__name__)

CACHE_NAME = "reference_logps.pt"

# (model, micro-batch) -> [2 * pairs] response log-probs, chosen halves first.
SequenceLogps = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


class BaseReference:
    """The policy with its adapters off."""

    def __init__(self, model: torch.nn.Module, forward: SequenceLogps) -> None:
        self.model, self.forward = model, forward

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.forward(self.model, batch)


class CopyReference:
    """A frozen model of the starting weights."""

    def __init__(self, model: torch.nn.Module, forward: SequenceLogps) -> None:
        self.model, self.forward = model, forward

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        return self.forward(self.model, batch)


def fingerprint(pairs: PreferencePairs | None) -> str:
    """A digest of the pairs' tokens: a cache made for other data (or another seq_len) is refused."""
    digest = hashlib.sha256()
    if pairs is not None:
        for ids in pairs.sequences.input_ids:
            digest.update(len(ids).to_bytes(4, "little"))
            digest.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


class PrecomputedReference:
    """Looks up each pair's cached reference log-probs: `table[split]` is [pairs, 2] (chosen, rejected)."""

    def __init__(self, table: dict[str, torch.Tensor], device: torch.device) -> None:
        self.table = {k: v.to(device) for k, v in table.items() if v is not None}

    def logps(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        rows = self.table[split][batch["pair_index"].to(self.table[split].device)]
        return torch.cat([rows[:, 0], rows[:, 1]])


def cache_paths(run_dir: Path, resume_from: Path | None) -> list[Path]:
    """Where a run looks for its cache: its own run directory, then that of the checkpoint it resumes."""
    paths = [run_dir / CACHE_NAME]
    if resume_from is not None:
        paths.append(Path(resume_from).parent.parent / CACHE_NAME)
    return paths


def load_cache(paths: list[Path], prints: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The first cache in `paths` made for these pairs, or None."""
    for path in paths:
        if not path.is_file():
            continue
        cache = torch.load(path, map_location="cpu", weights_only=True)
        if cache.get("fingerprints") == prints:
            log.info("reference log-probs read from %s", path)
            return cache["logps"]
        log.warning("%s holds reference log-probs of other data; not used", path)
    return None


def save_cache(path: Path, logps: dict[str, torch.Tensor], prints: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"fingerprints": prints, "logps": logps}, tmp)
    tmp.replace(path)  # a run stopped while writing never leaves half a cache


def missing_cache_error(paths: list[Path]) -> RuntimeError:
    return ConfigError(
        f"objective.reference=precomputed: this run resumes training, but no reference log-probs for its data "
        f"are cached at {[str(p) for p in paths]}; they can only be computed from the starting weights. Fix: "
        "restore the run directory's reference_logps.pt, or start the run afresh (checkpoint.resume=none)."
    )


def compute_table(pairs: PreferencePairs, batches: Any, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                  reduce: Callable[[torch.Tensor], torch.Tensor], keep: float, device: torch.device) -> torch.Tensor:
    """[pairs, 2] log-probs from this rank's `batches` (with `pair_index` and `valid`), summed over the
    ranks by `reduce`; `keep` (1 on one rank of each context-parallel group, else 0) counts each pair once."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float32, device=device)
    for batch in batches:
        with torch.no_grad():
            logps = forward(batch).float()
        b = batch["pair_index"].numel()
        valid = batch["valid"].to(device)
        index = batch["pair_index"].to(device)[valid]
        table[index, 0] = logps[:b][valid] * keep
        table[index, 1] = logps[b:][valid] * keep
    return reduce(table)
