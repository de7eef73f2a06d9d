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
import math
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
    pcie_gbps: float = 512.0  # host link (CPU offload's copies): PCIe Gen5 x16
    devices_per_node: int = 8
    format: str = "text"  # text | json
    suggestions: int = 8


@dataclass
class PlanEntryConfig(FinetuneConfig):
    plan: PlanConfig = field(default_factory=PlanConfig)


ConfigStore.instance().store(name="plan_schema", node=PlanEntryConfig)

_USER_ERRORS = (ConfigError, ModelConfigError, MeshError, ParallelConfigError)
# The trainer settings a released preset is planned with unless the command line sets them.
DEFAULTED = ("trainer.seq_len", "trainer.micro_batch_size", "trainer.global_batch_size")


def plan_problems(p) -> list[str]:
    """The `plan` group's numbers: sizes and speeds must be positive and finite."""
    errors = []
    if p.world_size is not None and p.world_size < 1:
        errors.append(f"plan.world_size={p.world_size}: must be >= 1. Fix: the number of processes to launch, or null "
                      "for what the mesh needs.")
    for name, example in (("device_memory_gib", "80"), ("tflops_per_device", "989"), ("link_gbps", "3600"),
                          ("ib_gbps", "400"), ("pcie_gbps", "512")):
        value = getattr(p, name)
        if not (math.isfinite(value) and value > 0):
            errors.append(f"plan.{name}={value}: must be a positive finite number. Fix: e.g. plan.{name}={example}.")
    if p.devices_per_node < 1:
        errors.append(f"plan.devices_per_node={p.devices_per_node}: must be >= 1. Fix: e.g. plan.devices_per_node=8.")
    if p.suggestions < 0:
        errors.append(f"plan.suggestions={p.suggestions}: must be >= 0. Fix: e.g. plan.suggestions=8.")
    return errors


def released_defaults(cfg: DictConfig, world: int, explicit: set[str]) -> str | None:
    """A released preset is planned at its own sequence length (PRESET_SEQ_LEN), one sequence per micro-batch
    and one micro-batch per data-parallel rank and step, where the command line leaves those unset; returns
    the line that says so, or None (the tiny preset, a checkpoint of no released shape, all three set)."""
    from nemotron_recipe.config import build_model_config
    from nemotron_recipe.distributed.plan import ParallelPlan
    from nemotron_recipe.models.hub import resolve_pretrained
    from nemotron_recipe.models.nemotron_v3.config import PRESET_SEQ_LEN, matching_preset

    if cfg.model.pretrained:  # a hub id: its config.json alone, as validate_config will fetch it
        cfg.model.pretrained = resolve_pretrained(cfg.model.pretrained, config_only=True)
    name = matching_preset(build_model_config(cfg.model)) if cfg.model.pretrained else cfg.model.preset
    unset = [k for k in DEFAULTED if k not in explicit]
    if name in (None, "tiny") or name not in PRESET_SEQ_LEN or not unset:
        return None
    t = cfg.trainer
    if "trainer.seq_len" in unset:
        t.seq_len = PRESET_SEQ_LEN[name]
    if "trainer.micro_batch_size" in unset:
        t.micro_batch_size = 1
    if "trainer.global_batch_size" in unset:
        t.global_batch_size = t.micro_batch_size * ParallelPlan.from_config(cfg, world).dp_size
    return (f"planned with {name}'s defaults for {', '.join(unset)}: sequences of {t.seq_len} tokens, micro-batch "
            f"{t.micro_batch_size}, global batch {t.global_batch_size} (one micro-batch per data-parallel rank); "
            "set them to plan others")


def plan_report(cfg: DictConfig, explicit: set[str] | None = None) -> tuple[dict, str]:
    """(the report as a dict, as text) for `cfg`. `explicit`: the keys the command line set; with it, a
    released preset's unset trainer sizes take that model's defaults (`released_defaults`)."""
    from nemotron_recipe.training.planner.comms import Hardware
    from nemotron_recipe.training.planner.estimate import Planner
    from nemotron_recipe.training.planner.launch import GIB, Launch, evaluate
    from nemotron_recipe.training.planner.report import as_dict, as_text
    from nemotron_recipe.training.planner.suggest import speedups, suggest

    p = cfg.plan
    if p.format not in ("text", "json"):
        raise ConfigError(f"plan.format={p.format!r}: unknown. Fix: use text or json (or pass --json).")
    if problems := plan_problems(p):
        raise ConfigError("invalid plan:\n  " + "\n  ".join(problems))
    world = p.world_size or processes_needed(cfg.mesh)
    defaults = released_defaults(cfg, world, explicit) if explicit is not None else None
    hw = Hardware(p.tflops_per_device, p.link_gbps, p.ib_gbps, p.devices_per_node, p.pcie_gbps)
    launch = Launch.from_config(cfg, world, int(p.device_memory_gib * GIB), "cuda", hw)
    planner = Planner(launch.config, launch.work, launch.trainability)
    outcome = evaluate(planner, launch)
    if outcome.fits:
        suggestions = speedups(planner, launch, limit=p.suggestions)
    else:
        suggestions = suggest(planner, launch, outcome, limit=p.suggestions)
    report, text = as_dict(outcome, suggestions), as_text(outcome, suggestions)
    if defaults:
        report["defaults"], text = defaults, f"{defaults}\n{text}"
    return report, text


@hydra.main(version_base=None, config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    explicit = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    try:
        report, text = plan_report(cfg, explicit)
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
