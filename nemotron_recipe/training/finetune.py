"""Fine-tuning loop: one code path for a single process and for any torchrun mesh.

`run` opens the process group and hands the run to a `Trainer`, whose setup builds the mesh, the
data, the model, the optimizer, the objective and the checkpointer, and whose `train` loop reads as
its steps: `train_step`, `log`, `evaluate`, `checkpoint`, then `summary`. What a step computes (its
micro-batches' forward and backward, its normalisers and its metrics) belongs to the objective
(`training.objectives`: `sft`, `dpo`); metrics rows (`TrainMetrics`), validation (`Validator`) and
checkpoints (`Checkpointer`) are components the trainer calls.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from nemotron_recipe.config import validate_config
from nemotron_recipe.data import ChatFormatter, GlobalBatchPlan
from nemotron_recipe.data.preference import PreferencePairs
from nemotron_recipe.distributed.env import DistEnv, distributed
from nemotron_recipe.distributed.plan import ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM, build_meta_model
from nemotron_recipe.models.nemotron_v3.lora import add_adapters, freeze_base, is_adapter
from nemotron_recipe.training.checkpoint import Checkpointer
from nemotron_recipe.training.compile import compile_blocks
from nemotron_recipe.training.data import load_training_data
from nemotron_recipe.training.cpu_memory import keep_freed_memory
from nemotron_recipe.training.hf_io import export_run_checkpoint, load_hf_sharded
from nemotron_recipe.training.logging import MetricsWriter, TrainMetrics, earlier_val_losses, print_summary
from nemotron_recipe.training.moe_balance import RouterBalance, freeze_routers
from nemotron_recipe.training.lora import (
    QUANTIZED_BASES,
    base_record,
    keep_fp8_base_weights,
    lora_spec,
    peft_record,
    quantize_nf4_base,
    start_adapters,
    store_base,
)
from nemotron_recipe.training.objectives import Objective, StepSums, build_objective
from nemotron_recipe.training.nonfinite import NonFiniteGuard
from nemotron_recipe.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from nemotron_recipe.training.pipeline.runtime import build_pipeline
from nemotron_recipe.training.pipeline.schedule import MicroBatchLoop
from nemotron_recipe.training.planner.preflight import preflight
from nemotron_recipe.training.preemption import StopConditions
from nemotron_recipe.training.samples import Samples, configured_prompts, validation_prompts
from nemotron_recipe.training.setup import data_layout, parallelize_model

log = logging.getLogger(__name__)


def build_model(cfg: Any, model_config: NemotronHConfig) -> NemotronHForCausalLM:
    """The full (unsharded) model on CPU: every rank builds the same weights from the same seed,
    and parallelization moves each rank's shard to its device.

    With `model.pretrained` the model is built on the meta device instead: each rank reads its own
    shards from the checkpoint once the model is parallelized (`load_hf_sharded`)."""
    torch.manual_seed(cfg.seed)
    if cfg.model.pretrained:
        return build_meta_model(model_config)
    return NemotronHForCausalLM(model_config)


class Validator:
    """Validation passes and their metrics rows, called by the trainer on every rank.

    Keeps the run's (step, val_loss) history, a resumed run's earlier rows included, for the
    summary. Without validation data a pass does nothing and takes no time.
    """

    def __init__(
        self,
        cfg: Any,
        objective: Objective,
        *,
        writer: MetricsWriter,
        history: list[tuple[int, float]],
        started: float,
        samples: Samples | None = None,
    ) -> None:
        self.objective, self.max_batches, self.samples = objective, cfg.data.val_max_batches, samples
        self.every, self.max_steps = cfg.trainer.val_every, cfg.trainer.max_steps
        self.writer, self.history, self.started = writer, history, started

    def due(self, step: int) -> bool:
        """Whether a pass follows `step` inside the loop; the pass after the last step comes at the end."""
        return bool(self.every) and step % self.every == 0 and step != self.max_steps

    def run(self, step: int) -> float:
        """Runs and logs a validation pass labelled `step` (its loss, its samples); returns the seconds it took."""
        began = time.perf_counter()
        metrics = self.objective.validate(self.max_batches)
        if metrics is not None:
            self.history.append((step, metrics["val_loss"]))
            self.writer.log_val({"step": step, **metrics, "elapsed_s": time.perf_counter() - self.started})
        if self.samples is not None:
            self.samples.run(step)
        self.writer.plot()
        return time.perf_counter() - began

    def summary(self, *, final: bool) -> dict[str, Any]:
        """The summary's validation entries: the run's first loss, its last one after that (None when no
        pass followed the first) with its step, their ratio, and whether the final pass ran (`final`: the
        run reached max_steps; a stopped run skips it, to end at once)."""
        first = self.history[0][1] if self.history else None
        last_step, last = self.history[-1] if len(self.history) > 1 else (None, None)
        return {"first_val_loss": first, "last_val_loss": last, "last_val_step": last_step,
                "val_loss_ratio": (last / first) if first and last is not None else None,
                "final_validation": ("done" if final else "skipped") if self.history else None,
                **(self.samples.summary() if self.samples is not None else {})}


@dataclass
class StepResult:
    """What one optimizer step leaves for its metrics row. Nothing here is reduced over ranks yet:
    the objective's sums are reduced over them only for the steps that get a row."""

    sums: StepSums  # this rank's loss sums over its micro-batches, detached, and the step's trained tokens
    lr: float  # the LR the step was taken with
    grad_norm: torch.Tensor  # the total gradient norm, before clipping
    skipped: bool = False  # not taken: its loss or gradient norm was not finite (trainer.nonfinite=skip)
    # Router health over the global batch: moe_load_imbalance (busiest expert / mean, worst MoE block)
    # and moe_aux_loss (the balance-loss term, when trained).
    moe: dict[str, float] | None = None
    expert_load: list[list[int]] | None = None  # rows per expert over the global batch, per MoE block
    real_tokens: int = 0  # the global batch's unpadded tokens, for the throughput


class Trainer:
    """One fine-tuning run on this rank, inside a process group the caller holds (`run`).

    `__init__` is the setup: mesh, checkpointer, data, model, optimizer (restored from the resumed
    checkpoint), metrics and stop conditions, in the order that makes bad settings fail before
    expensive work. `train` runs the loop and returns the summary. Every method is called on every
    rank in the same order: most of them hold collectives.
    """

    def __init__(
        self, cfg: Any, model_config: NemotronHConfig, plan: ParallelPlan, env: DistEnv, *, started: float
    ) -> None:
        self.cfg, self.parallel, self.env, self.started = cfg, plan, env, started
        self.model_config = model_config
        self.run_dir = Path(cfg.run_dir)
        # MTP layers train when the model has them and model.mtp_loss_scale is not 0.
        self.mtp_loss_scale = model_config.effective_mtp_loss_scale
        self.mtp_depths = model_config.num_nextn_predict_layers if self.mtp_loss_scale else 0
        self._setup_parallel()
        # Before any data or model work: a checkpoint that cannot be resumed fails the run at once.
        self.checkpointer = Checkpointer(
            cfg, self.run_dir, rank=env.rank, world_size=env.world_size, device=env.device,
            mesh_shape=self.mesh_shape, model_config=model_config,
        )
        try:  # the checkpointer holds checkpoint.dir's lock from here: a failed setup gives it back
            self._setup_data(model_config)
            self._setup_model(model_config)
            self._setup_optimizer()
            self._setup_objective()
            if cfg.trainer.compile:
                self._compile()
            self._setup_outputs()
        except BaseException:
            self.checkpointer.release()
            raise

    # ------------------------------------------------------------------ setup
    def _setup_parallel(self) -> None:
        """The device mesh, how batches are split over it, and how the model is to be parallelized.

        The one place that reads the mesh: the rest of the run sees `layout` (data), `mesh_shape`
        (reports and checkpoint meta) and `_parallelize` (the model).
        """
        meshes = self.parallel.build_meshes(self.env.device.type)
        self.layout = data_layout(self.parallel, meshes)
        self.mesh_shape = self.parallel.describe()
        # Under a pipeline (mesh.pp > 1) this rank runs some of the stages, and the gradient norm, the
        # expert loads and the losses are combined over the pipeline's ranks (`pp_group`).
        self.pipeline = build_pipeline(self.cfg, self.parallel, meshes, self.model_config, self.env.device)
        self.pp_group = None if meshes.pp is None else meshes.pp.get_group()
        # Pipeline stages exchange activations of static shapes: every micro-batch is padded to seq_len.
        self.pad_multiple = self.cfg.trainer.seq_len if self.pipeline else self.parallel.seq_len_divisor
        self._parallelize: Callable[[torch.nn.Module], torch.nn.Module] = functools.partial(
            parallelize_model, plan=self.parallel, meshes=meshes, pipeline=self.pipeline
        )

    def _setup_data(self, model_config: NemotronHConfig) -> None:
        """Tokenizer, data sets, the batch plan of every step and this rank's validation batches."""
        cfg, t = self.cfg, self.cfg.trainer
        tokenizer, self.data = load_training_data(cfg, model_config.vocab_size)
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.batch_plan = GlobalBatchPlan(
            len(self.data.train), t.global_batch_size, t.micro_batch_size, self.layout.dp_rank, self.layout.dp_size,
            cfg.seed,
        )
        log.info("data: %s; %d micro-batch(es) per rank per step", self.data.describe(t.seq_len),
                 self.batch_plan.grad_accum_steps)

    def _setup_model(self, model_config: NemotronHConfig) -> None:
        """The parallelized model in training mode; pretrained weights go straight into its shards."""
        cfg = self.cfg
        model = build_model(cfg, model_config)
        self.num_parameters = model.num_parameters()
        log.info(
            "model: pattern %s, %.2fM parameters; world size %d, mesh %s",
            model.config.pattern, self.num_parameters / 1e6, self.env.world_size, self.mesh_shape,
        )
        if not cfg.model.pretrained and self.env.is_main:
            say = log.info if cfg.model.preset == "tiny" else log.warning
            say("model: random weights (preset %s drawn from seed %d); to fine-tune released weights set "
                "model.pretrained=<checkpoint directory or hub id>", cfg.model.preset, cfg.seed)
        self.lora = lora_spec(cfg)
        self._check_peft(model)
        model = self._parallelize(model, reapply_trainability=self._trainability())
        # An nf4 or fp8 base was read before it was stored in its format (_check_peft).
        if cfg.model.pretrained and not (self.lora and cfg.peft.base_dtype in QUANTIZED_BASES):
            shard_device = torch.device("cpu") if cfg.fsdp.offload else self.env.device
            # A LoRA checkpoint holds the adapters only: its base is read from model.pretrained.
            if self.checkpointer.resume_from is None or self.lora:
                load_hf_sharded(model, cfg.model.pretrained, shard_device, skip=is_adapter)
            else:  # every tensor comes from the training checkpoint
                model.to_empty(device=shard_device)
        if self.lora and self.checkpointer.resume_from is None:
            start_adapters(model, cfg, self.lora)
        model.train()
        self.model = model

    def frozen_copy(self) -> torch.nn.Module:
        """A model holding the run's starting weights (LoRA: the base without adapters), sharded like the
        policy, with nothing to train: DPO's reference=copy. Built from the seed or read from
        model.pretrained as the policy was, so a resumed run gets the same one."""
        cfg = self.cfg
        model = build_model(cfg, self.model_config)
        if self.lora:
            store_base(model, cfg)
        model = self._parallelize(model, reapply_trainability=lambda m: m.requires_grad_(False))
        if cfg.model.pretrained:
            load_hf_sharded(model, cfg.model.pretrained, torch.device("cpu") if cfg.fsdp.offload else self.env.device,
                            skip=is_adapter)
        return model.eval()

    def _trainability(self) -> Callable[[torch.nn.Module], None] | None:
        """What trains, set after tensor parallel has replaced the parameters: LoRA's adapters only, and
        no router under `moe.freeze_router`."""
        freeze = ([freeze_base] if self.lora else []) + ([freeze_routers] if self.cfg.moe.freeze_router else [])
        if not freeze:
            return None

        def reapply(model: torch.nn.Module) -> None:
            for f in freeze:
                f(model)

        return reapply

    def _check_peft(self, model: NemotronHForCausalLM) -> None:
        """LoRA: the base in peft.base_dtype with adapters added (before parallelizing), its record for
        meta.json; a resumed checkpoint of another kind or base is refused here, before any heavy work."""
        record = None
        if self.lora:
            store_base(model, self.cfg)
            if self.cfg.peft.base_dtype in QUANTIZED_BASES and self.cfg.model.pretrained:
                # Quantized whole before sharding, so every mesh holds the same bits: read unsharded.
                load_hf_sharded(model, self.cfg.model.pretrained, "cpu")
            base = self.checkpointer.on_rank0(lambda: base_record(self.cfg, model))
            targets = add_adapters(model, self.lora)
            quantize_nf4_base(model, self.cfg)
            keep_fp8_base_weights(model, self.cfg)
            record = peft_record(self.cfg, self.lora, base, targets)
            trained = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
            log.info("LoRA: rank %d on %d projections, %.3fM adapter parameters (%.2f%% of the model)",
                     self.lora.rank, len(targets), trained / 1e6, 100 * trained / self.num_parameters)
        self.checkpointer.check_peft(record)

    def _setup_optimizer(self) -> None:
        """Optimizer and LR schedule; a resumed checkpoint then restores them with the model and sets
        the step to continue from (`step`: the number of optimizer steps done)."""
        self.optimizer = build_optimizer(self.model, self.cfg.optim)
        # What clipping measures and scales: the parameters the optimizer steps, taken before any forward.
        # After a forward FSDP leaves the root's and the head's gathered parameters in the model (they are
        # not resharded after forward), and a forward before the first backward (DPO's precomputed
        # reference) would leave `model.parameters()` naming those, whose gradients stay None.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.cfg.trainer.max_steps)
        self.start_step = self.checkpointer.load(self.model, self.optimizer, self.scheduler)
        self.checkpointer.check_space(self.model)
        self.step = self.start_step

    def _setup_objective(self) -> None:
        """What a step computes (`objective.name`), over the model and the data just set up."""
        self.objective = build_objective(
            self.cfg.objective.name, cfg=self.cfg, model=self.model, data=self.data, layout=self.layout,
            device=self.env.device, pad_id=self.pad_id, seq_len_divisor=self.pad_multiple,
            mtp_depths=self.mtp_depths, mtp_loss_scale=self.mtp_loss_scale, trainer=self,
        )

    def _compile(self) -> None:
        """Compiles the blocks. The probe compiles forward and backward at the training shape (a real
        micro-batch) on every rank in step, so a failure shows up here, not mid-training."""
        first = self.batch_plan.indices_for_step(self.start_step)[0]
        probe = {k: v.to(self.env.device) for k, v in self._collate(first).items()}

        def run_probe() -> None:
            self.objective.forward_backward(probe, self.objective.begin_step([probe]))
            self.model.zero_grad(set_to_none=True)

        compile_blocks(self.model, probe=run_probe)

    def _setup_outputs(self) -> None:
        """Metrics writer, training rows, validation and the stop conditions of the loop."""
        cfg, t, is_main = self.cfg, self.cfg.trainer, self.env.is_main
        self.writer = MetricsWriter(
            self.run_dir,
            enabled=is_main,
            total_steps=t.max_steps,
            progress_bar=cfg.logger.console.progress_bar,
            wandb_cfg=cfg.logger.wandb,
            config=OmegaConf.to_container(cfg, resolve=True) if is_main else None,
            resume_step=self.start_step,
        )
        self.validator = Validator(
            cfg, self.objective, writer=self.writer, history=earlier_val_losses(self.run_dir, self.start_step),
            started=self.started, samples=self._samples(),
        )
        sequences_per_step = t.global_batch_size * self.objective.sequences_per_example
        self.metrics = TrainMetrics(self.writer, log_every=t.log_every, max_steps=t.max_steps, started=self.started)
        # stop_at_step ends the run early but leaves the LR schedule to max_steps.
        self.end_step = min(t.max_steps, t.stop_at_step) if t.stop_at_step else t.max_steps
        self.stop = StopConditions(max_minutes=t.max_minutes, started=self.started, device=self.env.device)
        self.guard = NonFiniteGuard(t.nonfinite, t.max_skipped_steps, self.env.device)
        self.balance = RouterBalance(self.model, self.layout.moe_token_group, cfg.moe.bias_update_rate,
                                     cfg.moe.aux_loss_coeff, sequences_per_step=sequences_per_step,
                                     pp_group=self.pp_group)
        # What runs a step's micro-batches: the pipeline's schedule, or each in turn on the whole model.
        self.schedule = self.pipeline.schedule(self.balance) if self.pipeline else \
            MicroBatchLoop(lambda batch, context: self._forward_backward(batch, context), self.balance)

    def _samples(self) -> Samples | None:
        """The prompts continued at each validation: eval.samples, else the first validation prompts."""
        e = self.cfg.eval
        if not e.sample_tokens:
            return None
        if e.samples is None:
            val = self.data.val.chosen if isinstance(self.data.val, PreferencePairs) else self.data.val
            prompts = validation_prompts(val, self.tokenizer)  # a pair's prompt, its chosen reply the reference
        else:
            formatter = ChatFormatter.from_config(self.cfg.data, self.tokenizer)
            prompts = configured_prompts(list(e.samples), formatter)
        if not prompts:
            return None
        return Samples(self.model, prompts, self.tokenizer, self.writer, max_new_tokens=e.sample_tokens,
                       seq_len_divisor=self.parallel.seq_len_divisor, cp=self.layout.cp, device=self.env.device,
                       forward=self.pipeline.next_tokens if self.pipeline else None)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        """Trains from the resumed step to max_steps, or until a stop condition; returns the summary,
        also written to summary.json."""
        failed = True
        try:
            self.stop.install()
            if self.start_step == 0:  # a resumed run's earlier validation rows are already in its metrics
                self.validator.run(0)
            self.metrics.start()
            stopped: str | None = None
            for step in range(self.start_step, self.end_step):
                result = self.train_step(step)
                self.step = step + 1
                self.log(result)
                self.evaluate()
                stopped = self._poll_stop()
                self.checkpoint(stopped)
                if stopped:
                    log.warning("stopping after step %d (%s%s)", self.step, stopped,
                                f": {self.stop.received}" if stopped == "signal" else "")
                    break
            if stopped is None and self.step < self.cfg.trainer.max_steps:  # resumed at or past stop_at_step
                stopped = "stop_at_step"
            train_time = self.metrics.train_time()  # the final validation and export are not training
            hf_dir = None if stopped else self._finish()
            summary = self.summary(stopped, train_time=train_time, hf_dir=hf_dir)
            self.writer.write_summary(summary)
            failed = False
        finally:
            self.stop.restore()
            self.writer.plot()  # the rows since the last validation (a failed run's too), or all without one
            self.writer.close(failed=failed)
            self.checkpointer.release()
        return summary

    def train_step(self, step: int) -> StepResult:
        """One optimizer step on the global batch of `step` (0-based). The objective normalises it
        (its `begin_step`, before any backward) and runs each micro-batch's forward and backward.

        A step whose loss or gradient norm is not finite on any rank is not taken (`NonFiniteGuard`):
        the run stops, or under `trainer.nonfinite=skip` the batch is dropped and the LR schedule
        moves on, so the schedule and the data position stay functions of the step."""
        micro_batches = [self._collate(indices) for indices in self.batch_plan.indices_for_step(step)]
        context = self.objective.begin_step(micro_batches)
        losses, extras = self.schedule.run(micro_batches, context)
        sums = self.objective.finish_step(losses, extras, context)
        grad_norm = clip_grad_norm_(self.params, self.cfg.trainer.max_grad_norm, pp_group=self.pp_group,
                                    device=self.env.device)
        lr = self.scheduler.get_last_lr()[0]
        finite = self.guard.step_is_finite(self.objective.finite_value(sums), grad_norm)
        if finite:
            self.optimizer.step()
        else:
            self.guard.reject(step + 1, grad_norm.item(), self._last_good_checkpoint())
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # After the step, so the biases it moves route the next step's tokens.
        moe = self.balance.after_step(taken=finite) if self.balance else {}
        return StepResult(sums=sums, lr=lr, grad_norm=grad_norm, skipped=not finite,
                          moe={k: v for k, v in moe.items() if k != "expert_load"} or None,
                          expert_load=moe.get("expert_load"),
                          real_tokens=self.objective.real_tokens(self.batch_plan.global_indices_for_step(step)))

    def _last_good_checkpoint(self) -> Path | None:
        """The newest checkpoint this run saved or resumed from: every one of them is finite."""
        return self.checkpointer.last_saved or self.checkpointer.resume_from

    def _collate(self, indices: Any) -> dict[str, torch.Tensor]:
        """This rank's micro-batch of the examples at `indices`, as the objective lays it out."""
        return self.objective.collate(indices)

    def _forward_backward(self, batch: dict[str, torch.Tensor], context: Any) -> tuple[torch.Tensor, Any]:
        """The micro-batch's forward and backward (the objective's); returns this rank's loss sum and the
        objective's other sums."""
        return self.objective.forward_backward(batch, context)

    def log(self, result: StepResult) -> None:
        """Counts the step just done and writes its metrics row when one is due (the loss is summed
        over ranks for those steps only, and every skipped step gets one), then moves the progress bar."""
        self.metrics.record(result.sums.trained_tokens, result.real_tokens)
        if self.metrics.due(self.step) or result.skipped:
            row = self.objective.row(result.sums)
            loss, mtp_loss = row.pop("loss"), row.pop("mtp_loss", None)
            self.metrics.log(self.step, loss=loss, lr=result.lr, grad_norm=result.grad_norm.item(),
                             skipped=result.skipped, mtp_loss=mtp_loss, moe=result.moe, extra=row)
            if result.expert_load is not None:
                self.writer.log_expert_loads(self.step, result.expert_load)
        self.writer.advance()

    def evaluate(self) -> None:
        """A validation pass when one is due after this step; its time is kept out of the throughput."""
        if self.validator.due(self.step):
            self.metrics.exclude(self.validator.run(self.step))

    def _poll_stop(self) -> str | None:
        """Why the run ends after this step ('signal', 'max_minutes', 'stop_at_step'), or None; the
        same on every rank."""
        stop_at_step = self.step == self.end_step < self.cfg.trainer.max_steps
        return self.stop.poll() or ("stop_at_step" if stop_at_step else None)

    def checkpoint(self, stopped: str | None) -> None:
        """Saves when the checkpoint schedule says so, and always before an early stop: the next run
        resumes from it. Parameters holding a non-finite value are never saved."""
        if stopped or self.checkpointer.due(self.step, self.cfg.trainer.max_steps):
            self.guard.check_parameters(self.model, self.step, self._last_good_checkpoint())
            self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler)

    def _finish(self) -> str | None:
        """The end of a run that reached max_steps: the final validation pass, the `eval.tasks` on the
        final checkpoint, then the Hugging Face export if asked for; returns the export's directory."""
        self.validator.run(self.cfg.trainer.max_steps)
        if self.cfg.eval.tasks:
            from nemotron_recipe.training.end_eval import evaluate_final_checkpoint

            self.eval_metrics = evaluate_final_checkpoint(self.cfg, self.checkpointer, self.env.device)
            self.writer.log_eval({"step": self.step, **self.eval_metrics})
        if not self.cfg.checkpoint.export_hf:
            return None
        return str(export_run_checkpoint(self.checkpointer, self.run_dir / "hf"))

    def summary(self, stopped: str | None, *, train_time: float, hf_dir: str | None) -> dict[str, Any]:
        """The run's summary (summary.json, the printed summary and `run`'s result)."""
        last_saved = self.checkpointer.last_saved
        return {
            "steps": self.step,
            "stopped": stopped,
            "stop_signal": self.stop.received if stopped == "signal" else None,
            "resumed_from": self.start_step or None,
            "checkpoint": None if last_saved is None else str(last_saved),
            "hf_export": hf_dir,
            "skipped_steps": self.guard.skipped,
            **self.validator.summary(final=stopped is None),
            **getattr(self, "eval_metrics", {}),
            **self.metrics.summary(train_time),
            "wall_time_s": time.perf_counter() - self.started,
            "run_dir": str(self.run_dir),
            "world_size": self.env.world_size,
            "mesh": self.mesh_shape,
            "num_parameters": self.num_parameters,
            "data": self.data.counts(),
        }


def run(cfg: Any) -> dict[str, Any]:
    """Fine-tune as `cfg` (a `FinetuneConfig`-shaped DictConfig) says; returns the summary."""
    started = time.perf_counter()
    model_config, plan = validate_config(cfg)
    # Before any process group or model: every rank plans its own launch, so all stop alike.
    preflight(cfg, (model_config, plan), plan.world_size)
    with distributed(cfg.trainer.device) as env:
        if not env.is_main:
            logging.getLogger("nemotron_recipe").setLevel(logging.WARNING)
        if env.device.type == "cpu":
            keep_freed_memory()  # large activations are reused instead of page-faulted every step
        summary = Trainer(cfg, model_config, plan, env, started=started).train()
        if env.is_main:
            print_summary(summary)
    return summary
