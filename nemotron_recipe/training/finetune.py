"""Supervised fine-tuning loop: one code path for a single process and for any torchrun mesh.

Loss normalisation: every optimizer step covers a fixed global batch. Its number of trained
tokens is summed over every rank that holds different tokens (data- and context-parallel ranks)
before any backward pass, and each micro-batch back-propagates (sum of its token losses) / (that
global count). With the parallelizer summing gradients over those ranks, loss and gradients are
those of one big batch, whatever the mesh, micro-batch size or padding.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nemotron_recipe.config import ConfigError, model_overrides, validate_config, validate_data_parallel
from nemotron_recipe.data import (
    GlobalBatchPlan,
    collate,
    load_sft_examples,
    load_tokenizer,
    val_batches,
)
from nemotron_recipe.distributed.env import distributed
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.logging import MetricsWriter, print_summary
from nemotron_recipe.training.loss import IGNORE_INDEX, cross_entropy_sum, local_value, loss_parallel_for
from nemotron_recipe.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from nemotron_recipe.training.setup import DataLayout, build_device_mesh, data_layout, parallelize_model

log = logging.getLogger(__name__)


def _all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def build_model(cfg: Any, model_config: NemotronHConfig) -> NemotronHForCausalLM:
    """The full (unsharded) model on CPU: every rank builds the same weights from the same seed,
    and parallelization moves each rank's shard to its device."""
    torch.manual_seed(cfg.seed)
    if cfg.model.pretrained:
        return NemotronHForCausalLM.from_pretrained(cfg.model.pretrained, **model_overrides(cfg.model))
    return NemotronHForCausalLM(model_config)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: Any, *, max_batches: int | None, device: torch.device, layout: DataLayout
) -> float:
    """Token-weighted mean loss over this rank's batches and every other rank's tokens."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, trained tokens]
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            logits = model(layout.shard(batch["input_ids"]).to(device)).logits
            with loss_parallel_for(logits):
                loss_sum, count = cross_entropy_sum(logits, layout.shard(batch["targets"]))
            totals[0] += local_value(loss_sum).double()
            totals[1] += count.double()
    finally:
        model.train()
    _all_reduce_sum(totals, layout.token_group)
    return (totals[0] / totals[1].clamp(min=1)).item()


def run(cfg: Any) -> dict[str, Any]:
    """Fine-tune as `cfg` (a `FinetuneConfig`-shaped DictConfig) says; returns the summary."""
    start = time.perf_counter()
    model_config = validate_config(cfg)
    run_dir = Path(cfg.run_dir)
    t = cfg.trainer

    with distributed(t.device) as env:
        if not env.is_main:
            logging.getLogger("nemotron_recipe").setLevel(logging.WARNING)
        mesh = build_device_mesh(cfg, env.world_size, env.device.type)
        layout = data_layout(mesh)
        validate_data_parallel(cfg, layout.dp_size)

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        if len(tokenizer) > model_config.vocab_size:
            raise ConfigError(
                f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
                f"tokens (data.tokenizer={cfg.data.tokenizer!r}). Fix: set model.vocab_size>={len(tokenizer)} "
                "or use the model's own tokenizer."
            )
        data_kw = dict(prompt_key=cfg.data.prompt_key, response_key=cfg.data.response_key, seq_len=t.seq_len)
        train = load_sft_examples(cfg.data.train_file, tokenizer, field_name="data.train_file", **data_kw)
        val = (
            load_sft_examples(cfg.data.val_file, tokenizer, field_name="data.val_file", **data_kw)
            if cfg.data.val_file
            else None
        )
        pad_id = tokenizer.pad_token_id
        plan = GlobalBatchPlan(
            len(train), t.global_batch_size, t.micro_batch_size, layout.dp_rank, layout.dp_size, cfg.seed
        )
        val_data = None
        if val is not None:
            val_data = val_batches(val, t.micro_batch_size, layout.dp_rank, layout.dp_size, t.seq_len, pad_id)
        log.info(
            "data: %d train / %d val examples (%d truncated to seq_len=%d), %d micro-batch(es) per rank per step",
            len(train), 0 if val is None else len(val), train.num_truncated, t.seq_len, plan.grad_accum_steps,
        )

        model = build_model(cfg, model_config)
        num_parameters = model.num_parameters()
        log.info(
            "model: pattern %s, %.2fM parameters; world size %d, mesh %s",
            model.config.pattern, num_parameters / 1e6, env.world_size,
            dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        )
        model = parallelize_model(model, mesh, cfg)
        model.train()
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, t.max_steps)
        params = [p for p in model.parameters() if p.requires_grad]

        writer = MetricsWriter(
            run_dir,
            enabled=env.is_main,
            total_steps=t.max_steps,
            progress_bar=cfg.logger.console.progress_bar,
            wandb_cfg=cfg.logger.wandb,
            config=OmegaConf.to_container(cfg, resolve=True) if env.is_main else None,
        )
        val_history: list[tuple[int, float]] = []

        def validate(step: int) -> float:
            """Runs and logs a validation pass; returns the seconds it took."""
            if val_data is None:
                return 0.0
            began = time.perf_counter()
            val_loss = evaluate(model, val_data, max_batches=cfg.data.val_max_batches, device=env.device,
                                layout=layout)
            val_history.append((step, val_loss))
            writer.log_val({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - start})
            return time.perf_counter() - began

        # Input positions (padding included) of the whole global batch: what the model computes on.
        # Trained tokens (targets != -100) are reported separately.
        tokens_per_step = t.global_batch_size * t.seq_len
        failed = True
        try:
            validate(0)
            train_start = window_start = time.perf_counter()
            window_steps = window_trained = total_trained = 0
            val_seconds = 0.0  # spent validating inside the loop, kept out of the throughput
            loss_value = float("nan")
            for step in range(t.max_steps):
                micro_batches = [
                    {k: layout.shard(v) for k, v in collate(train, idx, t.seq_len, pad_id).items()}
                    for idx in plan.indices_for_step(step)
                ]
                local_count = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in micro_batches)
                counts = torch.tensor([local_count], dtype=torch.int64, device=env.device)
                global_count = int(_all_reduce_sum(counts, layout.token_group).item())
                denominator = max(global_count, 1)

                loss_total = torch.zeros((), dtype=torch.float32, device=env.device)
                for batch in micro_batches:
                    logits = model(batch["input_ids"].to(env.device)).logits
                    with loss_parallel_for(logits):
                        loss_sum, _ = cross_entropy_sum(logits, batch["targets"])
                        (loss_sum / denominator).backward()
                    loss_total += local_value(loss_sum.detach()).float()
                    del logits, loss_sum

                grad_norm = clip_grad_norm_(params, t.max_grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

                done = step + 1
                window_steps += 1
                window_trained += global_count
                total_trained += global_count
                if done == 1 or done % t.log_every == 0 or done == t.max_steps:
                    loss_value = (_all_reduce_sum(loss_total, layout.token_group) / denominator).item()
                    now = time.perf_counter()
                    window_s = max(now - window_start, 1e-9)
                    writer.log_train({
                        "step": done,
                        "loss": loss_value,
                        "lr": lr,
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": window_steps * tokens_per_step / window_s,
                        "trained_tokens_per_s": window_trained / window_s,
                        "elapsed_s": now - start,
                    })
                    window_start, window_steps, window_trained = now, 0, 0
                writer.advance()
                if t.val_every and done % t.val_every == 0 and done != t.max_steps:
                    seconds = validate(done)
                    val_seconds += seconds
                    window_start += seconds
            train_time = time.perf_counter() - train_start - val_seconds
            validate(t.max_steps)

            first = val_history[0][1] if val_history else None
            last = val_history[-1][1] if val_history else None
            summary = {
                "steps": t.max_steps,
                "first_val_loss": first,
                "last_val_loss": last,
                "val_loss_ratio": (last / first) if first else None,
                "final_loss": loss_value,
                "tokens_per_s": t.max_steps * tokens_per_step / train_time,
                "trained_tokens_per_s": total_trained / train_time,
                "train_time_s": train_time,
                "wall_time_s": time.perf_counter() - start,
                "run_dir": str(run_dir),
                "world_size": env.world_size,
                "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
                "num_parameters": num_parameters,
            }
            writer.write_summary(summary)
            failed = False
        finally:
            writer.close(failed=failed)
        if env.is_main:
            print_summary(summary)
    return summary
