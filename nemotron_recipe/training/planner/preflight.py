"""The launch's pre-flight: before any model is allocated, each rank estimates its peak memory and
stops (the same way on every rank) when it exceeds what its device has.

A GPU has its total memory; a CPU process the host's available memory (/proc/meminfo MemAvailable)
shared by the ranks on the host. `NR_DEVICE_MEMORY_GIB` overrides what is detected.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from .estimate import Planner
from .launch import GIB, Launch, evaluate
from .report import suggestion_lines
from .suggest import suggest

log = logging.getLogger(__name__)
MEMORY_OVERRIDE = "NR_DEVICE_MEMORY_GIB"


class PreflightError(RuntimeError):
    """The launch would not fit in the device's memory; the message gives the estimate and fixes."""


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def device_memory(device: str) -> tuple[int, str]:
    """(bytes one rank may use, the device it is on: "cuda" or "cpu")."""
    kind = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if os.environ.get(MEMORY_OVERRIDE):
        return int(float(os.environ[MEMORY_OVERRIDE]) * GIB), kind
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.cuda.get_device_properties(local).total_memory, kind
    return _available_host_memory() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")), kind


def _where(outcome) -> str:
    """Which pipeline rank the figure is for (the one that needs the most)."""
    if outcome.pipeline is None:
        return ""
    return f" on pipeline rank {outcome.pipeline.rank} of {outcome.launch.plan.pp}"


def preflight(cfg: Any, validated: tuple, world_size: int) -> None:
    """Raises `PreflightError` (or warns, under `trainer.preflight=warn`) when the launch will not fit."""
    mode = cfg.trainer.preflight
    if mode is False:
        return
    if dist.is_initialized():
        log.info("pre-flight skipped: a process group already exists in this process")
        return
    budget, kind = device_memory(cfg.trainer.device)
    launch = Launch.from_config(cfg, world_size, budget, kind, validated=validated)
    planner = Planner(launch.config, launch.work, launch.trainability)
    outcome = evaluate(planner, launch)
    if outcome.fits:
        log.info("pre-flight: %.2f GiB per rank of %.2f GiB", outcome.estimate.device_total / GIB, budget / GIB)
        return
    at_least = "" if outcome.estimate.trace is not None else "at least "
    lines = [(f"pre-flight: this launch needs {at_least}{outcome.estimate.device_total / GIB:.2f} GiB per rank "
             f"(parameters {outcome.estimate.state.params / GIB:.2f}, gradients {outcome.estimate.state.grads / GIB:.2f}, "
             f"optimizer {outcome.estimate.state.optimizer / GIB:.2f} GiB, plus activations){_where(outcome)}, but the "
             f"{kind} has {budget / GIB:.2f} GiB per rank. Fix, ranked:")]
    lines += suggestion_lines(suggest(planner, launch, outcome, limit=5)) or [
        "  no single change tried fits (up to 64x the ranks): a smaller model or a device with more memory"]
    lines.append("Plan other layouts with `python -m recipes.plan <the same overrides>`, or skip this check with "
                 "trainer.preflight=false.")
    message = "\n".join(lines)
    if mode == "warn":
        log.warning(message)
        return
    raise PreflightError(message)
