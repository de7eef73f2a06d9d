"""LoRA adapters on every linear projection of every Nemotron-H block kind.

An adapted projection computes `W x + (alpha / r) * B A x` with the base `W` frozen and `A` [r, in],
`B` [out, r] trained in fp32. `B` starts at zero, so an adapted model starts as its base exactly.

- Linear projections (Mamba2 `in_proj`/`out_proj`, attention q/k/v/o, MLP and shared-expert up/down)
  become `LoRALinear`: the same `nn.Linear` (its `weight` keeps its name and its tensor-parallel
  style) with two children, `lora_A` and `lora_B`, named as PEFT names them.
- `lm_head` (only when a pattern names it) becomes `LoRALMHead`, a `LoRALinear` whose chunked loss
  reads the adapter too; the embedding (only when named) gets PEFT's embedding adapter, `A` [r, vocab]
  (zero at the start) and `B` [hidden, r], in an `EmbeddingLoRA` child.
- Routed experts, stored stacked ([E, out, in]), get per-expert adapters `A` [E, r, in] and `B`
  [E, out, r] in an `ExpertAdapters` child that the experts' grouped GEMM path calls: two more
  grouped GEMMs per projection, no loop over experts.

Under tensor parallel an adapter is sharded like its base: a colwise base gets `B` colwise and `A`
replicated, a rowwise base `A` rowwise and `B` replicated, so the adapter's output has the base's
layout and needs no collective of its own (`adapter_styles`).

Adapters are initialised after the model is parallelized and its base loaded (`init_adapters`): every
rank draws the full tensors from one seed and keeps its own slice, so any mesh trains the same
adapters. The name and layout conversions to a PEFT adapter of transformers' `NemotronHForCausalLM`
(`to_peft` / `from_peft`) live here too, beside the model's own checkpoint conversions.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from .checkpoint import mamba_in_proj_order
from .config import ModelConfigError, NemotronHConfig
from .kernels import linear_cross_entropy_sum
from .model import Experts, LMHead, NemotronHForCausalLM, expert_matmul, local
from . import fp8_base, nf4
from .nf4 import nf4_bytes, quantize

# Every linear projection of every block kind; routed experts (`experts.up_proj`) and LatentMoE's
# projections to and from the experts' width included. Each pattern names the projections of some
# block kinds, and a model without those kinds has none: of the defaults only one need match.
DEFAULT_TARGETS = ("*.in_proj", "*.out_proj", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.up_proj",
                   "*.down_proj", "*.fc1_latent_proj", "*.fc2_latent_proj")
# Path components that mark a parameter as an adapter's.
ADAPTER_PARTS = ("lora_A", "lora_B", "lora")
# PEFT's names of an embedding's adapter factors (parameters, not modules: no `.weight`).
EMBEDDING_FACTORS = ("lora_embedding_A", "lora_embedding_B")
_EXPERT_PROJS = ("up_proj", "down_proj")


class LoRAError(ModelConfigError):
    """LoRA settings or an adapter that do not fit the model; names the field or file and a fix."""


@dataclass(frozen=True)
class LoRASpec:
    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAError(f"peft.rank={self.rank!r}: must be a positive integer. Fix: e.g. peft.rank=8.")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"peft.dropout={self.dropout!r}: must lie in [0, 1). Fix: e.g. peft.dropout=0.0.")
        if not self.target_modules:
            raise LoRAError("peft.target_modules is empty: nothing would be trained. Fix: name at least one pattern.")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` belongs to an adapter (wrapper prefixes do not matter)."""
    return any(part in ADAPTER_PARTS for part in name.split("."))


# ------------------------------------------------------------------------------- modules
class LoRALinear(nn.Linear):
    """An `nn.Linear` carrying a low-rank update; made by `adapt_linear`, never built directly."""

    scaling: float
    adapter_off = False  # set by `adapters_disabled`: the base alone computes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if nf4.is_nf4(self.weight):
            out = nf4.linear(x, self.weight, self.bias, getattr(self, "nf4_tp", None))
        elif fp8_base.is_kept(self, "weight"):
            out = fp8_base.linear(x, self.weight, fp8_base.scale_of(self, "weight"), self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return self.with_adapter(x, out)

    def with_adapter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out`, the base projection of `x`, plus the adapter's update (decoding computes the base its own way)."""
        if self.adapter_off:
            return out
        low = self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))
        # Scaled at rank r, not at the output's width: one multiply of [tokens, r] per projection.
        return out + self.lora_B(low * self.scaling).to(out.dtype)


class LoRALMHead(LoRALinear, LMHead):
    """`lm_head` with an adapter. Its chunked loss runs on `[hidden, scaling * A h] @ [W, B].T`: one
    GEMM per chunk as without the adapter, so the [tokens, vocab] logits still never exist at once."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, chunk_size: int = 0):
        if self.adapter_off:
            return LMHead.forward(self, hidden, targets, chunk_size)
        if targets is None or not chunk_size or isinstance(self.weight, DTensor) or isinstance(hidden, DTensor):
            return LoRALinear.forward(self, hidden)
        low = self.lora_A(self.lora_dropout(hidden.to(self.lora_A.weight.dtype))) * self.scaling
        weight = torch.cat([self.weight, self.lora_B.weight.to(self.weight.dtype)], dim=1)
        return linear_cross_entropy_sum(torch.cat([hidden, low.to(hidden.dtype)], dim=-1), weight, targets,
                                        chunk_size)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapter of `model` is switched off: the frozen base alone computes
    (DPO's reference=base), with no second copy of any weight."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAEmbedding, ExpertLoRA))]
    for m in adapted:
        m.adapter_off = True
    try:
        yield
    finally:
        for m in adapted:
            m.adapter_off = False


def adapt_linear(linear: nn.Linear, spec: LoRASpec) -> LoRALinear:
    """Gives `linear` (in place) fp32 adapters, left uninitialised: `init_adapters` fills them."""
    device = linear.weight.device
    linear.__class__ = LoRALMHead if isinstance(linear, LMHead) else LoRALinear
    linear.lora_A = nn.Linear(linear.in_features, spec.rank, bias=False, device=device, dtype=torch.float32)
    linear.lora_B = nn.Linear(spec.rank, linear.out_features, bias=False, device=device, dtype=torch.float32)
    linear.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    linear.scaling = spec.scaling
    return linear


def remove_linear_adapter(linear: LoRALinear) -> nn.Linear:
    for name in ("lora_A", "lora_B", "lora_dropout"):
        delattr(linear, name)
    linear.__class__ = LMHead if isinstance(linear, LoRALMHead) else nn.Linear
    return linear


class EmbeddingLoRA(nn.Module):
    """The embedding's adapter as PEFT makes it: the update of token t is `scaling * B A[:, t]`, with
    `A` [r, vocab] and `B` [hidden, r]. A child module, so that FSDP shards it apart from a bf16 base."""

    def __init__(self, embedding: nn.Embedding, spec: LoRASpec):
        super().__init__()
        device = embedding.weight.device
        self.lora_embedding_A = nn.Parameter(torch.empty(spec.rank, embedding.num_embeddings, device=device))
        self.lora_embedding_B = nn.Parameter(torch.empty(embedding.embedding_dim, spec.rank, device=device))
        self.scaling = spec.scaling

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        low = F.embedding(ids, self.lora_embedding_A.t()) * self.scaling  # [..., r]: a lookup, no GEMM
        return low @ self.lora_embedding_B.t()


class LoRAEmbedding(nn.Embedding):
    """An `nn.Embedding` with an `EmbeddingLoRA` child (`lora`); made by `adapt_embedding`."""

    adapter_off = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        if self.adapter_off:
            return out
        return out + self.lora(ids).to(out.dtype)


def adapt_embedding(embedding: nn.Embedding, spec: LoRASpec) -> LoRAEmbedding:
    embedding.__class__ = LoRAEmbedding
    embedding.lora = EmbeddingLoRA(embedding, spec)
    return embedding


class ExpertLoRA(nn.Module):
    """Per-expert adapters of one stacked routed-expert projection [E, out, in]: `A` [E, r, in] and
    `B` [E, out, r]. A module call of its own, so that FSDP gathers its parameters for it."""

    def __init__(self, weight: torch.Tensor, spec: LoRASpec):
        super().__init__()
        e, out, inp = weight.shape
        self.A = nn.Parameter(torch.empty(e, spec.rank, inp, device=weight.device))
        self.B = nn.Parameter(torch.empty(e, out, spec.rank, device=weight.device))
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()

    adapter_off = False

    def forward(self, out: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor | list[int]) -> torch.Tensor:
        """`out` plus the update for `rows` sorted by expert (`groups` as `expert_matmul` takes them)."""
        if self.adapter_off:
            return out
        # Under expert parallel A and B are split by expert like the experts' weights: this rank's part.
        a, b = local(self.A), local(self.B)
        if isinstance(groups, torch.Tensor):
            a, b = _aligned_rank(a, b)
        low = expert_matmul(self.dropout(rows.to(a.dtype)), a, groups)
        return out + (expert_matmul(low, b, groups) * self.scaling).to(out.dtype)


def _aligned_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B with the rank padded by zeros to 16 bytes, which the grouped GEMM needs of every row
    (a bf16 rank-4 adapter's are 8): the zeros add nothing, and no host sync is needed to fall back."""
    multiple = 16 // a.element_size()
    pad = -a.shape[1] % multiple
    if not pad:
        return a, b
    return F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))


class ExpertAdapters(nn.ModuleDict):
    """The routed experts' adapters, by projection name (`up_proj`, `down_proj`)."""

    def __init__(self, experts: Experts, projs: Iterable[str], spec: LoRASpec):
        super().__init__({proj: ExpertLoRA(getattr(experts, proj), spec) for proj in projs})


# ------------------------------------------------------------------------------- targets
def candidates(model: nn.Module) -> list[str]:
    """Every name a target pattern may match: linear projections (`lm_head` among them), the embedding
    and stacked routed-expert weights."""
    names = []
    for name, module in model.named_modules():
        if type(module) in (nn.Linear, LoRALinear, LMHead, LoRALMHead, nn.Embedding, LoRAEmbedding):
            names.append(name)
        elif isinstance(module, Experts):
            names += [f"{name}.{proj}" for proj in _EXPERT_PROJS]
    return names


def _generic(names: Iterable[str]) -> list[str]:
    """Names with their layer index replaced by `*`, each once: what an error message lists."""
    return sorted({re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n in names})


def match_targets(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The candidate names the glob `patterns` match. A pattern that matches nothing is an error naming
    what it could have matched, unless it is one of the default set (`DEFAULT_TARGETS`), which need only
    match something as a whole. The default patterns leave `lm_head` and the embedding out: they are
    adapted only when a pattern names them."""
    patterns = tuple(patterns)
    names = candidates(model)
    found: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and patterns != DEFAULT_TARGETS:
            raise LoRAError(
                f"peft.target_modules: pattern {pattern!r} matches no module. Fix: use glob patterns over "
                f"these names: {_generic(names)}."
            )
        found += [h for h in hits if h not in found]
    if not found:
        raise LoRAError(f"peft.target_modules: the default patterns match no module of this model. Fix: name "
                        f"glob patterns over these names: {_generic(names)}.")
    return [n for n in names if n in found]


def add_adapters(model: NemotronHForCausalLM, spec: LoRASpec) -> list[str]:
    """Adapts the projections `spec.target_modules` matches (in place); returns their names."""
    targets = match_targets(model, spec.target_modules)
    experts: dict[str, list[str]] = {}
    for name in targets:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(name) if leaf not in _EXPERT_PROJS or not _is_experts(model, owner) else None
        if module is None:
            experts.setdefault(owner, []).append(leaf)
        elif isinstance(module, nn.Embedding):
            adapt_embedding(module, spec)
        else:
            adapt_linear(module, spec)
    for owner, projs in experts.items():
        model.get_submodule(owner).lora = ExpertAdapters(model.get_submodule(owner), projs, spec)
    return targets


def _is_experts(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), Experts)
    except AttributeError:
        return False


def adapter_modules(module: nn.Module) -> list[nn.Module]:
    """The adapter modules below `module` (each `lora_A`, `lora_B`, routed experts' `ExpertLoRA`), which
    FSDP shards as one unit: as units of their own (fp32 beside a bf16 base), every small adapter
    would be gathered on its own."""
    found: list[nn.Module] = []

    def visit(name: str, m: nn.Module) -> None:
        if m is not module and isinstance(m, FSDPModule):
            return  # sharded already, on a mesh of its own (expert-parallel experts and their adapters)
        if isinstance(m, (ExpertLoRA, EmbeddingLoRA)) or (isinstance(m, nn.Linear) and name in ("lora_A", "lora_B")):
            found.append(m)
            return
        for child_name, child in m.named_children():
            visit(child_name, child)

    visit("", module)
    return found


def shard_adapters(module: nn.Module, **fsdp_options) -> None:
    """`fully_shard`s the adapters below `module` (a block) as one FSDP unit, if it has any.

    They keep fp32 storage and compute in the policy's dtype, as the rest of the step does (a bf16 policy
    gathers them in bf16; their gradients are reduced in the policy's `reduce_dtype`). On this CPU's
    oneDNN the rank-8 GEMMs of an h1024 block are 2-3x faster in bf16 than in fp32, and without the
    fp32 casts of each adapted projection's input and output a LoRA step takes 0.82-0.89x of full
    fine-tuning's time instead of 0.90-0.93x (benchmarks/RESULTS.md)."""
    if adapters := adapter_modules(module):
        fully_shard(adapters, **fsdp_options)


def freeze_base(model: nn.Module) -> None:
    """Only adapters train: the parallelizer's `reapply_trainability` hook, run before FSDP."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def nf4_targets(model: nn.Module) -> list[str]:
    """The weights an nf4 base stores in 4 bits: every base linear projection but lm_head, and the
    routed experts' stacked weights. Embeddings, norms, the conv, SSM terms and the router keep theirs."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, LMHead) and not is_adapter(name):
            names.append(f"{name}.weight")
        elif isinstance(module, Experts):
            names += [f"{name}.{proj}" for proj in _EXPERT_PROJS]
    return names


@torch.no_grad()
def quantize_base(model: nn.Module) -> tuple[int, int]:
    """Stores the frozen base projections of an unsharded `model` as NF4 (in place; nf4.py): quantized
    whole, so that every mesh shards the same bits. Returns (their bytes before, after)."""
    before = after = 0
    for name in nf4_targets(model):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        weight = getattr(module, leaf)
        q = quantize(weight, name)
        before += weight.numel() * weight.element_size()
        after += nf4_bytes(q)
        setattr(module, leaf, nn.Parameter(q, requires_grad=False))
        if isinstance(module, Experts):
            module.nf4_shapes = getattr(module, "nf4_shapes", {}) | {leaf: tuple(weight.shape)}
    return before, after


def adapter_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter parameters by their mesh-independent names (activation-checkpoint wrappers stripped)."""
    return {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in model.named_parameters()
            if is_adapter(name)}


# ------------------------------------------------------------------------------- init and values
def _local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the global tensor `full` that `param` (a DTensor shard or a plain tensor) holds."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


@torch.no_grad()
def set_full_values(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copies each full (unsharded) adapter tensor of `values` into this rank's shard of it."""
    params = adapter_parameters(model)
    elsewhere = set(getattr(model, "adapter_shapes", {})) - set(params)  # a pipeline's other stages hold these
    for name, full in values.items():
        if name in elsewhere:
            continue
        param = params[name]
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(_local_slice(param, full.to(local.dtype)))


def initial_values(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full adapter tensors as PEFT initialises them: `A` uniform in +-1/sqrt(in) (nn.Linear's default),
    `B` zero; an embedding's `A` zero and `B` standard normal. Drawn in name order from `seed` alone, the
    same on every rank and mesh. A model holding part of one (a pipeline's stages) names every adapter of
    the whole model in `adapter_shapes`: all are drawn, so each part gets what one process would."""
    gen = torch.Generator().manual_seed(seed)
    shapes = getattr(model, "adapter_shapes", None) or {n: p.shape for n, p in adapter_parameters(model).items()}
    values = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("lora_embedding_B"):
            values[name] = torch.empty(shape).normal_(generator=gen)
        elif name.endswith(("lora_A.weight", ".A")):
            bound = 1.0 / math.sqrt(shape[-1])
            values[name] = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            values[name] = torch.zeros(shape)
    return values


def init_adapters(model: nn.Module, seed: int) -> None:
    set_full_values(model, initial_values(model, seed))


# ------------------------------------------------------------------------------- tensor parallel
def _register_nf4(module: nn.Module) -> None:
    """An NF4 weight's part (`_place`) is held apart while a style's `distribute_module` runs, which would
    make every plain parameter it finds a replicated DTensor; registered back afterwards."""
    if (pending := module.__dict__.pop("_nf4_pending", None)) is not None:
        name, local = pending
        module.register_parameter(name, nn.Parameter(local, requires_grad=False))


class _AdaptedColwise(ColwiseParallel):
    """Colwise base: `B` sharded by output rows like the weight, `A` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # the adapters are placed with their base
            return
        _place(module, "weight", device_mesh, Shard(0), Shard(-1))
        _place(module, "bias", device_mesh, Shard(0))
        _place(module.lora_A, "weight", device_mesh, Replicate())
        _place(module.lora_B, "weight", device_mesh, Shard(0))

    def _apply(self, module, device_mesh):
        out = super()._apply(module, device_mesh)
        _register_nf4(module)
        return out


class _AdaptedRowwise(RowwiseParallel):
    """Rowwise base: `A` sharded by input columns like the weight, `B` replicated; the adapter's
    output is a partial sum like the base's, reduced with it."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:
            return
        _place(module, "weight", device_mesh, Shard(1), Partial())
        _place(module, "bias", device_mesh, Replicate())
        _place(module.lora_A, "weight", device_mesh, Shard(1))
        _place(module.lora_B, "weight", device_mesh, Replicate())

    def _apply(self, module, device_mesh):
        out = super()._apply(module, device_mesh)
        _register_nf4(module)
        return out


def _place(module: nn.Module, name: str, mesh, placement, output=None) -> None:
    """`module.name` as a DTensor of `placement`; an NF4 weight as this rank's NF4 part of it instead,
    whose GEMM hands on the `output` placement the DTensor weight's would (nf4.linear)."""
    param = getattr(module, name, None)
    if param is None:
        return
    if nf4.is_nf4(param):
        local = nf4.shard(param, placement.dim, mesh.get_local_rank(), mesh.size(), f"{type(module).__name__}.{name}")
        del module._parameters[name]
        module.__dict__["_nf4_pending"] = (name, local)
        module.nf4_tp = nf4.TensorParallelNF4(mesh, output)
        return
    dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


_ADAPTED_STYLES = {ColwiseParallel: _AdaptedColwise, RowwiseParallel: _AdaptedRowwise}


def adapter_styles(root: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`styles` (relative to `root`) with each plain colwise/rowwise style of an adapted projection
    replaced by one that shards its adapters consistently with it."""
    out = {}
    for name, style in styles.items():
        module = root.get_submodule(name)
        adapted = type(style) in _ADAPTED_STYLES and isinstance(module, LoRALinear)
        if adapted:
            style = copy.copy(style)
            style.__class__ = _ADAPTED_STYLES[type(style)]
        elif nf4.is_nf4(getattr(module, "weight", None)):
            raise nf4.NF4Error(
                f"{name}: its NF4 weight cannot be split by {type(style).__name__}: tensor parallel splits a 4-bit "
                "projection that carries an adapter, by rows or columns (and key/value heads when mesh.tp does not "
                "exceed num_key_value_heads). Fix: add it to peft.target_modules, use mesh.tp <= num_key_value_heads, "
                "or peft.base_dtype=bf16.")
        out[name] = style
    return out


# ------------------------------------------------------------------------------- PEFT format
PEFT_PREFIX = "base_model.model."
EMBEDDING_AND_HEAD = ("model.embeddings", "lm_head")


def _mamba_out_proj(cfg: NemotronHConfig, name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 4 and parts[1] == "layers" and cfg.block_types[int(parts[2])] == "mamba" \
        and parts[4] == "out_proj"


def _in_proj_rows(cfg: NemotronHConfig, name: str) -> torch.Tensor | None:
    """For a Mamba2 `in_proj` adapter, the native row of each Hugging Face row (None otherwise)."""
    parts = name.split(".")
    if len(parts) > 4 and parts[1] == "layers" and cfg.block_types[int(parts[2])] == "mamba" \
            and parts[4] == "in_proj":
        return torch.argsort(mamba_in_proj_order(cfg))
    return None


def _expert_keys(owner: str, projs: tuple[str, ...]) -> dict[str, str]:
    """PEFT nests one wrapper per targeted expert parameter, the first targeted innermost."""
    depth = {proj: len(projs) - 1 - i for i, proj in enumerate(projs)}
    return {proj: f"{owner}{'.base_layer' * depth[proj]}" for proj in projs}


def to_peft(cfg: NemotronHConfig, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native adapter tensors -> PEFT's names and layouts on transformers' NemotronH.

    Mamba2 `in_proj` rows go back to Hugging Face order; routed experts become PEFT's parameter
    adapters: `A` [E*r, in] (row e*r+k), `B` [out, r*E] (column k*E+e). Mamba2 `out_proj` adapters are
    left out: PEFT refuses LoRA on that module of NemotronH (the export writes them merged instead)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[str]] = {}
    for name in values:
        m = re.match(r"^(.*)\.lora\.(up_proj|down_proj)\.A$", name)
        if m:
            experts.setdefault(m.group(1), []).append(m.group(2))
    for name, value in values.items():
        if name.endswith(EMBEDDING_FACTORS):  # PEFT keeps them on the embedding itself
            out[PEFT_PREFIX + name.replace(".lora.lora_embedding_", ".lora_embedding_")] = value.contiguous()
        elif name.endswith((".lora_A.weight", ".lora_B.weight")):
            module = name.rsplit(".", 2)[0]
            if _mamba_out_proj(cfg, module):
                continue
            rows = _in_proj_rows(cfg, module)
            if rows is not None and name.endswith("lora_B.weight"):
                value = value[rows]
            out[PEFT_PREFIX + name] = value.contiguous()
    for owner, projs in experts.items():
        projs = tuple(p for p in _EXPERT_PROJS if p in projs)
        for proj, key in _expert_keys(owner, projs).items():
            a, b = values[f"{owner}.lora.{proj}.A"], values[f"{owner}.lora.{proj}.B"]
            e, r = a.shape[0], a.shape[1]
            out[f"{PEFT_PREFIX}{key}.lora_A.weight"] = a.reshape(e * r, a.shape[-1]).contiguous()
            out[f"{PEFT_PREFIX}{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return out


def from_peft(cfg: NemotronHConfig, tensors: dict[str, torch.Tensor], expert_projs: tuple[str, ...],
              rank: int, saved: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """PEFT adapter tensors (transformers' names) -> native adapter names and layouts; the inverse of
    `to_peft`. `expert_projs`: the routed-expert parameters the adapter targets, in its order. The
    full copies of the modules in `saved` (the adapter's modules_to_save) are passed over."""
    out: dict[str, torch.Tensor] = {}
    expert_key = {}
    copies = {f"{name}.weight" for name in saved}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        if name in copies:
            continue
        if name.endswith(EMBEDDING_FACTORS):
            module, _, factor = name.rpartition(".")
            out[f"{module}.lora.{factor}"] = value
            continue
        if name.endswith(".base_layer.weight") and name.removesuffix(".base_layer.weight") in EMBEDDING_AND_HEAD:
            continue  # PEFT saves a targeted embedding or lm_head whole (save_embedding_layers): the base's copy
        if name.endswith(".weight") and not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise LoRAError(f"adapter tensor {key!r} is not a LoRA factor (a saved module copy?); only LoRA "
                            "adapters load. Fix: save the adapter without modules_to_save.")
        module, _, factor = name.removesuffix(".weight").rpartition(".")
        owner = re.sub(r"(\.base_layer)+$", "", module)
        if owner.endswith(".mixer.experts"):
            expert_key[(module, factor)] = value
            continue
        rows = _in_proj_rows(cfg, module)
        if rows is not None and factor == "lora_B":
            value = value[torch.argsort(rows)]
        out[f"{module}.{factor}.weight"] = value
    owners = {re.sub(r"(\.base_layer)+$", "", m) for m, _ in expert_key}
    for owner in owners:
        for proj, key in _expert_keys(owner, expert_projs).items():
            a, b = expert_key.get((key, "lora_A")), expert_key.get((key, "lora_B"))
            if a is None or b is None:
                raise LoRAError(f"adapter: {owner}.{proj} lacks its {'lora_A' if a is None else 'lora_B'} tensor.")
            e = a.shape[0] // rank
            out[f"{owner}.lora.{proj}.A"] = a.reshape(e, rank, a.shape[-1])
            out[f"{owner}.lora.{proj}.B"] = b.reshape(b.shape[0], rank, e).permute(2, 0, 1)
    return out


def peft_targets(cfg: NemotronHConfig, names: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """(target_modules, target_parameters, modules_to_save) of an adapter_config.json for our adapted
    projections `names`. PEFT matches target_modules by suffix, so the full module names are given."""
    modules, params, saved = [], [], []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        if leaf in _EXPERT_PROJS and owner.endswith(".experts"):
            if f"experts.{leaf}" not in params:
                params.append(f"experts.{leaf}")
        elif _mamba_out_proj(cfg, name):
            saved.append(name)
        else:
            modules.append(name)
    params.sort(key=lambda p: _EXPERT_PROJS.index(p.split(".")[1]))
    return modules, params, saved


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W + scaling * B A`, computed in fp32, returned in the weight's dtype."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def merged_embedding(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W + scaling * (B A).T` for an embedding's [vocab, hidden] weight, as PEFT merges it."""
    return (weight.float() + scaling * (b.float() @ a.float()).t()).to(weight.dtype)


def merged_experts(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return (weight.float() + scaling * torch.bmm(b.float(), a.float())).to(weight.dtype)


def lora_spec_problem(cfg: NemotronHConfig, rank, alpha, dropout, target_modules, tp: int = 1) -> str | None:
    """What is wrong with these LoRA settings for a model of `cfg` on `tp` tensor-parallel ranks, or None;
    checked on a model built on the meta device, so before any process group or memory."""
    try:
        spec = LoRASpec(rank, float(alpha), float(dropout), tuple(target_modules))
        with torch.device("meta"):
            model = NemotronHForCausalLM(cfg)
        targets = match_targets(model, spec.target_modules)
    except LoRAError as e:
        return str(e)
    embeddings = {name for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    embedding = [t for t in targets if t in embeddings]
    if embedding and tp > 1:
        return (f"peft.target_modules={list(target_modules)} adapts the embedding ({embedding[0]}), which tensor "
                f"parallel shards by vocabulary; mesh.tp={tp}: an adapted embedding runs on tp=1 only. Fix: drop its "
                "pattern, or set mesh.tp=1.")
    return None
