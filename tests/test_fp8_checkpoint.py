"""NVIDIA's FP8 releases as `model.pretrained`: a small checkpoint written in the released ModelOpt FP8
layout (float8_e4m3fn weights, float32 per-tensor `weight_scale` and `input_scale`, KV-cache scales,
`quantization_config` in config.json) loads, unsharded and sharded, as the definition's bf16 weights;
exports write bf16; other formats and scale layouts are refused naming what was read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DIMS
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemotron_recipe.models.nemotron_v3 import (
    NemotronHConfig,
    NemotronHForCausalLM,
    build_meta_model,
)
from nemotron_recipe.models.nemotron_v3.checkpoint import CheckpointError, hf_to_native
from nemotron_recipe.training.hf_io import load_hf_sharded

FP8_MAX = 448.0  # largest float8_e4m3fn
CFG = NemotronHConfig(pattern="M*-E", **SMALL_DIMS)
# NVIDIA's selective recipe keeps attention and lm_head in bf16 (`exclude_modules`).
EXCLUDED = ("lm_head", "backbone.layers.1.mixer.q_proj", "backbone.layers.1.mixer.k_proj",
            "backbone.layers.1.mixer.v_proj", "backbone.layers.1.mixer.o_proj")
QUANTIZED = (".mixer.in_proj.weight", ".mixer.out_proj.weight", ".up_proj.weight", ".down_proj.weight")


def write_fp8_release(src: Path, out: Path, quantization: dict | None = None,
                      scale_shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """`src` (a bf16 Hugging Face directory) rewritten as ModelOpt's FP8 export; returns the bf16 weights
    the definition gives: fp8 * weight_scale."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization or {
        "quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
        "exclude_modules": list(EXCLUDED), "producer": {"name": "modelopt", "version": "0.29.0"}}
    (out / "config.json").write_text(json.dumps(config))
    tensors, expected = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if name.endswith(QUANTIZED) and module not in EXCLUDED:
            scale = w.float().abs().amax() / FP8_MAX
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            tensors |= {name: q, f"{module}.weight_scale": scale.expand(scale_shape).clone(),
                        f"{module}.input_scale": torch.tensor(0.02)}
            expected[name] = (q.to(torch.float32) * scale).to(torch.bfloat16)
        else:
            tensors[name] = w
            expected[name] = w
    tensors["backbone.layers.1.mixer.k_proj.k_scale"] = torch.tensor(0.5)
    tensors["backbone.layers.1.mixer.v_proj.v_scale"] = torch.tensor(0.5)
    save_file(tensors, str(out / "model.safetensors"))
    return expected


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(0)
    NemotronHForCausalLM(CFG).to(torch.bfloat16).save_pretrained(str(path))
    return path


def test_fp8_release_loads_as_the_definitions_bf16_weights(bf16_dir, tmp_path):
    expected = hf_to_native(write_fp8_release(bf16_dir, tmp_path / "fp8"), CFG)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert f.get_slice("backbone.layers.0.mixer.in_proj.weight").get_dtype() == "F8_E4M3"
    model = NemotronHForCausalLM.from_pretrained(str(tmp_path / "fp8")).to(torch.bfloat16)
    sharded = build_meta_model(CFG).to(torch.bfloat16)
    load_hf_sharded(sharded, str(tmp_path / "fp8"), "cpu")  # the training path: read slice by slice
    for m in (model, sharded):
        state = m.state_dict()
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name].to(torch.bfloat16), value.to(torch.bfloat16), rtol=0, atol=0,
                                       msg=name)
    # The FP8 weights differ from the bf16 ones by FP8's rounding only (3 mantissa bits: 1/16 relative).
    ref = NemotronHForCausalLM.from_pretrained(str(bf16_dir)).state_dict()
    w, r = model.state_dict()["model.layers.0.mixer.out_proj.weight"].float(), ref["model.layers.0.mixer.out_proj.weight"].float()
    assert 0 < (w - r).abs().max() <= r.abs().max() / 16

    out = tmp_path / "export"
    model.save_pretrained(str(out))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(n).get_dtype() for n in f.keys()}
        assert not any("scale" in n for n in f.keys())
    assert "F8_E4M3" not in dtypes and "BF16" in dtypes


def test_nvfp4_release_is_refused_naming_the_format(bf16_dir, tmp_path):
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8"}
    write_fp8_release(bf16_dir, tmp_path / "nvfp4", quantization=nvfp4)
    with pytest.raises(CheckpointError) as err:
        NemotronHForCausalLM.from_pretrained(str(tmp_path / "nvfp4"))
    message = str(err.value)
    assert "quantization_config" in message and "'quant_algo': 'NVFP4'" in message and "'group_size': 16" in message
    assert "does not read (NVFP4)" in message and "ModelOpt FP8" in message and "Fix:" in message


def test_an_unknown_fp8_scale_layout_is_refused_naming_the_tensor(bf16_dir, tmp_path):
    write_fp8_release(bf16_dir, tmp_path / "odd", scale_shape=(3,))
    with pytest.raises(CheckpointError) as err:
        load_hf_sharded(build_meta_model(CFG), str(tmp_path / "odd"), "cpu")
    message = str(err.value)
    assert "the scale of FP8 tensor" in message and "has shape (3,), a layout this recipe does not read" in message
    assert "a scalar (per tensor) or one per row" in message and "Fix:" in message
