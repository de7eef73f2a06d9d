"""NVIDIA's FP8 releases as `model.pretrained`: a small checkpoint written in the released ModelOpt FP8
layout (float8_e4m3fn weights, float32 per-tensor `weight_scale` and `input_scale`, KV-cache scales,
`quantization_config` in config.json) loads, unsharded and sharded, as the definition's bf16 weights;
exports write bf16; other formats and scale layouts are refused naming what was read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, SMALL_DIMS, compose_run
from safetensors import safe_open

from nemotron_recipe.config import validate_config
from nemotron_recipe.data.tokenizer import load_tokenizer
from nemotron_recipe.models.nemotron_v3 import (
    NemotronHConfig,
    NemotronHForCausalLM,
    build_meta_model,
)
from nemotron_recipe.models.nemotron_v3.checkpoint import CheckpointError, hf_to_native
from nemotron_recipe.models.nemotron_v3.fp8_base import keep_fp8_base, read_fp8_weights
from nemotron_recipe.models.nemotron_v3.fp8_release import write_fp8_release
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    add_adapters,
    freeze_base,
    init_adapters,
    nf4_targets,
)
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import load_hf_sharded

CFG = NemotronHConfig(pattern="M*-E", **SMALL_DIMS)


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
        assert f.get_slice("backbone.layers.1.mixer.q_proj.weight").get_dtype() == "BF16"
        assert {n for n in f.keys() if n.endswith(("k_scale", "v_scale"))} == {  # noqa: SIM118 - not a dict
            "backbone.layers.1.mixer.k_proj.k_scale", "backbone.layers.1.mixer.v_proj.v_scale"}
    # NVIDIA's selective recipe keeps attention and lm_head in bf16 and lists them in `exclude_modules`.
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["exclude_modules"] == [f"backbone.layers.1.mixer.{p}_proj" for p in "koqv"] + ["lm_head"]
    assert json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
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
    # The run's config check says the same before any data or weight is read.
    with pytest.raises(ValueError, match=r"model.pretrained=.*'quant_algo': 'NVFP4'.* does not read \(NVFP4\)"):
        validate_config(compose_run(tmp_path / "run", f"model.pretrained={tmp_path / 'nvfp4'}", "peft=lora"))


def test_the_script_writes_a_release_the_recipe_reads(tmp_path, capsys):
    """scripts/make_fp8_checkpoint.py: the tiny preset in the released layout, with the shipped tokenizer,
    loads as the bf16 weights it stands for; its NVFP4 variant is refused from the config."""
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", REPO / "scripts" / "make_fp8_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = NemotronHConfig.from_preset("tiny")
    expected = hf_to_native(script.make_fp8_checkpoint(tmp_path / "fp8", seed=3), config)
    state = NemotronHForCausalLM.from_pretrained(str(tmp_path / "fp8")).to(torch.bfloat16).state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name].to(torch.bfloat16), value.to(torch.bfloat16), rtol=0, atol=0, msg=name)
    tokenizer = load_tokenizer(tmp_path / "fp8")
    assert len(tokenizer) <= config.vocab_size and tokenizer("red").input_ids
    with pytest.raises(FileExistsError, match="exists; choose a new directory"):
        script.make_fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(SystemExit, match="holds no .safetensors file; give a bf16 Hugging Face checkpoint"):
        script.main([str(tmp_path / "none"), "--from", str(tmp_path / "no-checkpoint-here")])
    assert not (tmp_path / "none").exists()  # a bad source leaves nothing behind

    script.main([str(tmp_path / "nvfp4"), "--quant-algo", "NVFP4"])
    assert "projections in FP8 with per-tensor scales" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"'quant_algo': 'NVFP4'.* does not read \(NVFP4\)"):
        NemotronHForCausalLM.from_pretrained(str(tmp_path / "nvfp4"))


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
