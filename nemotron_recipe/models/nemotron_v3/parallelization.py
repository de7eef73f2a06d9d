"""Model-owned distributed parallelization for Nemotron-H and Nemotron-V3.

Parallelisms are applied in a fixed order, one small function each:
    tensor + sequence parallel  ->  context parallel  ->  activation checkpointing  ->  FSDP2

Context parallel (distributed/context_parallel.py) gives each cp rank a load-balanced part of every
sequence; Mamba2 and attention mixers exchange what they need across the cp group, the other blocks
are per-token and need nothing. FSDP shards over the flattened (dp_shard, cp) dim.

Tensor-parallel plans are data: dicts of `ParallelStyle` per block kind. The default plan shards every
block kind of the native model:
- MLP: `up_proj` colwise, `down_proj` rowwise;
- attention: q/k/v colwise and `o_proj` rowwise, so each rank holds heads/tp query and kv heads;
- Mamba2: by groups (and so heads). The native `in_proj` and `conv1d` are group-major, so a plain
  row split gives each rank its own z, x, B, C and dt slices; `A_log`/`D`/`dt_bias` and the gated
  norm weight are split the same way, and `out_proj` is rowwise. Groups never straddle ranks, so
  the gated norm needs no collective;
- MoE blocks stay replicated across tp ranks (with sequence parallel they gather the sequence
  and hand back their own shard);
- the embedding is vocab-sharded (rowwise) and `lm_head` colwise with vocab-sharded logits, so the
  loss runs on vocab shards without gathering the full vocabulary.
With sequence parallel the residual stream and the norms hold a sequence shard; each mixer
gathers the sequence before its input projections and reduce-scatters after its output one.

The reference plan `"mlp"` shards only the MLP blocks and `lm_head`, which is all the other stacks
offer. `transformers`' NemotronH and the remote-code model get the reference plan plus attention
heads (their fused Mamba2 `in_proj` cannot be split by rows), and no sequence parallel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nemotron_recipe.distributed import context_parallel
from nemotron_recipe.distributed.parallelizer import ModelParallelizer, ParallelConfigError

from .model import NemotronHForCausalLM

__all__ = ["PARALLELIZER"]

logger = logging.getLogger(__name__)

# Block-type names of the native model, transformers 5.x and the remote-code model, normalised.
_KINDS = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
    "moe": "moe", "E": "moe",
}


def _decoder_blocks(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """Return the mutable decoder container and its ordered blocks."""
    for path in ("model.layers", "backbone.layers", "layers"):
        try:
            container = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(container, nn.ModuleDict):
            return container, [container[k] for k in sorted(container.keys(), key=int)]
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            return container, list(container)
    raise ParallelConfigError(
        f"{type(model).__name__}: no decoder blocks found in model.layers or backbone.layers; "
        "this parallelizer handles Nemotron-H models only."
    )


def _set_block(container: nn.Module, index: int, block: nn.Module) -> None:
    if isinstance(container, nn.ModuleDict):
        key = sorted(container.keys(), key=int)[index]
        container[key] = block
    else:
        container[index] = block


def _block_kind(block: nn.Module) -> str:
    kind = getattr(block, "block_type", None)
    if kind not in _KINDS:
        raise ParallelConfigError(f"{type(block).__name__}: block_type {kind!r} is not a Nemotron-H block type")
    return _KINDS[kind]


def _embedding_and_head(model: nn.Module) -> tuple[str, str, str]:
    """Module paths of the embedding, the final norm and the output head."""
    owner = "backbone" if hasattr(model, "backbone") else "model"
    return f"{owner}.embeddings", f"{owner}.norm_f", "lm_head"


# ------------------------------------------------------------------------------- parallel styles
class ShardParameters(ParallelStyle):
    """Shards the module's own parameters (not its children's) along `dim` over the tp mesh.

    For parameters a mixer reads directly (conv weights, A_log, D, dt_bias, the gated-norm weight):
    the mixer takes their local shard, matching the heads and groups its projections produced.
    """

    def __init__(self, *names: str, dim: int = 0):
        super().__init__()
        self.names, self.dim = names, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not self.names or name in self.names:
                sharded = distribute_tensor(param.data, device_mesh, [Shard(self.dim)])
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


class Compose(ParallelStyle):
    """Several styles on one module, in order (a plan maps each module to one style)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


def _gather_sequence() -> ParallelStyle:
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


def block_plan(kind: str, *, native: bool, sequence_parallel: bool, plan: str) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one block, relative to the block."""
    sp = sequence_parallel
    out = Shard(1) if sp else Replicate()
    styles: dict[str, ParallelStyle] = {}
    if sp:
        styles["norm"] = SequenceParallel()
    if kind == "mlp":
        styles |= {"mixer.up_proj": ColwiseParallel(), "mixer.down_proj": RowwiseParallel(output_layouts=out)}
    elif kind == "attention" and plan == "default":
        styles |= {
            "mixer.q_proj": ColwiseParallel(),
            "mixer.k_proj": ColwiseParallel(),
            "mixer.v_proj": ColwiseParallel(),
            "mixer.o_proj": RowwiseParallel(output_layouts=out),
        }
    elif kind == "mamba" and plan == "default" and native:
        styles |= {
            "mixer.in_proj": ColwiseParallel(),
            "mixer.conv1d": ShardParameters(),
            "mixer.norm": ShardParameters(),
            "mixer.out_proj": RowwiseParallel(output_layouts=out),
        }
        mixer_params = ShardParameters("A_log", "D", "dt_bias")
        styles["mixer"] = Compose(mixer_params, _gather_sequence()) if sp else mixer_params
        return styles
    elif kind in ("moe", "mamba", "attention"):
        # Replicated over tp: with sequence parallel, gather the sequence in and hand back the shard.
        if sp:
            styles["mixer"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            )
        return styles
    if sp:
        styles["mixer"] = _gather_sequence()
    return styles


def model_plan(model: nn.Module, *, sequence_parallel: bool, plan: str) -> dict[str, ParallelStyle]:
    """Embedding, final norm and head, relative to the whole model."""
    embed, norm_f, head = _embedding_and_head(model)
    sp = sequence_parallel
    styles: dict[str, ParallelStyle] = {}
    if plan == "default":
        styles[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if sp:
        styles[norm_f] = SequenceParallel()
    styles[head] = ColwiseParallel(
        input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
    )
    return styles


# ------------------------------------------------------------------------------- validation
def check_tensor_parallel(model: nn.Module, tp: int, plan, sequence_parallel: bool) -> str | None:
    """Validate before anything is sharded; returns the plan's name (None for a user dict)."""
    native = isinstance(model, NemotronHForCausalLM)
    if isinstance(plan, dict):
        if sequence_parallel:
            raise ParallelConfigError(
                "mesh.sequence_parallel=true with a user tp_shard_plan dict: the layouts between regions are "
                "the plan's business. Fix: use tp_shard_plan='default' or put SequenceParallel styles in the dict."
            )
        return None
    name = "default" if plan is None else plan
    if name not in ("default", "mlp"):
        raise ParallelConfigError(
            f"tp_shard_plan={plan!r}: unknown plan. Fix: use 'default' (every block kind), 'mlp' (MLP blocks "
            "and lm_head only) or a dict of module name -> ParallelStyle."
        )
    if sequence_parallel and (name != "default" or not native):
        raise ParallelConfigError(
            "mesh.sequence_parallel=true needs the default tensor-parallel plan on the native model "
            f"(got plan {name!r} on {type(model).__name__}). Fix: use tp_shard_plan='default' with "
            "nemotron_recipe's NemotronHForCausalLM, or turn sequence parallel off."
        )
    if tp == 1:
        return name
    cfg = model.config
    kinds = {_block_kind(b) for b in _decoder_blocks(model)[1]}

    def need(field: str, value: int, what: str) -> None:
        if value % tp:
            raise ParallelConfigError(
                f"mesh.tp={tp} does not divide model.{field}={value} ({what}). "
                f"Fix: choose mesh.tp among the divisors of {value}."
            )

    get = lambda *names: next(getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None)  # noqa: E731
    need("vocab_size", get("vocab_size"), "the vocab-sharded lm_head")
    if "mlp" in kinds:
        need("intermediate_size", get("intermediate_size"), "MLP columns")
    if name == "default" and "attention" in kinds:
        need("num_attention_heads", get("num_attention_heads"), "query heads")
        need("num_key_value_heads", get("num_key_value_heads"), "key/value heads")
    if name == "default" and native and "mamba" in kinds:
        need("n_groups", get("n_groups", "mamba_n_groups"), "Mamba2 groups: a group never straddles ranks")
    return name


def check_context_parallel(model: nn.Module, tp: int, cp: int) -> None:
    if not isinstance(model, NemotronHForCausalLM):
        raise ParallelConfigError(
            f"mesh.cp={cp}: context parallel runs on nemotron_recipe's NemotronHForCausalLM, not on "
            f"{type(model).__name__}. Fix: load the checkpoint into the native model (model.pretrained=<dir>)."
        )
    cfg = model.config
    if "M" in cfg.pattern:
        try:
            context_parallel.check_mamba(cfg.mamba_num_heads // tp, cfg.n_groups // tp, cp)
        except ValueError as err:
            raise ParallelConfigError(str(err)) from None


# ------------------------------------------------------------------------------- the steps
def apply_tensor_parallel(model, blocks, tp_mesh, plan, sequence_parallel) -> None:
    if isinstance(plan, dict):
        parallelize_module(model, tp_mesh, plan)
        return
    native = isinstance(model, NemotronHForCausalLM)
    for block in blocks:
        kind = _block_kind(block)
        styles = block_plan(kind, native=native, sequence_parallel=sequence_parallel, plan=plan)
        if styles:
            parallelize_module(block, tp_mesh, styles)
    parallelize_module(model, tp_mesh, model_plan(model, sequence_parallel=sequence_parallel, plan=plan))
    logger.info(
        "tensor parallel: plan %r over %d ranks%s", plan, tp_mesh.size(), ", sequence parallel" if sequence_parallel
        else ""
    )


def apply_context_parallel(blocks, cp_mesh: DeviceMesh) -> None:
    """Every Mamba and attention mixer runs its sequence mixing across the cp group."""
    cp = context_parallel.ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    for block in blocks:
        if _block_kind(block) in ("mamba", "attention"):
            block.mixer.context_parallel = cp
    logger.info("context parallel over %d ranks", cp.size)


def apply_activation_checkpointing(container, blocks, mode: str, every: int) -> list[nn.Module]:
    """Wrap blocks for non-reentrant recomputation; returns the (possibly wrapped) blocks."""
    wrapped = []
    for i, block in enumerate(blocks):
        kind = _block_kind(block)
        if mode == "full" or (mode == "blocks" and kind in ("mlp", "mamba")) or (mode == "selective" and i % every == 0):
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            _set_block(container, i, block)
        wrapped.append(block)
    return wrapped


def _fp32_units(block: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(modules to shard as their own low-precision units, modules that must compute in fp32).

    FSDP casts a unit's parameters to the policy's dtype, so parameters that must stay fp32 need a
    unit of their own. `A_log`, `D` and `dt_bias` belong to the Mamba mixer itself, so the mixer's
    projections and gated norm become separate units and the mixer unit keeps the fp32 rest (the
    conv weights, read directly rather than through a module call, ride along in fp32). The MoE
    router is a module of its own.
    """
    mixer = block.mixer
    kind = _block_kind(block)
    if kind == "mamba":
        return [mixer.in_proj, mixer.norm, mixer.out_proj], [mixer]
    if kind == "moe":
        return [], [mixer.gate]
    return [], []


def apply_fsdp(
    model, container, blocks, inner_blocks, dp_mesh, mp_policy, offload_policy, reshard_after_forward
) -> None:
    low_precision = mp_policy is not None and mp_policy.param_dtype not in (None, torch.float32)
    fp32_policy = MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    common = dict(mesh=dp_mesh, offload_policy=offload_policy or OffloadPolicy())
    reshard = True if reshard_after_forward is None else reshard_after_forward
    for block, inner in zip(blocks, inner_blocks):
        if low_precision:
            own, fp32 = _fp32_units(inner)
            for module in own:
                fully_shard(module, mp_policy=mp_policy, reshard_after_forward=reshard, **common)
            for module in fp32:
                fully_shard(module, mp_policy=fp32_policy, reshard_after_forward=reshard, **common)
        fully_shard(block, mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard, **common)
    embed, _, head = _embedding_and_head(model)
    for path in (embed, head):
        fully_shard(model.get_submodule(path), mp_policy=mp_policy or MixedPrecisionPolicy(),
                    reshard_after_forward=reshard, **common)
    # The root's parameters (the final norm) are needed again at once by the head: keep them gathered.
    fully_shard(model, mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=False, **common)
    # The loss is normalised by the global token count, so data-parallel gradients are summed, not
    # averaged. A plain SUM (not NCCL's pre-multiplied sum) also runs on gloo.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class NemotronHModelParallelizer(ModelParallelizer):
    """Apply Nemotron-H's specialized TP, CP, AC, and FSDP policy."""

    def _apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool = False,
        tp_shard_plan: dict[str, ParallelStyle] | str | None = None,
        dp_replicate_mesh_name: str = "dp_replicate",
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        tp_mesh_name: str = "tp",
        reshard_after_forward: bool | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        **kwargs,
    ) -> nn.Module:
        """Apply every requested parallelism to a Nemotron-H model."""
        names = device_mesh.mesh_dim_names or ()
        tp = device_mesh[tp_mesh_name].size() if tp_mesh_name in names else 1
        cp = device_mesh["cp"].size() if "cp" in names else 1
        ac_mode = kwargs.pop("ac_mode", "blocks" if activation_checkpointing else "none")
        ac_every = kwargs.pop("ac_every", 2)
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")

        # Every check runs before anything is sharded, identically on every rank.
        plan = check_tensor_parallel(model, tp, tp_shard_plan, sequence_parallel)
        if sequence_parallel and tp == 1:
            raise ParallelConfigError(
                "mesh.sequence_parallel=true needs mesh.tp>1: the sequence is sharded across tensor-parallel ranks."
            )
        if cp > 1:
            check_context_parallel(model, tp, cp)
        container, blocks = _decoder_blocks(model)

        if tp > 1:
            apply_tensor_parallel(model, blocks, device_mesh[tp_mesh_name], plan, sequence_parallel)
        if cp > 1:
            apply_context_parallel(blocks, device_mesh["cp"])
        inner_blocks = list(blocks)
        if ac_mode != "none":
            blocks = apply_activation_checkpointing(container, blocks, ac_mode, ac_every)
        if reapply_trainability is not None:
            reapply_trainability(model)

        if dp_replicate_mesh_name in names and device_mesh[dp_replicate_mesh_name].size() > 1:
            dp_mesh = device_mesh[dp_replicate_mesh_name, dp_shard_cp_mesh_name]  # HSDP
        else:
            dp_mesh = device_mesh[dp_shard_cp_mesh_name]
        apply_fsdp(model, container, blocks, inner_blocks, dp_mesh, mp_policy, offload_policy, reshard_after_forward)
        return model


PARALLELIZER = NemotronHModelParallelizer()
