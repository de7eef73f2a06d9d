"""Write a bf16 Hugging Face checkpoint in the layout of NVIDIA's FP8 releases (ModelOpt's FP8 export).

The layout is the one `fp8.py` reads and cites: `config.json`'s `quantization_config` and
`hf_quant_config.json` name ModelOpt FP8; each quantized projection (Mamba `in_proj`/`out_proj`, MLP
and expert `up_proj`/`down_proj`) is `float8_e4m3fn` with a float32 per-tensor `weight_scale` and an
`input_scale`; attention and `lm_head` are excluded (kept bf16, listed in `exclude_modules`; the
releases exclude the Mamba layers next to attention too);
attention layers carry `k_scale`/`v_scale` for an FP8 KV cache. It makes small stand-ins for the
releases (the weights are not downloadable here): every tensor is held in memory and written to one
`model.safetensors`, so it is meant for small models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0  # the largest float8_e4m3fn
QUANTIZED = (".mixer.in_proj.weight", ".mixer.out_proj.weight", ".up_proj.weight", ".down_proj.weight")
ATTENTION = (".q_proj", ".k_proj", ".v_proj", ".o_proj")
INPUT_SCALE = 0.02  # the static activation scale an FP8 GEMM would use at inference; training reads past it
KV_SCALE = 0.5


def excluded_modules(names: list[str]) -> list[str]:
    """The modules a stand-in keeps in bf16: `lm_head` and every attention projection. (The releases'
    selective recipe also keeps the Mamba layers next to attention in bf16; the loader reads whatever
    `exclude_modules` lists, so a stand-in need not follow it.)"""
    modules = (n.removesuffix(".weight") for n in names if n.endswith(".weight"))
    return sorted(m for m in modules if m == "lm_head" or m.endswith(ATTENTION))


def modelopt_fp8_config(exclude: list[str]) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
            "exclude_modules": exclude, "producer": {"name": "modelopt", "version": "0.29.0"}}


def _weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} holds no .safetensors file; give a bf16 Hugging Face checkpoint directory "
                                "(config.json and safetensors, as `recipes.export` or `save_pretrained` write)")
    return {name: t for f in files for name, t in load_file(str(f)).items()}


def _quantize(w: torch.Tensor, scale_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its weight_scale expanded to `scale_shape`, the bf16 weight they stand for)."""
    scale = w.float().abs().amax() / FP8_MAX
    q = (w.float() / scale).to(torch.float8_e4m3fn)
    return q, scale.expand(scale_shape).clone(), (q.to(torch.float32) * scale).to(torch.bfloat16)


def write_fp8_release(src: str | Path, out: str | Path, quantization: dict | None = None,
                      scale_shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Rewrite the bf16 Hugging Face directory `src` into `out` (created; must not exist) as ModelOpt's FP8
    export; returns the bf16 weights the release stands for (`fp8 * weight_scale`, and the excluded
    weights as they were), by tensor name. `quantization` updates the config's ModelOpt FP8 entries (e.g.
    `quant_algo: NVFP4`, a format a loader must refuse; the tensors stay FP8); `scale_shape` expands each
    per-tensor scale (a layout a loader must refuse)."""
    src, out = Path(src), Path(out)
    weights = _weights(src)  # before `out` exists: a bad source leaves nothing behind
    out.mkdir(parents=True)
    exclude = excluded_modules(list(weights))
    quantization = {**modelopt_fp8_config(exclude), **(quantization or {})}
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    hf_quant = {"producer": quantization["producer"],
                "quantization": {k: v for k, v in quantization.items() if k not in ("producer", "quant_method")}}
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    tensors, expected = {}, {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(QUANTIZED) and module not in exclude:
            q, scale, expected[name] = _quantize(w, scale_shape)
            tensors |= {name: q, f"{module}.weight_scale": scale, f"{module}.input_scale": torch.tensor(INPUT_SCALE)}
        else:
            tensors[name] = expected[name] = w
        if module.endswith((".k_proj", ".v_proj")):
            kind = module.rsplit(".", 1)[-1][0]  # k or v
            tensors[f"{module}.{kind}_scale"] = torch.tensor(KV_SCALE)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    return expected
