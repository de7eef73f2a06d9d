"""`eval.tasks` at the end of training: lm-eval tasks on the run's final checkpoint.

Rank 0 loads the checkpoint the run just saved whole, as `recipes.evaluate` would (so the numbers
are that command's), and runs the tasks on its device; the other ranks wait for its metrics. The
training model is not used: under any mesh it is sharded, and lm-eval scores one process's batches.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from nemotron_recipe.training.checkpoint import Checkpointer, rank0_reads

log = logging.getLogger(__name__)


def evaluate_final_checkpoint(cfg: Any, checkpointer: Checkpointer, device: torch.device) -> dict[str, float]:
    """`{"eval/<task>/<metric>": value}` of `cfg.eval.tasks` on the newest checkpoint, on every rank."""
    source = checkpointer.last_saved or checkpointer.resume_from
    tasks = list(cfg.eval.tasks)

    def work() -> dict[str, float]:
        from nemotron_recipe.evaluation.harness import metric_rows, run_tasks
        from nemotron_recipe.training.load import load_for_inference

        began = time.perf_counter()
        loaded = load_for_inference(source, device=device)
        results = run_tasks(loaded.model, loaded.tokenizer, tasks, limit=cfg.eval.limit,
                            batch_size=cfg.trainer.micro_batch_size, context_length=loaded.context_length)
        del loaded
        log.info("eval.tasks %s on %s in %.1f s", tasks, source, time.perf_counter() - began)
        return metric_rows(results)

    # Rank 0 reads the checkpoint alone while the others wait in `on_rank0`: its own group for the read.
    with rank0_reads():
        return checkpointer.on_rank0(work)
