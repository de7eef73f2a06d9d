"""Model-owned distributed parallelization for Nemotron-H and Nemotron-V3.

`PARALLELIZER._apply` (the published signature) works on any Nemotron-H a caller brings: this
package's model, transformers' `NemotronHForCausalLM` and the remote-code `backbone.*` layout, over a
device mesh the caller built. Parallelisms are applied in a fixed order, one small function each:
    tensor + sequence parallel  ->  expert parallel  ->  context parallel  ->  activation checkpointing
    ->  compile  ->  FSDP2

Context parallel gives each cp rank a load-balanced part of every sequence; Mamba2 and attention
mixers exchange what they need across the cp group (models/nemotron_v3/context_parallel.py), the
other blocks are per-token and need nothing. FSDP shards over the flattened (dp_shard, cp) dim.

Tensor-parallel plans are data: dicts of `ParallelStyle` per block kind. The default plan shards every
block kind of the native model:
- MLP: `up_proj` colwise, `down_proj` rowwise;
- attention: q/k/v colwise and `o_proj` rowwise, so each rank holds heads/tp query and kv heads; with
  more tp ranks than kv heads, each rank keeps the kv head its query heads use (`KeyValueHeadsParallel`);
- Mamba2: by groups (and so heads). The native `in_proj` and `conv1d` are group-major, so a plain
  row split gives each rank its own z, x, B, C and dt slices; `A_log`/`D`/`dt_bias` and the gated
  norm weight are split the same way, and `out_proj` is rowwise. Groups never straddle ranks, so
  the gated norm needs no collective;
- MoE blocks stay whole on every tp rank. They are per-token, so with sequence parallel each tp rank
  routes its own sequence shard (no gather, 1/tp of the expert work), and their FSDP units take the tp
  ranks as replicas, so the weights' gradients add up over them; expert parallel (a `moe_mesh` with an
  `ep` dim) splits their routed experts by expert, and rows travel to their experts' ranks
  (distributed/expert_parallel.py); each rank's experts are FSDP units of their own over the
  `ep_shard` ranks;
- the embedding is vocab-sharded (rowwise) and `lm_head` colwise with vocab-sharded logits, so the
  loss runs on vocab shards without gathering the full vocabulary;
- LatentMoE's projections into and out of the latent space belong to the MoE block, replicated with it;
- multi-token-prediction layers (`mtp.layers`) are blocks like the others and take their kind's plan;
  their fusion (`enorm`, `hnorm`, `eh_proj`) and `final_layernorm` are per-token and replicated, with
  sequence parallel on the residual stream's sequence shard like the blocks' norms. MTP layers run
  context parallel, activation checkpointing and FSDP units exactly as the decoder blocks do.
With sequence parallel the residual stream and the norms hold a sequence shard; each mixer
gathers the sequence before its input projections and reduce-scatters after its output one.

The reference plan `"mlp"` shards only the MLP blocks and `lm_head`, which is all the other stacks
offer. `transformers`' NemotronH and the remote-code model get the reference plan plus attention
heads (their fused Mamba2 `in_proj` cannot be split by rows), no sequence parallel, and gathered
logits, so that their own `labels=` loss works unchanged.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nemotron_recipe.distributed.activation_checkpoint import is_checkpointed
from nemotron_recipe.distributed.activation_checkpoint import wrap as checkpoint_wrap
from nemotron_recipe.distributed.context_parallel import ContextParallel
from nemotron_recipe.distributed.expert_parallel import shard_experts
from nemotron_recipe.distributed.fsdp import set_prefetch, shard_by_dtype
from nemotron_recipe.distributed.mesh import MeshError, data_parallel_mesh, replicated_over, submesh
from nemotron_recipe.distributed.parallelizer import ModelParallelizer
from nemotron_recipe.distributed.plan import (
    ActivationCheckpointing,
    ParallelConfigError,
    check_experts_split,
    check_sequence_parallel,
)
from nemotron_recipe.distributed.tensor_parallel import (
    Compose,
    KeyValueHeadsParallel,
    RowwiseParallelOwnOutput,
    ShardParameters,
)

from . import nf4
from .context_parallel import check_mamba
from .kernels import SELECTIVE_AC_SAVED_OPS
from .lora import adapter_styles, shard_adapters
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


def _no_cache_in_training(model: nn.Module, container: nn.Module) -> None:
    """transformers' decoders build a generation cache whenever `use_cache` is on, in training too. A
    checkpointed Mamba block then recomputes against a cache its first run already advanced, and its
    conv sees a longer input than before. Training needs no cache: turn it off for training forwards."""
    decoder = next(m for m in model.modules() if container in m.children())
    if "use_cache" not in inspect.signature(decoder.forward).parameters:
        return

    def no_cache(module: nn.Module, args: tuple, kwargs: dict):
        if module.training:
            return args, {**kwargs, "use_cache": False}
        return None

    decoder.register_forward_pre_hook(no_cache, with_kwargs=True)


def _mtp_layers(model: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """The native model's multi-token-prediction layers (container and list); none for other models."""
    mtp = getattr(model, "mtp", None) if isinstance(model, NemotronHForCausalLM) else None
    return (None, []) if mtp is None else (mtp.layers, list(mtp.layers))


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


def _held(model: nn.Module, path: str) -> nn.Module | None:
    """The module at `path`, or None where the model does not hold it: a pipeline stage keeps the
    embedding (first stage) or the final norm and head (last stage) only where they run."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


# ------------------------------------------------------------------------------- plans
def _gather_sequence() -> ParallelStyle:
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


def block_plan(
    kind: str, *, native: bool, sequence_parallel: bool, plan: str, key_value: ParallelStyle | None = None
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one block, relative to the block. `key_value`: the style of the
    k/v projections (colwise unless tp exceeds the key/value heads)."""
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
            "mixer.k_proj": key_value or ColwiseParallel(),
            "mixer.v_proj": key_value or ColwiseParallel(),
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
    elif kind == "moe":
        # Per-token: with sequence parallel each tp rank routes its own part of the sequence (the
        # weights' gradients then add up over the tp ranks: `apply_moe_fsdp`).
        if sp:
            styles["mixer"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                input_kwarg_layouts={"token_mask": Replicate()}, desired_input_kwarg_layouts={"token_mask": Shard(1)},
                use_local_output=True)
        return styles
    elif kind in ("mamba", "attention"):
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


def mtp_fusion_plan(layer: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The MTP-only modules of an MTP layer: per-token and replicated over tp. With sequence parallel they
    take the sequence shard (their weight gradients then add up over the tp ranks); the fusion hands the
    block a plain shard, as the residual stream is between blocks."""
    if not sequence_parallel:
        return {}
    styles: dict[str, ParallelStyle] = {}
    if getattr(layer, "fuses", False):
        styles |= {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
                   "eh_proj": SequenceParallel(use_local_output=True)}
    if getattr(layer, "has_final_norm", False):
        styles["final_layernorm"] = SequenceParallel()
    return styles


def model_plan(model: nn.Module, *, native: bool, sequence_parallel: bool, plan: str) -> dict[str, ParallelStyle]:
    """Embedding, final norm and head, relative to the whole model.

    The native model's head hands out vocab-sharded logits, which its loss (and the recipe's) takes as
    they are; any other model gets them gathered, since its own loss expects plain logits."""
    embed, norm_f, head = _embedding_and_head(model)
    sp = sequence_parallel
    styles: dict[str, ParallelStyle] = {}
    if plan == "default":
        # Its own output tensor: the embedding is an FSDP unit of its own, and under SP its output is a view.
        styles[embed] = RowwiseParallelOwnOutput(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if sp:
        styles[norm_f] = SequenceParallel()
    head_input = Shard(1) if sp else Replicate()
    if native:
        styles[head] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False)
    else:
        styles[head] = ColwiseParallel(input_layouts=head_input, output_layouts=Replicate())
    return {path: style for path, style in styles.items() if _held(model, path) is not None}


# ------------------------------------------------------------------------------- validation
def _config_value(cfg, *names: str) -> int:
    """The first of `names` the config sets (native and transformers' configs name some fields apart)."""
    return next(getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None)


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
    if tp > 1:
        _check_tp_divides(model, tp, name, native)
    return name


def _check_tp_divides(model: nn.Module, tp: int, plan: str, native: bool) -> None:
    cfg = model.config
    kinds = {_block_kind(b) for b in _decoder_blocks(model)[1] + _mtp_layers(model)[1]}

    def need(field: str, value: int, what: str) -> None:
        if value % tp:
            raise ParallelConfigError(
                f"mesh.tp={tp} does not divide model.{field}={value} ({what}). "
                f"Fix: choose mesh.tp among the divisors of {value}."
            )

    need("vocab_size", _config_value(cfg, "vocab_size"), "the vocab-sharded lm_head")
    if "mlp" in kinds:
        need("intermediate_size", _config_value(cfg, "intermediate_size"), "MLP columns")
    if plan == "default" and "attention" in kinds:
        need("num_attention_heads", _config_value(cfg, "num_attention_heads"), "query heads")
        kv = _config_value(cfg, "num_key_value_heads")
        if kv % tp and tp % kv:
            raise ParallelConfigError(
                f"mesh.tp={tp} does not divide model.num_key_value_heads={kv}, nor is it a multiple of it "
                "(key/value heads are split over tp ranks, or each is replicated on tp/heads ranks). "
                f"Fix: choose mesh.tp among the divisors or multiples of {kv}."
            )
    if plan == "default" and native and "mamba" in kinds:
        need("n_groups", _config_value(cfg, "n_groups", "mamba_n_groups"),
             "Mamba2 groups: a group never straddles ranks")


def check_context_parallel(model: nn.Module, tp: int, cp: int) -> None:
    if not isinstance(model, NemotronHForCausalLM):
        raise ParallelConfigError(
            f"mesh.cp={cp}: context parallel runs on nemotron_recipe's NemotronHForCausalLM, not on "
            f"{type(model).__name__}. Fix: load the checkpoint into the native model (model.pretrained=<dir>)."
        )
    cfg = model.config
    if "M" in cfg.pattern:
        try:
            check_mamba(cfg.mamba_num_heads // tp, cfg.n_groups // tp, cp)
        except ValueError as err:
            raise ParallelConfigError(str(err)) from None


# ------------------------------------------------------------------------------- the steps
def apply_tensor_parallel(model, blocks, tp_mesh, plan, sequence_parallel) -> None:
    if isinstance(plan, dict):
        parallelize_module(model, tp_mesh, plan)
        return
    native = isinstance(model, NemotronHForCausalLM)
    tp, key_value = tp_mesh.size(), None
    kv_heads = _config_value(model.config, "num_key_value_heads")
    if tp > kv_heads:
        key_value = KeyValueHeadsParallel(kv_heads, _config_value(model.config, "head_dim", "attention_head_dim"))
    for block in blocks:
        kind = _block_kind(block)
        styles = block_plan(kind, native=native, sequence_parallel=sequence_parallel, plan=plan, key_value=key_value)
        styles |= mtp_fusion_plan(block, sequence_parallel=sequence_parallel)
        styles = adapter_styles(block, styles)  # LoRA adapters sharded like their base projections
        if styles:
            parallelize_module(block, tp_mesh, styles)
        if kind == "attention" and plan == "default" and hasattr(block.mixer, "num_key_value_groups"):
            # transformers' attention repeats each key/value head this many times to meet its query heads.
            heads = _config_value(model.config, "num_attention_heads")
            block.mixer.num_key_value_groups = (heads // tp) // max(kv_heads // tp, 1)
    model_styles = model_plan(model, native=native, sequence_parallel=sequence_parallel, plan=plan)
    parallelize_module(model, tp_mesh, adapter_styles(model, model_styles))  # an adapted lm_head
    logger.info(
        "tensor parallel: plan %r over %d ranks%s%s", plan, tp, ", sequence parallel" if sequence_parallel else "",
        f", each of {kv_heads} key/value heads on {tp // kv_heads} ranks" if key_value else "",
    )


def apply_context_parallel(blocks, cp_mesh: DeviceMesh) -> None:
    """Every Mamba and attention mixer runs its sequence mixing across the cp group."""
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    for block in blocks:
        if _block_kind(block) in ("mamba", "attention"):
            block.mixer.context_parallel = cp
    logger.info("context parallel over %d ranks", cp.size)


def apply_moe_sequence_group(blocks, cp_mesh: DeviceMesh | None, moe_tp: DeviceMesh | None) -> None:
    """The MoE blocks' balance loss counts whole sequences: tell them which ranks hold the other parts
    of theirs (the cp ranks, and the tp ranks where sequence parallel hands each its shard)."""
    meshes = [m for m in (cp_mesh, moe_tp) if m is not None and m.size() > 1]
    if not meshes:
        return
    mesh = meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)._flatten("moe_sequence")
    for block in blocks:
        if _block_kind(block) == "moe" and hasattr(block.mixer, "sequence_group"):
            block.mixer.sequence_group = mesh.get_group()


@dataclass(frozen=True)
class ExpertMeshes:
    """Expert parallel's meshes: `ep` splits each MoE block's routed experts, `dp` is what FSDP shards
    each rank's experts over (the data-parallel ranks left once ep is carved out)."""

    ep: DeviceMesh
    dp: DeviceMesh


def expert_meshes(moe_mesh: DeviceMesh | None, ep_name: str, shard_names: tuple[str, ...],
                  replicate_name: str) -> ExpertMeshes | None:
    """The expert meshes in a caller's `moe_mesh` (NeMo AutoModel's convention: dims `ep_axis_name` and
    `ep_shard_axis_names`, and `dp_replicate` for HSDP); None without expert parallel."""
    if moe_mesh is None or ep_name not in (moe_mesh.mesh_dim_names or ()) or moe_mesh[ep_name].size() == 1:
        return None
    names = moe_mesh.mesh_dim_names
    missing = [n for n in shard_names if n not in names]
    if missing:
        raise ParallelConfigError(f"moe_mesh with dims {names}: no {missing} for the experts' FSDP. Fix: pass "
                                  "ep_shard_axis_names=<the dims that shard each expert>, e.g. ('ep_shard',).")
    dp_names = ((replicate_name,) if replicate_name in names and moe_mesh[replicate_name].size() > 1 else ()) \
        + tuple(shard_names)
    return ExpertMeshes(ep=moe_mesh[ep_name], dp=moe_mesh[dp_names])


def _moe_experts(blocks: list[nn.Module]) -> list[nn.Module]:
    return [block.mixer.experts for block in blocks if _block_kind(block) == "moe"]


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Expert parallel needs the native model's routed experts, in a number `ep` divides."""
    _, blocks = _decoder_blocks(model)
    for module in _moe_experts(blocks + _mtp_layers(model)[1]):
        if not hasattr(module, "ep_group"):
            raise ParallelConfigError(
                f"expert parallel (ep={ep}) needs the native model's routed experts, not {type(module).__name__}. "
                "Fix: build the model with nemotron_recipe, or run without ep.")
        if problem := check_experts_split(ep, module.num_experts, has_moe=True):
            raise ParallelConfigError(problem)


def apply_expert_parallel(blocks: list[nn.Module], ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Splits each MoE block's routed experts by expert over `ep_mesh` (each rank holds n/ep whole
    experts, adapters included) and has them exchange rows over its group; returns the experts modules."""
    experts = _moe_experts(blocks)
    for module in experts:
        shard_experts(module, ep_mesh, module.num_experts)
        nf4.shard_experts(module, ep_mesh.get_local_rank(), ep_mesh.size())  # a 4-bit base's stacked weights
        module.ep_group = ep_mesh.get_group()
    return experts


def apply_activation_checkpointing(container, blocks, mode: str, every: int) -> list[nn.Module]:
    """Wrap blocks for non-reentrant recomputation (modes: distributed/activation_checkpoint.py);
    returns the (possibly wrapped) blocks. `blocks` picks the Mamba and MLP blocks; `selective` keeps
    the Mamba2 scan's outputs besides the matmuls and attention. `every_nth` counts blocks by their index
    in the full model: a pipeline stage's blocks sit in a dict keyed by that index."""
    wrapped = []
    indices = sorted(map(int, container.keys())) if isinstance(container, nn.ModuleDict) else range(len(blocks))
    for i, (index, block) in enumerate(zip(indices, blocks)):
        if is_checkpointed(mode, index, every, model_choice=_block_kind(block) in ("mlp", "mamba")):
            block = checkpoint_wrap(block, mode, model_ops=SELECTIVE_AC_SAVED_OPS)
            _set_block(container, i, block)
        wrapped.append(block)
    return wrapped


def apply_compile(blocks: list[nn.Module]) -> None:
    """`torch.compile` each block in place (inside its checkpoint wrapper and, later, its FSDP unit)."""
    for block in blocks:
        block.compile()
    logger.info("compiled %d blocks", len(blocks))


# Parameters that compute in fp32 under a low-precision policy: the SSM decay, skip and step terms,
# the conv the scan's inputs pass through (the mixers read its weight directly, so it must share
# their unit) and the MoE router, whose rounding would change which experts are picked.
FP32_PARAMS = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.conv1d.weight", "mixer.conv1d.bias",
               "mixer.gate.weight")


def _computes_in_fp32(model: nn.Module) -> Callable[[str], bool]:
    """The fp32 rule for names relative to a block, with the patterns a transformers model declares."""
    declared = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) + tuple(
        getattr(model, "_keep_in_fp32_modules", None) or ())

    def rule(name: str) -> bool:
        name = name.replace("_checkpoint_wrapped_module.", "")
        return name in FP32_PARAMS or any(pattern in name for pattern in declared)

    return rule


def apply_expert_fsdp(model, experts, expert_dp, data_parallel_size, mp_policy, offload_policy,
                      reshard_after_forward) -> None:
    """Each rank's experts become FSDP units of their own over the ranks that hold the same experts.
    Their rows came from every data-parallel rank, so under FSDP's averaging they divide by the whole
    data-parallel size, as every other unit does, not by their own mesh's."""
    reshard = True if reshard_after_forward is None else reshard_after_forward
    for module in experts:
        shard_by_dtype(module, mesh=expert_dp, mp_policy=mp_policy, offload_policy=offload_policy,
                       reshard_after_forward=reshard, keep_fp32=_computes_in_fp32(model))
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(float(data_parallel_size))


def apply_moe_fsdp(model, blocks, moe_dp, data_parallel_size, mp_policy, offload_policy,
                   reshard_after_forward) -> None:
    """Under sequence parallel each tp rank routes different tokens through its whole copy of a MoE
    block, so the block's mixer is an FSDP unit of its own over `moe_dp`, whose replicate dim holds the
    tp ranks: gradients add up over them and average over the data-parallel ranks as elsewhere."""
    reshard = True if reshard_after_forward is None else reshard_after_forward
    options = dict(mesh=moe_dp, mp_policy=mp_policy, offload_policy=offload_policy, reshard_after_forward=reshard)
    for block in blocks:
        if _block_kind(block) != "moe":
            continue
        mixer = block.mixer
        shard_adapters(mixer, **options | dict(mp_policy=mp_policy or MixedPrecisionPolicy(),
                                                offload_policy=offload_policy or OffloadPolicy()))
        shard_by_dtype(mixer, keep_fp32=lambda name: _computes_in_fp32(model)("mixer." + name), **options)
        for unit in mixer.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(float(data_parallel_size))


def apply_fsdp(model, blocks, dp_mesh, mp_policy, offload_policy, reshard_after_forward) -> None:
    """FSDP units: each block (split by dtype where needed), the embedding, the head, then the root."""
    reshard = True if reshard_after_forward is None else reshard_after_forward
    common = dict(mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                  keep_fp32=_computes_in_fp32(model))
    for block in blocks:
        shard_adapters(block, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                       offload_policy=offload_policy or OffloadPolicy(), reshard_after_forward=reshard)
        shard_by_dtype(block, reshard_after_forward=reshard, **common)
    embed_path, _, head_path = _embedding_and_head(model)
    embedding, head = _held(model, embed_path), _held(model, head_path)
    if embedding is not None and head is not None and head.weight is embedding.weight:
        logger.info("tied embedding and head: one unit, the root's")
    else:
        for module in (m for m in (embedding, head) if m is not None):  # adapters there when target_modules names them
            shard_adapters(module, mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                           offload_policy=offload_policy or OffloadPolicy(), reshard_after_forward=reshard)
        if embedding is not None:
            shard_by_dtype(embedding, reshard_after_forward=reshard, **common)
        if head is not None:
            # Backward needs the head's weight right after forward: keep it gathered unless told otherwise.
            shard_by_dtype(head, reshard_after_forward=bool(reshard_after_forward), **common)
    # The root's parameters (the final norm) are needed again at once by the head: keep them gathered.
    shard_by_dtype(model, reshard_after_forward=False, **common)


# Arguments already named in the log as ignored (once per process).
_IGNORED_LOGGED: set[str] = set()
# Scopes (AutoModel's names) that include a language model's decoder blocks.
_LANGUAGE_SCOPES = {"all", "language"}


@dataclass(frozen=True)
class CallerOptions:
    """Keyword arguments NeMo AutoModel's callers pass to `_apply` that mean something here."""

    compile: bool = False
    prefetch: bool = False
    forward_prefetch_depth: int = 1
    backward_prefetch_depth: int = 1
    ac_scope: tuple[str, ...] = ("all",)
    moe_mesh: DeviceMesh | None = None
    ep_axis_name: str = "ep"
    ep_shard_axis_names: tuple[str, ...] = ("ep_shard",)

    _NAMES = {
        "enable_compile": "compile",
        "enable_fsdp2_prefetch": "prefetch",
        "fsdp2_forward_prefetch_depth": "forward_prefetch_depth",
        "fsdp2_backward_prefetch_depth": "backward_prefetch_depth",
        "activation_checkpointing_scope": "ac_scope",
        "moe_mesh": "moe_mesh",
        "ep_axis_name": "ep_axis_name",
        "ep_shard_axis_names": "ep_shard_axis_names",
    }

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> CallerOptions:
        """Honours the arguments it knows; every other one is accepted, so that any caller of the base
        class can call `_apply`, and named once in the log as ignored."""
        known = {cls._NAMES[k]: v for k, v in kwargs.items() if k in cls._NAMES and v is not None}
        for name in sorted(set(kwargs) - set(cls._NAMES) - _IGNORED_LOGGED):
            _IGNORED_LOGGED.add(name)
            logger.warning("parallelizer: argument %s=%r has no effect on Nemotron-H; ignored", name, kwargs[name])
        for name in ("ac_scope", "ep_shard_axis_names"):
            if isinstance(known.get(name), str):
                known[name] = (known[name],)
            elif name in known:
                known[name] = tuple(known[name])
        return cls(**known)


def activation_checkpointing_spec(value, scope: tuple[str, ...]) -> ActivationCheckpointing:
    """`activation_checkpointing` as callers pass it: a bool (True: the model's choice of blocks), a
    mode name ("full", "selective", ...) or an `ActivationCheckpointing`."""
    if isinstance(value, ActivationCheckpointing):
        spec = value
    elif isinstance(value, bool) or value is None:
        spec = ActivationCheckpointing("blocks" if value else "none")
    else:
        try:
            spec = ActivationCheckpointing(value)
        except ParallelConfigError as err:
            raise ParallelConfigError(f"activation_checkpointing={value!r}: {err}") from None
    if spec.mode != "none" and not _LANGUAGE_SCOPES & {s.lower() for s in scope}:
        logger.info("activation checkpointing scope %s holds no decoder blocks: none checkpointed", list(scope))
        return ActivationCheckpointing("none")
    return spec


def _checked_layout(model, device_mesh, tp, cp, tp_shard_plan, sequence_parallel, options, names):
    """Every check `_apply` makes, before anything is sharded and identically on every rank; returns
    the tensor-parallel plan, the data-parallel mesh and the expert meshes (or None)."""
    replicate_name, shard_name, tp_name = names
    plan = check_tensor_parallel(model, tp, tp_shard_plan, sequence_parallel)
    if problem := check_sequence_parallel(sequence_parallel, tp):
        raise ParallelConfigError(problem)
    if cp > 1:
        check_context_parallel(model, tp, cp)
    try:
        dp_mesh = data_parallel_mesh(device_mesh, replicate_name, shard_name, model_parallel=(tp_name, "cp"))
    except MeshError as err:
        raise ParallelConfigError(str(err)) from None
    ep = expert_meshes(options.moe_mesh, options.ep_axis_name, options.ep_shard_axis_names, replicate_name)
    if ep:
        check_expert_parallel(model, ep.ep.size())
    return plan, dp_mesh, ep


def _moe_token_split(blocks, tp_mesh, sequence_parallel, options, ep, tp_name) -> DeviceMesh | None:
    """The tp mesh over which MoE blocks see different tokens (sequence parallel), or None. Under expert
    parallel it is the `moe_mesh`'s own tp dim, since the experts' FSDP mesh is cut from that mesh."""
    if not sequence_parallel or tp_mesh is None or tp_mesh.size() == 1:
        return None
    if not any(_block_kind(block) == "moe" for block in blocks):
        return None
    if ep is None:
        return tp_mesh
    names = options.moe_mesh.mesh_dim_names
    if tp_name not in names:
        raise ParallelConfigError(
            f"moe_mesh with dims {names} and tp={tp_mesh.size()} with sequence parallel: the MoE blocks route "
            f"each tp rank's sequence shard, so the experts' gradients must add up over the tp ranks, and "
            f"moe_mesh has no {tp_name!r} dim to do it over. Fix: give moe_mesh a {tp_name!r} dim (innermost).")
    return options.moe_mesh[tp_name]


def _tokens_split(fsdp_mesh: DeviceMesh, moe_tp: DeviceMesh | None) -> DeviceMesh:
    return fsdp_mesh if moe_tp is None else replicated_over(fsdp_mesh, moe_tp, "dp_replicate_tp")


def _checkpointed(ac, container: nn.Module, blocks: list, mtp_container: nn.Module | None, mtp_blocks: list) -> list:
    """The decoder's blocks then the MTP layers', each stack checkpointed as `ac` says (every_nth counts
    within its own stack)."""
    if ac.mode == "none":
        return blocks + mtp_blocks
    blocks = apply_activation_checkpointing(container, blocks, ac.mode, ac.every)
    if mtp_blocks:
        mtp_blocks = apply_activation_checkpointing(mtp_container, mtp_blocks, ac.mode, ac.every)
    return blocks + mtp_blocks


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
        """Apply every requested parallelism to a Nemotron-H model.

        Order: tensor (+ sequence) parallel, expert parallel, context parallel, activation checkpointing,
        compile, FSDP. Expert parallel takes NeMo AutoModel's keywords: `moe_mesh` (dims `ep_axis_name`,
        `ep_shard_axis_names`, optionally `dp_replicate`).
        FSDP averages gradients over the data-parallel ranks (its default); a caller whose loss is
        already normalised over the whole global batch calls `sum_data_parallel_gradients` after this.
        `activation_checkpointing` also takes a mode name or an `ActivationCheckpointing`; keyword
        arguments of NeMo AutoModel's callers are honoured where they apply (`CallerOptions`)."""
        options = CallerOptions.from_kwargs(kwargs)
        ac = activation_checkpointing_spec(activation_checkpointing, options.ac_scope)
        tp_mesh, cp_mesh = submesh(device_mesh, tp_mesh_name), submesh(device_mesh, "cp")
        tp, cp = (mesh.size() if mesh is not None else 1 for mesh in (tp_mesh, cp_mesh))
        plan, dp_mesh, ep = _checked_layout(model, device_mesh, tp, cp, tp_shard_plan, sequence_parallel, options,
                                            (dp_replicate_mesh_name, dp_shard_cp_mesh_name, tp_mesh_name))
        container, blocks = _decoder_blocks(model)
        mtp_container, mtp_blocks = _mtp_layers(model)
        inner_blocks = blocks + mtp_blocks
        moe_tp = _moe_token_split(inner_blocks, tp_mesh, sequence_parallel, options, ep, tp_mesh_name)

        if tp > 1:
            apply_tensor_parallel(model, inner_blocks, tp_mesh, plan, sequence_parallel)
        experts = apply_expert_parallel(inner_blocks, ep.ep) if ep else []
        if cp > 1:
            apply_context_parallel(inner_blocks, cp_mesh)
        apply_moe_sequence_group(inner_blocks, cp_mesh, tp_mesh if moe_tp is not None else None)
        _no_cache_in_training(model, container)
        blocks = _checkpointed(ac, container, blocks, mtp_container, mtp_blocks)
        if options.compile:
            apply_compile(inner_blocks)
        if reapply_trainability is not None:
            reapply_trainability(model)
        fsdp_args = (dp_mesh.size(), mp_policy, offload_policy, reshard_after_forward)
        if experts:
            apply_expert_fsdp(model, experts, _tokens_split(ep.dp, moe_tp), *fsdp_args)
        if moe_tp is not None:
            apply_moe_fsdp(model, blocks, _tokens_split(dp_mesh, moe_tp), *fsdp_args)
        apply_fsdp(model, blocks, dp_mesh, mp_policy, offload_policy, reshard_after_forward)
        if options.prefetch:
            set_prefetch(blocks, options.forward_prefetch_depth, options.backward_prefetch_depth)
        return model


PARALLELIZER = NemotronHModelParallelizer()
