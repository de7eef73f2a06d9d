"""Which lm-eval tasks exist here, and whether they can run without the network, checked before any
model is loaded.

The shipped tasks live in `SHIPPED_DIR` (one `<task>.yaml` each, data beside it). Directories the
user includes are searched next, and lm-eval's own few thousand tasks last: indexing those takes
seconds, so it happens only when a requested name is not found among the first two.

The Hugging Face libraries read their offline switches when they are imported, so `prepare_network`
runs before anything imports them: a run of shipped tasks only is made offline outright, and any
other run is made offline when the Hub cannot be reached (a task whose dataset is not cached is
then refused by name, with how to use a local copy, instead of waiting on retries).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
SHIPPED_TASKS = tuple(sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml")))
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# `datasets` loaders that read local files named in `dataset_kwargs.data_files`.
FILE_LOADERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}
INSTALL_HINT = "pip install -e '.[eval]'"


class EvalError(ValueError):
    """A bad evaluation request; the message names it and a fix."""


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError(f"evaluation runs through the lm-eval harness, which is not installed. Fix: {INSTALL_HINT} "
                        "(or pip install lm_eval).")


def parse_tasks(spec: str | Sequence[str], where: str = "--tasks") -> list[str]:
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t and t.strip()]
    if not names:
        raise EvalError(f"{where}: no task named. Fix: e.g. {where.split('=')[0]} {SHIPPED_TASKS[0]}.")
    return names


def _env_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in OFFLINE_ENV)


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the Hub (HF_ENDPOINT, else huggingface.co) opens within `timeout`."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def prepare_network(names: Iterable[str]) -> bool:
    """Makes the Hugging Face libraries offline when the run needs no network (shipped tasks only) or has
    none; returns whether the run is offline. Call before transformers, datasets or lm_eval are imported."""
    if _env_offline():
        return True
    if set(names) <= set(SHIPPED_TASKS) or not hub_reachable():
        for key in OFFLINE_ENV:
            os.environ[key] = "1"
        return True
    return False


def task_manager(names: Sequence[str], include_paths: Sequence[str | Path] = ()) -> Any:
    """An lm-eval TaskManager that knows the shipped tasks, `include_paths`, and lm-eval's own tasks when
    a name is not among the first two."""
    from lm_eval.tasks import TaskManager

    for p in include_paths:
        if not Path(p).expanduser().is_dir():
            raise EvalError(f"--include-path {p}: not a directory. Fix: pass a directory holding task YAML files.")
    paths = [SHIPPED_DIR, *(Path(p).expanduser() for p in include_paths)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if all(n in manager.all_tasks for n in names):
        return manager
    return TaskManager(include_path=paths)


def check_tasks(manager: Any, names: Sequence[str], *, offline: bool, include_paths: Sequence[str | Path] = ()) -> None:
    """Refuses unknown task names (listing the local ones and the closest of lm-eval's), and offline, a task
    whose dataset must come from the Hub and is not cached."""
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        local = sorted(set(SHIPPED_TASKS) | {e.name for e in manager.task_index.values()
                                              if e.yaml_path and not _in_harness(e.yaml_path)})
        close = sorted({m for n in unknown for m in difflib.get_close_matches(n, manager.all_tasks, n=5, cutoff=0.6)}
                       - set(local))
        raise EvalError(
            f"--tasks: unknown task(s) {unknown}. Available here: {local}"
            + (f"; close lm-eval names: {close}" if close else "")
            + f". Fix: use one of those, list all {len(manager.all_tasks)} with `python -m recipes.evaluate --list-tasks`, "
            "or pass the directory of your own task YAML with --include-path."
        )
    if not offline:
        return
    for task, path in _hub_datasets(manager, names):
        if not _cached(path):
            raise EvalError(
                f"task {task}: reads dataset {path!r} from the Hugging Face Hub, which this run cannot reach (the Hub "
                "does not answer, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set), and it is not in the local cache. Fix: run once where the Hub is reachable (the dataset is then cached), "
                "or write a task YAML whose dataset_path is a local copy (a directory, or `dataset_path: json` with "
                "local dataset_kwargs.data_files) and pass its directory with --include-path; the shipped tasks "
                f"{list(SHIPPED_TASKS)} run offline."
            )


def _in_harness(path: Path) -> bool:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent in Path(path).resolve().parents


def _hub_datasets(manager: Any, names: Sequence[str]) -> list[tuple[str, str]]:
    """(task, dataset) for each task under `names` (groups and tags expanded) that reads a Hub dataset."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    found, todo, seen = [], list(names), set()
    while todo:
        name = todo.pop()
        entry = manager.task_index.get(name) if isinstance(name, str) else None
        if name in seen or entry is None:
            continue
        seen.add(name)
        if entry.kind == Kind.TAG:
            todo += [e.name for e in manager.task_index.values() if name in (e.tags or ())]
            continue
        cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else (entry.cfg or {})
        if entry.kind == Kind.GROUP:
            members = cfg.get("task") or []
            todo += [m if isinstance(m, str) else m.get("task") for m in (members if isinstance(members, list) else [members])]
            continue
        if (path := _hub_dataset(cfg)) is not None:
            found.append((name, path))
    return found


def _hub_dataset(cfg: dict[str, Any]) -> str | None:
    """The Hub dataset a task config reads, or None when its data is local or made by a function."""
    path = cfg.get("dataset_path")
    if cfg.get("custom_dataset") or not path or Path(str(path)).expanduser().exists():
        return None
    if path in FILE_LOADERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
        values = files.values() if isinstance(files, dict) else files if isinstance(files, list) else [files]
        remote = [v for v in values if isinstance(v, str) and v.startswith(("http://", "https://", "hf://"))]
        return remote[0] if remote else None
    return str(path)


def _cached(dataset: str) -> bool:
    """Whether the Hub dataset `dataset` has a copy in the local Hugging Face caches."""
    if dataset.startswith(("http://", "https://", "hf://")):
        return False
    from datasets import config as ds_config
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    prepared = Path(ds_config.HF_DATASETS_CACHE) / dataset.replace("/", "___")
    return hub.is_dir() or prepared.is_dir()
