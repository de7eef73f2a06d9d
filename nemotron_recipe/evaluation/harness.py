"""lm-eval tasks on a loaded native model: the run behind `recipes.evaluate` and `eval.tasks`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemotron_recipe.evaluation.tasks import check_tasks, prepare_network, require_lm_eval, task_manager


def run_tasks(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    context_length: int = 4096,
    include_paths: Sequence[str | Path] = (),
    log_samples: bool = False,
    manager: Any = None,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` on `model`: its result dict (`results`, `configs`, and with
    `log_samples` the per-request `samples`). Task names are checked first unless `manager` is given
    by a caller that checked them."""
    require_lm_eval()
    if manager is None:
        offline = prepare_network(tasks)
        manager = task_manager(tasks, include_paths)
        check_tasks(manager, tasks, offline=offline, include_paths=include_paths)
    import lm_eval

    from nemotron_recipe.evaluation.lm import NativeLM

    lm = NativeLM(model, tokenizer, batch_size=batch_size, max_length=context_length)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples)


def metric_rows(results: dict[str, Any]) -> dict[str, float]:
    """`{"eval/<task>/<metric>": value}` for every numeric metric of lm-eval's `results` (filter names
    other than lm-eval's default `none` kept after the metric: `acc,strict` -> `acc/strict`)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key in ("sample_len",):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}/{filt}"
            out[f"eval/{task}/{name}"] = float(value) if math.isfinite(value) else None
    return out
