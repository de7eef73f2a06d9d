"""The published `PARALLELIZER._apply` as outside callers use it: models they bring (transformers'
NemotronH, the remote-code `backbone.*` layout, the native model), meshes they build by hand, the
model's own `labels=` loss, bf16-stored weights, and NeMo AutoModel's keyword arguments.

The torchrun job is tests/distributed/seed_api_worker.py; each case trains three AdamW steps next to
one process training an unsharded fp32 copy on the whole batch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from nemotron_recipe.distributed.env import distributed
from nemotron_recipe.distributed.fsdp import dtype_units
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER, _computes_in_fp32

WORKER = Path(__file__).parent / "distributed" / "seed_api_worker.py"
FP32_RTOL = 1e-5  # losses and pre-clipping gradient norms against one process
BF16_LOSS_RTOL = 2e-2  # a bf16-stored model under a bf16 policy against the fp32 single process

CASES = [
    # model, dtype, tp_shard_plan, activation checkpointing, mesh (seed_api_worker.MESHES)
    "hf,fp32,mlp,1,fsdp2_tp2",
    "hf,bf16,mlp,1,fsdp2_tp2",
    "native,fp32,mlp,1,fsdp2_tp2",
    "native,bf16,mlp,1,fsdp2_tp2",
    "backbone,fp32,mlp,1,fsdp2_tp2",
    "backbone,bf16,mlp,1,fsdp2_tp2",
    "native,fp32,default,1,fsdp2_tp2_unflattened",
    "hf,fp32,default,1,tp4",  # 2 key/value heads on 4 tp ranks
    "native,fp32,default,1,tp4",
    "hf,fp32,mlp,0,hsdp2x2",
]


@pytest.fixture(scope="module")
def seed_api(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed_api") / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(WORKER),
           str(out), *CASES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_apply_matches_one_process(seed_api, case):
    result = seed_api[case]
    bf16 = case.split(",")[1] == "bf16"
    for step, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        assert _rel(loss, ref) <= (BF16_LOSS_RTOL if bf16 else FP32_RTOL), f"step {step}: {loss} vs {ref}"
    if not bf16:
        # FSDP averages gradients (the page's convention): the norm of one process's mean-loss gradient.
        for step, (norm, ref) in enumerate(zip(result["grad_norms"], result["ref_grad_norms"])):
            assert _rel(norm, ref) <= FP32_RTOL, f"step {step}: gradient norm {norm} vs {ref}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in CASES if ",bf16," in c])
def test_bf16_policy_keeps_mamba_terms_fp32_at_the_scan(seed_api, case):
    dtypes = seed_api[case]["mamba_dtypes"]
    for name in ("A_log", "D", "dt_bias", "conv1d.weight"):
        assert dtypes[name] == ["torch.float32"], (name, dtypes)
    assert dtypes["in_proj.weight"] == ["torch.bfloat16"]  # the policy does cast the projections


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_root_and_head_stay_gathered_after_forward(seed_api, case):
    assert seed_api[case]["units_gathered"] == {"root": True, "head": True, "first_block": False}


# ------------------------------------------------------------------ one process, no torchrun
def _native(**dims) -> NemotronHForCausalLM:
    torch.manual_seed(0)
    return NemotronHForCausalLM(NemotronHConfig.from_preset("tiny", **dims))


def test_native_to_bf16_keeps_ssm_terms_and_router_fp32(tmp_path):
    model = _native(pattern="ME").to(torch.bfloat16)
    fp32 = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype == torch.float32}
    mixer, router = "model.layers.0.mixer.", "model.layers.1.mixer.gate."
    assert fp32 == {mixer + n for n in ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias")} | {
        router + "weight", router + "e_score_correction_bias"}
    model.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        bias = next(k for k in f.keys() if k.endswith("e_score_correction_bias"))
        assert f.get_tensor(bias).dtype == torch.float32


def test_units_split_where_storage_or_compute_dtype_differs():
    block = _native(pattern="M").to(torch.bfloat16).model.layers[0]
    units = dtype_units(block, _computes_in_fp32(block), None)
    names = {id(m): n for n, m in block.named_modules()}
    assert [(names[id(m)], key) for m, key in units] == [
        ("mixer.out_proj", (torch.bfloat16, torch.bfloat16)),
        ("mixer.norm", (torch.bfloat16, torch.bfloat16)),
        ("mixer.in_proj", (torch.bfloat16, torch.bfloat16)),
        ("mixer", (torch.float32, torch.float32)),
        ("", (torch.bfloat16, torch.bfloat16)),
    ]
    # fp32 storage under a bf16 policy: the same split, now by compute dtype.
    block = _native(pattern="M").model.layers[0]
    units = dtype_units(block, _computes_in_fp32(block), torch.bfloat16)
    assert [key for _, key in units][-2:] == [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
    # One dtype throughout: one unit.
    assert len(dtype_units(_native(pattern="-").model.layers[0], lambda n: False, None)) == 1


def _one_rank_mesh():
    return init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))


def test_automodel_keyword_arguments_are_honoured_or_named_once(caplog):
    kwargs = dict(enable_async_tensor_parallel=True, enable_compile=False, enable_fsdp2_prefetch=True,
                  fsdp2_forward_prefetch_depth=2, fsdp2_backward_prefetch_depth=2,
                  activation_checkpointing_scope="language", frozen_multimodal_sharding=None)
    with distributed("cpu"), caplog.at_level(logging.WARNING):
        for _ in range(2):
            model = PARALLELIZER._apply(_native(), _one_rank_mesh(), activation_checkpointing=True, **kwargs)
            ids = torch.randint(0, 512, (2, 16))
            model(ids, labels=ids).loss.backward()
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert [m.split("=")[0].rsplit(" ", 1)[1] for m in ignored] == ["enable_async_tensor_parallel",
                                                                     "frozen_multimodal_sharding"]


def test_tied_embedding_and_head_shard_as_one_unit():
    model = _native(pattern="M-")
    model.lm_head.weight = model.model.embeddings.weight
    with distributed("cpu"):
        PARALLELIZER._apply(model, _one_rank_mesh())
        ids = torch.randint(0, 512, (2, 16))
        model(ids, labels=ids).loss.backward()
        assert model.lm_head.weight is model.model.embeddings.weight


def test_unknown_activation_checkpointing_value_is_named():
    from nemotron_recipe.distributed import ParallelConfigError

    with distributed("cpu"), pytest.raises(ParallelConfigError, match="activation_checkpointing=.sometimes.: ac.mode"):
        PARALLELIZER._apply(_native(), _one_rank_mesh(), activation_checkpointing="sometimes")


@pytest.mark.distributed
def test_docs_example_runs(tmp_path):
    """The runnable example of docs/own-model.md, as a user would copy it."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "own-model.md").read_text()
    script = tmp_path / "parallelize_hf.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_mesh_without_a_data_parallel_dim_is_a_clear_error():
    from nemotron_recipe.distributed import ParallelConfigError

    with distributed("cpu"), pytest.raises(ParallelConfigError, match="add a 'dp_shard' dim"):
        PARALLELIZER._apply(_native(), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    with distributed("cpu"):  # a 1-D mesh of another name is the data-parallel one
        PARALLELIZER._apply(_native(), init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
