"""LoRA on a 4-bit NF4 base: the format against its definition, the GEMMs against the dequantized
weights, refusals before any work, each rank's part of the bits, parity on HSDP, tensor, sequence and
expert parallel (tests/distributed/nf4_worker.py), convergence and the planner's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import RUN_BASE, compose_run

from nemotron_recipe.config import ConfigError
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3 import nf4 as nf4_module
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRASpec,
    add_adapters,
    freeze_base,
    init_adapters,
    quantize_base,
)
from nemotron_recipe.models.nemotron_v3.model import Experts, expert_matmul
from nemotron_recipe.models.nemotron_v3.nf4 import (
    dequantize,
    is_nf4,
    nf4_bytes,
    quantize,
)
from nemotron_recipe.training.finetune import run

WORKER = Path(__file__).parent / "distributed" / "nf4_worker.py"
PARITY_RTOL = 1e-5  # nf4-base LoRA curves of a mesh against one process (fp32 compute)
FAST = [*RUN_BASE, "trainer.val_every=0", "optim.warmup_steps=0", "optim.lr=1e-2"]

# QLoRA's NF4 code book (Dettmers et al. 2023, appendix E), rounded to 4 decimals as torchao stores it.
NF4_CODES = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]


def nf4_by_definition(w: torch.Tensor, block: int, group: int) -> torch.Tensor:
    """Quantize -> dequantize written out from the definition: each block of `block` consecutive
    weights (row-major) is divided by its absmax and rounded to the nearest code; the absmax values,
    less their mean, are quantized to int8 by groups of `group` (factor 128 / the group's absmax,
    round half to even, clamped to [-128, 127]); a weight is its code times its dequantized absmax."""
    flat = w.reshape(-1, block)
    absmax = flat.abs().amax(dim=1)
    codes = torch.tensor(NF4_CODES, dtype=w.dtype)
    nearest = (flat / absmax[:, None]).unsqueeze(-1).sub(codes).abs().argmin(dim=-1)
    mean = absmax.mean()
    centered = (absmax - mean).reshape(-1, group)
    factor = 256 / (2 * centered.abs().amax(dim=1, keepdim=True))
    q = (centered * factor).round().clamp(-128, 127)
    scales = (q / factor).reshape(-1).to(w.dtype) + mean
    return (codes[nearest] * scales[:, None]).reshape(w.shape)


@pytest.mark.parametrize("shape,group", [((512, 2048), 256), ((64, 128), 2), ((4, 96, 64), 2)])
def test_nf4_round_trip_equals_the_definition(shape, group):
    """Codes, blockwise absmax and double quantization as the definition gives them, and the bytes:
    half a byte a weight, one int8 scale per 64 weights, one fp32 factor per `group` scales, one mean."""
    torch.manual_seed(0)
    w = torch.randn(*shape)
    q = quantize(w)
    assert q.scaler_block_size == group
    expected = nf4_by_definition(w.reshape(-1, shape[-1]), 64, group)
    torch.testing.assert_close(dequantize(q, torch.float32), expected, rtol=0, atol=1e-6)
    n = w.numel()
    assert nf4_bytes(q) == n // 2 + n // 64 + 4 * (n // 64 // group) + 4


def test_nf4_refuses_rows_that_straddle_blocks():
    with pytest.raises(nf4_module.NF4Error, match=r"rows of 96 weights, not a multiple of the NF4 block \(64\)"):
        quantize(torch.randn(8, 96), "model.layers.0.mixer.q_proj.weight")


def _adapted_model() -> NemotronHForCausalLM:
    cfg = NemotronHConfig(pattern="M*-E", vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                          ssm_state_size=8, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg)
    add_adapters(model, LoRASpec(rank=4))
    init_adapters(model, 3)
    return model


def test_nf4_base_stores_every_projection_and_keeps_the_rest():
    model = _adapted_model()
    before = {n: p.dtype for n, p in model.named_parameters()}
    quantize_base(model)
    quantized = sorted(n for n, p in model.named_parameters() if is_nf4(p))
    kinds = {n.split(".", 3)[-1] for n in quantized}
    assert kinds == {"mixer.in_proj.weight", "mixer.out_proj.weight", "mixer.q_proj.weight", "mixer.k_proj.weight",
                     "mixer.v_proj.weight", "mixer.o_proj.weight", "mixer.up_proj.weight", "mixer.down_proj.weight",
                     "mixer.experts.up_proj", "mixer.experts.down_proj", "mixer.shared_experts.up_proj.weight",
                     "mixer.shared_experts.down_proj.weight"}
    for name, p in model.named_parameters():
        if name not in quantized:  # embeddings, lm_head, norms, conv, A_log, D, dt_bias, router, adapters
            assert not is_nf4(p) and p.dtype == before[name], name
    assert all(not p.requires_grad for n, p in model.named_parameters() if is_nf4(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_gemms_equal_the_dequantized_weights(dtype):
    """An adapted model on its NF4 base computes what the same model computes on the dequantized
    weights: logits and every adapter gradient; the routed experts on both the grouped GEMM and the
    per-expert loop."""
    model = _adapted_model().to(dtype)
    quantize_base(model)
    reference = _adapted_model().to(dtype)
    with torch.no_grad():
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            if is_nf4(p):
                owner = model.get_submodule(name.rpartition(".")[0])
                shape = getattr(owner, "nf4_shapes", {}).get(name.rpartition(".")[2], ref.shape)
                ref.copy_(dequantize(p, dtype).view(shape))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (model, reference):
        freeze_base(m)
        out = m(ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    assert outs[0][1].keys() == outs[1][1].keys()
    for name in outs[0][1]:
        torch.testing.assert_close(outs[0][1][name], outs[1][1][name], **tol, msg=name)

    experts = next(m for m in model.modules() if isinstance(m, Experts))
    rows = torch.randn(10, 64, dtype=dtype, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 3])
    weight = dequantize(experts.up_proj, dtype).view(experts.nf4_shapes["up_proj"]).detach()
    for groups in (counts.cumsum(0).to(torch.int32), counts.tolist()):
        got = experts._matmul("up_proj", rows, experts.up_proj, groups)
        want = expert_matmul(rows, weight, counts.tolist())
        torch.testing.assert_close(got, want, **tol)
        g_got, = torch.autograd.grad(got.square().sum(), rows)
        g_want, = torch.autograd.grad(want.square().sum(), rows)
        torch.testing.assert_close(g_got, g_want, **tol)


# ------------------------------------------------------------------ refusals
def _run(run_dir: Path, *overrides: str) -> dict:
    return run(compose_run(run_dir, *overrides, base=FAST))


@pytest.mark.parametrize("overrides,needle", [
    (["peft.base_dtype=nf4"], "peft.base_dtype=nf4 with peft.method=none: full fine-tuning trains the base"),
    (["peft.base_dtype=fp8"], "peft.base_dtype=fp8 with peft.method=none: full fine-tuning trains the base"),
    (["peft=lora", "peft.base_dtype=fp8"], ("peft.base_dtype=fp8 keeps an FP8 checkpoint's weights as the base, "
                                            "and model.pretrained is not set")),
])
def test_bad_nf4_settings_are_named_before_any_work(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, *overrides)
    assert needle in str(err.value) and "Fix:" in str(err.value)
    assert not (tmp_path / "checkpoints").exists()


def test_nf4_without_torchao_names_the_pip_line(tmp_path, monkeypatch):
    nf4_module.nf4_tensor_type.cache_clear()
    for name in ("torchao.quantization", "torchao.dtypes.nf4tensor"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    try:
        with pytest.raises(ConfigError) as err:
            _run(tmp_path, "peft=lora", "peft.base_dtype=nf4")
    finally:
        nf4_module.nf4_tensor_type.cache_clear()
    assert "needs torchao's NF4 tensor, and torchao is not installed. Fix: pip install -e '.[quant]'" in str(err.value)


# ------------------------------------------------------------------ meshes and convergence
@pytest.mark.parametrize("name,shape,dim,parts", [
    ("model.layers.0.mixer.q_proj.weight", (128, 256), 0, 2),     # colwise tensor parallel, FSDP2
    ("model.layers.0.mixer.o_proj.weight", (96, 512), 1, 8),      # rowwise tensor parallel, up to 8
    ("model.layers.0.mixer.o_proj.weight", (96, 512), 0, 4),      # ... and FSDP2 of its rows
    ("model.layers.1.mixer.experts.up_proj", (4, 64, 128), 0, 2),  # expert parallel
])
def test_nf4_parts_hold_the_whole_tensors_bits(name, shape, dim, parts):
    """Each rank's part of a tensor quantized whole holds exactly its bits (codes, int8 scales, the
    factors of whole groups and the whole's mean), so it dequantizes bit for bit to that part of the
    whole's dequantization, by our dequantization and torchao's: a mesh's blocks are one process's."""
    torch.manual_seed(0)
    whole = quantize(torch.randn(*shape), name)
    full = dequantize(whole, torch.float32)
    scales = whole.quantized_scalers.view(full.shape[0], -1)
    for index in range(parts):
        part = nf4_module.shard(whole, dim, index, parts, name)
        assert torch.equal(dequantize(part, torch.float32), full.chunk(parts, dim)[index])
        assert torch.equal(part.get_original_weight(), whole.get_original_weight().chunk(parts, dim)[index])
        assert torch.equal(part.quantized_scalers.view(part.shape[0], -1), scales.chunk(parts, dim)[index])
        assert torch.equal(part.scaler_mean, whole.scaler_mean)


def test_nf4_refuses_a_split_through_a_block_or_group():
    whole = quantize(torch.randn(64, 128), "model.layers.0.mixer.o_proj.weight")
    with pytest.raises(nf4_module.NF4Error, match=r"o_proj.weight: NF4 \(64, 128\) cannot be split into 4 parts "
                                                  r"of 128 columns: a part must hold whole blocks of 64 weights"):
        nf4_module.shard(whole, 1, 0, 4, "model.layers.0.mixer.o_proj.weight")


# One torchrun job of 4 ranks: HSDP 2 x 2, FSDP2 x tensor parallel 2 with sequence parallel (and
# activation checkpointing), expert parallel 2 within FSDP 4. Each rank's share of the 4-bit bytes:
NF4_CASES = {"2,2,1,1,0,none": 1 / 2, "1,2,1,2,1,full": None, "1,4,1,1,0,none,ep2": 1 / 4}


@pytest.mark.distributed
def test_nf4_lora_curves_on_hsdp_tp_sp_and_ep_match_one_process(tmp_path):
    """Every mesh cuts the one-process NF4 bits (FSDP2 and HSDP by rows of 4-bit data, tensor parallel
    by rows or columns, expert parallel by experts): the LoRA loss curve equals one process's within
    1e-5 over 5 steps, and each rank stores its share of the 4-bit data."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(WORKER), str(out), *NF4_CASES], capture_output=True, text=True, timeout=600,
                          cwd=WORKER.parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    for case, share in NF4_CASES.items():
        r = results[case]
        for step, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert abs(loss - ref) <= PARITY_RTOL * abs(ref), f"{case} step {step}: {loss} vs {ref}"
        # Tensor parallel x FSDP2 keeps the MoE blocks whole over tp: between a quarter and a half.
        assert r["nf4_bytes"] == r["ref_nf4_bytes"] * share if share else \
            r["ref_nf4_bytes"] / 4 < r["nf4_bytes"] < r["ref_nf4_bytes"] / 2


def test_nf4_lora_converges_like_the_bf16_base(tmp_path):
    """30 LoRA steps on the tiny preset (shipped SFT data and validation set): on the NF4 base the
    validation loss ends within 10% of the bf16 base's."""
    settings = ["peft=lora", "trainer.max_steps=30", "optim.lr=3e-3", "optim.warmup_steps=10",
                "data.val_max_batches=8", "checkpoint.save_final=false"]
    bf16 = _run(tmp_path / "bf16", *settings, "peft.base_dtype=bf16")
    nf4 = _run(tmp_path / "nf4", *settings, "peft.base_dtype=nf4")
    print(f"30 LoRA steps: validation loss bf16 base {bf16['first_val_loss']:.4f} -> {bf16['last_val_loss']:.4f}, "
          f"nf4 base {nf4['first_val_loss']:.4f} -> {nf4['last_val_loss']:.4f}")
    assert nf4["last_val_loss"] <= 0.7 * nf4["first_val_loss"]  # it learns
    assert abs(nf4["last_val_loss"] - bf16["last_val_loss"]) <= 0.1 * bf16["last_val_loss"]


def test_planner_counts_an_nf4_base_at_its_stored_bytes():
    """The planner (a meta model: nothing is quantized) counts each base projection of an nf4 run at
    what quantize_base really stores (the per-tensor mean aside), on each of 2 FSDP ranks."""
    from nemotron_recipe.distributed.plan import ParallelPlan
    from nemotron_recipe.models.nemotron_v3.lora import nf4_targets
    from nemotron_recipe.models.nemotron_v3.nf4 import bytes_per_weight
    from nemotron_recipe.training.planner.state import module_state
    from nemotron_recipe.training.planner.world import (
        Trainability,
        fake_world,
        sharded_meta_model,
    )

    cfg = NemotronHConfig.from_preset("tiny")
    plan = ParallelPlan(dp_shard=2)
    with fake_world(2):
        params = {nf4: module_state(sharded_meta_model(cfg, plan, plan.build_meshes("cpu"),
                                                       Trainability(LoRASpec(), torch.bfloat16, False, nf4))).params
                  for nf4 in (False, True)}
    model = NemotronHForCausalLM(cfg).to(torch.bfloat16)
    add_adapters(model, LoRASpec())
    weights = dict(model.named_parameters())
    targets = {n: weights[n].shape for n in nf4_targets(model)}
    saved = sum(2 * s.numel() - s.numel() * bytes_per_weight(tuple(s), name=n) for n, s in targets.items()) / 2
    assert params[False] - params[True] == pytest.approx(saved, rel=1e-3)
    quantize_base(model)
    stored = sum(nf4_bytes(p) - 2 for n, p in model.named_parameters() if is_nf4(p))
    assert stored == pytest.approx(sum(s.numel() * bytes_per_weight(tuple(s), name=n) for n, s in targets.items()),
                                   rel=1e-9)
