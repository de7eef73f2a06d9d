"""LoRA in the recipe: the frozen base, its fingerprint, the adapters' start, and PEFT-format files.

A LoRA run stores its base in `peft.base_dtype` (a bf16 base has no fp32 master copy), adds fp32
adapters (models/nemotron_v3/lora.py), and freezes everything else through the parallelizer's
`reapply_trainability` hook. Its checkpoints hold the adapters, their optimizer state and the RNG;
meta.json names the base (`model.pretrained`, or the preset and seed it was drawn from) with a hash
of its content, and a resume on another base is refused.

Export (`export_lora`): the adapters as a PEFT adapter of transformers' `NemotronHForCausalLM`
(adapter_config.json, adapter_model.safetensors), or with `merge` folded into a full Hugging Face
model. PEFT refuses LoRA on the Mamba2 `out_proj` of NemotronH (its CUDA kernels read that weight
directly), so the adapter carries those projections as merged weights in `modules_to_save`: the
model PEFT loads computes what ours does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from nemotron_recipe.models.nemotron_v3 import (
    CheckpointError,
    NemotronHConfig,
    NemotronHForCausalLM,
    build_meta_model,
)
from nemotron_recipe.models.nemotron_v3.checkpoint import (
    in_saved_dtypes,
    safetensors_files,
)
from nemotron_recipe.models.nemotron_v3.fp8_base import keep_fp8_base, read_fp8_weights
from nemotron_recipe.models.nemotron_v3.lora import (
    PEFT_PREFIX,
    ExpertAdapters,
    LoRAEmbedding,
    LoRAError,
    LoRALinear,
    LoRASpec,
    adapter_parameters,
    add_adapters,
    from_peft,
    init_adapters,
    merged_embedding,
    merged_experts,
    merged_weight,
    nf4_targets,
    peft_targets,
    quantize_base,
    remove_linear_adapter,
    set_full_values,
    to_peft,
)
from nemotron_recipe.training.checkpoint import load_here

log = logging.getLogger(__name__)

# The dtype a base is built and read in; an nf4 base is read in bf16 and quantized once the adapters are
# added (`quantize_nf4_base`), and its export merges into those bf16 weights, not the 4-bit ones.
BASE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "nf4": torch.bfloat16, "fp8": torch.bfloat16}
# Bases read whole, unsharded, and then stored in their own format before parallelizing.
QUANTIZED_BASES = ("nf4", "fp8")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The LoRA factors of the Mamba2 out_proj adapters, which the PEFT files carry merged (modules_to_save).
OUT_PROJ_FACTORS = "out_proj_lora.safetensors"
DRAWN_BASE = "base"  # an adapter's base that was drawn from a seed, exported beside it


def lora_spec(cfg: Any) -> LoRASpec | None:
    p = getattr(cfg, "peft", None)
    if p is None or p.method == "none":
        return None
    return LoRASpec(int(p.rank), float(p.alpha), float(p.dropout), tuple(p.target_modules))


# ------------------------------------------------------------------------------- the base
def _state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _files_hash(path: str) -> str:
    """CRC-32 of every weight file of a Hugging Face directory, combined: its content, read once."""
    digest = hashlib.sha256()
    for file in safetensors_files(path):
        crc = 0
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        digest.update(f"{Path(file).name}:{Path(file).stat().st_size}:{crc}".encode())
    return digest.hexdigest()[:32]


def base_record(cfg: Any, model: torch.nn.Module) -> dict[str, Any]:
    """What meta.json says of the base: where it comes from and a hash of its content (the weight
    files of `model.pretrained`, else the seed-drawn weights in `peft.base_dtype`)."""
    pretrained = cfg.model.pretrained
    source = {"pretrained": str(Path(pretrained).expanduser().resolve())} if pretrained else {
        "preset": cfg.model.preset, "seed": cfg.seed}
    content = _files_hash(pretrained) if pretrained else _state_hash(model)
    return {**source, "dtype": cfg.peft.base_dtype, "hash": content}


def peft_record(cfg: Any, spec: LoRASpec, base: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    return {"method": "lora", "rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
            "target_modules": list(spec.target_modules), "adapted": targets, "base": base}


def store_base(model: NemotronHForCausalLM, cfg: Any) -> None:
    """The base in `peft.base_dtype`, the SSM terms and the router kept fp32 (a meta model too)."""
    model.to(BASE_DTYPES[cfg.peft.base_dtype])


def quantize_nf4_base(model: NemotronHForCausalLM, cfg: Any) -> None:
    """An nf4 run's base projections in 4 bits, after the adapters are added (their shapes read the
    bf16 weights); nothing for other runs."""
    if cfg.peft.base_dtype != "nf4":
        return
    before, after = quantize_base(model)
    log.info("nf4 base: %d projections' weights %.2f MB -> %.2f MB (%.3fx)", len(nf4_targets(model)),
             before / 1e6, after / 1e6, after / before)


def keep_fp8_base_weights(model: NemotronHForCausalLM, cfg: Any) -> None:
    """An fp8 run's base projections as the FP8 checkpoint stores them (fp8_base.py), after the adapters
    are added; nothing for other runs."""
    if cfg.peft.base_dtype != "fp8":
        return
    weights = read_fp8_weights(str(cfg.model.pretrained), model.config)
    before, after = keep_fp8_base(model, weights, nf4_targets(model))
    log.info("fp8 base: %d projections kept in FP8, %.2f MB in bf16 -> %.2f MB (%.3fx)",
             sum(n in weights for n in nf4_targets(model)), before / 1e6, after / 1e6, after / max(before, 1))


# ------------------------------------------------------------------------------- the start
def start_adapters(model: torch.nn.Module, cfg: Any, spec: LoRASpec) -> None:
    """B = 0 and A drawn from the run's seed, or the values of the PEFT adapter `peft.init_from`."""
    if cfg.peft.init_from:
        values = read_peft_adapter(cfg.peft.init_from, model.config, spec, adapter_parameters(model))
        set_full_values(model, values)
        log.info("adapters from %s", cfg.peft.init_from)
    else:
        init_adapters(model, cfg.seed)


def read_peft_adapter(path: str | Path, model_cfg: NemotronHConfig, spec: LoRASpec,
                      params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory's tensors in native names and layouts, checked against our adapters
    (`params`, by name): the same rank, alpha, projections and shapes, else a LoRAError naming them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except (OSError, ValueError, SafetensorError) as e:  # a file cut short is a SafetensorError
        raise LoRAError(f"peft.init_from={str(path)!r}: not a readable PEFT adapter ({e}). Fix: point it at a "
                        f"directory holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.") from None
    if config.get("peft_type", "LORA") != "LORA" or int(config.get("r", -1)) != spec.rank \
            or float(config.get("lora_alpha", -1)) != spec.alpha:
        raise LoRAError(
            f"peft.init_from={str(path)!r}: a {config.get('peft_type')} adapter of rank {config.get('r')} and alpha "
            f"{config.get('lora_alpha')}, this run has rank {spec.rank} and alpha {spec.alpha}. Fix: set peft.rank and "
            "peft.alpha to the adapter's."
        )
    projs = tuple(p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or ())
    saved = list(config.get("modules_to_save") or ())
    values = from_peft(model_cfg, tensors, tuple(p for p in ("up_proj", "down_proj") if p in projs), spec.rank,
                       saved=saved)
    values |= _out_proj_factors(path, saved)
    missing, unexpected = sorted(set(params) - set(values)), sorted(set(values) - set(params))
    bad = [(n, tuple(values[n].shape), tuple(params[n].shape)) for n in values if n in params
           and tuple(values[n].shape) != tuple(params[n].shape)]
    if missing or unexpected or bad:
        raise LoRAError(
            f"peft.init_from={str(path)!r}: the adapter does not match this model's adapters: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, shapes (name, adapter, model) {bad[:4]}. Fix: use an adapter made for "
            "this base with the same peft.target_modules."
        )
    return values


def _out_proj_factors(path: Path, saved: list[str]) -> dict[str, torch.Tensor]:
    """The LoRA factors of the modules an adapter carries as merged copies (`modules_to_save`), from
    the file our export writes beside the PEFT files; a merged copy alone cannot start an adapter."""
    from safetensors.torch import load_file

    if not saved:
        return {}
    try:
        factors = load_file(str(path / OUT_PROJ_FACTORS))
    except (OSError, ValueError) as e:
        raise LoRAError(
            f"peft.init_from={str(path)!r}: the adapter carries {len(saved)} modules as full copies "
            f"(modules_to_save: {saved[:2]}...) and {OUT_PROJ_FACTORS} with their LoRA factors is unreadable "
            f"({type(e).__name__}: {e}). Fix: export it again with `python -m recipes.export`, or with "
            "`--out-proj skip` and peft.target_modules without out_proj."
        ) from None
    missing = [n for n in saved if f"{n}.lora_A.weight" not in factors or f"{n}.lora_B.weight" not in factors]
    if missing:
        raise LoRAError(f"peft.init_from={str(path)!r}: {OUT_PROJ_FACTORS} lacks the factors of {missing[:4]}. "
                        "Fix: export the adapter again with `python -m recipes.export`.")
    return {n: v for n, v in factors.items() if n.rsplit(".", 2)[0] in saved}


# ------------------------------------------------------------------------------- export
def load_adapters(path: Path, meta: dict[str, Any]) -> tuple[NemotronHForCausalLM, dict[str, torch.Tensor]]:
    """The adapter values of a LoRA checkpoint, with the (storage-less) adapted model they belong to."""
    peft = meta["peft"]
    config = NemotronHConfig(**meta["model"])
    model = build_meta_model(config)
    add_adapters(model, LoRASpec(peft["rank"], peft["alpha"], peft["dropout"], tuple(peft["target_modules"])))
    values = {name: torch.empty(p.shape, dtype=p.dtype) for name, p in adapter_parameters(model).items()}
    try:
        load_here({"model": values}, path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own type is not an Exception
        raise CheckpointError(f"{path}: loading the adapters failed: {type(e).__name__}: {e}") from None
    return model, values


def load_base(meta: dict[str, Any], path: Path, *, as_trained: bool = True) -> NemotronHForCausalLM:
    """The LoRA checkpoint's base, unsharded; refused if its content changed. `as_trained`: in the
    `peft.base_dtype` the run stored it in. Else in fp32, what exports merge into: a pretrained base
    with its files' values (written back in their dtypes), a seed-drawn one with the values the run
    trained on (stored in fp32, so that a merge does not round the adapters' part to bf16)."""
    base, config = meta["peft"]["base"], NemotronHConfig(**meta["model"])
    if "pretrained" in base:
        if not Path(base["pretrained"]).is_dir():
            raise CheckpointError(f"{path}: its base {base['pretrained']} no longer exists; the adapters need it.")
        model = NemotronHForCausalLM.from_pretrained(base["pretrained"])
    else:
        torch.manual_seed(base["seed"])
        model = NemotronHForCausalLM(config)
    if as_trained or "pretrained" not in base:  # a drawn base exists only as the run stored it
        model.to(BASE_DTYPES[base["dtype"]])
    got = _files_hash(base["pretrained"]) if "pretrained" in base else _state_hash(model)
    if got != base["hash"]:
        raise CheckpointError(
            f"{path}: its base ({base.get('pretrained') or 'preset ' + str(base.get('preset'))}) has changed since "
            f"training (hash {got}, trained on {base['hash']}). Fix: export with the base the adapters were trained on."
        )
    return model if as_trained else model.float()


def merge_into(model: NemotronHForCausalLM, values: dict[str, torch.Tensor], spec: LoRASpec,
               unmerged: set[str] = frozenset()) -> None:
    """Folds the adapters `values` (native names) into the base weights of `model`, in place; the
    projections named in `unmerged` keep their base weights."""
    add_adapters(model, spec)
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, LoRALinear) and name in unmerged:
                remove_linear_adapter(module)
            elif isinstance(module, LoRALinear):
                a, b = values[f"{name}.lora_A.weight"], values[f"{name}.lora_B.weight"]
                module.weight.copy_(merged_weight(module.weight, a, b, spec.scaling))
                remove_linear_adapter(module)
            elif isinstance(module, LoRAEmbedding):
                a, b = values[f"{name}.lora.lora_embedding_A"], values[f"{name}.lora.lora_embedding_B"]
                module.weight.copy_(merged_embedding(module.weight, a, b, spec.scaling))
                del module.lora
                module.__class__ = torch.nn.Embedding
            elif isinstance(module, ExpertAdapters):
                experts = model.get_submodule(name.rsplit(".", 1)[0])
                for proj in module:
                    a, b = values[f"{name}.{proj}.A"], values[f"{name}.{proj}.B"]
                    getattr(experts, proj).copy_(merged_experts(getattr(experts, proj), a, b, spec.scaling))
                del experts.lora


def _spec(meta: dict[str, Any]) -> LoRASpec:
    p = meta["peft"]
    return LoRASpec(p["rank"], p["alpha"], p["dropout"], tuple(p["target_modules"]))


def export_lora(path: Path, meta: dict[str, Any], *, merge: bool, out_proj: str = "save",
                out_dir: Path | None = None) -> tuple[Callable[[Path], None], int]:
    """Loads a LoRA checkpoint (and its base where needed) and returns the function that writes it to a
    directory (a PEFT adapter, or with `merge` a Hugging Face model with the adapters folded in) and the
    bytes of the tensors it writes. Every error is raised here, before anything is written.

    Both merge into the base's own checkpoint values, so a PEFT-loaded adapter and the merged model
    agree. `out_proj="skip"` leaves the Mamba2 out_proj adapters out (the adapter then needs no
    `modules_to_save`); the merged model leaves them out too, so the two still agree."""
    model, values = load_adapters(path, meta)
    spec, config = _spec(meta), model.config
    bad = [n for n, t in values.items() if not bool(t.isfinite().all())]
    if bad:
        raise CheckpointError(f"{path}: non-finite values in {bad[:6]}; the run had diverged. Fix: export an "
                              "earlier checkpoint.")
    modules, params, saved = peft_targets(config, meta["peft"]["adapted"])
    skipped = saved if out_proj == "skip" else []
    if skipped:
        values = {n: v for n, v in values.items() if n.rsplit(".", 2)[0] not in skipped}
        log.warning("left out the adapters of %d Mamba2 out_proj projections (--out-proj skip)", len(skipped))
        saved = []
    base_path = meta["peft"]["base"].get("pretrained")
    base = load_base(meta, path, as_trained=False) if merge or saved or base_path is None else None
    if merge:
        merge_into(base, values, spec, unmerged=set(skipped))
        return (lambda out: base.save_pretrained(str(out))), _nbytes(base.state_dict().values())
    tensors = to_peft(config, values) | _saved_copies(base, values, saved, spec)
    factors = {n: v.contiguous() for n, v in values.items() if n.rsplit(".", 2)[0] in saved}
    _report_size(tensors, saved)
    drawn = base if base_path is None else None
    nbytes = _nbytes(tensors.values()) + _nbytes(factors.values())
    nbytes += _nbytes(base.state_dict().values()) if drawn is not None else 0
    return (lambda out: write_peft_adapter(out, tensors, spec, modules, params, saved, base_path, factors, drawn,
                                           named_at=out_dir)), nbytes


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _saved_copies(base: NemotronHForCausalLM | None, values: dict[str, torch.Tensor], saved: list[str],
                  spec: LoRASpec) -> dict[str, torch.Tensor]:
    """The merged Mamba2 out_proj weights PEFT loads as modules to save, in the base's checkpoint dtypes:
    PEFT refuses LoRA on that module of NemotronH (its CUDA kernels read the weight directly)."""
    merged = {}
    for name in saved:
        weight = base.get_submodule(name).weight
        merged[f"{name}.weight"] = merged_weight(weight, values[f"{name}.lora_A.weight"],
                                                 values[f"{name}.lora_B.weight"], spec.scaling).contiguous()
    merged = in_saved_dtypes(merged, base.config.weight_dtypes) if merged else merged
    return {PEFT_PREFIX + name: value for name, value in merged.items()}


def _report_size(tensors: dict[str, torch.Tensor], saved: list[str]) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    copies = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(".out_proj.weight"))
    log.info("adapter: %.1f MiB, %.0f%% of it full copies of %d Mamba2 out_proj weights (modules_to_save)%s",
             total / 2**20, 100 * copies / max(total, 1), len(saved),
             "; `--out-proj skip` leaves them out for tools that cannot load modules_to_save" if saved else "")


def write_peft_adapter(out: Path, tensors: dict[str, torch.Tensor], spec: LoRASpec, modules: list[str],
                       params: list[str], saved: list[str], base_path: str | None,
                       out_proj_factors: dict[str, torch.Tensor] | None = None,
                       drawn_base: NemotronHForCausalLM | None = None, named_at: Path | None = None) -> None:
    """adapter_config.json and adapter_model.safetensors; beside them the Mamba2 out_proj factors (which
    PEFT ignores and `peft.init_from` reads back) and, for a base drawn from a seed, that base in
    `base/`, which `base_model_name_or_path` then names, as it will stand in `named_at` (the export's
    directory, when `out` is where it is staged)."""
    from safetensors.torch import save_file

    if drawn_base is not None:
        drawn_base.save_pretrained(str(out / DRAWN_BASE))
        base_path = str((Path(named_at or out) / DRAWN_BASE).resolve())
        log.info("the base was drawn from a seed, not loaded: wrote it to %s", out / DRAWN_BASE)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "target_parameters": params or None,
        "modules_to_save": saved or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if out_proj_factors:
        save_file(out_proj_factors, str(out / OUT_PROJ_FACTORS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
