"""Print the number of processes the recipe's mesh needs: `python -m recipes.mesh_size [overrides...]`.

The overrides are those of `python -m recipes.finetune`, composed the same way, so the mesh group and
`mesh.*` keys count exactly as the recipe will read them. The number is the product of the mesh sizes,
an inferred `dp_shard` (-1) counting as 1. launch/torchrun.sh starts that many processes on a machine
without GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

# Importing the config module registers the schema and resolvers that conf/finetune.yaml uses.
import nemotron_recipe.config  # noqa: F401
from nemotron_recipe.distributed.plan import ParallelConfigError, processes_needed

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_mesh(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="finetune", overrides=overrides).mesh


def main(overrides: list[str]) -> int:
    try:
        print(processes_needed(compose_mesh(overrides)))
    except (HydraException, OmegaConfBaseException, ParallelConfigError) as e:
        # As Hydra reports it to the recipe: the message, then the type error behind it.
        print(e, file=sys.stderr)
        if isinstance(e.__cause__, OmegaConfBaseException):
            print(e.__cause__, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
