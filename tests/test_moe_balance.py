"""Aux-loss-free balancing: expert loads over a step's micro-batches, the imbalance metric and the
correction-bias update they drive, the same on every mesh; expert parallel in the recipe."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wandb

from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3 import model as model_module
from nemotron_recipe.models.nemotron_v3.model import MoE, sequence_balance_loss
from nemotron_recipe.training import logging as logging_module
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import load_checkpoint_model
from nemotron_recipe.training.moe_balance import RouterBalance

from helpers import PREFLIGHT_ON, RUN_BASE, SMALL_DIMS, compose_run, metrics_rows


def _model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return NemotronHForCausalLM(NemotronHConfig(pattern="EME", n_routed_experts=4, num_experts_per_tok=2))


def test_loads_add_up_over_micro_batches_and_move_the_bias_against_the_load():
    model = _model()
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.5)
    first, second = balance.blocks
    for loads in ([6, 2, 0, 0], [2, 2, 4, 0]):
        first.experts.tokens_per_expert = torch.tensor(loads)
        second.experts.tokens_per_expert = torch.tensor([2, 2, 2, 2])
        balance.after_micro_batch()
    metrics = balance.after_step(taken=True)
    # Block 1's loads [8, 4, 4, 0]: mean 4, busiest 8 -> 2.0; block 2 is balanced (1.0).
    assert metrics["moe_load_imbalance"] == pytest.approx(2.0)
    assert metrics["expert_load"] == [[8, 4, 4, 0], [4, 4, 4, 4]]
    assert first.gate.e_score_correction_bias.tolist() == [-0.5, 0.0, 0.0, 0.5]
    assert second.gate.e_score_correction_bias.tolist() == [0.0] * 4
    assert balance.counts is None  # the next step counts afresh


def test_a_step_not_taken_leaves_the_bias_and_rate_zero_only_measures():
    model = _model()
    for rate, taken in ((0.5, False), (0.0, True)):
        balance = RouterBalance(model, token_group=None, bias_update_rate=rate)
        for block in balance.blocks:
            block.experts.tokens_per_expert = torch.tensor([3, 1, 0, 0])
        balance.after_micro_batch()
        assert balance.after_step(taken=taken)["moe_load_imbalance"] == pytest.approx(3.0)
        assert all(not b.gate.e_score_correction_bias.any() for b in balance.blocks)


def _balance_loss_by_definition(scores, idx, mask) -> float:
    """DeepSeek-V3's L = sum_i f_i P_i of each sequence, summed over the sequences, one token at a time."""
    rows, t, experts = scores.shape
    total = 0.0
    for r in range(rows):
        real = [j for j in range(t) if mask[r, j]]
        if not real:
            continue
        for i in range(experts):
            f = experts / (idx.shape[-1] * len(real)) * sum(int(i in idx[r, j].tolist()) for j in real)
            p = sum((scores[r, j, i] / scores[r, j].sum()).item() for j in real) / len(real)
            total += f * p
    return total


def test_sequence_balance_loss_matches_its_definition_and_leaves_padding_out():
    g = torch.Generator().manual_seed(0)
    rows, t, experts, k = 3, 7, 6, 2
    scores = torch.rand(rows, t, experts, generator=g, dtype=torch.float64)
    idx = scores.topk(k, dim=-1).indices
    mask = torch.ones(rows, t, dtype=torch.bool)
    mask[0, 4:] = False  # padding trails the real tokens
    mask[2, :] = False  # a row of padding only adds nothing
    got = sequence_balance_loss(scores.flatten(0, 1), idx.flatten(0, 1), rows, mask, None)
    assert got.item() == pytest.approx(_balance_loss_by_definition(scores, idx, mask), rel=1e-12)
    # Perfectly balanced routing with uniform scores has loss 1 per sequence.
    uniform = torch.full((4 * experts, experts), 0.5, dtype=torch.float64)
    cyclic = torch.stack([torch.arange(4 * experts) % experts, (torch.arange(4 * experts) + 1) % experts], -1)
    assert sequence_balance_loss(uniform, cyclic, 4, None, None).item() == pytest.approx(4.0)


def test_the_balance_loss_reaches_the_gradients_with_its_weight():
    """A training forward with `balance_loss_weight` w back-propagates main loss + w * (the blocks'
    balance losses): the same gradients as adding that sum to the loss by hand."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    weight, grads = 0.3, []
    for by_hand in (False, True):
        model = _model()
        routes = []
        for block in RouterBalance(model, None, 0.0).blocks:
            block.balance_loss_weight = 0.0 if by_hand else weight
            block.gate.register_forward_hook(lambda module, args, out: routes.append(out))
        loss = model(ids, labels=ids).loss
        if by_hand:
            loss = loss + weight * sum(sequence_balance_loss(s, i, 2, None, None) for s, _, i in routes)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-7, msg=name)
    assert grads[0]["model.layers.0.mixer.gate.weight"].abs().sum() > 0


def test_balance_loss_metric_is_the_weighted_sum_over_blocks_and_steps_micro_batches():
    model = _model()
    balance = RouterBalance(model, None, 0.0, aux_loss_coeff=0.01, sequences_per_step=4)
    assert [b.balance_loss_weight for b in balance.blocks] == [0.0025, 0.0025] and balance.needs_token_mask
    for parts in ((1.0, 2.0), (3.0, 4.0)):
        for block, part in zip(balance.blocks, parts):
            block.experts.tokens_per_expert = torch.tensor([1, 1, 1, 1])
            block.balance_loss = torch.tensor(part)
        balance.after_micro_batch()
    assert balance.after_step(taken=True)["moe_aux_loss"] == pytest.approx(10.0 * 0.0025)
    assert not RouterBalance(NemotronHForCausalLM(NemotronHConfig(pattern="M*")), None, 0.0).needs_token_mask


def test_a_model_without_moe_blocks_has_nothing_to_balance():
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-"))
    balance = RouterBalance(model, token_group=None, bias_update_rate=0.1)
    assert not balance and balance.after_step(taken=True) == {}


# ---------------------------------------------------------------------------------------- recipe
SHORT = ["trainer.val_every=0", "optim.warmup_steps=0", "trainer.log_every=1"]


def _rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if "loss" in r]


def _biases(checkpoint: Path) -> torch.Tensor:
    model, _, _ = load_checkpoint_model(checkpoint)
    return torch.stack([b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")])


WORKER = Path(__file__).resolve().parent / "distributed" / "recipe_worker.py"
# seed=3: over these 20 steps no token comes near a routing tie (smallest margin 4.3e-4 with one
# thread or two; seed 0 came within 6e-6 on one machine, under the test's own 1e-5 guard).
EP_COMMON = [*SHORT, "trainer.max_steps=20", "checkpoint.every=10", "moe.bias_update_rate=0.02", "seed=3"]
SP_COMMON = [*SHORT, "trainer.max_steps=5", "checkpoint.every=5", "moe.bias_update_rate=0.01", "moe.aux_loss_coeff=0.1"]
LORA_COMMON = [*SHORT, "trainer.max_steps=3", "peft=lora"]


def hf_common(source: Path) -> list[str]:
    return [*SHORT, "trainer.max_steps=2", f"model.pretrained={source / 'hf'}"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    """The 2-rank recipe runs of this module's parity tests, one after another in a single torchrun
    launch (tests/distributed/recipe_worker.py): one start-up and rendezvous instead of one per test.
    Each test compares its run with one process's run of the same overrides."""
    base = tmp_path_factory.mktemp("two_rank")
    # The Hugging Face checkpoint the ep 2 load reads: exported by a one-process run.
    run(compose_run(base / "source", *SHORT, "trainer.max_steps=2", "checkpoint.export_hf=true"))
    jobs = {
        "ep2_split": [*EP_COMMON, "trainer.stop_at_step=10", PREFLIGHT_ON, "mesh.ep=2"],  # planned at ep 2 too
        "tp2_sp": [*SP_COMMON, "mesh.tp=2", "mesh.sequence_parallel=true"],
        "ep2_hf": [*hf_common(base / "source"), "mesh.ep=2"],
        "ep2_lora": [*LORA_COMMON, "mesh.ep=2"],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
         json.dumps([[*RUN_BASE, *overrides, f"run_dir={base / name}"] for name, overrides in jobs.items()])],
        cwd=base, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base


def _skewed_data(path: Path) -> Path:
    """Prompts and responses drawn from three words, one of them three times as often: most tokens
    look alike to the router."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(200):
            words = " ".join(rng.choice(["moon", "moon", "moon", "star", "key"]) for _ in range(rng.randint(8, 30)))
            f.write(json.dumps({"prompt": f"Repeat: {words}", "response": words}) + "\n")
    return path


def test_bias_updates_bring_a_skewed_load_down(tmp_path):
    data = _skewed_data(tmp_path / "skewed.jsonl")
    # A small LR keeps the routers nearly where they start, so the bias alone moves the load.
    common = [*SHORT, "trainer.max_steps=50", f"data.train_file={data}", "data.val_file=null", "optim.lr=1e-5",
              "checkpoint.save_final=false", "trainer.global_batch_size=2"]
    imbalance = {}
    for rate in (0.0, 0.01):
        run(compose_run(tmp_path / str(rate), *common, f"moe.bias_update_rate={rate}"))
        rows = _rows(tmp_path / str(rate))
        imbalance[rate] = [statistics.mean(r["moe_load_imbalance"] for r in rows[:5]),
                           statistics.mean(r["moe_load_imbalance"] for r in rows[-10:])]
    assert imbalance[0.01][1] < 0.85 * imbalance[0.01][0], imbalance
    assert imbalance[0.01][1] < 0.85 * imbalance[0.0][1], imbalance


def _track_margins(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Records each training MoE forward's smallest top-k margin over real tokens: the k-th minus the
    (k+1)-th biased router score, how close the token's choice of experts is to a tie."""
    margins: list[float] = []
    original = MoE.forward

    def forward(self, hidden, token_mask=None):
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                scores, _, _ = self.gate(hidden.flatten(0, -2))
                biased = scores + model_module.local(self.gate.e_score_correction_bias)
                top = biased.topk(self.gate.top_k + 1, dim=-1).values
                margin = top[:, -2] - top[:, -1]
                if token_mask is not None:
                    margin = margin[token_mask.flatten()]
                if margin.numel():
                    margins.append(margin.min().item())
        return original(self, hidden, token_mask)

    monkeypatch.setattr(MoE, "forward", forward)
    return margins


@pytest.mark.distributed
def test_expert_parallel_run_matches_one_process_and_resumes_on_one(tmp_path, monkeypatch, two_rank_runs):
    """10 steps at ep 2 on 2 ranks, then 10 more resumed on one process, against 20 straight steps on
    one process: the same losses, gradient norms and correction biases.

    Routing is discrete, so this holds over a horizon in which no token comes within rounding of a tie
    between its k-th and (k+1)-th expert (docs/moe-routing.md): the layouts' router scores differ by up
    to about 2e-6 by step 20, and the one-process run's smallest margin must stay above 1e-5."""
    margins = _track_margins(monkeypatch)
    run(compose_run(tmp_path / "straight", *EP_COMMON))
    monkeypatch.undo()
    assert min(margins) > 1e-5, (f"a token came within {min(margins):.1e} of a routing tie within the compared "
                                 "steps: layouts may route it differently and part; shorten the horizon or change "
                                 "the data (docs/moe-routing.md)")
    split = two_rank_runs / "ep2_split"  # stopped at step 10 on 2 ranks at ep 2
    assert json.loads((split / "summary.json").read_text())["mesh"]["ep"] == 2
    resumed = run(compose_run(split, *EP_COMMON))
    assert resumed["resumed_from"] == 10

    got, want = _rows(split), _rows(tmp_path / "straight")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 21))
    # Losses and loads to 1e-5 over all 20 steps; the gradient norm drifts further (2e-5 measured) as
    # AdamW carries fp32 summation-order differences from step to step (5-step parity: test_parallel).
    for key, rel in (("loss", 1e-5), ("moe_load_imbalance", 1e-5), ("grad_norm", 1e-4)):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=rel), key
    for step in ("step_000010", "step_000020"):
        biases = _biases(split / "checkpoints" / step)
        assert biases.abs().max() > 0  # the update ran
        torch.testing.assert_close(biases, _biases(tmp_path / "straight" / "checkpoints" / step), rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_balance_loss_and_bias_updates_under_sequence_parallel_match_one_process(tmp_path, two_rank_runs):
    """tp 2 + sequence parallel, where each tp rank routes its own sequence shard: 5 steps with the
    balance loss and bias updates on padded batches give one process's losses, balance losses and biases."""
    run(compose_run(tmp_path / "one", *SP_COMMON))
    got, want = _rows(two_rank_runs / "tp2_sp"), _rows(tmp_path / "one")
    assert all(r["moe_aux_loss"] > 0 for r in want)
    for key in ("loss", "moe_aux_loss", "moe_load_imbalance"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    biases = _biases(two_rank_runs / "tp2_sp" / "checkpoints" / "step_000005")
    assert biases.abs().max() > 0
    torch.testing.assert_close(biases, _biases(tmp_path / "one" / "checkpoints" / "step_000005"), rtol=0, atol=1e-6)


def test_a_frozen_router_keeps_its_weight_and_bias_while_the_experts_train(tmp_path):
    run(compose_run(tmp_path, *SHORT, "trainer.max_steps=2", "checkpoint.every=1", "checkpoint.keep=0",
                    "moe.freeze_router=true"))
    states = [load_checkpoint_model(tmp_path / "checkpoints" / f"step_00000{s}")[0].state_dict() for s in (1, 2)]
    routers = [n for n in states[0] if ".gate." in n]
    assert routers and all(torch.equal(states[0][n], states[1][n]) for n in routers)
    assert not torch.equal(*(s["model.layers.5.mixer.experts.up_proj"] for s in states))


@pytest.mark.parametrize("overrides, needle", [
    (["moe.bias_update_rate=-0.1"], "moe.bias_update_rate=-0.1: must be >= 0"),
    (["moe.bias_update_rate=0.01", "moe.freeze_router=true"], "a frozen router keeps its correction bias too"),
    (["moe.freeze_router=true", "model.pattern=M*M-"], "moe.freeze_router=True: the model (pattern 'M*M-') has no MoE"),
    (["moe.aux_loss_coeff=-1"], "moe.aux_loss_coeff=-1.0: must be >= 0"),
    (["moe.aux_loss_coeff=0.01", "model.pattern=M*M-"], "moe.aux_loss_coeff=0.01: the model (pattern 'M*M-') has no MoE"),
])
def test_moe_options_that_cannot_apply_are_refused(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate_config(compose_run(tmp_path, *overrides))


@pytest.mark.distributed
def test_a_hugging_face_checkpoint_loads_under_expert_parallel_with_the_single_process_loss(tmp_path, two_rank_runs):
    """Each rank reads its own experts from the files; the first steps equal one process's."""
    run(compose_run(tmp_path / "one", *hf_common(two_rank_runs / "source")))
    got, want = _rows(two_rank_runs / "ep2_hf"), _rows(tmp_path / "one")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)


@pytest.mark.distributed
def test_lora_under_expert_parallel_matches_one_process(tmp_path, two_rank_runs):
    """Adapters on the routed experts split by expert with them; the curve is one process's."""
    run(compose_run(tmp_path / "one", *LORA_COMMON))
    got, want = _rows(two_rank_runs / "ep2_lora"), _rows(tmp_path / "one")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key


def test_expert_loads_reach_wandb_as_one_histogram_per_moe_block(tmp_path, monkeypatch):
    logged: list[tuple[dict, int]] = []
    run_dir = tmp_path / "run"

    class FakeRun:
        summary: dict = {}

        def log(self, data: dict, step: int) -> None:
            logged.append((data, step))

        def finish(self, exit_code: int) -> None:
            pass

    monkeypatch.setattr(logging_module, "_init_wandb", lambda *args: FakeRun())
    monkeypatch.setattr(wandb, "Histogram", lambda np_histogram: np_histogram)
    run(compose_run(run_dir, *SHORT, "trainer.max_steps=2", "logger.wandb.mode=offline", "checkpoint.save_final=false"))
    loads = [(data, step) for data, step in logged if any(k.startswith("moe/expert_load/") for k in data)]
    assert [step for _, step in loads] == [1, 2]
    (name, (counts, bins)), = loads[0][0].items()  # the tiny preset has one MoE block
    assert name == "moe/expert_load/block_0" and bins == list(range(9)) and len(counts) == 8
    assert sum(counts) > 0


def test_the_balance_loss_leaves_the_mtp_layers_moe_blocks_alone():
    """With MTP layers holding MoE blocks, `moe.aux_loss_coeff` weighs the decoder's MoE blocks only: the MTP
    layers' gradients are exactly those without the balance loss, the decoder routers' are not, and the
    metric sums the decoder blocks' losses alone."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    grads, blocks = [], {}
    for coeff in (0.0, 0.5):
        torch.manual_seed(0)
        model = NemotronHForCausalLM(NemotronHConfig(**{**SMALL_DIMS, "pattern": "EME", "num_nextn_predict_layers": 1,
                                                        "mtp_pattern": "*E", "mtp_loss_scale": 0.3})).train()
        balance = RouterBalance(model, None, 0.0, aux_loss_coeff=coeff, sequences_per_step=2)
        mtp_blocks = [m for m in model.mtp.modules() if m in balance.blocks]
        assert len(balance.blocks) == 3 and len(mtp_blocks) == 1  # two decoder blocks, one MTP block
        model(ids, labels=ids).loss.backward()
        balance.after_micro_batch()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        blocks[coeff] = (balance, mtp_blocks[0])
    balance, mtp_block = blocks[0.5]
    assert mtp_block.balance_loss_weight == 0.0 and mtp_block.balance_loss is None
    assert [b.balance_loss_weight for b in balance.aux_blocks] == [0.25, 0.25] and mtp_block not in balance.aux_blocks
    without, with_aux = grads
    mtp_names = [n for n in without if n.startswith("mtp.")]
    assert mtp_names and any("gate" in n for n in mtp_names)
    for name in mtp_names:
        assert torch.equal(with_aux[name], without[name]), name
    assert not torch.equal(with_aux["model.layers.0.mixer.gate.weight"], without["model.layers.0.mixer.gate.weight"])
    decoder_sum = sum(b.balance_loss for b in balance.aux_blocks).item()
    assert balance.after_step(taken=True)["moe_aux_loss"] == pytest.approx(0.25 * decoder_sum, rel=1e-6)
