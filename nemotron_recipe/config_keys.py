"""Keys the typed schema does not know, refused whichever way they came in.

Hydra refuses `trainer.max_step=5` against the schema, but its own hint (`+trainer.max_step=5`)
adds the key to the composed config, where nothing reads it. Both forms are caught here with the
nearest known name: `unknown_key_problems` walks a composed config against the dataclasses that
typed it, `override_key_problems` checks command-line overrides before Hydra sees them.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.nodes import ValueNode

# Launcher and Hydra's own settings, and config-group selections (`hydra/launcher=...`), are Hydra's.
_HYDRA_PREFIXES = ("hydra.", "hydra/")


def _fields(cls: type) -> dict[str, Any]:
    """A schema dataclass's field names and their resolved types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass a field holds, `Optional[X]` unwrapped; None for plain values."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _problem(path: str, key: str, known: list[str], value: Any = None) -> str:
    full = f"{path}.{key}" if path else key
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if near:
        fixed = f"{path}.{near[0]}" if path else near[0]
        fix = f"Did you mean {near[0]}? Fix: {fixed}={value}" if value is not None else f"Did you mean {near[0]}? Fix: use {fixed}"
    else:
        fix = f"Fix: use one of {sorted(known)}"
    return (f"{full}: no such setting (the schema of {path or 'the config'} does not know it, so nothing would read "
            f"it; a `+` in front does not change that). {fix}.")


def unknown_key_problems(cfg: DictConfig, path: str = "") -> list[str]:
    """Every key of `cfg` (recursively) that the dataclass typing its node does not declare."""
    cls = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(cls):
        return []
    fields = _fields(cls)
    errors: list[str] = []
    for key in cfg.keys():
        key = str(key)
        node = cfg._get_node(key)
        if key not in fields:
            value = node._value() if isinstance(node, ValueNode) else None
            errors.append(_problem(path, key, list(fields), value if isinstance(value, (int, float, str)) else None))
            continue
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            errors += unknown_key_problems(node, f"{path}.{key}" if path else key)
    return errors


def override_key_problems(overrides: list[str], schema: type) -> list[str]:
    """Command-line overrides (`key=value`, `+key=value`, `++key=value`, `~key`) whose dotted key leaves
    `schema`; config-group choices (`model=nemotron_h_8b`) and Hydra's own keys pass."""
    errors: list[str] = []
    for arg in overrides:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue  # a flag (--cfg, --help, --multirun) or a flag's argument (`--cfg job`)
        key, sep, value = arg.lstrip("+~").partition("=")
        if not key or key.startswith(_HYDRA_PREFIXES) or key == "hydra" or "/" in key or "@" in key:
            continue
        cls, path = schema, ""
        for part in key.split("."):
            fields = _fields(cls)
            if part not in fields:
                errors.append(_problem(path, part, list(fields), value if sep else None))
                break
            path = f"{path}.{part}" if path else part
            cls = _dataclass_of(fields[part])
            if cls is None:
                break  # a plain value (or a list, indexed further): nothing below to check
    return errors
