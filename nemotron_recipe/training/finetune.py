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

from nemotron_recipe.config import ConfigError, validate_config, validate_data_parallel
from nemotron_recipe.data import (
    GlobalBatchPlan,
    collate,
    load_sft_data,
    load_tokenizer,
    val_batches,
)
from nemotron_recipe.distributed.env import distributed
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.training.checkpoint import Checkpointer
from nemotron_recipe.training.compile import compile_blocks
from nemotron_recipe.training.cpu_memory import keep_freed_memory
from nemotron_recipe.training.hf_io import build_meta_model, export_run_checkpoint, load_hf_sharded
from nemotron_recipe.training.logging import MetricsWriter, earlier_val_losses, print_summary
from nemotron_recipe.training.loss import IGNORE_INDEX, forward_loss_sum, local_value
from nemotron_recipe.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from nemotron_recipe.training.preemption import StopConditions
from nemotron_recipe.training.setup import DataLayout, build_device_mesh, data_layout, parallelize_model

log = logging.getLogger(__name__)


def _all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def build_model(cfg: Any, model_config: NemotronHConfig) -> NemotronHForCausalLM:
    """The full (unsharded) model on CPU: every rank builds the same weights from the same seed,
    and parallelization moves each rank's shard to its device.

    With `model.pretrained` the model is built on the meta device instead: each rank reads its own
    shards from the checkpoint once the model is parallelized (`load_hf_sharded`)."""
    torch.manual_seed(cfg.seed)
    if cfg.model.pretrained:
        return build_meta_model(model_config)
    return NemotronHForCausalLM(model_config)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Any,
    *,
    max_batches: int | None,
    device: torch.device,
    layout: DataLayout,
    loss_chunk_size: int | None = None,
) -> float:
    """Token-weighted mean loss over this rank's batches and every other rank's tokens."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, trained tokens]
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            docs = batch.get("document_ids")  # only packed data has them
            loss_sum, count = forward_loss_sum(
                model, layout.shard(batch["input_ids"]).to(device), layout.shard(batch["targets"]).to(device),
                document_ids=None if docs is None else layout.shard(docs).to(device), loss_chunk_size=loss_chunk_size,
            )
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
        if env.device.type == "cpu":
            keep_freed_memory()  # large activations are reused instead of page-faulted every step
        mesh = build_device_mesh(cfg, env.world_size, env.device.type)
        layout = data_layout(mesh)
        validate_data_parallel(cfg, layout.dp_size)
        # Before any data or model work: a checkpoint that cannot be resumed fails the run at once.
        checkpointer = Checkpointer(
            cfg, run_dir, rank=env.rank, world_size=env.world_size, device=env.device,
            mesh_shape=dict(zip(mesh.mesh_dim_names or (), mesh.shape)), model_config=model_config,
        )

        tokenizer = load_tokenizer(cfg.data.tokenizer)
        if len(tokenizer) > model_config.vocab_size:
            raise ConfigError(
                f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
                f"tokens (data.tokenizer={cfg.data.tokenizer!r}). Fix: set model.vocab_size>={len(tokenizer)} "
                "or use the model's own tokenizer."
            )
        data = load_sft_data(cfg.data, tokenizer, seq_len=t.seq_len, seed=cfg.seed)
        train, val = data.train, data.val
        pad_id = tokenizer.pad_token_id
        plan = GlobalBatchPlan(
            len(train), t.global_batch_size, t.micro_batch_size, layout.dp_rank, layout.dp_size, cfg.seed
        )
        val_data = None
        if val is not None:
            val_data = val_batches(val, t.micro_batch_size, layout.dp_rank, layout.dp_size, t.seq_len, pad_id)
        log.info("data: %s; %d micro-batch(es) per rank per step", data.describe(t.seq_len), plan.grad_accum_steps)

        model = build_model(cfg, model_config)
        num_parameters = model.num_parameters()
        log.info(
            "model: pattern %s, %.2fM parameters; world size %d, mesh %s",
            model.config.pattern, num_parameters / 1e6, env.world_size,
            dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        )
        model = parallelize_model(model, mesh, cfg)
        if cfg.model.pretrained:
            shard_device = torch.device("cpu") if cfg.fsdp.offload else env.device
            if checkpointer.resume_from is None:
                load_hf_sharded(model, cfg.model.pretrained, shard_device)
            else:  # every tensor comes from the training checkpoint
                model.to_empty(device=shard_device)
        model.train()
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, t.max_steps)
        start_step = checkpointer.load(model, optimizer, scheduler)

        if t.compile:
            # The probe compiles forward and backward at the training shape (a real micro-batch) on
            # every rank in step, so a failure shows up here, not mid-training.
            probe = {k: layout.shard(v).to(env.device)
                     for k, v in collate(train, plan.indices_for_step(start_step)[0], t.seq_len, pad_id).items()}

            def run_probe() -> None:
                forward_loss_sum(model, probe["input_ids"], probe["targets"], document_ids=probe.get("document_ids"),
                                 loss_chunk_size=t.loss_chunk_size, backward_denominator=1.0)
                model.zero_grad(set_to_none=True)

            compile_blocks(model, probe=run_probe)
        params = [p for p in model.parameters() if p.requires_grad]

        writer = MetricsWriter(
            run_dir,
            enabled=env.is_main,
            total_steps=t.max_steps,
            progress_bar=cfg.logger.console.progress_bar,
            wandb_cfg=cfg.logger.wandb,
            config=OmegaConf.to_container(cfg, resolve=True) if env.is_main else None,
            resume_step=start_step,
        )
        val_history = earlier_val_losses(run_dir, start_step)

        def validate(step: int) -> float:
            """Runs and logs a validation pass; returns the seconds it took."""
            if val_data is None:
                return 0.0
            began = time.perf_counter()
            val_loss = evaluate(model, val_data, max_batches=cfg.data.val_max_batches, device=env.device,
                                layout=layout, loss_chunk_size=t.loss_chunk_size)
            val_history.append((step, val_loss))
            writer.log_val({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - start})
            return time.perf_counter() - began

        # Input positions (padding included) of the whole global batch: what the model computes on.
        # Trained tokens (targets != -100) are reported separately.
        tokens_per_step = t.global_batch_size * t.seq_len
        # stop_at_step ends the run early but leaves the LR schedule to max_steps.
        end_step = min(t.max_steps, t.stop_at_step) if t.stop_at_step else t.max_steps
        stop = StopConditions(max_minutes=t.max_minutes, started=start, device=env.device)
        stopped: str | None = None
        done = start_step
        failed = True
        try:
            stop.install()
            if start_step == 0:  # a resumed run's earlier validation rows are already in its metrics
                validate(0)
            train_start = window_start = time.perf_counter()
            window_steps = window_trained = total_trained = 0
            val_seconds = 0.0  # spent validating inside the loop, kept out of the throughput
            loss_value = float("nan")
            for step in range(start_step, end_step):
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
                    # Packed batches carry document_ids (already sharded like the inputs); others run
                    # the model's single-document path.
                    docs = batch.get("document_ids")
                    loss_sum, _ = forward_loss_sum(
                        model, batch["input_ids"].to(env.device), batch["targets"].to(env.device),
                        document_ids=None if docs is None else docs.to(env.device),
                        loss_chunk_size=t.loss_chunk_size, backward_denominator=denominator,
                    )
                    loss_total += local_value(loss_sum.detach()).float()
                    del loss_sum

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
                stopped = stop.poll() or ("stop_at_step" if done == end_step < t.max_steps else None)
                if stopped or checkpointer.due(done, t.max_steps):
                    checkpointer.save(done, model, optimizer, scheduler)
                if stopped:
                    log.warning("stopping after step %d (%s%s)", done, stopped,
                                f": {stop.received}" if stopped == "signal" else "")
                    break
            if stopped is None and done < t.max_steps:  # resumed at or past stop_at_step
                stopped = "stop_at_step"
            train_time = max(time.perf_counter() - train_start - val_seconds, 1e-9)
            hf_dir = None
            if not stopped:
                validate(t.max_steps)
                if cfg.checkpoint.export_hf:
                    hf_dir = str(export_run_checkpoint(checkpointer, run_dir / "hf"))

            first = val_history[0][1] if val_history else None
            last = val_history[-1][1] if val_history else None
            summary = {
                "steps": done,
                "stopped": stopped,
                "stop_signal": stop.received if stopped == "signal" else None,
                "resumed_from": start_step or None,
                "checkpoint": None if checkpointer.last_saved is None else str(checkpointer.last_saved),
                "hf_export": hf_dir,
                "first_val_loss": first,
                "last_val_loss": last,
                "val_loss_ratio": (last / first) if first else None,
                "final_loss": loss_value,
                "tokens_per_s": (done - start_step) * tokens_per_step / train_time,
                "trained_tokens_per_s": total_trained / train_time,
                "train_time_s": train_time,
                "wall_time_s": time.perf_counter() - start,
                "run_dir": str(run_dir),
                "world_size": env.world_size,
                "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
                "num_parameters": num_parameters,
                "data": data.counts(),
            }
            writer.write_summary(summary)
            failed = False
        finally:
            stop.restore()
            writer.close(failed=failed)
        if env.is_main:
            print_summary(summary)
    return summary
