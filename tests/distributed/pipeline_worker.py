"""Runs several pipeline-parallel recipe configs one after another in a single torchrun launch.

Usage: torchrun ... tests/distributed/pipeline_worker.py '[{"overrides": [...], "plant": null}, ...]'

Each entry is one run (Hydra overrides of conf/finetune.yaml). `plant` names a fault planted for that
run only, to show that the parity checks catch it:
- "drop_block": the second stage skips its first block (a wrong stage boundary);
- "no_normaliser": the last stage does not divide by the step's trained tokens;
- "nan_first_stage": the first stage's output turns NaN in the second step (the non-finite guard's case).
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from hydra import compose, initialize_config_dir

from nemotron_recipe.distributed.env import init_distributed, teardown
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.pipeline import stages

CONF = Path(__file__).resolve().parents[2] / "conf"


def _dropped_block(starts: list[int], num_blocks: int, stage: int) -> range:
    blocks = range(starts[stage], starts[stage + 1] if stage + 1 < len(starts) else num_blocks)
    return blocks[1:] if stage == 1 else blocks


def _unnormalised(self, batches, denominator) -> None:
    self.batches, self.denominator, self.cursors, self.sums = batches, 1.0, {}, {}


def _nan_in_first_stage():
    forward, seen = stages.PipelineStageModel.forward, [0]

    def poisoned(self, *received):
        out = forward(self, *received)
        if self.is_first and self.training and torch.is_grad_enabled():
            seen[0] += 1
            if seen[0] == 5:  # the second step's first micro-batch (four per step)
                out = (out[0] * float("nan"), *out[1:])
        return out

    return mock.patch.object(stages.PipelineStageModel, "forward", poisoned)


PLANTS = {
    "drop_block": lambda: mock.patch.object(stages, "stage_blocks", _dropped_block),
    "no_normaliser": lambda: mock.patch.object(stages.StageInputs, "start", _unnormalised),
    "nan_first_stage": _nan_in_first_stage,
}


def main() -> None:
    jobs = json.loads(sys.argv[1])
    init_distributed("cpu")
    failed = True
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            for job in jobs:
                with ExitStack() as stack:
                    if job.get("plant"):
                        stack.enter_context(PLANTS[job["plant"]]())
                    run(compose(config_name="finetune", overrides=job["overrides"]))
        failed = False
    finally:
        teardown(failed=failed)


if __name__ == "__main__":
    main()
