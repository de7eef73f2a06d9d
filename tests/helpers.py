"""Helpers the test modules share: tiny recipe runs, their metrics, and random model inputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nemotron_recipe.training.loss import cross_entropy_sum

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# Overrides that make a recipe run take seconds; each module adds its step and validation counts.
# The pre-flight's fake-tensor trace of a step (about 2 s a launch, on every rank) is left to the
# planner's tests, the default run's and the launches that name `PREFLIGHT_ON`.
RUN_BASE = [
    "trainer.seq_len=64",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.log_every=1",
    "data.val_max_batches=1",
    "logger.console.progress_bar=false",
    "trainer.preflight=false",
    # Two tokens: every run still samples at each validation on its mesh, at the cost of two forwards.
    "eval.sample_tokens=2",
]
PREFLIGHT_ON = "trainer.preflight=true"
# A model of every block kind that runs and compiles in seconds: two heads of each kind, so head
# splits are exercised, and routed experts narrow enough for a handful of tokens to reach each.
SMALL_DIMS = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                  chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=16)


def compose_run(run_dir: Path, *overrides: str, base: list[str] = RUN_BASE):
    """The recipe's composed config for a run in `run_dir`: `base`, then `overrides`."""
    # Imported here: the model and kernel tests that use the other helpers run where hydra is absent.
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="finetune", overrides=[*base, f"run_dir={run_dir}", *overrides])


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, document_ids: torch.Tensor | None = None):
    """From fresh gradients: the mean next-token loss of `ids` (targets rolled by one) and a copy of
    every trainable parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    loss_sum, count = cross_entropy_sum(model(ids, document_ids=document_ids).logits, torch.roll(ids, -1, dims=1))
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def perturb_off_init(model: torch.nn.Module) -> None:
    """Random init leaves norms at 1 and the router bias at 0; move them so every path is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("D", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))


def scan_inputs(seq_len: int, g: torch.Generator, *, b: int = 2, h: int = 6, p: int = 4, groups: int = 3,
                n: int = 5, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Random SSD scan inputs [x, dt, A, B, C, D] drawn from `g`, dt in (0.01, 0.51) and A negative."""
    x = torch.randn(b, seq_len, h, p, generator=g, dtype=dtype)
    dt = torch.rand(b, seq_len, h, generator=g, dtype=dtype) * 0.5 + 0.01
    A = -torch.rand(h, generator=g, dtype=dtype) * 3
    B = torch.randn(b, seq_len, groups, n, generator=g, dtype=dtype)
    C = torch.randn(b, seq_len, groups, n, generator=g, dtype=dtype)
    D = torch.randn(h, generator=g, dtype=dtype)
    return [x, dt, A, B, C, D]
