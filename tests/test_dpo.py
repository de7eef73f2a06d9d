"""DPO (objective=dpo): its loss and rewards against their definition, transformers' NemotronH and TRL;
its references; preference data and its bad input; resume; and its learning on the shipped pairs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, RUN_BASE, compose_run, metrics_rows
from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.data import DEFAULT_ASSETS_DIR, DataError, GlobalBatchPlan, load_tokenizer
from nemotron_recipe.data.preference import load_preference_data
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.objectives import dpo as dpo_module

# Small enough for seconds a step on two loaded cores; fp32 so that runs compare to 1e-5.
DPO = [*RUN_BASE, "objective=dpo", "model.hidden_size=64", "trainer.val_every=0", "optim.warmup_steps=0"]
LORA = ["peft=lora", "peft.base_dtype=fp32"]
WORKER = REPO / "tests" / "distributed" / "recipe_worker.py"
# The first pairs of the shipped sets: a precomputed reference reads every pair once before step 1.
SMALL: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def small_pairs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs")
    for split, n in (("train", 32), ("val", 8)):
        lines = (DEFAULT_ASSETS_DIR / f"tiny_dpo_{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    SMALL[:] = [f"data.train_file={out / 'train.jsonl'}", f"data.val_file={out / 'val.jsonl'}"]


def dpo_run(run_dir: Path, *overrides: str) -> dict:
    return run(compose_run(run_dir, *SMALL, *overrides, base=DPO))


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if "loss" in r]


# ---------------------------------------------------------------------------------------- references
@pytest.mark.parametrize("reference, peft", [("base", LORA), ("copy", []), ("precomputed", [])])
def test_step1_is_ln2_and_the_reference_never_changes(tmp_path, monkeypatch, reference, peft):
    """Policy = reference at step 1 gives loss ln 2 and zero rewards; the reference's log-probs of a fixed
    batch are the same before step 1 and before step 4, while the policy's have moved."""
    probes: list[tuple[torch.Tensor, torch.Tensor]] = []
    begin = dpo_module.DPOObjective.begin_step

    def begin_step(self, micro_batches):
        batch = self.collate([0, 1, 2])
        with torch.no_grad():
            probes.append((self.reference.logps(batch, "train"), self.sequence_logps(self.model, batch)))
        return begin(self, micro_batches)

    monkeypatch.setattr(dpo_module.DPOObjective, "begin_step", begin_step)
    dpo_run(tmp_path, *peft, f"objective.reference={reference}", "trainer.max_steps=4")
    rows = train_rows(tmp_path)
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-6
    assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == rows[0]["rewards/margin"] == 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    (ref_first, policy_first), (ref_last, policy_last) = probes[0], probes[-1]
    torch.testing.assert_close(policy_first, ref_first, rtol=0, atol=1e-6)
    assert torch.equal(ref_first, ref_last)
    assert (policy_last - policy_first).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------- the definition
def _hf_response_logps(model, ids: list[int], targets: list[int]) -> torch.Tensor:
    """Summed log-probs of the trained targets of one sequence under a transformers model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    t = torch.tensor(targets)
    keep = t != -100
    return torch.log_softmax(logits, -1)[keep].gather(-1, t[keep][:, None]).sum()


def _trl_loss(beta: float, policy_model, ref_chosen, ref_rejected, sequences, targets) -> float:
    """TRL's DPOTrainer loss computation (`_compute_loss`, sigmoid loss, precomputed reference log-probs)
    run on the per-token log-probs of `policy_model` (a transformers model)."""
    from trl import DPOTrainer

    length = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), length, dtype=torch.long)
    completion = torch.zeros(len(sequences), length, dtype=torch.long)
    attention = torch.zeros(len(sequences), length, dtype=torch.long)
    for i, (ids, tgt) in enumerate(zip(sequences, targets)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # TRL marks the completion tokens themselves; ours trains target t (the token at t + 1).
        completion[i, 1: len(ids)] = torch.tensor([int(t != -100) for t in tgt[:-1]])

    def model(input_ids, attention_mask, labels, **_):
        logits = policy_model(input_ids, attention_mask=attention_mask).logits.float()[:, :-1]
        shifted = labels[:, 1:]
        logps = torch.log_softmax(logits, -1).gather(-1, shifted.clamp(min=0)[..., None])[..., 0]
        logps = logps * (shifted != -100)
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    identity = SimpleNamespace(gather_for_metrics=lambda t: t, gather=lambda t: t, device=torch.device("cpu"))
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=identity, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0],
        beta=beta, use_weighting=False, _metrics={"train": __import__("collections").defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    with torch.no_grad():
        loss = DPOTrainer._compute_loss(stand_in, model, inputs, return_outputs=False)
    return float(loss)


def test_a_step_equals_the_definition_with_transformers_and_trls_loss(tmp_path):
    """Step 2 of a full fine-tuning run (reference=copy): its loss and rewards, from the exported step-1
    weights and the starting weights run by transformers' NemotronH over the same pairs and response
    tokens (1e-5), and TRL's DPO loss on the same log-probs (1e-5)."""
    from transformers import AutoModelForCausalLM

    from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
    from nemotron_recipe.training.hf_io import export_hf

    beta = 0.3
    cfg = compose_run(tmp_path / "run", *DPO[len(RUN_BASE):], *SMALL, "objective.reference=copy", f"objective.beta={beta}",
                      "trainer.max_steps=2", "checkpoint.every=1", "optim.lr=1e-2", base=RUN_BASE)
    run(cfg)
    row = train_rows(tmp_path / "run")[1]
    export_hf(tmp_path / "run" / "checkpoints" / "step_000001", tmp_path / "policy")
    model_config, _ = validate_config(cfg)
    torch.manual_seed(cfg.seed)  # the recipe's starting weights (build_model)
    NemotronHForCausalLM(model_config).save_pretrained(str(tmp_path / "reference"))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()

    data = load_preference_data(cfg.data, load_tokenizer(cfg.data.tokenizer), seq_len=cfg.trainer.seq_len,
                                seed=cfg.seed)
    t = cfg.trainer
    pairs = GlobalBatchPlan(len(data.train), t.global_batch_size, t.micro_batch_size, 0, 1, cfg.seed)
    indices = pairs.global_indices_for_step(1)
    halves = [data.train.chosen, data.train.rejected]
    logps = {name: torch.stack([torch.stack([_hf_response_logps(m, h.input_ids[i], h.targets[i]) for i in indices])
                                for h in halves]) for name, m in (("policy", policy), ("reference", reference))}
    ratios = logps["policy"] - logps["reference"]  # [2, pairs]
    losses = -F.logsigmoid(beta * (ratios[0] - ratios[1]))
    rewards = beta * ratios
    assert row["loss"] == pytest.approx(losses.mean().item(), abs=1e-5)
    assert row["rewards/chosen"] == pytest.approx(rewards[0].mean().item(), abs=1e-5)
    assert row["rewards/rejected"] == pytest.approx(rewards[1].mean().item(), abs=1e-5)
    assert row["rewards/margin"] == pytest.approx((rewards[0] - rewards[1]).mean().item(), abs=1e-5)
    assert row["rewards/accuracy"] == (rewards[0] > rewards[1]).float().mean().item()
    assert abs(row["loss"] - math.log(2)) > 1e-3  # the step compared is not the trivial first one

    sequences = [h.input_ids[i] for h in halves for i in indices]
    targets = [h.targets[i] for h in halves for i in indices]
    trl = _trl_loss(beta, policy, logps["reference"][0], logps["reference"][1], sequences, targets)
    assert row["loss"] == pytest.approx(trl, abs=1e-5)


# ---------------------------------------------------------------------------------------- resume, learning
@pytest.mark.parametrize("reference, peft", [("base", LORA), ("copy", []), ("precomputed", [])])
def test_resume_is_exact(tmp_path, reference, peft):
    """Stopped after step 1 and resumed: the uninterrupted run's rows, bit for bit. Full fine-tuning
    with a precomputed reference is the case that once differed: the reference's forward before step 1
    left FSDP's gathered head and final norm in the model, and clipping, reading the model's parameters,
    measured and scaled every gradient but theirs, unlike a resumed run's first step, which reads the table.
    A copy is rebuilt from the starting weights, and a precomputed table is read back, not recomputed."""
    common = [*peft, f"objective.reference={reference}", "trainer.max_steps=2", "eval.sample_tokens=0"]
    dpo_run(tmp_path / "straight", *common)
    dpo_run(tmp_path / "resumed", *common, "trainer.stop_at_step=1")
    cache = tmp_path / "resumed" / "reference_logps.pt"
    written = cache.stat().st_mtime_ns if reference == "precomputed" else None
    dpo_run(tmp_path / "resumed", *common)
    if written is not None:
        assert cache.stat().st_mtime_ns == written  # read back, not computed again from the trained weights
    straight, resumed = metrics_rows(tmp_path / "straight"), metrics_rows(tmp_path / "resumed")
    drop = ("time", "elapsed_s", "tokens_per_s", "trained_tokens_per_s")
    keep = lambda rows: [{k: v for k, v in r.items() if k not in drop and "per_s" not in k} for r in rows]  # noqa: E731
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2]
    assert keep(resumed) == keep(straight)


def test_30_steps_on_the_shipped_pairs_raise_validation_reward_accuracy(tmp_path):
    """`objective=dpo peft=lora` with the shipped pairs: after 30 steps the reference-relative rewards
    rank chosen over rejected on most of the held-out pairs."""
    summary = run(compose_run(tmp_path, "peft=lora", "trainer.max_steps=30", "trainer.global_batch_size=8",
                      "trainer.micro_batch_size=8", "data.val_max_batches=null", base=DPO))
    val = [r for r in metrics_rows(tmp_path) if "val_loss" in r]
    assert val[0]["rewards/accuracy"] == 0 and val[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert val[-1]["step"] == 30 and val[-1]["rewards/accuracy"] > 0.5, val[-1]
    assert val[-1]["rewards/margin"] > 0 and summary["last_val_loss"] < math.log(2)


# ---------------------------------------------------------------------------------------- bad input
def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data_cfg(train: str, **over):
    cfg = compose_run(Path("/tmp/unused"), "objective=dpo", f"data.train_file={train}", "data.val_file=null",
                      *[f"data.{k}={v}" for k, v in over.items()])
    return cfg.data


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_ASSETS_DIR)


def test_a_preference_row_missing_a_key_names_the_row_the_key_and_the_fix(tmp_path, tok):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "Add 1 and 2.", "chosen": "3", "rejected": "4"},
                                          {"prompt": "Add 2 and 2.", "chosen": "4"}])
    with pytest.raises(DataError) as e:
        load_preference_data(_data_cfg(train), tok, seq_len=64, seed=0)
    for needle in ("t.jsonl:2", "['rejected']", "data.rejected_key"):
        assert needle in str(e.value), str(e.value)


def test_identical_pairs_and_prompts_longer_than_seq_len_are_counted_and_skipped(tmp_path, tok):
    long_prompt = "Repeat: " + " ".join(["cat dog"] * 40)
    rows = [{"prompt": "Add 1 and 2.", "chosen": "1 + 2 = 3.", "rejected": "1 + 2 = 4."},
            {"prompt": "Add 2 and 2.", "chosen": "2 + 2 = 4.", "rejected": "2 + 2 = 4."},
            {"prompt": long_prompt, "chosen": "cat", "rejected": "dog"},
            {"prompt": [{"role": "user", "content": "Add 3 and 3."}],
             "chosen": [{"role": "assistant", "content": "3 + 3 = 6."}], "rejected": "I do not know. " * 30}]
    data = load_preference_data(_data_cfg(_write(tmp_path / "t.jsonl", rows)), tok, seq_len=48, seed=0)
    assert data.train.counts() == {"pairs": 2, "truncated": 1, "dropped": 0, "prompt_too_long": 1, "identical": 1}
    # The truncated pair keeps its prompt whole and the start of its long response, trained to the end.
    assert len(data.train.rejected.input_ids[1]) == 48 and data.train.rejected.targets[1][-2] != -100
    dropped = load_preference_data(_data_cfg(_write(tmp_path / "t.jsonl", rows), max_length_policy="drop"), tok,
                                   seq_len=48, seed=0)
    assert dropped.train.counts()["dropped"] == 2 and len(dropped.train) == 1
    assert "prompt leaves no response token" in data.describe(48)
    with pytest.raises(DataError, match="no preference pair is left"):
        load_preference_data(_data_cfg(_write(tmp_path / "t.jsonl", rows[1:3])), tok, seq_len=48, seed=0)


@pytest.mark.parametrize("overrides, needles", [
    (["objective.reference=base"], ["objective.reference=base without LoRA", "objective.reference=copy"]),
    (["peft=lora", "data.packing=true"], ["data.packing=true", "objective=dpo"]),
    (["peft=lora", "objective.loss=hinge"], ["objective.loss='hinge'", "sigmoid"]),
    (["peft=lora", "data.format=jsonl"], ["objective=dpo with data.format='jsonl'", "data.format=preference"]),
    (["peft=lora", "moe.bias_update_rate=0.001"], ["moe.bias_update_rate", "objective.reference=copy"]),
])
def test_bad_dpo_settings_are_refused_before_any_work(tmp_path, overrides, needles):
    with pytest.raises(ConfigError) as e:
        validate_config(compose_run(tmp_path, "objective=dpo", *overrides))
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_preference_data_is_refused_under_sft(tmp_path):
    with pytest.raises(ConfigError, match="data.format=preference: preference pairs train with DPO"):
        validate_config(compose_run(tmp_path, "data.format=preference"))


# ---------------------------------------------------------------------------------------- meshes
@pytest.mark.distributed
def test_meshes_equal_one_process(tmp_path):
    """fsdp 2, hsdp (2 replicas of 1 shard), tp 2 + sequence parallel, cp 2 and ep 2 (the tiny preset's MoE
    block) in one torchrun launch: over 5 steps their losses, rewards and gradient norms are the one-process run's (1e-5)."""
    common = [*DPO, *SMALL, *LORA, "trainer.max_steps=5"]
    dpo_run(tmp_path / "single", *LORA, "trainer.max_steps=5")
    meshes = {"fsdp": [], "hsdp": ["mesh.dp_replicate=2", "mesh.dp_shard=1"],
              "tp_sp": ["mesh.tp=2", "mesh.sequence_parallel=true"], "cp": ["mesh.cp=2"], "ep": ["mesh.ep=2"]}
    jobs = [[*common, f"run_dir={tmp_path / name}", *mesh] for name, mesh in meshes.items()]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
         json.dumps(jobs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    single = train_rows(tmp_path / "single")
    worst = {}
    for name in meshes:
        rows = train_rows(tmp_path / name)
        assert len(rows) == 5, name
        for key in ("loss", "grad_norm"):
            worst[name, key] = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(rows, single))
        # Rewards are beta x differences of log-probs some 100x larger: compared absolutely.
        for key in ("rewards/chosen", "rewards/rejected"):
            worst[name, key] = max(abs(a[key] - b[key]) for a, b in zip(rows, single))
    print(worst)
    assert all(v <= (1e-5 if k[1] in ("loss", "grad_norm") else 1e-6) for k, v in worst.items()), worst


# ---------------------------------------------------------------------------------------- the planner
def test_the_planner_counts_two_sequences_per_pair_the_reference_forward_and_the_copy():
    from hydra import compose, initialize_config_dir

    from helpers import CONF
    from recipes.plan import plan_report

    def report(*overrides: str) -> dict:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return plan_report(compose(config_name="plan", overrides=["run_dir=.", *overrides]))[0]

    sft, base = report("peft=lora"), report("objective=dpo", "peft=lora")
    copy, precomputed = (report("objective=dpo", f"objective.reference={r}") for r in ("copy", "precomputed"))
    assert base["micro_batch_size"] == 2 * sft["micro_batch_size"]
    # reference=base holds no second model; reference=copy holds the policy's parameters once more.
    assert base["per_rank_bytes"]["params"] == sft["per_rank_bytes"]["params"] and base["per_rank_bytes"]["reference"] == 0
    assert copy["per_rank_bytes"]["reference"] == copy["per_rank_bytes"]["params"] > 0
    assert copy["per_rank_bytes"]["total"] - precomputed["per_rank_bytes"]["total"] == copy["per_rank_bytes"]["params"]
    # The reference forward is compute a precomputed reference does not spend.
    assert copy["step_time_s"]["compute_s"] > precomputed["step_time_s"]["compute_s"]


# ---------------------------------------------------------------------------------------- composition
def test_every_activation_checkpointing_mode_leaves_dpo_unchanged(tmp_path):
    """Recomputing activations changes no value: each AC mode's losses, rewards and gradient norms over
    two LoRA steps (reference=base, whose no-grad forward runs through the same wrapped blocks) are
    those without AC, to fp32 rounding (1e-6 relative)."""
    common = [*LORA, "trainer.max_steps=2", "eval.sample_tokens=0", "data.val_file=null"]
    dpo_run(tmp_path / "none", *common)
    plain = train_rows(tmp_path / "none")
    for mode in ("blocks", "every_nth", "full", "selective"):
        dpo_run(tmp_path / mode, *common, f"ac={mode}")
        for a, b in zip(train_rows(tmp_path / mode), plain, strict=True):
            for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (mode, key)


def _balance_loss_by_definition(scores: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor) -> float:
    """sum over sequences and experts of f_i P_i: f_i = E / (k T) x (real tokens routed to i), P_i = the
    mean over the T real tokens of expert i's share of the token's scores (DeepSeek-V3's sequence-wise
    balance loss), written out sequence by sequence."""
    rows, experts, k = mask.shape[0], scores.shape[-1], idx.shape[-1]
    total = 0.0
    for s, i, m in zip(scores.view(rows, -1, experts), idx.view(rows, -1, k), mask):
        s, i = s[m].double(), i[m]
        tokens = s.shape[0]
        f = torch.bincount(i.flatten(), minlength=experts).double() * experts / (k * tokens)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        total += float((f * p).sum())
    return total


def test_moe_balance_loss_under_dpo_is_the_policys_on_both_halves(tmp_path, monkeypatch):
    """moe.aux_loss_coeff under DPO: the step's `moe_aux_loss` is coefficient / (2 x pairs) x the
    balance loss of the policy's forward over every micro-batch's chosen and rejected sequences (real
    tokens only), recomputed here from the routers' scores and choices; the reference's forward
    (reference=base: the same blocks, adapters off, no grad) routes tokens but adds nothing."""
    from nemotron_recipe.models.nemotron_v3.model import Router

    coeff, batches, policy_routes, reference_routes = 0.01, [], [], []
    begin = dpo_module.DPOObjective.begin_step
    monkeypatch.setattr(dpo_module.DPOObjective, "begin_step",
                        lambda self, mbs: batches.extend(mbs) or begin(self, mbs))

    def record(module, args, output):
        scores, _, idx = output
        (policy_routes if torch.is_grad_enabled() else reference_routes).append((scores.detach(), idx))

    real_init = Router.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.register_forward_hook(record)

    monkeypatch.setattr(Router, "__init__", init)
    dpo_run(tmp_path, *LORA, f"moe.aux_loss_coeff={coeff}", "trainer.max_steps=1", "eval.sample_tokens=0",
            "data.val_file=null")
    row = train_rows(tmp_path)[0]
    blocks = len(policy_routes) // len(batches)
    assert blocks >= 1 and len(policy_routes) == blocks * len(batches) and len(reference_routes) == len(policy_routes)
    expected = sum(_balance_loss_by_definition(scores, idx, batches[n // blocks]["token_mask"])
                   for n, (scores, idx) in enumerate(policy_routes))
    pairs = sum(b["pair_index"].numel() for b in batches)
    assert row["moe_aux_loss"] == pytest.approx(expected * coeff / (2 * pairs), rel=1e-5)
    assert row["moe_aux_loss"] > 0


def test_a_nan_under_dpo_skips_or_stops_as_configured(tmp_path, monkeypatch):
    """A NaN planted in step 2's policy log-probs: under trainer.nonfinite=skip the step is dropped and
    counted and the run goes on, finite; under stop (the default) the run ends naming step 2, with
    step 1's checkpoint the last one kept."""
    from nemotron_recipe.training.nonfinite import NonFiniteError

    real, calls = dpo_module.preference_loss, []

    def planted(policy_chosen, *rest, **kw):
        if torch.is_grad_enabled():  # training micro-batches only; 2 of them a step
            calls.append(1)
            if len(calls) == 3:
                policy_chosen = policy_chosen * float("nan")
        return real(policy_chosen, *rest, **kw)

    monkeypatch.setattr(dpo_module, "preference_loss", planted)
    common = [*LORA, "trainer.max_steps=3", "eval.sample_tokens=0", "data.val_file=null", "checkpoint.every=1"]
    summary = dpo_run(tmp_path / "skip", *common, "trainer.nonfinite=skip")
    rows = {r["step"]: r for r in train_rows(tmp_path / "skip")}
    assert summary["skipped_steps"] == 1 and rows[2].get("skipped") is True and rows[2]["loss"] is None
    assert all(math.isfinite(rows[s]["loss"]) and not rows[s].get("skipped") for s in (1, 3))
    calls.clear()
    with pytest.raises(NonFiniteError, match="step 2:"):
        dpo_run(tmp_path / "stop", *common)
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir()) == ["step_000001"]


def test_lora_export_after_dpo_loads_in_peft_with_our_logits(tmp_path):
    """Three DPO steps of LoRA on a Hugging Face base, exported: peft loads the adapter onto transformers'
    NemotronH and gives our model's logits, as does the merged export (the LoRA export tolerance, 1e-4)."""
    from test_lora import _exports_match_peft

    from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig.from_preset("tiny")).save_pretrained(str(tmp_path / "base"))
    summary = run(compose_run(tmp_path / "run", *SMALL, *LORA, f"model.pretrained={tmp_path / 'base'}",
                              "trainer.max_steps=3", "optim.lr=1e-2", "eval.sample_tokens=0", "data.val_file=null",
                              base=[*RUN_BASE, "objective=dpo", "trainer.val_every=0", "optim.warmup_steps=0"]))
    assert train_rows(tmp_path / "run")[-1]["rewards/margin"] != 0  # the adapters moved off the base
    config = _exports_match_peft(tmp_path / "out", tmp_path / "base", Path(summary["checkpoint"]))
    assert config["peft_type"] == "LORA"
