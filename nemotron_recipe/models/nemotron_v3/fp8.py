"""NVIDIA's FP8 releases of Nemotron 3 (Nano 30B-A3B FP8, Super 120B-A12B FP8), read as bf16 weights.

The layout, as the released files and their loaders describe it:
- `config.json` carries `quantization_config` = {"quant_method": "modelopt", "quant_algo": "FP8",
  "kv_cache_quant_algo": "FP8", "exclude_modules": [...], "producer": {"name": "modelopt", ...}}
  (ModelOpt's Hugging Face export; `hf_quant_config.json` repeats it as {"producer": ...,
  "quantization": {"quant_algo": ...}}). Sources: vLLM's `ModelOptFp8Config` (keys `quant_method`,
  `quant_algo`, `exclude_modules`/`ignore`), the model cards of NVIDIA-Nemotron-3-Nano-30B-A3B-FP8 and
  -NVFP4 ("static per-tensor weight scaling"; `hf_quant_config.json` of the NVFP4 release: producer
  modelopt 0.29.0, `quant_algo` "NVFP4", `group_size` 16, `exclude_modules` listing the attention
  layers and the Mamba layers next to them, and `lm_head`).
- each quantized linear weight is `float8_e4m3fn` with a float32 `<module>.weight_scale` (a scalar:
  one scale per tensor) and `<module>.input_scale` (the static activation scale, for FP8 GEMMs at
  inference); attention layers may carry `k_scale` / `v_scale` for an FP8 KV cache. Modules in
  `exclude_modules` stay bf16. The weight is `fp8 * weight_scale`.
- which GEMMs the releases hold in FP8: NVIDIA's Nemotron 3 Super quantization page
  (docs.nvidia.com/nemotron/nightly/nemotron/super3/quantization.html: the sparse and shared experts'
  and the Mamba GEMMs FP8, attention QKV/output, latent projections and output layers BF16, router
  FP32); the tensor dtypes and scale shapes as a public engine's test pins them to the released
  checkpoints' safetensors headers (`F8_E4M3` weight, `F32` scalar `weight_scale` and `input_scale`,
  `F32` scalar `k_scale`/`v_scale`, no scale beside a bf16 weight). No released `config.json` /
  `hf_quant_config.json` of an FP8 Nemotron 3 checkpoint is in the public sources searched.

Fine-grained FP8 (transformers' `quant_method: "fp8"` with `weight_block_size` [bm, bn], as DeepSeek's
releases) is read too: `weight_scale_inv` holds one scale per [bm, bn] block and the weight is
`fp8 * scale` of its block. Any other format (NVFP4, MXFP4, GPTQ, AWQ, ...) is refused, naming it.
Activation and KV-cache scales have no use once the weights are bf16 and are read past.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

FP8_DTYPES = (torch.float8_e4m3fn,)
INFERENCE_SCALES = (".input_scale", ".k_scale", ".v_scale")
READ = "ModelOpt FP8 (quant_method 'modelopt', quant_algo 'FP8', per-tensor weight_scale) and fine-grained FP8 " \
       "(quant_method 'fp8' with weight_block_size, weight_scale_inv)"


class QuantizedCheckpointError(CheckpointError):
    """A quantized checkpoint this recipe does not read; names the file, what it found and a fix."""


@dataclass(frozen=True)
class FP8Format:
    """How a checkpoint's FP8 weights are scaled: `block` None for ModelOpt's per-tensor (or per-row)
    `weight_scale`, else the [rows, cols] block of each `weight_scale_inv` entry."""

    source: str
    block: tuple[int, int] | None = None

    def scale_name(self, weight: str) -> str:
        return weight.removesuffix("weight") + ("weight_scale_inv" if self.block else "weight_scale")

    def dequantize(self, weight: str, fp8: torch.Tensor, box: list[tuple[int, int]] | None,
                   read_scale: Callable[[str], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """`fp8` (the part `box` of tensor `weight`, whose full shape is `shape`) in float32."""
        name = self.scale_name(weight)
        try:
            scale = read_scale(name).float()
        except KeyError:
            raise QuantizedCheckpointError(
                f"{self.source}: FP8 tensor {weight!r} has no {name!r}; {READ} are read. Fix: point model.pretrained "
                "at the unmodified release, or at its BF16 version.") from None
        box = box or [(0, n) for n in shape]
        return fp8.float() * self._expand(scale, weight, box, shape)

    def _expand(self, scale: torch.Tensor, weight: str, box, shape) -> torch.Tensor:
        rows, cols = box[-2] if len(shape) > 1 else (0, 1), box[-1]
        if self.block is None:
            if scale.numel() == 1:
                return scale.reshape(())
            if len(shape) == 2 and scale.numel() == shape[0]:  # one scale per output row
                return scale.reshape(-1, 1)[rows[0]:rows[1]]
        elif len(shape) == 2 and tuple(scale.shape) == tuple(math.ceil(n / b) for n, b in zip(shape, self.block)):
            bm, bn = self.block
            full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
            return full[rows[0]:rows[1], cols[0]:cols[1]]
        layouts = ("a scalar (per tensor) or one per row" if self.block is None
                   else f"one per {list(self.block)} block: {[math.ceil(n / b) for n, b in zip(shape, self.block)]}")
        raise QuantizedCheckpointError(
            f"{self.source}: the scale of FP8 tensor {weight!r} {tuple(shape)} has shape {tuple(scale.shape)}, a layout "
            f"this recipe does not read; for this weight it reads {layouts}. Fix: point model.pretrained at the "
            "unmodified release, or at its BF16 version.")


def _config_quantization(path: Path) -> tuple[dict | None, str]:
    config = path / "config.json"
    if config.is_file():
        q = json.loads(config.read_text()).get("quantization_config")
        if q:
            return q, f"{config} quantization_config"
    extra = path / "hf_quant_config.json"
    if extra.is_file():
        q = json.loads(extra.read_text())
        return {"quant_method": q.get("producer", {}).get("name"), **q.get("quantization", {})}, str(extra)
    return None, ""


def checkpoint_fp8_format(path: str | Path) -> FP8Format | None:
    """The FP8 layout of the Hugging Face directory `path`, None for an unquantized one; a format this
    recipe does not read is refused here, before any weight is read."""
    q, source = _config_quantization(Path(path))
    if q is None:
        return None
    method, algo = str(q.get("quant_method", "")).lower(), str(q.get("quant_algo", "")).upper()
    if method == "modelopt" and algo == "FP8":
        return FP8Format(source)
    if method == "fp8" and q.get("weight_block_size"):
        return FP8Format(source, tuple(int(b) for b in q["weight_block_size"]))
    if method == "fp8":
        return FP8Format(source)
    found = {k: q[k] for k in ("quant_method", "quant_algo", "fmt", "weight_block_size", "group_size", "bits")
             if k in q}
    raise QuantizedCheckpointError(
        f"{source}: {found} is a quantization format this recipe does not read ({algo or method or 'unnamed'}); it "
        f"reads {READ}. Fix: point model.pretrained at the BF16 (or FP8) release of this model, e.g. "
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.")


def quantization_problem(path: str | Path) -> str | None:
    """Why the quantized checkpoint at `path` cannot be read (its format named, with a fix), or None:
    the check `checkpoint_fp8_format` makes on load, for a config to run before any heavy work."""
    try:
        checkpoint_fp8_format(path)
    except QuantizedCheckpointError as e:
        return str(e)
    return None


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def auxiliary(name: str) -> bool:
    """Whether a tensor of an FP8 checkpoint is a scale rather than a model weight."""
    return name.endswith((".weight_scale", ".weight_scale_inv", *INFERENCE_SCALES))


def dequantize_state(state: dict[str, torch.Tensor], fmt: FP8Format, dtype: torch.dtype = torch.bfloat16
                     ) -> dict[str, torch.Tensor]:
    """A whole FP8 checkpoint's tensors with every FP8 weight in `dtype` and the scales dropped."""
    out = {}
    for name, value in state.items():
        if auxiliary(name):
            continue
        if is_fp8(value):
            value = fmt.dequantize(name, value, None, state.__getitem__, tuple(value.shape)).to(dtype)
        out[name] = value
    return out
