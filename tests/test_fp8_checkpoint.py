"""NVIDIA's FP8 releases as `model.pretrained`: a small checkpoint written in the released ModelOpt FP8
layout (float8_e4m3fn weights, float32 per-tensor `weight_scale` and `input_scale`, KV-cache scales,
`quantization_config` in config.json) loads, unsharded and sharded, as the definition's bf16 weights;
exports write bf16; other formats and scale layouts are refused naming what was read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DIMS, compose_run
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemotron_recipe.models.nemotron_v3 import (
    NemotronHConfig,
    NemotronHForCausalLM,
    build_meta_model,
)
from nemotron_recipe.models.nemotron_v3.checkpoint import CheckpointError, hf_to_native
from nemotron_recipe.models.nemotron_v3.fp8_base import keep_fp8_base, read_fp8_weights
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    add_adapters,
    freeze_base,
    init_adapters,
    nf4_targets,
)
from nemotron_recipe.training.finetune import run
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


# ------------------------------------------------------------------ the FP8 weights kept as the LoRA base
def _lora_curve(model: NemotronHForCausalLM, steps: int = 5) -> list[float]:
    freeze_base(model)
    init_adapters(model, 3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):  # one batch, learnt
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lora_on_the_kept_fp8_base_equals_lora_on_the_dequantized_base(bf16_dir, tmp_path):
    """`peft.base_dtype=fp8`: every projection the release holds in FP8 (Mamba in/out, MLP, shared and
    routed experts) keeps its float8_e4m3fn bytes with float32 row scales, at ~half the bf16 bytes, and each GEMM
    dequantizes it as loading does: the 5-step LoRA curve equals that over the dequantized base within
    1e-5 (fp32 compute; the GEMMs differ only in their kernels' summation order)."""
    write_fp8_release(bf16_dir, tmp_path / "fp8")
    path = str(tmp_path / "fp8")
    curves, stored = {}, {}
    for kept in (False, True):
        model = NemotronHForCausalLM.from_pretrained(path)
        add_adapters(model, LoRASpec(rank=4))
        if kept:
            before, after = keep_fp8_base(model, read_fp8_weights(path, CFG), nf4_targets(model))
            stored = {n: p for n, p in model.named_parameters() if n + "_fp8_scale" in dict(model.named_buffers())}
            assert all(p.dtype == torch.uint8 and not p.requires_grad for p in stored.values())
        curves[kept] = _lora_curve(model)
    assert {n.split(".", 3)[-1] for n in stored} == {
        "mixer.in_proj.weight", "mixer.out_proj.weight", "mixer.up_proj.weight", "mixer.down_proj.weight",
        "mixer.shared_experts.up_proj.weight", "mixer.shared_experts.down_proj.weight", "mixer.experts.up_proj",
        "mixer.experts.down_proj"}  # attention and lm_head: bf16 in the release (`exclude_modules`)
    # A byte a weight and a float32 scale a row, against bf16's 2 bytes: (1 + 4 / in) / 2, 0.50-0.51 at the
    # released widths (in >= 1856), 0.57 at these.
    assert before == sum(2 * p.numel() for p in stored.values())
    assert after == sum(p.numel() + 4 * p.numel() // p.shape[-1] for p in stored.values())
    assert after / before < 0.6
    for step, (got, want) in enumerate(zip(curves[True], curves[False], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert curves[True][-1] < curves[True][0]


def test_an_fp8_base_needs_an_fp8_checkpoint(bf16_dir):
    with pytest.raises(CheckpointError, match=r"has no quantization_config \(its weights are not FP8\)"):
        read_fp8_weights(str(bf16_dir), CFG)


def test_planner_counts_the_fp8_base_at_its_stored_bytes(bf16_dir, tmp_path):
    """The planner reads which weights the checkpoint holds in FP8 from its headers and counts each at a
    byte a weight and a float32 scale a row (what keep_fp8_base stores), on each of 2 FSDP ranks; the
    release's bf16 projections (attention) stay at 2 bytes."""
    from nemotron_recipe.distributed.plan import ParallelPlan
    from nemotron_recipe.training.planner.state import module_state
    from nemotron_recipe.training.planner.world import Trainability, fake_world, fp8_weight_names, sharded_meta_model

    write_fp8_release(bf16_dir, tmp_path / "fp8")
    names = fp8_weight_names(str(tmp_path / "fp8"))
    plan = ParallelPlan(dp_shard=2)
    with fake_world(2):
        params = {}
        for kept in (False, True):
            trainability = Trainability(LoRASpec(), torch.bfloat16, False, False, names if kept else frozenset())
            params[kept] = module_state(sharded_meta_model(CFG, plan, plan.build_meshes("cpu"), trainability)).params
    model = NemotronHForCausalLM.from_pretrained(str(tmp_path / "fp8"))
    add_adapters(model, LoRASpec())
    before, after = keep_fp8_base(model, read_fp8_weights(str(tmp_path / "fp8"), CFG), nf4_targets(model))
    assert {n for n, p in model.named_parameters() if p.dtype == torch.uint8} == names & set(nf4_targets(model))
    assert params[False] - params[True] == pytest.approx((before - after) / 2, rel=1e-3)


def test_the_recipe_on_the_kept_fp8_base_trains_as_on_the_dequantized_base(tmp_path):
    """`recipes.finetune` with `peft.base_dtype=fp8` on an FP8 release of the tiny preset (read whole, the
    FP8 projections kept as their bytes, FSDP2 on a group of one): its first step's loss (B = 0: the base
    alone) equals that with the weights read as bf16, to bf16 GEMM rounding."""
    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig.from_preset("tiny")).to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    write_fp8_release(tmp_path / "bf16", tmp_path / "fp8")
    losses = {base: run(compose_run(tmp_path / base / "run", f"model.pretrained={tmp_path / 'fp8'}", "peft=lora",
                                    f"peft.base_dtype={base}", "trainer.max_steps=1", "trainer.val_every=0",
                                    "eval.sample_tokens=0", "checkpoint.save_final=false"))["final_loss"]
              for base in ("bf16", "fp8")}
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=1e-5)
