"""What the recipes' command lines share before Hydra runs: overrides naming keys the schema does not
know are refused with the nearest known name, and `--help` prints the composed config with the
model's values filled in from its preset (or checkpoint), where the schema holds them as null."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf, open_dict

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
HELP_FLAGS = ("--help", "-h")


def check_override_keys(argv: list[str], schema: type) -> None:
    """Exits (code 1) naming every override whose key `schema` does not declare."""
    from nemotron_recipe.config_keys import override_key_problems

    if problems := override_key_problems(argv, schema):
        print("Error: invalid configuration:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)


def _groups() -> str:
    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


def model_values(cfg) -> str | None:
    """Fills `cfg.model`'s null fields with the values its preset or checkpoint gives them; returns why
    it could not, or None."""
    from nemotron_recipe.config import MODEL_OVERRIDE_FIELDS, build_model_config

    try:
        model = build_model_config(cfg.model)
    except Exception as e:  # noqa: BLE001 - help still prints; the run itself reports the problem
        return f"(model values not shown: {e})"
    with open_dict(cfg.model):
        for name in MODEL_OVERRIDE_FIELDS:
            if name != "weight_dtypes" and cfg.model.get(name) is None:
                cfg.model[name] = getattr(model, name)
    return None


def print_help(argv: list[str], config_name: str, command: str) -> None:
    """The help `python -m recipes.<command> [overrides] --help` prints: config groups and the composed config."""
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv if not a.startswith("-")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)
    note = model_values(cfg)
    source = f"checkpoint {cfg.model.pretrained}" if cfg.model.pretrained else f"preset {cfg.model.preset}"
    print(f"python -m recipes.{command} [group=option ...] [key=value ...]   (Hydra's own flags: --hydra-help)\n\n"
          f"== Configuration groups ==\n{_groups()}\n\n"
          f"== Config (model values from {source}) ==\n"
          f"{note + chr(10) if note else ''}{OmegaConf.to_yaml(cfg)}")
