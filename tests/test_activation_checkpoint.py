"""Activation checkpointing modes: each trains exactly like none, and selective keeps less than none
and more than full. One process: the recipe's parallelizer runs on a group of one."""

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from nemotron_recipe.distributed import activation_checkpoint as ac
from nemotron_recipe.distributed.env import distributed
from nemotron_recipe.distributed.plan import ActivationCheckpointing, ParallelPlan
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3 import kernels
from nemotron_recipe.training.loss import cross_entropy_sum
from nemotron_recipe.training.setup import parallelize_model

from benchmarks.measure import kept_for_backward
from helpers import CONF, SMALL_DIMS, perturb_off_init, scan_inputs

# Every block kind, biases on, a scan of several chunks with a padded last one.
DIMS = dict(SMALL_DIMS, use_bias=True, mlp_bias=True)
PATTERN = "M*-E"
CHECKPOINTING = [m for m in ac.AC_MODES if m != "none"]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    with distributed("cpu"):
        yield


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern=PATTERN, **DIMS))
    perturb_off_init(model)
    return model


def _parallelized(model: torch.nn.Module, mode: str, every: int = 2, dtype=torch.float32) -> torch.nn.Module:
    plan = ParallelPlan(ac=ActivationCheckpointing(mode, every), param_dtype=dtype)
    return parallelize_model(copy.deepcopy(model), plan, plan.build_meshes("cpu"))


def _batch(seq_len: int, docs: bool = False):
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, DIMS["vocab_size"], (2, seq_len), generator=g)
    document_ids = (torch.arange(seq_len) >= seq_len // 3).long().expand(2, -1) if docs else None
    return ids, document_ids


def _loss(model, ids, document_ids=None) -> torch.Tensor:
    loss_sum, count = cross_entropy_sum(model(ids, document_ids=document_ids).logits, torch.roll(ids, -1, 1))
    return loss_sum / count


def _loss_and_grads(model, ids, document_ids=None):
    loss = _loss(model, ids, document_ids)
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
             for name, p in model.named_parameters()}
    return loss.detach(), grads


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("mode", CHECKPOINTING)
def test_every_mode_trains_like_none(base_model, mode, docs):
    ids, document_ids = _batch(44, docs)
    ref_loss, ref_grads = _loss_and_grads(_parallelized(base_model, "none"), ids, document_ids)
    loss, grads = _loss_and_grads(_parallelized(base_model, mode), ids, document_ids)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_selective_bf16_trains_like_none(base_model):
    """Under bf16 the parameters that stay fp32 are FSDP units of their own inside each block, so
    FSDP's hooks run inside the checkpointed regions; two steps, so the second sees FSDP's steady state."""
    ids, _ = _batch(44)
    runs = {}
    for mode in ("none", "selective"):
        model = _parallelized(base_model, mode, dtype=torch.bfloat16)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            runs[mode] = _loss_and_grads(model, ids)
    (ref_loss, ref_grads), (loss, grads) = runs["none"], runs["selective"]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_modes_wrap_their_blocks(base_model):
    def wrapped(mode, every=2):
        layers = _parallelized(base_model, mode, every).model.layers
        return [i for i, block in enumerate(layers) if hasattr(block, "_checkpoint_wrapped_module")]

    assert wrapped("none") == []
    assert wrapped("blocks") == [0, 2]  # the Mamba and MLP blocks of "M*-E"
    assert wrapped("full") == wrapped("selective") == [0, 1, 2, 3]
    assert wrapped("every_nth", 2) == [0, 2] and wrapped("every_nth", 3) == [0, 3]


# ------------------------------------------------------------------------------------------ memory
def test_selective_keeps_less_than_none_and_more_than_full(base_model):
    ids, _ = _batch(128)
    kept = {}
    for mode in ("none", "selective", "full"):
        model = _parallelized(base_model, mode)
        kept[mode], loss = kept_for_backward(lambda: _loss(model, ids), model)
        loss.backward()
    assert kept["full"] < kept["selective"] < kept["none"], kept


class _CountCalls(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.calls = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.ops
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", [torch.ops.nemotron_recipe.ssd_scan_forward.default,
                                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default])
def test_selective_does_not_recompute_the_scan_or_attention(base_model, op):
    ids, _ = _batch(32)
    calls = {}
    for mode in ("none", "selective", "full"):
        model = _parallelized(base_model, mode)
        with _CountCalls({op}) as counter:
            _loss(model, ids).backward()
        calls[mode] = counter.calls
    assert calls["none"] == calls["selective"] == 1 and calls["full"] == 2, calls


# ------------------------------------------------------------------------------------------ pieces
def test_policy_saves_named_ops_and_recomputes_the_rest():
    policy = ac.save_policy({torch.ops.aten.mm.default})
    assert policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.silu.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert torch.ops.aten._grouped_mm.default in ac.SAVED_BY_DEFAULT
    assert torch.ops.aten.addmm.default in ac.SAVED_BY_DEFAULT


def test_scan_op_passes_opcheck():
    """The scan's forward is a custom op (so a policy can name it): schema, fake tensors and tracing."""
    g = torch.Generator().manual_seed(0)
    # One head and one group over whole chunks: the head-major layouts could be the inputs themselves.
    # Tracing through AOTAutograd (8 s a call) is checked on the general shape; the rest on both.
    cheap = ("test_schema", "test_autograd_registration", "test_faketensor")
    for seq_len, h, groups in ((20, 6, 3), (16, 1, 1)):
        x, dt, A, B, C, D = scan_inputs(seq_len, g, h=h, groups=groups)
        doc = torch.tensor([[0] * 5 + [1] * (seq_len - 5)] * 2)
        for document_ids in (None, doc):
            args = (x, dt, A, B, C, D, 8, document_ids)
            utils = cheap + ("test_aot_dispatch_dynamic",) if h > 1 else cheap
            torch.library.opcheck(torch.ops.nemotron_recipe.ssd_scan_forward.default, args, test_utils=utils)
            inputs = {t.untyped_storage()._cdata for t in args if isinstance(t, torch.Tensor)}
            outputs = torch.ops.nemotron_recipe.ssd_scan_forward(*args)
            assert not [t for t in outputs if t.untyped_storage()._cdata in inputs]
    assert kernels.SELECTIVE_AC_SAVED_OPS == {torch.ops.nemotron_recipe.ssd_scan_forward.default}


def test_mode_names_and_config_options_agree():
    assert ac.AC_MODES == ("none", "blocks", "full", "selective", "every_nth")
    assert {p.stem for p in (CONF / "ac").glob("*.yaml")} == set(ac.AC_MODES)
    assert "every" not in (CONF / "ac" / "selective.yaml").read_text()
    assert "every:" in (CONF / "ac" / "every_nth.yaml").read_text()


def test_generic_machinery_knows_no_model():
    source = Path(ac.__file__).read_text()
    imported = [node.module or "" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for a in node.names]
    assert not [m for m in imported if "models" in m], imported


def test_selective_around_compiled_blocks_trains_like_none():
    """The recipe compiles the blocks inside their checkpoint wrappers: the policy then sees each
    compiled block as one op and recomputes it whole; the result must not change."""
    from nemotron_recipe.training.compile import compile_blocks

    torch.manual_seed(0)
    small = NemotronHForCausalLM(NemotronHConfig(pattern="M*", **DIMS))
    ids, _ = _batch(16)
    ref_loss, ref_grads = _loss_and_grads(_parallelized(small, "none"), ids)
    model = _parallelized(small, "selective")

    def probe():
        _loss_and_grads(model, ids)
        model.zero_grad(set_to_none=True)

    assert compile_blocks(model, probe=probe)
    loss, grads = _loss_and_grads(model, ids)
    torch._dynamo.reset()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
