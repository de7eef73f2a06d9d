"""Runs several pipeline-parallel recipe configs one after another in a single torchrun launch.

Usage: torchrun ... tests/distributed/pipeline_worker.py '[{"overrides": [...], "plant": null}, ...]'

Each entry is one run (Hydra overrides of conf/finetune.yaml). `plant` names a fault planted for that
run only, to show that the parity checks catch it:
- "drop_block": the second stage skips its first block (a wrong stage boundary);
- "no_normaliser": the last stage does not divide by the step's trained tokens;
- "nan_first_stage": the first stage's output turns NaN in the second step (the non-finite guard's case).
`record` names what a run writes down besides its metrics:
- "checkpointed": each rank's activation-checkpointed blocks (by index in the full model) and how often
  their forwards ran inside and outside the checkpoint wrapper, in RUN_DIR/checkpointed_rank{R}.json.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from hydra import compose, initialize_config_dir

from nemotron_recipe.distributed.env import init_distributed, teardown
from nemotron_recipe.models.nemotron_v3 import parallelization
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


def _record_checkpointed(run_dir: Path) -> ExitStack:
    """Notes which blocks the parallelizer wraps for recomputation (their keys in the decoder's, or the MTP
    layers', container) and counts their forwards: a wrapped block's inner forward runs again in the
    backward, so it outnumbers the wrapper's."""
    apply, calls, wrapped = parallelization.apply_activation_checkpointing, Counter(), []

    def count(key: str):
        return lambda module, args: calls.update([key])

    def recording(container, blocks, mode, every):
        out = apply(container, blocks, mode, every)
        keys = sorted(container.keys(), key=int) if isinstance(container, torch.nn.ModuleDict) else range(len(out))
        for key, block in zip(keys, out):
            inner = getattr(block, "_checkpoint_wrapped_module", None)
            if inner is not None:
                wrapped.append(int(key))
                block.register_forward_pre_hook(count("outer"))
                inner.register_forward_pre_hook(count("inner"))
        return out

    stack = ExitStack()
    stack.enter_context(mock.patch.object(parallelization, "apply_activation_checkpointing", recording))
    stack.callback(lambda: (run_dir / f"checkpointed_rank{torch.distributed.get_rank()}.json").write_text(
        json.dumps({"blocks": sorted(wrapped), **calls})))
    return stack


RECORDERS = {"checkpointed": _record_checkpointed}


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
                    if job.get("record"):
                        run_dir = Path(next(o for o in job["overrides"] if o.startswith("run_dir=")).split("=", 1)[1])
                        stack.enter_context(RECORDERS[job["record"]](run_dir))
                    run(compose(config_name="finetune", overrides=job["overrides"]))
        failed = False
    finally:
        teardown(failed=failed)


if __name__ == "__main__":
    main()
