"""Fine-tune a Nemotron-H model: `python -m recipes.finetune [overrides...]` (see conf/finetune.yaml)."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

# Importing the config module registers the schema and resolvers that conf/finetune.yaml uses.
from nemotron_recipe.config import ConfigError
from nemotron_recipe.data import DataError
from nemotron_recipe.distributed import MeshError, ParallelConfigError
from nemotron_recipe.distributed.env import DistributedSetupError
from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError
from nemotron_recipe.training.nonfinite import NonFiniteError
from nemotron_recipe.training.planner.preflight import PreflightError

# Mistakes in the settings or inputs, and a diverged run, get their message alone; a traceback would
# only bury it.
_USER_ERRORS = (
    ConfigError, ModelConfigError, CheckpointError, DataError, DistributedSetupError, MeshError, ParallelConfigError,
    NonFiniteError, PreflightError,
)


@hydra.main(version_base=None, config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    from nemotron_recipe.training.finetune import run

    try:
        run(cfg)
    except _USER_ERRORS as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)


def _only_rank0_writes_hydra_files(argv: list[str]) -> None:
    """Under torchrun every rank runs Hydra over the same run dir; rank 0 alone writes `.hydra/` and
    the log file there, the others keep to the console."""
    if int(os.environ.get("RANK", "0")) != 0:
        argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


if __name__ == "__main__":
    from nemotron_recipe.config import FinetuneConfig
    from recipes.cli import HELP_FLAGS, check_override_keys, print_help

    check_override_keys(sys.argv[1:], FinetuneConfig)
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help(sys.argv[1:], "finetune", "finetune")
        sys.exit(0)
    _only_rank0_writes_hydra_files(sys.argv)
    main()
