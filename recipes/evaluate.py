"""Evaluate a model on lm-eval tasks: `python -m recipes.evaluate PATH --tasks T1,T2 [options]`.

PATH is a training checkpoint (a `step_N` directory, or the run or checkpoints directory holding
them; full or LoRA) or a Hugging Face model directory. The model runs natively, in one process,
without an export. `tiny_sft_mc`, shipped in nemotron_recipe/evaluation/tasks, runs offline; any of
lm-eval's tasks (or your own, with --include-path) runs too. Needs the `eval` extra:
pip install -e '.[eval]'.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# Before anything imports torch: OpenMP reads its thread settings once, when torch loads it, and on
# cores other jobs share its spinning threads make decoding steps many times slower.
from nemotron_recipe.training.threads import choose_threads

choose_threads()

from nemotron_recipe.evaluation.tasks import EvalError, parse_tasks, prepare_network, require_lm_eval  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="training checkpoint (step_N, run or checkpoints directory) or "
                        "Hugging Face model directory")
    parser.add_argument("--tasks", help="comma-separated lm-eval task names, e.g. tiny_sft_mc")
    parser.add_argument("--limit", type=float, help="at most this many examples per task (below 1: that fraction)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    parser.add_argument("--output", type=Path, help="write the results (and with --log-samples every request) as JSON")
    parser.add_argument("--log-samples", action="store_true", help="keep each request's inputs and scores in --output")
    parser.add_argument("--include-path", action="append", default=[], help="a directory of task YAML files (repeatable)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights and compute (default fp32)")
    parser.add_argument("--max-length", type=int, help="context length in tokens (default: the model's, 4096 "
                        "when its config names none)")
    parser.add_argument("--list-tasks", action="store_true", help="print every task name lm-eval knows here and exit")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.path is None:
        raise EvalError("PATH: missing. Fix: python -m recipes.evaluate CHECKPOINT_OR_MODEL_DIR --tasks tiny_sft_mc.")
    if args.limit is not None and args.limit <= 0:
        raise EvalError(f"--limit {args.limit:g}: must be > 0. Fix: a number of examples, or a fraction below 1.")
    for name in ("batch_size", "num_fewshot", "max_length"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "num_fewshot" else 1):
            raise EvalError(f"--{name.replace('_', '-')} {value}: must be {'>= 0' if name == 'num_fewshot' else '> 0'}.")
    if args.log_samples and args.output is None:
        raise EvalError("--log-samples: keeps the samples in --output, which is not set. Fix: add --output FILE.")


def _device(spec: str) -> str:
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"--device {spec}: CUDA is not available here. Fix: --device cpu.")
    return spec


def evaluate(args: argparse.Namespace) -> dict:
    """Checks every input (cheapest first), then loads the model and runs the tasks."""
    _check_args(args)
    tasks = parse_tasks(args.tasks or "")
    offline = prepare_network(tasks)  # before any Hugging Face library is imported
    require_lm_eval()
    from nemotron_recipe.evaluation.harness import run_tasks
    from nemotron_recipe.evaluation.tasks import check_tasks, task_manager
    from nemotron_recipe.training.load import load_for_inference, source_kind

    source_kind(args.path)
    manager = task_manager(tasks, args.include_path)
    check_tasks(manager, tasks, offline=offline, include_paths=args.include_path)
    loaded = load_for_inference(args.path, device=_device(args.device), dtype=args.dtype)
    logging.getLogger(__name__).info("evaluating %s", loaded.describe())
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    return run_tasks(loaded.model, loaded.tokenizer, tasks, limit=limit, num_fewshot=args.num_fewshot,
                     batch_size=args.batch_size, context_length=args.max_length or loaded.context_length,
                     log_samples=args.log_samples, manager=manager) | {"model_path": str(loaded.path),
                                                                        "model_kind": loaded.kind}


def _list_tasks(include_paths: list[str]) -> None:
    prepare_network(["*"])
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    from nemotron_recipe.evaluation.tasks import SHIPPED_DIR

    print("\n".join(TaskManager(include_path=[SHIPPED_DIR, *include_paths]).all_tasks))


def _write(results: dict, out: Path) -> None:
    keep = {k: results[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                                    "samples", "model_path", "model_kind") if k in results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(keep, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError

    try:
        if args.list_tasks:
            _list_tasks(args.include_path)
            return 0
        results = evaluate(args)
    except (EvalError, CheckpointError, ModelConfigError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output is not None:
        _write(results, args.output)
        print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
