"""Structured (typed) configuration of the fine-tuning recipe, registered with Hydra.

The dataclasses here are the schema that `conf/finetune.yaml` extends, so Hydra itself rejects a
misspelt key or a value of the wrong type, naming it. Checks that need more than one field, or
knowledge of the model, live in `validate_config`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from nemotron_recipe.config_keys import unknown_key_problems
from nemotron_recipe.distributed import pipeline_layout
from nemotron_recipe.distributed.env import launched_world_size
from nemotron_recipe.distributed.plan import ParallelConfigError, ParallelPlan, check_experts_split
from nemotron_recipe.models.nemotron_v3.checkpoint import (
    CheckpointError,
    checkpoint_weight_dtypes,
    safetensors_file_problem,
    weight_file_problem,
)
from nemotron_recipe.models.hub import resolve_pretrained
from nemotron_recipe.models.nemotron_v3.config import PRESET_LR, ModelConfigError, NemotronHConfig, matching_preset
from nemotron_recipe.models.nemotron_v3.lora import DEFAULT_TARGETS, LoRAError, lora_spec_problem
from nemotron_recipe.models.nemotron_v3.fp8 import quantization_problem
from nemotron_recipe.models.nemotron_v3.fp8_base import fp8_base_problems
from nemotron_recipe.models.nemotron_v3.nf4 import nf4_problems

WANDB_MODES = ("disabled", "offline", "online")
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_MODES = ("stop", "skip")
PREFLIGHT_MODES = (True, False, "warn")

log = logging.getLogger(__name__)

# Shipped with the package, next to the data layer that documents their format.
ASSETS_DIR = Path(__file__).resolve().parent / "data" / "assets"


class ConfigError(ValueError):
    """An invalid setting; the message names the field, its value and a fix."""


# ---------------------------------------------------------------------------------------- resolvers
def _asset_path(name: str = "") -> str:
    return str(ASSETS_DIR / name) if name else str(ASSETS_DIR)


def _agent_start_time() -> Optional[datetime.datetime]:
    """Start time of torchrun's agent, which every local rank shares as parent (Linux only)."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            # Field 22 counts clock ticks since boot; the command name (field 2) may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return datetime.datetime.fromtimestamp(boot + start_ticks / os.sysconf("SC_CLK_TCK"))


def run_id() -> str:
    """One name for this run that every rank computes identically: the run directory below `outputs/`.

    Each rank resolves Hydra's run dir on its own, so a per-process timestamp would scatter a
    multi-rank run over several directories. `NR_RUN_ID` wins when set, as it is: a named run keeps
    its directory from one day to the next, so relaunching the same line resumes it. Otherwise the
    name is `<date>/<id>`: under torchrun the rendezvous id, shared by construction; torchrun without
    `--rdzv-id` reports the id "none", which would make every such run share one directory, so the
    agent's start time stands in for it; a single process takes its start time.
    """
    explicit = os.environ.get("NR_RUN_ID")
    if explicit:
        return explicit
    if "TORCHELASTIC_RUN_ID" in os.environ:
        rdzv = os.environ["TORCHELASTIC_RUN_ID"]
        if rdzv and rdzv != "none":
            return f"{datetime.datetime.now():%Y-%m-%d}/{rdzv}"
        started = _agent_start_time()
        if started is not None:
            return started.strftime("%Y-%m-%d/%H-%M-%S")
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def _register_resolvers() -> None:
    # Cached: Hydra copies the resolver cache into every job of a multirun, so all jobs (and, via
    # run_id, all ranks) land in one sweep directory rather than one per job start time.
    OmegaConf.register_new_resolver("nr_run_id", run_id, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("nr_asset", _asset_path, replace=True)


# ---------------------------------------------------------------------------------------- schema
def _make_model_config_class() -> type:
    """`ModelConfig`: a preset or checkpoint, plus one optional override per `NemotronHConfig` field.

    Generated from the model's own dataclass so that a new model field is overridable (and
    type-checked by Hydra) without touching this file.
    """
    hints = typing.get_type_hints(NemotronHConfig)
    spec: list[tuple[str, Any, Any]] = [
        ("preset", str, field(default="tiny")),
        ("pretrained", Optional[str], field(default=None)),
    ]
    for f in dataclasses.fields(NemotronHConfig):
        spec.append((f.name, Optional[hints[f.name]], field(default=None)))
    cls = dataclasses.make_dataclass("ModelConfig", spec)
    cls.__module__ = __name__
    cls.__doc__ = (
        "Which model to build: `preset` (a name in PRESETS) or `pretrained` (a Hugging Face checkpoint "
        "directory or hub id, which takes precedence), with any non-None field overriding that base config."
    )
    return cls


ModelConfig = _make_model_config_class()
MODEL_OVERRIDE_FIELDS = tuple(f.name for f in dataclasses.fields(NemotronHConfig))


@dataclass
class MeshConfig:
    """Parallel layout; the product of the sizes must equal the number of processes."""

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other sizes leave of the world size
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel: ranks of dp_shard x cp that split the routed experts
    sequence_parallel: bool = False
    # Pipeline parallel (the outermost dim): `pp` ranks each run a contiguous run of blocks, the step's
    # micro-batches flowing through them by `pp_schedule` (gpipe | 1f1b | interleaved_1f1b | zbv) with
    # `pp_virtual_stages` stages per rank; `pp_split`: the first block of each stage after the first
    # (pp x pp_virtual_stages - 1 indices), None: split by estimated cost.
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_split: Optional[list[int]] = None


@dataclass
class MoEConfig:
    """Routed experts of MoE models. `bias_update_rate` (0: off): after each optimizer step every
    router's correction bias moves by this rate times sign(mean load - expert load), the loads counted
    over the whole global batch (auxiliary-loss-free balancing). `freeze_router`: the router weight
    and its correction bias stay as loaded. `aux_loss_coeff` (0: off): the coefficient of the
    sequence-wise balance loss (DeepSeek-V3, Megatron-LM's `seq_aux_loss`) each MoE block of the
    decoder adds to the objective, averaged over the step's sequences."""

    bias_update_rate: float = 0.0
    freeze_router: bool = False
    aux_loss_coeff: float = 0.0


@dataclass
class ACConfig:
    """Activation checkpointing, applied by the model's parallelizer: none; blocks (its choice of blocks,
    for Nemotron-H Mamba and MLP); full (all blocks); selective (all, op by op); every_nth (every `every`-th)."""

    mode: str = "none"
    every: int = 2


@dataclass
class FSDPConfig:
    """FSDP2 precision and placement. Parameters are stored in fp32 either way; `param_dtype` is
    what forward/backward compute in, `reduce_dtype` what gradients are summed in."""

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    offload: bool = False
    reshard_after_forward: Optional[bool] = None  # None: FSDP's default


@dataclass
class DataConfig:
    """SFT data; docs/data.md describes formats, chat rows, packing and validation."""

    # A .jsonl/.json/.parquet/.csv file, or a Hugging Face hub dataset id "org/name".
    train_file: str = "${nr_asset:tiny_sft_train.jsonl}"
    val_file: Optional[str] = "${nr_asset:tiny_sft_val.jsonl}"  # None: val_split_fraction, else no validation
    tokenizer: str = "${nr_asset:}"
    format: Optional[str] = None  # jsonl|json|parquet|csv|hub; None: from the extension (or a hub id)
    train_split: str = "train"  # split of a hub train_file
    val_split: str = "validation"  # split of a hub val_file
    val_split_fraction: float = 0.0  # with val_file null: hold out this fraction of training rows (by seed)
    prompt_key: str = "prompt"
    response_key: str = "response"
    chosen_key: str = "chosen"  # data.format=preference: the preferred response (string or one assistant turn)
    rejected_key: str = "rejected"  # ... and the dispreferred one
    messages_key: Optional[str] = None  # chat rows: a list of {role, content} turns; replaces prompt/response
    role_key: str = "role"
    content_key: str = "content"
    # auto (tokenizer's, else built-in) | builtin | nemotron3 (the released Nemotron 3 template) |
    # tokenizer (its template's {% generation %} markers) | a Jinja template
    chat_template: str = "auto"
    train_on: str = "assistant"  # assistant | last_assistant | all
    # The final assistant turn's <think> trace: train | answer_only (in the text, out of the loss) | drop.
    # Earlier turns lose theirs under every value, as the released Nemotron 3 template renders history.
    reasoning: str = "train"
    train_empty_think: bool = False  # an empty <think></think> block is a target only when true
    max_length_policy: str = "truncate"  # rows longer than trainer.seq_len: truncate | drop
    packing: bool = False  # several documents per sequence; global_batch_size then counts packed sequences
    val_max_batches: Optional[int] = 8  # None: the whole validation set


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then cosine decay to `lr * min_lr_ratio` at `trainer.max_steps`."""

    # None: the model's own (PRESET_LR: its preset's, or that of the released model a checkpoint has the shapes
    # of), for full fine-tuning or for LoRA as peft.method says; the run logs which.
    lr: Optional[float] = None
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConfig:
    max_steps: int = 200
    global_batch_size: int = 16  # sequences per optimizer step, summed over data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    seq_len: int = 128
    log_every: int = 10
    val_every: int = 50  # 0: validate only before and after training
    max_grad_norm: Optional[float] = 1.0  # None: no clipping (the norm is still logged)
    device: str = "auto"
    # End early with a checkpoint (and exit code 0) after this step or this many minutes; the LR
    # schedule still runs to max_steps, so a later resume continues the same curve.
    stop_at_step: Optional[int] = None
    max_minutes: Optional[float] = None
    # torch.compile each decoder block; if compiling fails on this machine the run warns and
    # continues eagerly.
    compile: bool = False
    # Tokens per chunk of the lm_head + cross-entropy, so the [tokens, vocab] logits never exist
    # at once; 0 or None: off. A tensor-parallel head keeps the plain (vocab-sharded) loss.
    loss_chunk_size: Optional[int] = None
    # A step whose loss or gradient norm is not finite is never taken nor saved. `stop`: the run
    # ends at once (exit 1) naming the step and the last good checkpoint; `skip`: the step's batch
    # is dropped and the run goes on, until more than `max_skipped_steps` steps were skipped.
    nonfinite: str = "stop"
    max_skipped_steps: int = 10
    # Before the model is built, each rank estimates its peak memory (recipes.plan's planner) and
    # stops with the estimate and what would fit when it exceeds the device's: true, false, or warn.
    preflight: Any = True


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) that resume on any mesh.

    Saved every `every` steps (0: none on the way), at the end (`save_final`) and whenever a run
    stops early (signal, `trainer.stop_at_step`, `trainer.max_minutes`); the newest `keep` are
    kept (0: all). `resume`: `auto` (newest complete checkpoint in `dir`, if any), `none`, or a
    checkpoint path. `export_hf`: also write the final weights to `<run_dir>/hf` in Hugging Face format.
    """

    dir: Optional[str] = None  # None: <run_dir>/checkpoints
    every: int = 0
    keep: int = 2
    resume: str = "auto"
    save_final: bool = True
    export_hf: bool = False


OBJECTIVES = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")
DPO_REFERENCES = ("base", "copy", "precomputed")


@dataclass
class ObjectiveConfig:
    """What a step optimizes (docs/dpo.md). `sft`: next-token cross-entropy. `dpo`: direct preference
    optimization over `data.format=preference` pairs: `beta`, `loss` (sigmoid | ipo) with
    `label_smoothing`, `sft_weight` (an NLL term on the chosen responses) and `reference` (base | copy |
    precomputed); the DPO keys are ignored under `sft`."""

    name: str = "sft"
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    reference: str = "base"


PEFT_METHODS = ("none", "lora")
BASE_DTYPE_NAMES = ("bf16", "fp32", "nf4", "fp8")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning. `method=none` trains every weight; `lora` trains fp32 low-rank
    adapters (`rank`, `alpha`: the update is alpha/rank * B A) on the modules `target_modules` (glob
    patterns over module names) matches, over a frozen base stored in `base_dtype`. `init_from`: a
    PEFT adapter directory to start from instead of B = 0."""

    method: str = "none"
    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    base_dtype: str = "bf16"
    init_from: Optional[str] = None


@dataclass
class EvalConfig:
    """lm-eval tasks (as `recipes.evaluate` runs them) evaluated on the final checkpoint at the end of
    training; their metrics go to metrics.jsonl, the summary and wandb. `limit`: at most this many
    examples per task (None: all). `samples`: prompts (each a user turn in the training chat format)
    continued greedily for `sample_tokens` tokens at each validation, under the training mesh, and written
    to samples.jsonl; null: the first two prompts of the validation set; []: none."""

    tasks: list[str] = field(default_factory=list)
    limit: Optional[int] = None
    samples: Optional[list[str]] = None
    sample_tokens: int = 32  # 0: no samples


@dataclass
class WandbConfig:
    mode: str = "disabled"
    project: str = "nemotron-recipe"
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class ConsoleConfig:
    progress_bar: bool = True


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)


@dataclass
class FinetuneConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # type: ignore[valid-type]
    mesh: MeshConfig = field(default_factory=MeshConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 1234
    run_dir: str = "${hydra:runtime.output_dir}"


SCHEMA_NAME = "finetune_schema"


def register_configs() -> None:
    _register_resolvers()
    ConfigStore.instance().store(name=SCHEMA_NAME, node=FinetuneConfig)


register_configs()


# ---------------------------------------------------------------------------------------- helpers
def model_overrides(model_cfg: Any) -> dict[str, Any]:
    """The `NemotronHConfig` fields that `model_cfg` sets explicitly."""
    return {
        name: value
        for name in MODEL_OVERRIDE_FIELDS
        if (value := getattr(model_cfg, name, None)) is not None
    }


def build_model_config(model_cfg: Any) -> NemotronHConfig:
    """The `NemotronHConfig` that `model_cfg` describes; raises `ModelConfigError` naming the bad field."""
    overrides = model_overrides(model_cfg)
    if model_cfg.pretrained:
        path = Path(model_cfg.pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"model.pretrained={model_cfg.pretrained!r}: no config.json there. Fix: point it at a "
                "Hugging Face checkpoint directory, or unset it (model.pretrained=null) to train a preset."
            )
        try:  # an export writes each tensor back in the dtype the checkpoint holds it in
            dtypes = checkpoint_weight_dtypes(str(path))
        except CheckpointError:
            dtypes = None  # no weight files: loading them says so, with the fix
        return dataclasses.replace(NemotronHConfig.from_hf(str(path)), weight_dtypes=dtypes, **overrides)
    return NemotronHConfig.from_preset(model_cfg.preset, **overrides)


def _check_choice(errors: list[str], name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        errors.append(f"{name}={value!r}: unknown value. Fix: use one of {list(choices)}.")


def _check_path(errors: list[str], name: str, value: Optional[str], *, allow_dir: bool = False) -> None:
    if value is None:
        return
    p = Path(value).expanduser()
    if p.is_file() or (allow_dir and p.is_dir()):
        return
    what = "is a directory, not a file" if p.is_dir() else "does not exist"
    errors.append(
        f"{name}={value!r}: {what} (relative paths resolve against the launch directory). "
        f"Fix: point {name} at an existing file."
    )


def _positive(errors: list[str], name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value):  # nan passes every comparison below, inf every lower bound
        errors.append(f"{name}={value!r}: must be a finite number. Fix: set a finite value (null where the field "
                      "allows it turns it off).")
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        errors.append(f"{name}={value!r}: must be {bound}. Fix: set a value {bound}.")


def _trainer_problems(t: Any, checkpoint: Any) -> list[str]:
    errors: list[str] = []
    for name in ("max_steps", "global_batch_size", "micro_batch_size", "log_every", "max_grad_norm",
                 "stop_at_step", "max_minutes"):
        _positive(errors, f"trainer.{name}", getattr(t, name))
    for name in ("val_every", "loss_chunk_size", "max_skipped_steps"):
        _positive(errors, f"trainer.{name}", getattr(t, name), allow_zero=True)
    _positive(errors, "checkpoint.every", checkpoint.every, allow_zero=True)
    _positive(errors, "checkpoint.keep", checkpoint.keep, allow_zero=True)
    if t.seq_len < 2:
        errors.append(
            f"trainer.seq_len={t.seq_len}: must be >= 2 (one input and one target token). "
            "Fix: set trainer.seq_len to at least 2, e.g. 128."
        )
    _check_choice(errors, "trainer.device", t.device, DEVICES)
    _check_choice(errors, "trainer.nonfinite", t.nonfinite, NONFINITE_MODES)
    if t.preflight not in PREFLIGHT_MODES:
        errors.append(f"trainer.preflight={t.preflight!r}: unknown value. Fix: use true, false or warn.")
    return errors


def _optim_problems(o: Any) -> list[str]:
    errors: list[str] = []
    _positive(errors, "optim.lr", o.lr)
    _positive(errors, "optim.eps", o.eps)
    _positive(errors, "optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive(errors, "optim.warmup_steps", o.warmup_steps, allow_zero=True)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        errors.append(f"optim.min_lr_ratio={o.min_lr_ratio}: must lie in [0, 1]. Fix: e.g. 0.1.")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        errors.append(f"optim.betas={list(o.betas)}: need two values in [0, 1). Fix: e.g. [0.9,0.95].")
    return errors


def _parallel_problems(cfg: Any, world_size: int | None = None) -> tuple[ParallelPlan | None, list[str]]:
    """The parallel plan for `world_size` (default: the one the launcher set), and the batch split it implies."""
    t = cfg.trainer
    try:
        plan = ParallelPlan.from_config(cfg, world_size or launched_world_size())
    except ParallelConfigError as e:
        return None, [str(e).removeprefix("invalid parallel settings:\n  ")]
    if t.global_batch_size > 0 and t.micro_batch_size > 0:
        split = _batch_split_problems(t, plan.dp_size)
        micro_batches = None if split else t.global_batch_size // (t.micro_batch_size * plan.dp_size)
        return plan, split + pipeline_layout.layout_problems(cfg.mesh, micro_batches)
    return plan, pipeline_layout.layout_problems(cfg.mesh, None)


def _input_problems(cfg: Any, weights: bool = True) -> list[str]:
    """Data, tokenizer, run directory and pretrained weights."""
    # Imported here: the data layer pulls in transformers and datasets, which composing a config should not.
    from nemotron_recipe.data.sources import check_data_config

    errors = list(check_data_config(cfg.data))
    _check_path(errors, "data.tokenizer", cfg.data.tokenizer, allow_dir=True)
    _positive(errors, "data.val_max_batches", cfg.data.val_max_batches)
    try:
        _ = cfg.run_dir
    except InterpolationResolutionError:
        errors.append(
            "run_dir: cannot be resolved. It defaults to Hydra's output directory, which exists only in "
            "a run launched through Hydra. Fix: set run_dir explicitly."
        )
    if weights and cfg.model.pretrained:
        path = Path(cfg.model.pretrained).expanduser()
        errors.extend(f"model.pretrained={cfg.model.pretrained!r}: {problem}"
                      for problem in (weight_file_problem(path), quantization_problem(path)) if problem)
    return errors


def validate_config(cfg: Any, world_size: int | None = None, *,
                    weights: bool = True) -> tuple[NemotronHConfig, ParallelPlan]:
    """Check everything that can be checked before any process group, data or model exists.

    Raises `ConfigError` listing every problem at once (or `ModelConfigError` for the model), so
    every rank fails identically and early. Returns the model config and the parallel plan (for the
    world size the launcher set, or `world_size` for a launch being planned), which it had to build anyway.

    Fills in what the config leaves to the model: a hub id in `model.pretrained` becomes its local
    snapshot (downloaded; with `weights=False`, for planning, its config.json alone) and a null
    `optim.lr` the model's own learning rate.
    """
    if unknown := unknown_key_problems(cfg):  # nothing else is worth checking in a config nothing reads right
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(unknown))
    if cfg.model.pretrained:
        cfg.model.pretrained = resolve_pretrained(cfg.model.pretrained, config_only=not weights)
    errors = _trainer_problems(cfg.trainer, cfg.checkpoint) + _optim_problems(cfg.optim)
    plan, parallel_errors = _parallel_problems(cfg, world_size)
    errors += parallel_errors
    _check_choice(errors, "logger.wandb.mode", cfg.logger.wandb.mode, WANDB_MODES)
    errors += _input_problems(cfg, weights)
    errors += _peft_problems(cfg)
    errors += _objective_problems(cfg)
    errors += _eval_problems(cfg)
    errors += pipeline_problems(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    model_config = build_model_config(cfg.model)
    problems = _moe_problems(cfg, model_config, plan) + pipeline_layout.model_problems(cfg.mesh, model_config.num_layers)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    if cfg.optim.lr is None:
        cfg.optim.lr, source = model_lr(cfg, model_config)
        if int(os.environ.get("RANK", "0")) == 0:  # every rank takes the same rate; one says so
            log.info("optim.lr=%g: %s (set optim.lr to choose another)", cfg.optim.lr, source)
    return model_config, plan


def model_lr(cfg: Any, model_config: NemotronHConfig) -> tuple[float, str]:
    """The peak learning rate the model is fine-tuned with by default, and where it comes from: the
    preset's, or for a checkpoint that of the released model whose shapes it has (else the preset's)."""
    lora = getattr(cfg, "peft", None) is not None and cfg.peft.method == "lora"
    kind = "LoRA" if lora else "full fine-tuning"
    name, note = cfg.model.preset, ""
    if cfg.model.pretrained:
        if (match := matching_preset(model_config)) is not None:
            name = match
        else:
            note = f"; model.pretrained has none of the released shapes, so preset {name}'s"
    if name not in PRESET_LR:
        raise ConfigError(f"optim.lr=null: preset {name!r} has no learning rate of its own. Fix: set optim.lr.")
    lr = PRESET_LR[name].lora if lora else PRESET_LR[name].full
    return lr, f"{name}'s {kind} learning rate (PRESET_LR in nemotron_recipe/models/nemotron_v3/config.py){note}"


def _moe_problems(cfg: Any, model_config: NemotronHConfig, plan: ParallelPlan) -> list[str]:
    """Expert parallel and the `moe` options need routed experts to act on."""
    has_moe = "moe" in model_config.block_types
    errors = [p for p in [check_experts_split(plan.ep, model_config.n_routed_experts, has_moe)] if p]
    rate = cfg.moe.bias_update_rate
    if rate < 0:
        errors.append(f"moe.bias_update_rate={rate}: must be >= 0 (0: off). Fix: e.g. moe.bias_update_rate=1e-3.")
    if rate > 0 and cfg.moe.freeze_router:
        errors.append(f"moe.bias_update_rate={rate} with moe.freeze_router=true: a frozen router keeps its correction "
                      "bias too. Fix: moe.bias_update_rate=0, or moe.freeze_router=false.")
    coeff = cfg.moe.aux_loss_coeff
    if coeff < 0:
        errors.append(f"moe.aux_loss_coeff={coeff}: must be >= 0 (0: off). Fix: e.g. moe.aux_loss_coeff=1e-4.")
    for name, value in (("bias_update_rate", rate), ("freeze_router", cfg.moe.freeze_router),
                        ("aux_loss_coeff", coeff)):
        if value and not has_moe:
            errors.append(f"moe.{name}={value}: the model (pattern {model_config.pattern!r}) has no MoE block. "
                          f"Fix: leave moe.{name} at its default, or use a model with MoE blocks ('E').")
    return errors


def _batch_split_problems(t: Any, dp_size: int) -> list[str]:
    """The global batch must split into whole micro-batches on every data-parallel rank."""
    unit = t.micro_batch_size * dp_size
    if t.global_batch_size % unit == 0:
        return []
    lower = t.global_batch_size // unit * unit
    options = " or ".join(str(v) for v in (lower, lower + unit) if v > 0)
    return [
        f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size="
        f"{t.micro_batch_size} x data-parallel size {dp_size} = {unit}, so ranks would run unequal "
        f"numbers of micro-batches. Fix: set trainer.global_batch_size={options}, or lower "
        "trainer.micro_batch_size."
    ]


def _peft_problems(cfg: Any) -> list[str]:
    """The `peft` group; LoRA's targets are matched against the model's module names (built on the meta
    device, so no memory and no time)."""
    p = getattr(cfg, "peft", None)
    if p is None or p.method == "none":
        return [] if p is None else _method_problems(p) + nf4_problems(cfg) + fp8_base_problems(cfg)
    errors = _method_problems(p)
    if p.base_dtype not in BASE_DTYPE_NAMES:
        errors.append(f"peft.base_dtype={p.base_dtype!r}: unknown. Fix: use one of {list(BASE_DTYPE_NAMES)}.")
    errors += nf4_problems(cfg) + fp8_base_problems(cfg)
    _check_path(errors, "peft.init_from", p.init_from, allow_dir=True)
    if p.init_from and not errors and (problem := adapter_problem(Path(p.init_from).expanduser())):
        errors.append(f"peft.init_from={p.init_from!r}: {problem}")
    if errors:
        return errors
    try:
        problem = lora_spec_problem(build_model_config(cfg.model), p.rank, p.alpha, p.dropout, list(p.target_modules),
                                    tp=int(cfg.mesh.tp))
    except (ModelConfigError, LoRAError) as e:
        problem = str(e)
    return [problem] if problem else []


def adapter_problem(path: Path) -> str | None:
    """Why the PEFT adapter directory `path` cannot be read (a file missing or cut short), or None."""
    config, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return (f"{config} is not readable JSON ({type(e).__name__}: {e}). Fix: point peft.init_from at a PEFT "
                "adapter directory (adapter_config.json, adapter_model.safetensors), or copy the adapter again.")
    if problem := safetensors_file_problem(weights):
        return f"{problem}. Fix: copy or export the adapter again; its weights file is incomplete."
    return None


def pipeline_problems(cfg: Any) -> list[str]:
    """Settings a pipeline-parallel run (mesh.pp > 1) cannot train with, each naming its field and a fix;
    checked with the rest of the config, on every rank before any process group or model exists."""
    pp = int(getattr(cfg.mesh, "pp", 1))
    if pp <= 1:
        return []
    problems = []
    if cfg.objective.name != "sft":
        problems.append(f"objective.name={cfg.objective.name} with mesh.pp={pp}: a pipeline trains the sft objective "
                        "only (DPO's reference forward and its pair loss are not run through the stages). Fix: "
                        "objective=sft, or mesh.pp=1 with FSDP/TP to fit the model.")
    if cfg.trainer.compile:
        problems.append(f"trainer.compile=true with mesh.pp={pp}: compiling pipeline stages is not supported. "
                        "Fix: trainer.compile=false.")
    return problems


def _objective_problems(cfg: Any) -> list[str]:
    """The `objective` group, and what DPO needs of the data, the adapters and the trainer."""
    o, errors = cfg.objective, []
    _check_choice(errors, "objective.name", o.name, OBJECTIVES)
    preference = cfg.data.format == "preference"
    if o.name == "sft":
        if preference:
            errors.append("data.format=preference: preference pairs train with DPO. Fix: objective=dpo, or point "
                          "data.train_file at prompt/response rows with data.format=null.")
        return errors
    if o.name != "dpo":
        return errors
    _check_choice(errors, "objective.loss", o.loss, DPO_LOSSES)
    _check_choice(errors, "objective.reference", o.reference, DPO_REFERENCES)
    _positive(errors, "objective.beta", o.beta)
    _positive(errors, "objective.sft_weight", o.sft_weight, allow_zero=True)
    if not 0.0 <= o.label_smoothing < 0.5:
        errors.append(f"objective.label_smoothing={o.label_smoothing}: must lie in [0, 0.5). Fix: e.g. 0.1, or 0.")
    if not preference:
        errors.append(f"objective=dpo with data.format={cfg.data.format!r}: DPO trains on preference pairs. Fix: "
                      "data.format=preference, with prompt/chosen/rejected in each row.")
    lora = cfg.peft.method == "lora"
    if o.reference == "base" and not lora:
        errors.append("objective.reference=base without LoRA (peft.method=none): the base reference is the model "
                      "with its adapters switched off, and full fine-tuning has none. Fix: objective.reference=copy "
                      "(a frozen copy of the starting weights), objective.reference=precomputed, or peft=lora.")
    if o.reference == "base" and cfg.moe.bias_update_rate:
        errors.append(f"objective.reference=base with moe.bias_update_rate={cfg.moe.bias_update_rate}: the routers' "
                      "correction biases are shared with the base and would move the reference. Fix: "
                      "objective.reference=copy or precomputed, or moe.bias_update_rate=0.")
    if o.reference == "copy" and lora and cfg.peft.init_from:
        errors.append("objective.reference=copy with peft.init_from: the copy holds the base without adapters, not "
                      "the starting adapters. Fix: objective.reference=precomputed (the starting policy's log-probs).")
    if cfg.data.packing:
        errors.append("data.packing=true with objective=dpo: a pair's halves are whole sequences of one micro-batch. "
                      "Fix: data.packing=false.")
    if cfg.trainer.loss_chunk_size:
        errors.append(f"trainer.loss_chunk_size={cfg.trainer.loss_chunk_size} with objective=dpo: DPO needs each "
                      "sequence's log-probs, which the chunked loss does not give. Fix: trainer.loss_chunk_size=null.")
    if cfg.data.messages_key is not None:
        errors.append(f"data.messages_key={cfg.data.messages_key!r} with objective=dpo: preference rows hold "
                      "data.prompt_key/chosen_key/rejected_key. Fix: data.messages_key=null.")
    return errors


def _eval_problems(cfg: Any) -> list[str]:
    """`eval.samples` and `eval.sample_tokens`; `eval.tasks` must name tasks lm-eval can run here (checked
    now: the run would find out only after training), on a final checkpoint the run saves."""
    e = getattr(cfg, "eval", None)
    if e is None:
        return []
    errors: list[str] = []
    _positive(errors, "eval.sample_tokens", e.sample_tokens, allow_zero=True)
    for i, text in enumerate(e.samples or []):
        if not str(text).strip():
            errors.append(f"eval.samples[{i}]={text!r}: an empty prompt. Fix: give it words, or remove it.")
    if not e.tasks:
        return errors
    _positive(errors, "eval.limit", e.limit)
    if not cfg.checkpoint.save_final:
        errors.append(f"eval.tasks={list(e.tasks)}: they run on the final checkpoint, and checkpoint.save_final=false "
                      "saves none. Fix: checkpoint.save_final=true, or eval.tasks=[] (then `python -m recipes.evaluate` "
                      "evaluates any checkpoint later).")
    # Imported here: lm-eval is optional, and composing a config without eval.tasks must not need it.
    from nemotron_recipe.evaluation.tasks import EvalError, check_tasks, prepare_network, require_lm_eval, task_manager

    try:
        require_lm_eval()
        offline = prepare_network(e.tasks)
        check_tasks(task_manager(list(e.tasks)), list(e.tasks), offline=offline)
    except EvalError as err:
        errors.append(f"eval.tasks={list(e.tasks)}: {str(err).replace('--tasks: ', '')}")
    return errors


def _method_problems(p: Any) -> list[str]:
    errors: list[str] = []
    _check_choice(errors, "peft.method", p.method, PEFT_METHODS)
    return errors
