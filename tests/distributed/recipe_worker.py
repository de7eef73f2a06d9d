"""Runs several recipe configs one after another in a single torchrun launch.

Usage: torchrun ... tests/distributed/recipe_worker.py '[["override", ...], ...]'

Each list is one run (Hydra overrides of conf/finetune.yaml). The process group is started once
and shared by the runs, which saves the launch and rendezvous time of one torchrun per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from nemotron_recipe.distributed.env import init_distributed, teardown
from nemotron_recipe.training.finetune import run

CONF = Path(__file__).resolve().parents[2] / "conf"


def main() -> None:
    jobs = json.loads(sys.argv[1])
    init_distributed("cpu")
    failed = True
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            for overrides in jobs:
                run(compose(config_name="finetune", overrides=overrides))
        failed = False
    finally:
        teardown(failed=failed)


if __name__ == "__main__":
    main()
