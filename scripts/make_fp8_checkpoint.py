"""Write a small checkpoint in the layout of NVIDIA's FP8 releases (NVIDIA-Nemotron-3-*-FP8).

A stand-in for the released FP8 checkpoints, to try `model.pretrained` on an FP8 directory without
downloading one: a preset's weights (drawn from `--seed`, or read from a bf16 checkpoint `--from`)
rewritten as ModelOpt's FP8 export (`nemotron_recipe/models/nemotron_v3/fp8_release.py`: FP8
projections with per-tensor `weight_scale`, attention and `lm_head` in bf16, `quantization_config`
in config.json and `hf_quant_config.json`), with the shipped tokenizer beside them:

    python scripts/make_fp8_checkpoint.py ckpt/tiny-fp8                       # the tiny preset
    python scripts/make_fp8_checkpoint.py ckpt/tiny-nvfp4 --quant-algo NVFP4  # a config the loader refuses
    python -m recipes.finetune model.pretrained=ckpt/tiny-fp8 data.tokenizer=ckpt/tiny-fp8 peft=lora

`--quant-algo NVFP4` writes the NVFP4 release's `quantization_config` over the same FP8 tensors: the
format is refused from the config, before any weight is read.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch
from safetensors import safe_open

from nemotron_recipe.data.tokenizer import DEFAULT_ASSETS_DIR
from nemotron_recipe.models.nemotron_v3 import (
    PRESETS,
    NemotronHConfig,
    NemotronHForCausalLM,
)
from nemotron_recipe.models.nemotron_v3.fp8_release import (
    excluded_modules,
    write_fp8_release,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# What the NVFP4 release's hf_quant_config.json says beside the FP8 one: 4-bit weights in groups of 16.
NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}


def make_fp8_checkpoint(out: Path, preset: str = "tiny", seed: int = 0, source: Path | None = None,
                        quant_algo: str = "FP8") -> dict[str, torch.Tensor]:
    """Write the checkpoint to `out` (which must not exist); returns the bf16 weights it stands for."""
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new directory (the checkpoint is written whole)")
    with tempfile.TemporaryDirectory() as tmp:
        if source is None:
            torch.manual_seed(seed)
            NemotronHForCausalLM(NemotronHConfig.from_preset(preset)).to(torch.bfloat16).save_pretrained(tmp)
            source = Path(tmp)
        expected = write_fp8_release(source, out, NVFP4 if quant_algo == "NVFP4" else None)
    tokenizer = source if (source / "tokenizer.json").is_file() else DEFAULT_ASSETS_DIR
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return expected


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write (must not exist)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shapes (default tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed the preset's weights are drawn from")
    parser.add_argument("--from", dest="source", type=Path, help="a bf16 Hugging Face checkpoint to rewrite instead")
    parser.add_argument("--quant-algo", default="FP8", choices=("FP8", "NVFP4"),
                        help="quant_algo written to the config (NVFP4: a format the loader refuses)")
    args = parser.parse_args(argv)
    try:
        expected = make_fp8_checkpoint(args.out, args.preset, args.seed, args.source, args.quant_algo)
    except (FileExistsError, FileNotFoundError) as e:
        raise SystemExit(f"Error: {e}") from None
    with safe_open(str(args.out / "model.safetensors"), "pt") as f:
        fp8 = [n for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"]  # noqa: SIM118 - not a dict
    kept = len(excluded_modules(list(expected)))
    print(f"wrote {args.out} (quant_algo {args.quant_algo}, tokenizer): {len(fp8)} projections in FP8 with "
          f"per-tensor scales, {kept} excluded modules in bf16, {len(expected) - len(fp8) - kept} other tensors "
          "as they were (embedding, norms, routers, Mamba conv, A_log, D, dt_bias)")


if __name__ == "__main__":
    main()
