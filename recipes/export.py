"""Export a training checkpoint to a Hugging Face directory: `python -m recipes.export CHECKPOINT OUT_DIR`.

CHECKPOINT is a `step_N` directory, or a checkpoints/run directory (its newest complete
checkpoint is taken). Runs in one process on CPU, whatever mesh wrote the checkpoint. OUT_DIR must be
new or empty; `--overwrite` replaces an earlier export there (its weight files are deleted first).
A LoRA checkpoint becomes a PEFT adapter (adapter_config.json, adapter_model.safetensors) for
transformers' NemotronH, or with `--merge` a full model with the adapters folded into its base.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="step_N checkpoint directory, or a directory holding them")
    parser.add_argument("out_dir", help="where to write config.json, safetensors and the tokenizer (new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="export into a non-empty OUT_DIR, deleting its old weight files first")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA checkpoints: write the base with the adapters folded in, not a PEFT adapter")
    parser.add_argument("--out-proj", choices=("save", "skip"), default="save",
                        help="LoRA checkpoints: Mamba2 out_proj adapters as merged copies in modules_to_save "
                             "(save, what peft loads on NemotronH), or left out of the adapter and the merge "
                             "(skip, for tools that cannot load modules_to_save)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from nemotron_recipe.training.hf_io import export_hf

    try:
        out = export_hf(args.checkpoint, args.out_dir, overwrite=args.overwrite, merge=args.merge,
                        out_proj=args.out_proj)
    except (CheckpointError, ModelConfigError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
