"""Plan a fine-tuning launch on this machine, for any world size, without starting it:

    python -m recipes.plan model=nemotron_h_56b mesh.tp=8 plan.world_size=64 plan.device_memory_gib=80
    python -m recipes.plan model=nemotron_h_8b plan.world_size=8 --json

Takes every override `recipes.finetune` takes, plus the `plan` group (conf/plan.yaml, `PlanConfig`).
Prints per rank the parameters, gradients, optimizer state, activations and total against the device
memory with a verdict, the bytes each rank sends per step by collective, a step-time floor, and, when
the launch does not fit, ranked changes that would make it fit. Exit code 0 when it fits, 2 when not.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from nemotron_recipe.config import ConfigError, FinetuneConfig
from nemotron_recipe.distributed import MeshError, ParallelConfigError
from nemotron_recipe.distributed.plan import processes_needed
from nemotron_recipe.models.nemotron_v3 import ModelConfigError


@dataclass
class PlanConfig:
    """The launch to plan for. Hardware defaults: H100/H200 SXM (989 dense bf16 TFLOP/s, NVLink 4 at
    450 GB/s = 3600 Gbit/s per direction within a node of 8, one 400 Gbit/s NDR InfiniBand port per GPU)."""

    world_size: int | None = None  # None: the processes the mesh needs (recipes.mesh_size)
    device_memory_gib: float = 80.0
    tflops_per_device: float = 989.0
    link_gbps: float = 3600.0
    ib_gbps: float = 400.0
    devices_per_node: int = 8
    format: str = "text"  # text | json
    suggestions: int = 8


@dataclass
class PlanEntryConfig(FinetuneConfig):
    plan: PlanConfig = field(default_factory=PlanConfig)


ConfigStore.instance().store(name="plan_schema", node=PlanEntryConfig)

_USER_ERRORS = (ConfigError, ModelConfigError, MeshError, ParallelConfigError)


def plan_report(cfg: DictConfig) -> tuple[dict, str]:
    """(the report as a dict, as text) for `cfg`."""
    from nemotron_recipe.training.planner.comms import Hardware
    from nemotron_recipe.training.planner.estimate import Planner
    from nemotron_recipe.training.planner.launch import GIB, Launch, evaluate
    from nemotron_recipe.training.planner.report import as_dict, as_text
    from nemotron_recipe.training.planner.suggest import suggest

    p = cfg.plan
    if p.format not in ("text", "json"):
        raise ConfigError(f"plan.format={p.format!r}: unknown. Fix: use text or json (or pass --json).")
    world = p.world_size or processes_needed(cfg.mesh)
    hw = Hardware(p.tflops_per_device, p.link_gbps, p.ib_gbps, p.devices_per_node)
    launch = Launch.from_config(cfg, world, int(p.device_memory_gib * GIB), "cuda", hw)
    planner = Planner(launch.config, launch.work, launch.trainability)
    outcome = evaluate(planner, launch)
    suggestions = [] if outcome.fits else suggest(planner, launch, outcome, limit=p.suggestions)
    return as_dict(outcome, suggestions), as_text(outcome, suggestions)


@hydra.main(version_base=None, config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        report, text = plan_report(cfg)
    except _USER_ERRORS as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(report, indent=2) if cfg.plan.format == "json" else text)
    sys.exit(0 if report["fits"] else 2)


if __name__ == "__main__":
    from recipes.cli import HELP_FLAGS, check_override_keys, print_help

    check_override_keys([a for a in sys.argv[1:] if a != "--json"], PlanEntryConfig)
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help([a for a in sys.argv[1:] if a != "--json"], "plan", "plan")
        sys.exit(0)
    if "--json" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--json"] + ["plan.format=json"]
    main()
