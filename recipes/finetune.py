"""Fine-tune a Nemotron-H model: `python -m recipes.finetune [overrides...]` (see conf/finetune.yaml)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

# Importing the config module registers the schema and resolvers that conf/finetune.yaml uses.
from nemotron_recipe.config import ConfigError
from nemotron_recipe.data import DataError
from nemotron_recipe.distributed import MeshError, ParallelConfigError
from nemotron_recipe.distributed.env import DistributedSetupError
from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError

# Mistakes in the settings or inputs get their message alone; a traceback would only bury it.
_USER_ERRORS = (
    ConfigError, ModelConfigError, CheckpointError, DataError, DistributedSetupError, MeshError, ParallelConfigError
)


@hydra.main(version_base=None, config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    from nemotron_recipe.training.finetune import run

    try:
        run(cfg)
    except _USER_ERRORS as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
