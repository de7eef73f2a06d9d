"""Nemotron 3 Super/Ultra pieces: LatentMoE against `transformers`' NemotronH, multi-token-prediction
(MTP) layers against their definition, checkpoints with MTP tensors in and out with no tensor left
behind, the Super preset's parameter counts, bad settings, and mesh invariance under torchrun."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import RUN_BASE, compose_run, metrics_rows, perturb_off_init
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nemotron_recipe.models.nemotron_v3 import (
    CheckpointError,
    ModelConfigError,
    NemotronHConfig,
    NemotronHForCausalLM,
)
from nemotron_recipe.models.nemotron_v3 import model as model_module
from nemotron_recipe.models.nemotron_v3.checkpoint import (
    native_to_hf,
    safetensors_files,
)
from nemotron_recipe.models.nemotron_v3.flops import forward_flops, moe_flops
from nemotron_recipe.models.nemotron_v3.mtp import shift_for_mtp
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import build_meta_model, load_hf_sharded

transformers = pytest.importorskip("transformers")

LATENT = 24
HF_DIMS = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_latent_size=LATENT,
)
PATTERN = "M*-EM"  # every block kind


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def latent_pair(tmp_path_factory):
    """transformers' NemotronH with LatentMoE (random, off its init) and ours loaded from its save."""
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(hybrid_override_pattern=PATTERN, **HF_DIMS))
    hf = hf.float()
    perturb_off_init(hf)
    path = tmp_path_factory.mktemp("latent")
    hf.save_pretrained(path)
    return hf, NemotronHForCausalLM.from_pretrained(str(path)), path


def released_mtp_tensors(d: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP depth of attention + LatentMoE under the names and shapes of the released checkpoints
    (`mtp.layers.0` fuses embedding and hidden state, `mtp.layers.1` ends in `final_layernorm`)."""
    dims = HF_DIMS
    q, kv = dims["num_attention_heads"] * dims["head_dim"], dims["num_key_value_heads"] * dims["head_dim"]
    e, i, s = dims["n_routed_experts"], dims["moe_intermediate_size"], dims["moe_shared_expert_intermediate_size"]
    shapes = {
        "mtp.layers.0.enorm.weight": (d,), "mtp.layers.0.hnorm.weight": (d,), "mtp.layers.0.eh_proj.weight": (d, 2 * d),
        "mtp.layers.0.norm.weight": (d,), "mtp.layers.0.mixer.q_proj.weight": (q, d),
        "mtp.layers.0.mixer.k_proj.weight": (kv, d), "mtp.layers.0.mixer.v_proj.weight": (kv, d),
        "mtp.layers.0.mixer.o_proj.weight": (d, q),
        "mtp.layers.1.norm.weight": (d,), "mtp.layers.1.mixer.gate.weight": (e, d),
        "mtp.layers.1.mixer.shared_experts.up_proj.weight": (s, d),
        "mtp.layers.1.mixer.shared_experts.down_proj.weight": (d, s),
        "mtp.layers.1.mixer.fc1_latent_proj.weight": (LATENT, d), "mtp.layers.1.mixer.fc2_latent_proj.weight": (d, LATENT),
        "mtp.layers.1.final_layernorm.weight": (d,),
    }
    for x in range(e):
        shapes[f"mtp.layers.1.mixer.experts.{x}.up_proj.weight"] = (i, LATENT)
        shapes[f"mtp.layers.1.mixer.experts.{x}.down_proj.weight"] = (LATENT, i)
    out = {}
    for name, shape in shapes.items():
        base = 1.0 if name.endswith(("norm.weight", "layernorm.weight")) else 0.0
        out[name] = (base + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    out["mtp.layers.1.mixer.gate.e_score_correction_bias"] = 0.1 * torch.randn(e, generator=g)  # fp32, as released
    return out


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A bf16 transformers-made LatentMoE checkpoint plus released-style MTP tensors in a second shard."""
    torch.manual_seed(1)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(hybrid_override_pattern=PATTERN, **HF_DIMS))
    perturb_off_init(hf)
    path = tmp_path_factory.mktemp("mtp_ckpt")
    hf.to(torch.bfloat16).save_pretrained(path)
    main = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    mtp = released_mtp_tensors(HF_DIMS["hidden_size"], torch.bfloat16, torch.Generator().manual_seed(2))
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    for name, tensors in shards.items():
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, t in shards.items() for k in t}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in safetensors_files(str(path)):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open is not a dict
    return out


def assert_bit_identical(source: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> None:
    assert set(written) == set(source), (sorted(set(source) - set(written))[:5], sorted(set(written) - set(source))[:5])
    for name, t in source.items():
        w = written[name]
        assert w.dtype == t.dtype and w.shape == t.shape, (name, w.dtype, t.dtype)
        assert torch.equal(w.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name


# ------------------------------------------------------------------------------------ LatentMoE
def _hf_named_grads(hf) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in hf.named_parameters():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            base, proj = name.rsplit(".", 1)
            grads.update({f"{base}.{e}.{proj}.weight": p.grad[e] for e in range(p.shape[0])})
        else:
            grads[name] = p.grad
    return grads


@pytest.mark.parametrize("grouped_gemm", [True, False])
def test_latent_moe_matches_transformers(latent_pair, monkeypatch, grouped_gemm):
    """Logits within 1e-4, equal loss, every gradient within 1e-4 relative; a length (21) that is not a
    multiple of the chunk (8), grouped routing with a non-zero correction bias, both expert paths."""
    hf, ours, _ = latent_pair
    if not grouped_gemm:
        monkeypatch.setattr(model_module, "_grouped_mm_supported", lambda rows, up: False)
    assert all(b.abs().max() > 0 for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias"))
    ids = torch.randint(0, HF_DIMS["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(3))
    hf.zero_grad()
    ours.zero_grad()
    out_hf, out = hf(ids, labels=ids), ours(ids, labels=ids)
    assert (out_hf.logits - out.logits).abs().max().item() <= 1e-4
    torch.testing.assert_close(out.loss, out_hf.loss, rtol=1e-6, atol=1e-6)
    out_hf.loss.backward()
    out.loss.backward()
    ours_grads = native_to_hf({n: p.grad for n, p in ours.named_parameters()}, ours.config)
    hf_grads = _hf_named_grads(hf)
    assert set(ours_grads) == set(hf_grads)
    assert any("fc1_latent_proj" in n for n in ours_grads)
    for name, g in hf_grads.items():
        rel = (ours_grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert rel <= 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_latent_config_round_trips_through_transformers(latent_pair, tmp_path):
    _, ours, _ = latent_pair
    assert ours.config.moe_latent_size == LATENT
    assert ours.model.layers[3].mixer.experts.up_proj.shape == (8, 32, LATENT)
    ours.save_pretrained(str(tmp_path))
    hf_cfg = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert hf_cfg.moe_latent_size == LATENT
    assert NemotronHConfig.from_hf(hf_cfg).moe_latent_size == LATENT


def test_latent_moe_flops():
    cfg = NemotronHConfig(pattern="E", hidden_size=64, moe_latent_size=16, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=48)
    t = 3
    expected = 2 * t * 64 * 8 + 2 * 2 * 2 * t * 16 * 32 + 2 * 2 * t * 64 * 16 + 2 * 2 * t * 64 * 48
    assert moe_flops(cfg, 1, t) == expected
    mtp_cfg = dataclasses.replace(cfg, num_nextn_predict_layers=2, mtp_pattern="E")
    per_depth = 2 * t * 128 * 64 + expected + 2 * t * 64 * cfg.vocab_size
    assert forward_flops(mtp_cfg, 1, t)["mtp"] == 2 * per_depth


# ------------------------------------------------------------------------------------ MTP
def _mtp_model(**overrides) -> NemotronHForCausalLM:
    torch.manual_seed(4)
    cfg = NemotronHConfig(**{**HF_DIMS, "pattern": PATTERN, "num_nextn_predict_layers": 2, **overrides})
    model = NemotronHForCausalLM(cfg)
    perturb_off_init(model)
    return model.train()


def _mtp_loss_by_definition(model, ids, targets, docs=None) -> torch.Tensor:
    """Σ over depths k and positions t of CE(head(h_k[t]), token t+1+k) / depths, written out plainly."""
    b, l = ids.shape
    h = model.model(ids, docs)
    emb = model.model.embeddings.weight
    per_depth = model.mtp.per_depth
    total = torch.zeros((), dtype=torch.float64)
    for k in range(1, model.config.num_nextn_predict_layers + 1):
        shifted = torch.zeros_like(ids)
        shifted[:, : l - k] = ids[:, k:]
        layers = model.mtp.layers[(k - 1) * per_depth: k * per_depth]
        first = layers[0]
        x = first.eh_proj(torch.cat([first.enorm(emb[shifted]), first.hnorm(h)], dim=-1))
        for layer in layers:
            if layer.block_type in ("mamba", "attention"):
                x = x + layer.mixer(layer.norm(x), document_ids=docs)
            else:
                x = x + layer.mixer(layer.norm(x))
        h = layers[-1].final_layernorm(x)
        logits = h @ model.lm_head.weight.T
        for row in range(b):
            for t in range(l - k):
                target = targets[row, t + k]
                if target == -100 or (docs is not None and docs[row, t + k] != docs[row, t]):
                    continue
                total += F.cross_entropy(logits[row, t], target).double()
    return total / model.config.num_nextn_predict_layers


def test_mtp_loss_equals_its_definition():
    """Two depths of attention + LatentMoE: the model's MTP loss sum equals the plain computation
    within 1e-6 (relative, fp32), with untrained targets and packed documents; the labels= loss adds it
    scaled by mtp_loss_scale over the main loss's trained tokens."""
    model = _mtp_model()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (2, 19), generator=g)
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    targets[torch.rand(targets.shape, generator=g) < 0.2] = -100
    docs = torch.tensor([[0] * 7 + [1] * 12, [0] * 19])
    for doc in (None, docs):
        out = model(ids, targets=targets, document_ids=doc)
        expected = _mtp_loss_by_definition(model, ids, targets, doc)
        assert abs(out.mtp_loss_sum.double() - expected) <= 1e-6 * expected, (out.mtp_loss_sum.item(), expected.item())
    labels = ids.clone()
    out = model(ids, labels=labels)
    main = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    trained = labels[:, 1:].numel()
    torch.testing.assert_close(out.loss, main + 0.1 * out.mtp_loss_sum / trained, rtol=1e-6, atol=0)
    # Through the recipe's path: shifted from whole sequences, chunked head.
    mtp = shift_for_mtp(ids, targets, 2, docs)
    chunked = model(ids, targets=targets, document_ids=docs, loss_chunk_size=7, mtp_input_ids=mtp[0],
                    mtp_targets=mtp[1])
    expected = _mtp_loss_by_definition(model, ids, targets, docs)
    assert abs(chunked.mtp_loss_sum.double() - expected) <= 1e-6 * expected


def test_mtp_runs_only_in_training_and_scale_zero_trains_nothing():
    model = _mtp_model(mtp_loss_scale=0.0)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(6))
    out = model(ids, labels=ids)
    assert out.mtp_loss_sum is None
    out.loss.backward()
    assert all(p.grad is None for p in model.mtp.parameters())
    assert _mtp_model().eval()(ids, labels=ids).mtp_loss_sum is None


def test_mtp_checkpoint_import_export_is_bit_identical(mtp_checkpoint, tmp_path):
    """Both import paths (from_pretrained, and the recipe's sharded reader) then export, untrained: every
    tensor of the checkpoint comes back with its name, dtype and bits (bf16, the fp32 router buffers)."""
    source = read_all(mtp_checkpoint)
    assert source["mtp.layers.1.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    model = NemotronHForCausalLM.from_pretrained(str(mtp_checkpoint))
    model.save_pretrained(str(tmp_path / "a"))
    assert_bit_identical(source, read_all(tmp_path / "a"))

    from nemotron_recipe.config import build_model_config

    cfg = build_model_config(compose_run(tmp_path / "run", f"model.pretrained={mtp_checkpoint}").model)
    sharded = build_meta_model(cfg)
    load_hf_sharded(sharded, str(mtp_checkpoint), "cpu")
    sharded.save_pretrained(str(tmp_path / "b"))
    assert_bit_identical(source, read_all(tmp_path / "b"))


def test_mtp_checkpoint_trains_logs_mtp_loss_and_exports_every_tensor(mtp_checkpoint, tmp_path):
    source = read_all(mtp_checkpoint)
    summary = run(compose_run(tmp_path, f"model.pretrained={mtp_checkpoint}", "trainer.max_steps=5",
                              "trainer.val_every=0", "checkpoint.export_hf=true", base=RUN_BASE))
    rows = [r for r in metrics_rows(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["mtp_loss"]) and math.isfinite(r["loss"]) for r in rows)
    exported = read_all(Path(summary["hf_export"]))
    assert set(exported) == set(source)
    mtp_names = [n for n in source if n.startswith("mtp.")]
    assert len(mtp_names) == 8 * 2 + 16
    assert all(exported[n].dtype == source[n].dtype and exported[n].shape == source[n].shape for n in mtp_names)
    assert not torch.equal(exported["mtp.layers.0.eh_proj.weight"], source["mtp.layers.0.eh_proj.weight"])


# ------------------------------------------------------------------------------------ presets
SUPER_RELEASED_PARAMETERS = 123_611_012_096


def _counts(cfg: NemotronHConfig) -> tuple[int, int, int]:
    """(all parameters, without MTP, active per token without MTP) of the model built on meta."""
    model = build_meta_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    experts = sum(p.numel() for n, p in model.model.named_parameters() if ".experts." in n)
    active_experts = experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return total, total - mtp, total - mtp - experts + active_experts


def test_super_preset_has_the_released_parameter_counts():
    """The BF16 release's safetensors headers hold 123,611,012,096 weights (the fp32 router-bias buffers
    apart): the preset built on meta has exactly as many parameters. Its backbone (without the MTP
    depth) is the published "120B" within 1% and its active parameters the published "12B" (a rounded
    figure) within 7%."""
    total, backbone, active = _counts(NemotronHConfig.from_preset("nemotron3_super_120b_a12b"))
    assert total == SUPER_RELEASED_PARAMETERS
    assert abs(backbone - 120e9) <= 0.01 * 120e9, backbone
    assert abs(active - 12e9) <= 0.07 * 12e9, active


def _counts_by_kind(cfg: NemotronHConfig) -> tuple[int, int, int]:
    """`_counts` from a model of one block per kind (a block's parameters depend on its kind alone), so that
    a 108-block model of 512 experts each is counted without building it block by block."""
    kinds = "".join(dict.fromkeys(cfg.pattern))
    model = build_meta_model(dataclasses.replace(cfg, pattern=kinds))
    per_kind = {k: sum(p.numel() for p in model.model.layers[i].parameters()) for i, k in enumerate(kinds)}
    experts = {k: sum(p.numel() for n, p in model.model.layers[i].named_parameters() if ".experts." in n)
               for i, k in enumerate(kinds)}
    outside = sum(p.numel() for p in model.parameters()) - sum(per_kind.values())
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    total = outside + sum(per_kind[k] for k in cfg.pattern)
    routed = sum(experts[k] for k in cfg.pattern)
    return total, total - mtp, total - mtp - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts


def test_ultra_preset_has_the_published_parameter_counts():
    """Nemotron 3 Ultra is published as 550B total, 55B active (the name's "550B-A55B"): the preset's backbone is
    within 0.2% and its active parameters within 2% (56.1B: the name rounds). With its MTP depth it holds
    560.5B weights, 1,121 GB in bf16, the size of the BF16 release."""
    ultra = NemotronHConfig.from_preset("nemotron3_ultra_550b_a55b")
    total, backbone, active = _counts_by_kind(ultra)
    assert (len(ultra.pattern), ultra.pattern.count("M"), ultra.pattern.count("E"), ultra.pattern.count("*")) == (
        108, 48, 48, 12)
    assert abs(backbone - 550e9) <= 0.002 * 550e9, backbone
    assert abs(active - 55e9) <= 0.02 * 55e9, active
    assert round(total * 2 / 1e9) == 1121, total
    # the by-kind count is the whole model's (checked where building it whole is cheap)
    assert _counts_by_kind(NemotronHConfig.from_preset("nemotron3_super_120b_a12b"))[0] == SUPER_RELEASED_PARAMETERS


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("overrides, needle", [
    ({"moe_latent_size": 65}, "model.moe_latent_size=65"),
    ({"moe_latent_size": 0}, "model.moe_latent_size=0"),
    ({"num_nextn_predict_layers": -1}, "model.num_nextn_predict_layers=-1"),
    ({"num_nextn_predict_layers": 1, "mtp_pattern": "*X"}, "model.mtp_pattern='*X'"),
    ({"num_nextn_predict_layers": 1, "mtp_pattern": ""}, "model.mtp_pattern=''"),
    ({"mtp_loss_scale": 0.1}, "has no MTP layers"),
    ({"num_nextn_predict_layers": 1, "mtp_loss_scale": -1.0}, "model.mtp_loss_scale=-1.0"),
])
def test_bad_latent_and_mtp_settings_are_named(overrides, needle):
    with pytest.raises(ModelConfigError, match="Fix:") as err:
        NemotronHConfig(**{**HF_DIMS, "pattern": PATTERN, **overrides})
    assert needle in str(err.value)


def test_contradicting_mtp_patterns_in_config_json_are_refused():
    hf = {**HF_DIMS, "hybrid_override_pattern": PATTERN, "num_nextn_predict_layers": 1,
          "mtp_hybrid_override_pattern": "*E", "mtp_layers_block_type": ["moe"]}
    with pytest.raises(ModelConfigError, match="contradicts mtp_layers_block_type"):
        NemotronHConfig.from_hf(hf)


def test_mtp_loss_scale_without_mtp_fails_before_any_work(tmp_path):
    with pytest.raises(ModelConfigError, match="mtp_loss_scale"):
        run(compose_run(tmp_path, "model.mtp_loss_scale=0.1"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_mtp_tensors_without_mtp_layers_are_named(mtp_checkpoint, tmp_path):
    """A checkpoint's MTP tensors are never dropped: a config without MTP layers is an error naming them."""
    with pytest.raises(CheckpointError, match=r"unexpected \['mtp\.layers\.0\..*MTP layers differ"):
        NemotronHForCausalLM.from_pretrained(str(mtp_checkpoint), num_nextn_predict_layers=0)
    from nemotron_recipe.config import build_model_config

    cfg = build_model_config(compose_run(tmp_path, f"model.pretrained={mtp_checkpoint}",
                                         "model.num_nextn_predict_layers=0").model)
    with pytest.raises(CheckpointError, match=r"unexpected \['mtp\.layers"):
        load_hf_sharded(build_meta_model(cfg), str(mtp_checkpoint), "cpu")
    with pytest.raises(CheckpointError, match=r"missing \['mtp\.layers\.2.*MTP layers differ"):
        NemotronHForCausalLM.from_pretrained(str(mtp_checkpoint), mtp_pattern="*E*")


# ------------------------------------------------------------------------------------ meshes
WORKER = Path(__file__).parent / "distributed" / "latent_mtp_worker.py"


def test_mesh_invariance_with_latent_moe_and_mtp(tmp_path):
    """fsdp 2, tp 2 + sequence parallel, cp 2 (and fsdp 2, tp 2 + SP with every block checkpointed, fsdp 2
    with ep 2) train like one process within 1e-5: losses and MTP losses of 3 steps, every first gradient."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    results = json.loads(out.read_text())
    assert set(results) == {"fsdp2", "tp2_sp", "cp2", "fsdp2_ac", "tp2_sp_ac", "fsdp2_ep2"}
    for case, r in results.items():
        for step, (got, ref) in enumerate(zip(r["losses"] + r["mtp_losses"], r["ref_losses"] + r["ref_mtp_losses"])):
            assert abs(got - ref) <= 1e-5 * abs(ref), f"{case}: loss {step} {got} vs one process {ref}"
        assert not r["missing_grads"], case
        worst = max(r["grad_rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"{case}: gradient of {worst[0]} differs by {worst[1]:.2e}"
        assert any(n.startswith("mtp.") for n in r["grad_rel_err"]), case


def test_checkpoints_saved_before_the_latent_and_mtp_fields_still_resume(tmp_path):
    """A checkpoint's meta.json without the fields added for LatentMoE and MTP (or the weight dtypes) is
    the same model as one built today with their defaults; another model is still refused."""
    from nemotron_recipe.training.checkpoint import check_model_config

    config = NemotronHConfig(weight_dtypes={"lm_head.weight": "bfloat16"})
    added = ("moe_latent_size", "num_nextn_predict_layers", "mtp_pattern", "mtp_loss_scale", "weight_dtypes")
    older = {k: v for k, v in dataclasses.asdict(config).items() if k not in added}
    check_model_config(tmp_path, {"model": older}, config)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers: 0 in the checkpoint, 1 in this run"):
        check_model_config(tmp_path, {"model": older}, dataclasses.replace(config, num_nextn_predict_layers=1))
