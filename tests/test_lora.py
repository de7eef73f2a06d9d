"""LoRA fine-tuning: adapters on every block kind, adapter-only checkpoints, PEFT-format export and
import against `peft` on transformers' NemotronH, and parity on every mesh (tests/distributed/lora_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from nemotron_recipe.config import ConfigError
from nemotron_recipe.models.nemotron_v3 import CheckpointError, NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3 import model as model_module
from nemotron_recipe.models.nemotron_v3.lora import (
    LoRAError,
    LoRASpec,
    adapter_parameters,
    add_adapters,
    freeze_base,
    init_adapters,
    match_targets,
    set_full_values,
)
from nemotron_recipe.training.checkpoint import read_meta
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import export_hf
from nemotron_recipe.training.lora import load_adapters, load_base, read_peft_adapter

from helpers import PREFLIGHT_ON, RUN_BASE, SMALL_DIMS, compose_run, loss_and_grads, metrics_rows

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "distributed" / "lora_worker.py"
LOGITS_ATOL = 1e-4  # ours against peft / transformers on the same weights
PARITY_RTOL = 1e-5  # LoRA loss curves of a mesh against one process, fp32
FAST = [*RUN_BASE, "trainer.val_every=0", "optim.warmup_steps=0", "optim.lr=1e-2"]
# Everything but the Mamba2 out_proj, which PEFT refuses to adapt on NemotronH.
PEFT_TARGETS = "peft.target_modules=[*.in_proj,*.q_proj,*.k_proj,*.v_proj,*.o_proj,*.up_proj,*.down_proj]"


def lora_run(run_dir: Path, *overrides: str) -> dict:
    return run(compose_run(run_dir, *overrides, base=FAST))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A Hugging Face directory of the tiny preset (fp32), the base of the export tests."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig.from_preset("tiny")).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_dir) -> Path:
    """Three LoRA steps on `base_dir` (fp32 base, every default target): its final checkpoint."""
    run_dir = tmp_path_factory.mktemp("lora_run")
    summary = lora_run(run_dir, "peft=lora", "peft.base_dtype=fp32", f"model.pretrained={base_dir}",
                       "trainer.max_steps=3")
    return Path(summary["checkpoint"])


def ours_with_adapters(checkpoint: Path) -> NemotronHForCausalLM:
    """The checkpoint's base with its adapters, unsharded, as our forward computes it."""
    meta = read_meta(checkpoint)
    _, values = load_adapters(checkpoint, meta)
    model = load_base(meta, checkpoint)
    p = meta["peft"]
    add_adapters(model, LoRASpec(p["rank"], p["alpha"], p["dropout"], tuple(p["target_modules"])))
    set_full_values(model, values)
    return model.eval()


def hf_model(path: Path):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------ the model
def test_adapters_cover_every_block_kind_and_start_as_the_base():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig.from_preset("tiny"))
    x = ids()
    with torch.no_grad():
        before = model(x).logits
    targets = add_adapters(model, LoRASpec())
    init_adapters(model, seed=1)
    assert {t.split(".", 4)[-1] for t in targets} == {
        "in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
        "experts.up_proj", "experts.down_proj", "shared_experts.up_proj", "shared_experts.down_proj"}
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)  # B = 0: exactly the base
        for name, p in adapter_parameters(model).items():
            if name.endswith(("lora_B.weight", ".B")):
                p.add_(0.01 * torch.randn_like(p))
        grouped = model(x).logits
        # The routed experts' adapters run inside the grouped GEMM; the per-expert path agrees.
        supported = model_module._grouped_mm_supported
        model_module._grouped_mm_supported = lambda *args: False
        try:
            per_expert = model(x).logits
        finally:
            model_module._grouped_mm_supported = supported
    assert not torch.equal(grouped, before)
    torch.testing.assert_close(grouped, per_expert, rtol=1e-5, atol=1e-5)


def test_default_targets_adapt_the_block_kinds_a_model_has():
    """Each default pattern names some block kinds' projections: a model without those kinds is no
    error, as long as the defaults match something; a pattern a user names must match."""
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M-", **SMALL_DIMS))
    adapted = add_adapters(model, LoRASpec())
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"in_proj", "out_proj", "up_proj", "down_proj"}
    with pytest.raises(LoRAError, match=r"pattern '\*\.q_proj' matches no module"):
        match_targets(model, ("*.in_proj", "*.q_proj"))
    with pytest.raises(LoRAError, match="the default patterns match no module of this model"):
        match_targets(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoRASpec().target_modules)


def test_compiled_blocks_with_adapters_match_eager():
    """`trainer.compile=true` with LoRA: each block kind compiles with its adapters inside, the routed
    experts' grouped GEMMs included, and gives eager's loss and adapter gradients."""
    from nemotron_recipe.training.compile import compile_blocks

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-E", **SMALL_DIMS))
    add_adapters(model, LoRASpec(rank=4))
    init_adapters(model, seed=1)
    freeze_base(model)
    with torch.no_grad():
        for name, p in adapter_parameters(model).items():
            if name.endswith(("lora_B.weight", ".B")):
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, SMALL_DIMS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))

    eager_loss, eager_grads = loss_and_grads(model, x)  # the adapters' alone: the base is frozen
    try:
        assert compile_blocks(model, probe=lambda: loss_and_grads(model, x))
        loss, grads = loss_and_grads(model, x)
    finally:
        torch._dynamo.reset()
    assert len(eager_grads) == 24  # A and B of 12 projections: every block kind and the routed experts
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("overrides, needle", [
    (["peft.rank=0"], "peft.rank=0: must be a positive integer"),
    (["peft.target_modules=[*.gate_proj]"], "'*.gate_proj' matches no module. Fix: use glob patterns over these "
                                            "names: ['lm_head', 'model.embeddings', 'model.layers.*.mixer.down_proj'"),
    (["peft.target_modules=[model.embeddings]", "mesh.tp=2"], "an adapted embedding runs on tp=1 only"),
    (["peft.base_dtype=fp16"], "peft.base_dtype='fp16': unknown"),
])
def test_bad_lora_settings_are_named_before_any_work(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        lora_run(tmp_path, "peft=lora", *overrides)
    assert needle in str(err.value)
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------ the recipe
def test_step_zero_is_the_base_and_lora_learns(tmp_path):
    """30 LoRA steps with the default targets on the tiny preset (its random base, the shipped SFT data
    and validation set, the recipe's learning rate) lower validation loss by 30%; step 0 is the base's
    loss exactly (fp32 base, as the full run's)."""
    settings = ["optim.lr=3e-3", "optim.warmup_steps=10", "data.val_max_batches=8", "checkpoint.save_final=false"]
    full = lora_run(tmp_path / "full", "trainer.max_steps=1", *settings)
    lora = lora_run(tmp_path / "lora", "peft=lora", "peft.base_dtype=fp32", "trainer.max_steps=30", *settings)
    print(f"LoRA, 30 steps: validation loss {lora['first_val_loss']:.4f} -> {lora['last_val_loss']:.4f}")
    assert lora["first_val_loss"] == full["first_val_loss"]  # exactly: B = 0
    assert lora["last_val_loss"] <= 0.7 * lora["first_val_loss"]


def test_checkpoint_holds_adapters_and_resumes_exactly(tmp_path):
    common = ["peft=lora", "trainer.max_steps=4", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    straight = lora_run(tmp_path / "straight", *common[:2], PREFLIGHT_ON)  # planned over the bf16 base
    lora_run(tmp_path / "first", *common, "trainer.stop_at_step=2")
    resumed = lora_run(tmp_path / "second", *common)
    assert resumed["resumed_from"] == 2
    a = [r["loss"] for r in metrics_rows(tmp_path / "straight") if "loss" in r]
    b = [r["loss"] for r in metrics_rows(tmp_path / "first") if "loss" in r]
    b += [r["loss"] for r in metrics_rows(tmp_path / "second") if "loss" in r]
    assert a == b  # adapters, their optimizer state, the schedule and the RNG all restored

    ckpt = Path(straight["checkpoint"])
    meta = read_meta(ckpt)
    assert meta["peft"]["base"]["preset"] == "tiny" and len(meta["peft"]["base"]["hash"]) == 32
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    params = [k.removeprefix("model.") for k in saved if k.startswith("model.") and "correction_bias" not in k]
    assert params and all(".lora" in k for k in params)  # no frozen base weight is saved

    # The same checkpoint on another base (another seed draws another preset base) is refused.
    with pytest.raises(CheckpointError, match="trained on another base"):
        lora_run(tmp_path / "other", *common, "trainer.max_steps=6", "seed=5")
    with pytest.raises(CheckpointError, match="a LoRA checkpoint, and this run is full fine-tuning"):
        lora_run(tmp_path / "full", *common[1:], "trainer.max_steps=6")


def test_lora_checkpoint_is_a_small_fraction_of_a_full_one(tmp_path):
    """What a LoRA checkpoint holds: each adapter's fp32 value and two Adam moments (12 bytes an element,
    as a full checkpoint holds for every parameter), Adam's step, the param groups once, the RNG, and
    DCP's per-tensor framing (torch.save and the metadata file: about 1.9 kB a tensor). The ratio is
    therefore about the adapters' share of the base's parameters: on the tiny preset (hidden 256, 4.6M
    parameters) rank 8 adds 4.3% and its checkpoint is 4.7% of a full one; rank 4 adds 2.1% and 2.6%.
    On the released shapes rank 8 adds 0.2-0.7%."""
    from torch.distributed.checkpoint import FileSystemReader

    full = lora_run(tmp_path / "full", "trainer.max_steps=1")
    full_bytes = dir_bytes(Path(full["checkpoint"]))
    for rank, ratio in ((8, 0.05), (4, 0.03)):
        lora = lora_run(tmp_path / f"lora{rank}", "peft=lora", f"peft.rank={rank}", "trainer.max_steps=1")
        ckpt = Path(lora["checkpoint"])
        lora_bytes = dir_bytes(ckpt)
        torch.manual_seed(0)
        model = NemotronHForCausalLM(NemotronHConfig.from_preset("tiny"))
        add_adapters(model, LoRASpec(rank=rank))
        adapters = sum(p.numel() for p in adapter_parameters(model).values())
        share = adapters / sum(p.numel() for p in model.parameters())
        items = len(FileSystemReader(str(ckpt)).read_metadata().storage_data)
        print(f"tiny, rank {rank}: LoRA checkpoint {lora_bytes} bytes, full {full_bytes}: {lora_bytes / full_bytes:.2%} "
              f"(adapters: {adapters} parameters, {share:.2%}; {items} saved items)")
        # Nothing of the base, no second copy: 12 bytes an adapter element, DCP's framing per item, the
        # metadata file (about 350 bytes an item) and meta.json.
        assert lora_bytes <= 12 * adapters + 2_000 * items + 10_000
        # Per adapter: its value, two moments and Adam's step; the param groups once, buffers, the RNG.
        assert items <= 4 * len(adapter_parameters(model)) + 16
        assert lora_bytes <= ratio * full_bytes


# ------------------------------------------------------------------ PEFT format
def _exports_match_peft(out: Path, base_dir: Path, checkpoint: Path) -> dict:
    """Exports `checkpoint` as a PEFT adapter and merged; both, loaded onto transformers' NemotronH of
    `base_dir`, give our logits. Returns the adapter's config."""
    import peft

    export_hf(checkpoint, out / "adapter")
    export_hf(checkpoint, out / "merged", merge=True)
    x = ids()
    with torch.no_grad():
        ours = ours_with_adapters(checkpoint)(x).logits
        base = hf_model(base_dir)
        assert (base(x).logits - ours).abs().max() > 100 * LOGITS_ATOL  # the adapters do change the model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        torch.testing.assert_close(adapted(x).logits, ours, rtol=0, atol=LOGITS_ATOL)
        torch.testing.assert_close(hf_model(out / "merged")(x).logits, ours, rtol=0, atol=LOGITS_ATOL)
    return json.loads((out / "adapter" / "adapter_config.json").read_text())


def test_exported_adapter_loads_in_peft_and_merge_in_transformers(tmp_path, base_dir, trained):
    config = _exports_match_peft(tmp_path, base_dir, trained)
    assert config["target_parameters"] == ["experts.up_proj", "experts.down_proj"]
    assert config["base_model_name_or_path"] == str(base_dir.resolve())


def test_latent_moe_projections_are_default_targets_and_export(tmp_path):
    """LatentMoE's projections to and from the experts' width are linear projections of the MoE block:
    the default targets adapt them, and the adapter loads in peft like the others."""
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig.from_preset("tiny", moe_latent_size=64)).save_pretrained(str(base_dir))
    summary = lora_run(tmp_path / "run", "peft=lora", "peft.base_dtype=fp32", f"model.pretrained={base_dir}",
                       "trainer.max_steps=3")
    config = _exports_match_peft(tmp_path, base_dir, Path(summary["checkpoint"]))
    assert {"fc1_latent_proj", "fc2_latent_proj"} <= {m.rsplit(".", 1)[-1] for m in config["target_modules"]}


def test_export_cli_refuses_merge_of_a_full_checkpoint(tmp_path):
    full = lora_run(tmp_path / "full", "trainer.max_steps=1")
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "recipes.export", full["checkpoint"], str(out), "--merge"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "full fine-tuning checkpoint" in proc.stderr and "export it without --merge" in proc.stderr
    assert not out.exists()


def test_adapter_made_by_peft_starts_a_run(tmp_path, base_dir):
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
            r=8, lora_alpha=32, init_lora_weights=False,
            target_modules=["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
            target_parameters=["experts.up_proj", "experts.down_proj"]))
    made.save_pretrained(str(tmp_path / "made"))
    x = ids()
    with torch.no_grad():
        theirs = made.eval()(x).logits
        ours = NemotronHForCausalLM.from_pretrained(str(base_dir))
        spec = LoRASpec(8, 32.0, 0.0, ("*.in_proj", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.up_proj",
                                       "*.down_proj"))
        add_adapters(ours, spec)
        set_full_values(ours, read_peft_adapter(tmp_path / "made", ours.config, spec, adapter_parameters(ours)))
        torch.testing.assert_close(ours.eval()(x).logits, theirs, rtol=0, atol=LOGITS_ATOL)

    summary = lora_run(tmp_path / "run", "peft=lora", "peft.base_dtype=fp32", PEFT_TARGETS,
                       f"model.pretrained={base_dir}", f"peft.init_from={tmp_path / 'made'}", "trainer.max_steps=1")
    base = lora_run(tmp_path / "base", "peft=lora", "peft.base_dtype=fp32", PEFT_TARGETS,
                    f"model.pretrained={base_dir}", "trainer.max_steps=1", "checkpoint.save_final=false")
    assert summary["first_val_loss"] != base["first_val_loss"]  # started from the adapter, not from B = 0

    with pytest.raises(LoRAError, match="rank 8 and alpha 32.*this run has rank 4"):
        lora_run(tmp_path / "rank4", "peft=lora", "peft.rank=4", PEFT_TARGETS, f"model.pretrained={base_dir}",
                 f"peft.init_from={tmp_path / 'made'}", "trainer.max_steps=1")
    with pytest.raises(LoRAError, match="does not match this model's adapters: missing .*out_proj"):
        lora_run(tmp_path / "all", "peft=lora", f"model.pretrained={base_dir}",
                 f"peft.init_from={tmp_path / 'made'}", "trainer.max_steps=1")


def test_embedding_and_lm_head_adapters_match_peft(tmp_path, base_dir):
    """lm_head and the embedding, adapted when named: our forward (and the head's chunked loss) against
    `peft` on transformers' model both ways (our export loaded by peft; an adapter made by peft, which
    saves the embedding layers whole, loaded by ours), and the merge."""
    import peft

    from nemotron_recipe.models.nemotron_v3.lora import peft_targets, to_peft
    from nemotron_recipe.training.lora import merge_into, write_peft_adapter

    spec = LoRASpec(8, 32.0, 0.0, ("lm_head", "model.embeddings", "*.q_proj"))
    ours = NemotronHForCausalLM.from_pretrained(str(base_dir))
    targets = add_adapters(ours, spec)
    init_adapters(ours, seed=1)
    x, values = ids(), {}
    with torch.no_grad():
        for name, p in adapter_parameters(ours).items():  # B = 0 and the embedding's A = 0 at the start
            values[name] = p.add_(0.01 * torch.randn_like(p)).clone() if p.abs().max() == 0 else p.clone()
        logits = ours.eval()(x).logits
        out = ours(x, targets=x.roll(-1, 1), loss_chunk_size=16)
        plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten(), reduction="sum")
        torch.testing.assert_close(out.loss_sum, plain, rtol=1e-6, atol=1e-4)
    write_peft_adapter(tmp_path, to_peft(ours.config, values), spec, *peft_targets(ours.config, targets), None)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        adapted = peft.PeftModel.from_pretrained(hf_model(base_dir), str(tmp_path)).eval()
        assert (hf_model(base_dir)(x).logits - logits).abs().max() > 100 * LOGITS_ATOL
        torch.testing.assert_close(adapted(x).logits, logits, rtol=0, atol=LOGITS_ATOL)
        made = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
            r=8, lora_alpha=32, init_lora_weights=False, target_modules=["embeddings", "lm_head"]))
        made.save_pretrained(str(tmp_path / "made"))
        theirs = made.eval()(x).logits
    spec = LoRASpec(8, 32.0, 0.0, ("lm_head", "model.embeddings"))
    loaded = NemotronHForCausalLM.from_pretrained(str(base_dir))
    add_adapters(loaded, spec)
    set_full_values(loaded, read_peft_adapter(tmp_path / "made", loaded.config, spec, adapter_parameters(loaded)))
    merged = NemotronHForCausalLM.from_pretrained(str(base_dir))
    merge_into(merged, {n: p.detach() for n, p in adapter_parameters(loaded).items()}, spec)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, theirs, rtol=0, atol=LOGITS_ATOL)
        torch.testing.assert_close(merged.eval()(x).logits, theirs, rtol=0, atol=LOGITS_ATOL)


def _peft_and_merged_logits(out: Path, base: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import peft

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        adapted = peft.PeftModel.from_pretrained(hf_model(base), str(out / "adapter")).eval()
        return adapted(x).logits, hf_model(out / "merged")(x).logits


def test_export_round_trips_on_a_bf16_trained_base(tmp_path, base_dir):
    """A run on the default bf16 base with the default targets (every block kind of the tiny preset):
    its PEFT export starts a run with exactly the checkpoint's adapters, Mamba2 out_proj included, and
    peft on the fp32 base files equals the merged export (both merge into the files' own values)."""
    summary = lora_run(tmp_path / "run", "peft=lora", f"model.pretrained={base_dir}", "trainer.max_steps=3")
    checkpoint = Path(summary["checkpoint"])
    export_hf(checkpoint, tmp_path / "adapter")
    export_hf(checkpoint, tmp_path / "merged", merge=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] and all(m.endswith("mixer.out_proj") for m in config["modules_to_save"])

    meta = read_meta(checkpoint)
    model, trained = load_adapters(checkpoint, meta)
    started = read_peft_adapter(tmp_path / "adapter", model.config, _spec_of(meta), adapter_parameters(model))
    assert started.keys() == trained.keys()
    assert any(".out_proj." in n for n in started) and any(".experts.lora." in n for n in started)
    for name, value in trained.items():
        assert torch.equal(started[name], value), name

    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        copies = [f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("out_proj.weight")]
    assert copies and set(copies) == {"F32"}  # the base files' dtype, not the bf16 the run stored
    x = ids()
    adapted, merged = _peft_and_merged_logits(tmp_path, base_dir, x)
    torch.testing.assert_close(adapted, merged, rtol=0, atol=LOGITS_ATOL)
    assert (hf_model(base_dir)(x).logits - merged).abs().max() > 100 * LOGITS_ATOL

    # --out-proj skip: no modules_to_save; the adapter and the merge both leave out_proj's adapters out.
    export_hf(checkpoint, tmp_path / "skip" / "adapter", out_proj="skip")
    export_hf(checkpoint, tmp_path / "skip" / "merged", merge=True, out_proj="skip")
    skipped = json.loads((tmp_path / "skip" / "adapter" / "adapter_config.json").read_text())
    assert skipped["modules_to_save"] is None
    assert not (tmp_path / "skip" / "adapter" / "out_proj_lora.safetensors").exists()
    adapted_skip, merged_skip = _peft_and_merged_logits(tmp_path / "skip", base_dir, x)
    torch.testing.assert_close(adapted_skip, merged_skip, rtol=0, atol=LOGITS_ATOL)
    assert (adapted_skip - adapted).abs().max() > 100 * LOGITS_ATOL  # out_proj's adapters did matter


def _spec_of(meta: dict) -> LoRASpec:
    p = meta["peft"]
    return LoRASpec(p["rank"], p["alpha"], p["dropout"], tuple(p["target_modules"]))


def test_adapter_of_a_drawn_base_exports_that_base(tmp_path):
    """A run on a preset's seed-drawn weights has no base directory: the export writes the base it
    trained on beside the adapter and names it, and peft on it equals the merged export."""
    summary = lora_run(tmp_path / "run", "peft=lora", "trainer.max_steps=2")
    export_hf(summary["checkpoint"], tmp_path / "adapter")
    export_hf(summary["checkpoint"], tmp_path / "merged", merge=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "adapter" / "base").resolve())
    adapted, merged = _peft_and_merged_logits(tmp_path, Path(config["base_model_name_or_path"]), ids())
    torch.testing.assert_close(adapted, merged, rtol=0, atol=LOGITS_ATOL)


def test_init_from_needs_the_out_proj_factors_of_its_copies(tmp_path, base_dir, trained):
    """An adapter whose Mamba2 out_proj adapters are full copies only cannot start those adapters: the
    run is refused, naming the file and the fixes, rather than starting them from zero."""
    export_hf(trained, tmp_path / "adapter")
    (tmp_path / "adapter" / "out_proj_lora.safetensors").unlink()
    with pytest.raises(LoRAError, match="out_proj_lora.safetensors.*--out-proj skip"):
        lora_run(tmp_path / "run", "peft=lora", "peft.base_dtype=fp32", f"model.pretrained={base_dir}",
                 f"peft.init_from={tmp_path / 'adapter'}", "trainer.max_steps=1")


# ------------------------------------------------------------------ meshes
LORA_CASES_2 = ["1,2,1,1,0,none", "1,1,1,2,1,none", "1,1,2,1,0,none", "1,2,1,1,0,full", "1,2,1,1,0,selective",
                "1,2,1,1,0,blocks"]
LORA_CASES_4 = ["1,2,1,2,1,none", "2,2,1,1,0,every_nth"]


def _launch(tmp_path_factory, nproc: int, cases: list[str]) -> dict:
    out = tmp_path_factory.mktemp(f"lora{nproc}") / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           str(out), *cases]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=WORKER.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lora_meshes(tmp_path_factory) -> dict:
    return {**_launch(tmp_path_factory, 2, LORA_CASES_2), **_launch(tmp_path_factory, 4, LORA_CASES_4)}


@pytest.mark.distributed
@pytest.mark.parametrize("case", LORA_CASES_2 + LORA_CASES_4)
def test_lora_curves_match_one_process(lora_meshes, case):
    result = lora_meshes[case]
    for step, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"], strict=True)):
        assert abs(loss - ref) <= PARITY_RTOL * abs(ref), f"step {step}: {loss} vs {ref}"
    assert result["losses"][0] == pytest.approx(result["base_losses"][0], rel=PARITY_RTOL)
    assert max(abs(a - b) for a, b in zip(result["losses"][1:], result["base_losses"][1:])) > 1e-3  # they train
    # Adam magnifies rounding in elements with near-zero gradients; the values still agree closely.
    assert max(result["adapter_rel_err"].values()) < 1e-3
    # Only adapters train, on every block kind: Mamba2 in/out, attention, MLP, shared and routed experts.
    assert all(".lora" in n for n in result["trainable"]) and len(result["trainable"]) == 32
    if case.split(",")[3] == "2":
        # colwise bases shard B, rowwise ones A: two projections per dense block (2 Mamba, 1 attention
        # with four, 2 MLP); the MoE block stays replicated over tp.
        assert len(result["tp_sharded"]) == 12 and not any("experts" in n for n in result["tp_sharded"])


@pytest.mark.distributed
def test_lora_checkpoint_resumes_on_other_meshes(tmp_path):
    """A one-process LoRA checkpoint continues on fsdp 2 and on tp 2 + sequence parallel (one torchrun
    launch), each as the uninterrupted one-process run."""
    common = ["peft=lora", "trainer.max_steps=4"]
    lora_run(tmp_path / "straight", *common)
    lora_run(tmp_path / "first", *common, "trainer.stop_at_step=2")
    ckpt = tmp_path / "first" / "checkpoints" / "step_000002"
    meshes = {"fsdp": [], "tp_sp": ["mesh.tp=2", "mesh.sequence_parallel=true"]}
    jobs = [[*FAST, *common, f"run_dir={tmp_path / name}", f"checkpoint.resume={ckpt}", *mesh]
            for name, mesh in meshes.items()]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(WORKER.parent / "recipe_worker.py"), json.dumps(jobs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    straight = [r["loss"] for r in metrics_rows(tmp_path / "straight") if "loss" in r][2:]
    for name in meshes:
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["resumed_from"] == 2 and summary["world_size"] == 2
        resumed = [r["loss"] for r in metrics_rows(tmp_path / name) if "loss" in r]
        assert resumed == pytest.approx(straight, rel=PARITY_RTOL), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routed_expert_adapters_of_a_rank_below_16_bytes_run_the_grouped_gemm(dtype):
    """A rank-2 adapter's rows are 4 (bf16) or 8 (fp32) bytes, under the grouped GEMM's 16: padded
    with zeros they give the per-expert loop's result."""
    from nemotron_recipe.models.nemotron_v3.lora import ExpertLoRA, LoRASpec

    g = torch.Generator().manual_seed(0)
    adapter = ExpertLoRA(torch.empty(4, 32, 16), LoRASpec(rank=2)).to(dtype)
    with torch.no_grad():
        adapter.A.copy_(torch.randn(adapter.A.shape, generator=g))
        adapter.B.copy_(torch.randn(adapter.B.shape, generator=g))
    rows, out = torch.randn(10, 16, generator=g, dtype=dtype), torch.zeros(10, 32, dtype=dtype)
    counts = [3, 0, 5, 2]
    grouped = adapter(out, rows, torch.tensor(counts).cumsum(0).to(torch.int32))
    torch.testing.assert_close(grouped, adapter(out, rows, counts))
    assert grouped.abs().max() > 0


def _peft_reference(kind: str, shape: tuple[int, ...], rank: int, alpha: float, draws: int = 8):
    """peft's initial (A, B) for a base of `shape`, and its random factor's values pooled over `draws`
    initialisations: a Linear [out, in], an Embedding [vocab, hidden] or a stacked expert parameter."""
    import peft
    from peft.tuners.lora import layer as peft_layer

    holder = torch.nn.Module()
    if kind == "linear":
        holder.base = torch.nn.Linear(shape[1], shape[0], bias=False)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["base"])
    elif kind == "embedding":
        holder.base = torch.nn.Embedding(*shape)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["base"])
    else:
        holder.base = torch.nn.Module()
        holder.base.weight = torch.nn.Parameter(torch.zeros(shape))
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=[], target_parameters=["base.weight"])
    layer = next(m for m in peft.get_peft_model(holder, config).modules() if isinstance(m, peft_layer.LoraLayer))
    if kind == "embedding":
        factors = lambda: (layer.lora_embedding_A["default"], layer.lora_embedding_B["default"])  # noqa: E731
    else:
        factors = lambda: (layer.lora_A["default"].weight, layer.lora_B["default"].weight)  # noqa: E731
    a, b = (t.detach().clone() for t in factors())
    pooled = []
    for _ in range(draws):
        layer.reset_lora_parameters("default", True)
        pooled.append(factors()[1 if kind == "embedding" else 0].detach().flatten().clone())
    return a, b, torch.cat(pooled)


def test_adapters_start_from_peft_initialisation_on_the_same_shapes():
    """Each adapter's initial values against peft's on the same base shapes: the zero factor is zero in
    both, and the random one (A of a projection or expert weight, B of the embedding) has peft's bound and
    spread. A factor drawn at another scale (1/in instead of 1/sqrt(in), say) fails here."""
    from nemotron_recipe.models.nemotron_v3.lora import ExpertLoRA, LoRAEmbedding, LoRALinear, initial_values

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**{**SMALL_DIMS, "pattern": "M*-E", "hidden_size": 64}))
    spec = LoRASpec(8, 16.0, 0.0, ("*.in_proj", "*.out_proj", "*.q_proj", "*.o_proj", "*.up_proj", "*.down_proj",
                                   "*.experts.up_proj", "*.experts.down_proj", "model.embeddings", "lm_head"))
    add_adapters(model, spec)
    values = initial_values(model, seed=3)
    checked = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            kind, shape, a_name, b_name = "linear", tuple(module.weight.shape), "lora_A.weight", "lora_B.weight"
        elif isinstance(module, LoRAEmbedding):
            kind, shape, a_name, b_name = "embedding", tuple(module.weight.shape), "lora.lora_embedding_A", \
                "lora.lora_embedding_B"
        elif isinstance(module, ExpertLoRA):
            kind, shape, a_name, b_name = "experts", (module.A.shape[0], module.B.shape[1], module.A.shape[2]), "A", "B"
        else:
            continue
        ours_a, ours_b = values[f"{name}.{a_name}"], values[f"{name}.{b_name}"]
        ref_a, ref_b, pooled = _peft_reference(kind, shape, spec.rank, spec.alpha)
        assert ours_a.numel() == ref_a.numel() and ours_b.numel() == ref_b.numel(), name
        zero, drawn = (ours_a, ours_b) if kind == "embedding" else (ours_b, ours_a)
        assert not zero.any() and not (ref_a if kind == "embedding" else ref_b).any(), name
        # Spread within 15% (at least 256 draws each: about 5 standard errors); for the uniform A, every
        # value inside peft's bound and the largest near it.
        assert abs(drawn.std().item() / pooled.std().item() - 1) < 0.15, (name, drawn.std(), pooled.std())
        if kind != "embedding":
            bound = pooled.abs().max().item()
            assert 0.9 * bound < drawn.abs().max().item() <= bound * 1.001, (name, drawn.abs().max(), bound)
        checked.add(kind)
    assert checked == {"linear", "embedding", "experts"}
