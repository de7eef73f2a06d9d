"""The CUDA paths, checked on CPU: what the GPU kernels demand of their inputs (through a fake kernel
that enforces `causal_conv1d`'s checks), which attention kernel a call can reach, no host sync and
no host-made index in a training step, the fallback scan's blocks, the kernel import guard, and the
GPU check script's plan. Tests that need a GPU are marked `cuda` (test_perf.py has the rest).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nemotron_recipe.distributed.context_parallel as dist_cp
from nemotron_recipe.distributed.activation_checkpoint import wrap as checkpoint_wrap
from nemotron_recipe.distributed.context_parallel import ContextParallel
from nemotron_recipe.models.nemotron_v3 import PRESETS, NemotronHForCausalLM, kernels
from nemotron_recipe.models.nemotron_v3 import context_parallel as model_cp
from nemotron_recipe.models.nemotron_v3 import model as model_mod
from nemotron_recipe.models.nemotron_v3.model import Mamba2Mixer
from nemotron_recipe.models.nemotron_v3.ops import (
    attention,
    causal_attention,
    expands_kv_heads,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ conv kernel
class _FakeCausalConv1d(torch.autograd.Function):
    """`causal_conv1d_fn` as causal_conv1d 1.7 takes it (csrc/causal_conv1d.cpp and its Python
    interface): the same argument checks, forward and backward, and the PyTorch conv's result."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx):
        b, dim, seqlen = x.shape
        assert weight.shape == (dim, weight.shape[-1]) and 2 <= weight.shape[-1] <= 4, "weight must be [dim, 2..4]"
        assert weight.dtype == x.dtype and (bias is None or bias.dtype == weight.dtype)
        if x.stride(2) != 1 and x.stride(1) != 1:  # the Python interface's only copy
            x = x.contiguous()
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:
            assert dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
            assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, (
                f"causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2)) to be "
                f"multiples of 8, got {x.stride()}")
            out = torch.empty_like(x)  # the interface allocates out (and dx) so, and the kernel writes
            assert out.stride(1) == 1, f"channel-last kernel, but empty_like(x) is not channels-last: {out.stride()}"
        if seq_idx is not None:
            assert channel_last, "seq_idx is only supported for channel last layout"
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (b, seqlen)
        ctx.channel_last = channel_last
        docs = None if seq_idx is None else seq_idx.long()
        out = kernels.CausalConv1dSiLU.apply(x.transpose(1, 2), weight, bias, docs)  # [b, l, dim]
        return out.transpose(1, 2) if channel_last else out.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, dout):
        if ctx.channel_last and dout.stride(1) != 1:
            dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)
        if ctx.channel_last:
            assert dout.stride(2) % 8 == 0 and dout.stride(0) % 8 == 0, f"dout strides {dout.stride()}"
        return None, None, None, None  # gradients are the reference path's, compared elsewhere


class FakeKernel:
    def __init__(self):
        self.calls = 0

    def __call__(self, x, weight, bias=None, seq_idx=None, activation=None):
        assert activation == "silu"
        self.calls += 1
        return _FakeCausalConv1d.apply(x, weight, None if bias is None else bias.contiguous(), seq_idx)


@pytest.fixture
def fake_conv(monkeypatch):
    """The wrapper takes its CUDA branch on CPU tensors, into the fake kernel."""
    kernel = FakeKernel()
    monkeypatch.setattr(kernels, "_cuda_conv", lambda: kernel)
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ("cuda", "cpu"))
    return kernel


def _local_mixer(tp: int, **changes) -> Mamba2Mixer:
    """A tensor-parallel rank's Mamba2 mixer of the tiny preset: 1/tp of its heads and groups."""
    cfg = dataclasses.replace(PRESETS["tiny"], **changes)
    cfg = dataclasses.replace(cfg, mamba_num_heads=cfg.mamba_num_heads // tp, n_groups=cfg.n_groups // tp)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg)
    with torch.no_grad():
        mixer.A_log.copy_(torch.rand_like(mixer.A_log))
        mixer.D.normal_()
        mixer.dt_bias.normal_(-3.0, 0.1)
    return mixer


def _documents(b: int, l: int) -> torch.Tensor:
    return (torch.arange(l)[None] >= torch.tensor([[l // 3], [l // 2]])[:b]).long()


@pytest.mark.parametrize("tp", [1, 4])
def test_conv_wrapper_hands_the_kernel_aligned_input_tensor_parallel(fake_conv, monkeypatch, tp):
    """tp = n_groups leaves a rank one group: its conv input is a strided slice of the projection."""
    mixer = _local_mixer(tp)
    hidden = torch.randn(2, 40, mixer.in_proj.in_features)
    docs = _documents(2, 40)
    out = mixer(hidden.requires_grad_(), document_ids=docs)
    out.sum().backward()
    assert fake_conv.calls == 1
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ("cuda",))
    with torch.no_grad():
        ref = mixer(hidden, document_ids=docs)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def _identity_cp(monkeypatch, cp_size: int, rank: int):
    """One process standing in for rank `rank` of `cp_size`: it holds the whole sequence, and the
    exchange hands it its heads' slice contiguous, as the all-to-all does."""
    cp = ContextParallel(group=None, rank=rank, size=cp_size)

    def to_heads(t, cp):
        mine = model_cp.heads_of_rank(t.shape[2], cp)
        return t[:, :, mine].contiguous()

    def to_sequence(t, cp):
        return t.repeat(1, 1, cp.size, 1)

    monkeypatch.setattr(model_cp, "sequence_to_heads", to_heads)
    monkeypatch.setattr(model_cp, "heads_to_sequence", to_sequence)
    monkeypatch.setattr(model_cp, "gather_sequence", lambda t, cp: t)
    return cp


@pytest.mark.parametrize("tp,cp_size", [(1, 4), (2, 2), (2, 4), (4, 2)])
def test_conv_wrapper_hands_the_kernel_aligned_input_context_parallel(fake_conv, monkeypatch, tp, cp_size):
    """One (virtual) group per cp rank: the rank's conv input is a slice of the exchanged pack."""
    mixer = _local_mixer(tp)
    cp = _identity_cp(monkeypatch, cp_size, rank=cp_size - 1)
    g, r = mixer.A_log.numel() // mixer.heads_per_group, mixer.heads_per_group
    xbc = torch.randn(2, 32, g, mixer.conv_group)
    dt = torch.randn(2, 32, g, r)
    docs = _documents(2, 32)
    out = model_cp.context_parallel_conv_and_scan(mixer, xbc, dt, cp, docs)
    assert fake_conv.calls == 1
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ("cuda",))
    ref = model_cp.context_parallel_conv_and_scan(mixer, xbc, dt, cp, docs)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_conv_wrapper_falls_back_when_channels_are_not_a_multiple_of_8(fake_conv):
    x = torch.randn(2, 24, 12)[:, :, :10]  # 10 channels, a strided view
    weight, bias = torch.randn(10, 1, 4), torch.randn(10)
    out = kernels.causal_conv1d_silu(x, weight, bias, _documents(2, 24))
    assert fake_conv.calls == 0
    ref = kernels.CausalConv1dSiLU.apply(x.contiguous(), weight.reshape(10, 4), bias, _documents(2, 24))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_conv_kernel_input_layout():
    x = torch.randn(2, 16, 3, 162)[:, :, 1, 64:160]  # one group's 96 conv channels of a 162-wide row
    t = kernels._conv_kernel_input(x)
    assert t.shape == (2, 96, 16) and t.stride(1) == 1 and t.stride(2) % 8 == 0 and t.stride(0) % 8 == 0
    aligned = torch.randn(2, 16, 96)
    assert kernels._conv_kernel_input(aligned).data_ptr() == aligned.data_ptr()  # no copy when dense
    wide = torch.randn(2, 16, 192)[:, :, :96]  # not dense, but strides multiples of 8: taken as it is
    assert kernels._conv_kernel_input(wide).data_ptr() == wide.data_ptr()
    assert kernels._conv_kernel_input(torch.randn(2, 16, 100)) is None


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("dtype,head_dim,masked,expands", [
    (torch.bfloat16, 128, False, False),  # flash takes grouped heads
    (torch.bfloat16, 128, True, True),  # a document mask: memory-efficient kernel, kv heads repeated
    (torch.float32, 128, False, True),  # fp32: flash cannot run
    (torch.float16, 512, False, True),
])
def test_cuda_attention_expands_kv_heads_where_flash_cannot_run(dtype, head_dim, masked, expands):
    assert expands_kv_heads("cuda", dtype, head_dim, masked) is expands
    assert not expands_kv_heads("cpu", dtype, head_dim, masked)


@pytest.mark.parametrize("docs", [False, True])
def test_expanded_kv_heads_give_the_grouped_result(docs):
    torch.manual_seed(0)
    q = torch.randn(2, 8, 24, 16, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, requires_grad=True)
    v = torch.randn(2, 2, 24, 16, requires_grad=True)
    doc = _documents(2, 24) if docs else None
    grouped = causal_attention(q, k, v, doc, expand_kv=False)
    expanded = causal_attention(q, k, v, doc, expand_kv=True)
    torch.testing.assert_close(expanded, grouped, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(grouped)
    for a, b in zip(torch.autograd.grad(expanded, (q, k, v), g), torch.autograd.grad(grouped, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_attention_never_builds_scores_with_a_mask_on_the_expanded_path(monkeypatch):
    """What SDPA is called with on CUDA (kernel choice is SDPA's): never `enable_gqa` beside a mask."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("attn_mask") is not None, kw.get("enable_gqa")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 8, 16, 16), torch.randn(1, 2, 16, 16)
    attention(q, k, k, torch.ones(1, 1, 16, 16, dtype=torch.bool).tril(), expand_kv=True)
    attention(q, k, k, expand_kv=True)
    assert calls == [(8, 8, True, False), (8, 8, False, False)]


# ------------------------------------------------------------------------------------------ host syncs
class HostSyncSpy(TorchDispatchMode):
    """Records, with the model line that caused it, every op that reads a tensor back to the host or
    touches a host tensor while the model lives on another device (meta here, standing in for CUDA:
    a host tensor there is an index made on the CPU and copied, or a CPU index into device weights)."""

    # Ops whose output size depends on data: on CUDA each reads a value back to the host.
    SYNC_OPS = frozenset({"_local_scalar_dense", "bincount", "nonzero", "masked_select", "_unique2", "unique_dim",
                          "unique_consecutive", "item"})

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack() if "nemotron_recipe" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        self.events.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.SYNC_OPS or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
                                     and args[0].dtype in (torch.int32, torch.int64)
                                     and kwargs.get("output_size") is None):
            self.record(f"host sync: aten.{name}")
            if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves(args)):
                raise AssertionError(self.events[-1])  # the meta device cannot run it: stop here, saying why
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves((args, kwargs, out))):
            self.record(f"host tensor: {func}")
        return out


@pytest.fixture
def spy(monkeypatch):
    """The spy, with Tensor.item/.tolist/.cpu/.numpy (Python-side reads) recorded too."""
    mode = HostSyncSpy()
    for method in ("item", "tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, method)

        def patched(self, *a, _real=real, _name=method, **kw):
            if self.device.type != "cpu":
                mode.record(f"host sync: Tensor.{_name}()")
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, method, patched)
    # An H200 in bf16: the experts' grouped GEMM (the meta device has no capability to ask).
    monkeypatch.setattr(model_mod, "_grouped_mm_supported", lambda rows, up: True)
    return mode


def _meta_model(checkpointed: bool) -> NemotronHForCausalLM:
    with torch.device("meta"):
        model = NemotronHForCausalLM(PRESETS["tiny"]).to(torch.bfloat16)
    if checkpointed:  # every block recomputed in backward: the recompute must not sync either
        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrap(block, "full")
    return model


def _training_step(model, seq_len: int) -> None:
    ids = torch.randint(0, 512, (2, seq_len), device="meta")
    docs = torch.zeros(2, seq_len, dtype=torch.long, device="meta")
    out = model(ids, targets=ids, loss_chunk_size=64, document_ids=docs)
    out.loss_sum.backward()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_step_has_no_host_sync(spy, checkpointed):
    """The tiny preset (Mamba2, attention, MLP and MoE blocks) with packed documents and the chunked
    loss: forward, backward and recompute touch no host tensor and read nothing back."""
    model = _meta_model(checkpointed)
    assert any(b.block_type == "moe" for b in model.model.layers if hasattr(b, "block_type"))
    with spy:
        _training_step(model, 128)
    assert spy.events == []


def _fake_collectives(monkeypatch, cp_size: int) -> None:
    """Collectives that keep shapes on one process (values do not matter on the meta device)."""
    funcol = dist_cp.funcol
    monkeypatch.setattr(funcol, "all_gather_single_autograd",
                        lambda t, gather_dim, group: torch.cat([t] * cp_size, dim=gather_dim))
    monkeypatch.setattr(funcol, "all_to_all_single_autograd", lambda t, out_sizes, in_sizes, group: t.clone())
    monkeypatch.setattr(dist_cp.dist, "all_gather_single", lambda out, t, group: out.copy_(torch.cat([t] * cp_size)))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_context_parallel_step_has_no_host_sync(spy, monkeypatch, checkpointed):
    """Rank 1 of cp=4 (one virtual group per rank) through the model's own context-parallel mixers:
    every index tensor is made on the device, once."""
    _fake_collectives(monkeypatch, 4)
    model = _meta_model(checkpointed)
    cp = ContextParallel(group=None, rank=1, size=4)
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp
    with spy:
        _training_step(model, 32)  # this rank's 32 of 128 tokens
    assert spy.events == []


def test_spy_catches_a_host_sync_and_a_host_index(spy):
    """The spy itself: bincount (which reads the largest index back) and a CPU index into device
    weights are both reported."""
    w = torch.randn(8, 4, device="meta")
    with spy:
        w.index_select(0, torch.arange(3))
        with pytest.raises(AssertionError, match="aten.bincount"):
            torch.bincount(torch.zeros(4, dtype=torch.long, device="meta"), minlength=8)
    assert any("host tensor" in e for e in spy.events)
    assert any("aten.bincount" in e for e in spy.events)


def test_context_parallel_indices_are_made_once_on_the_device():
    meta = torch.device("meta")
    first = dist_cp._time_order(16, 4, meta)
    assert first.device == meta and dist_cp._time_order(16, 4, meta) is first
    cpu = dist_cp._time_order(4, 2, torch.device("cpu"))
    assert cpu.tolist() == torch.argsort(torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])).tolist()


# ------------------------------------------------------------------------------------------ scan
def test_fallback_scan_runs_blockwise_off_cpu(monkeypatch):
    """The PyTorch scan on a non-CPU device (meta standing in for CUDA) runs in blocks of
    SCAN_BLOCK_TOKENS, as on CPU: 8k tokens are four blocks, not one."""
    blocks = []
    real = kernels._scan_block_forward

    def counting(*args):
        blocks.append(args[0].shape[1])
        return real(*args)

    monkeypatch.setattr(kernels, "_scan_block_forward", counting)
    b, l, h, p, g, n = 1, 8192, 4, 8, 1, 8
    x = torch.empty(b, l, h, p, device="meta")
    dt = torch.empty(b, l, h, device="meta")
    B = torch.empty(b, l, g, n, device="meta")
    kernels.SSDChunkScan.apply(x, dt, torch.empty(h, device="meta"), B, B, torch.empty(h, device="meta"), 64, None)
    assert blocks == [kernels.SCAN_BLOCK_TOKENS] * (l // kernels.SCAN_BLOCK_TOKENS)


# ------------------------------------------------------------------------------------------ import guard
@pytest.mark.parametrize("error", [OSError("libcudart.so.12: cannot open shared object file"),
                                   ImportError("causal_conv1d_cuda...so: undefined symbol: _ZN3c104cuda9SetDeviceEi"),
                                   RuntimeError("CUDA driver version is insufficient")])
def test_broken_kernel_install_falls_back_and_says_why_once(monkeypatch, caplog, error):
    def broken(name):
        raise error

    monkeypatch.setattr(kernels.importlib, "import_module", broken)
    kernels._cuda_conv.cache_clear()
    kernels._triton_scan.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=kernels.__name__):
            assert kernels._cuda_conv() is None and kernels._cuda_conv() is None
            assert kernels._triton_scan() is None
    finally:
        kernels._cuda_conv.cache_clear()
        kernels._triton_scan.cache_clear()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages  # once per kernel, however often it is asked for
    assert str(error) in messages[0] and "PyTorch path" in messages[0]


# ------------------------------------------------------------------------------------------ benchmark
def test_nominal_peak_by_device_name():
    from benchmarks.measure import nominal_peak_flops

    assert nominal_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert nominal_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert nominal_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert nominal_peak_flops("NVIDIA H200", torch.float32) is None
    assert nominal_peak_flops("CPU Xeon", torch.bfloat16) is None


def test_cuda_peak_memory_counts_only_the_model_measured(monkeypatch):
    """Both models and optimizers share the device: each model's peak is its own state plus its
    step's rise, whatever the other one holds (allocator calls faked, no GPU needed)."""
    from benchmarks import measure

    other = 10 * 2**30  # the other model and its optimizer, on the device all along
    state = {"allocated": other, "peak": other}

    def step():
        state["peak"] = max(state["peak"], state["allocated"] + 2**30)  # the step rises by 1 GiB

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    own = measure.resident_bytes(model, opt)
    assert own >= 3 * 4 * (256 * 256 + 256)  # weights and AdamW's two moments
    memory = measure.step_memory(step, model, torch.device("cuda"), opt)
    assert memory["peak"] == own + 2**30


# ------------------------------------------------------------------------------------------ GPU check script
def _gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *args], check=False, capture_output=True,
                          text=True,
                          timeout=120, env={"PATH": path, **env})


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("hydra_core-1.3.8-py3-none-any.whl", "not_installed_anywhere-1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    proc = _gpu_check("--dry-run", WHEELS=str(wheels), MAMBA_WHEELS="/opt/mamba")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "skip hydra_core-1.3.8-py3-none-any.whl: hydra_core is installed" in out
    assert (f"would run (limit 60s): python3 -m pip install -q --no-deps --no-index "
            f"{wheels}/not_installed_anywhere-1.0-py3-none-any.whl") in out
    assert "python3 -m pip install -q --no-deps --no-build-isolation -e ." in out
    assert "--no-deps --no-index --find-links /opt/mamba mamba-ssm causal-conv1d" in out
    assert "python3 -m pytest -q tests/test_gpu_ready.py" in out
    assert "python3 -m benchmarks.throughput --preset gpu_1b --dtype bf16 --device cuda" in out
    assert "tests/test_generation.py -k gpu_ready\\ or\\ cuda\\ or\\ transformers" in out
    assert "python3 -m benchmarks.decode --device cuda --dtypes bf16" in out
    limits = [int(line.split("(limit ")[1].split("s)")[0]) for line in out.splitlines() if "(limit " in line]
    assert sum(limits) <= 470, limits  # with the CUDA check, inside 8 minutes
    assert " python " not in out and "CUDA" not in proc.stderr  # python3 only, and no GPU asked for


def test_gpu_check_dry_run_without_wheels_says_how_to_get_them(tmp_path):
    proc = _gpu_check("--dry-run", WHEELS=str(tmp_path / "missing"))
    assert proc.returncode == 1
    assert f"no wheels in {tmp_path / 'missing'}/" in proc.stdout and "--download" in proc.stdout
    assert "would run" not in proc.stdout


def test_experts_with_unaligned_rows_take_the_per_expert_path():
    """Grouped GEMMs refuse rows that are not 16-byte aligned (CPU, torch 2.9 to 2.13): 20 bf16
    intermediate channels take one matmul per expert instead of raising."""
    cfg = dataclasses.replace(PRESETS["tiny"], moe_intermediate_size=20)
    torch.manual_seed(0)
    moe = model_mod.MoE(cfg).to(torch.bfloat16)
    x = torch.randn(2, 8, cfg.hidden_size, dtype=torch.bfloat16)
    assert not model_mod._grouped_mm_supported(x[0], moe.experts.up_proj)
    assert moe(x).shape == x.shape


# ------------------------------------------------------------------------------------------ the GPU image
def test_helpers_import_without_hydra():
    """The GPU image may lack hydra: the model and kernel tests import tests/helpers.py all the same."""
    code = ("import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None; "
            f"sys.path.insert(0, {str(REPO / 'tests')!r}); import helpers; print(helpers.scan_inputs.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "scan_inputs" in proc.stdout, proc.stderr[-2000:]


def test_document_ids_gather_without_all_gather_single(monkeypatch):
    """torch 2.11 has the single-tensor all-gather as all_gather_into_tensor only."""
    monkeypatch.delattr(dist_cp.dist, "all_gather_single", raising=False)
    calls = []

    def all_gather_into_tensor(out, t, group=None):
        calls.append(group)
        out.copy_(torch.cat([t, t + 100]))  # rank 1's ids: rank 0's plus 100

    monkeypatch.setattr(dist_cp.dist, "all_gather_into_tensor", all_gather_into_tensor)
    cp = ContextParallel(group="cp", rank=0, size=2)
    local = torch.arange(8).view(2, 4)  # [b, l]: two chunks of 2 per rank
    full = dist_cp.gather_sequence(local, cp)
    assert calls == ["cp"] and full.shape == (2, 8)
    assert full[0].tolist() == [0, 1, 100, 101, 102, 103, 2, 3]  # zig-zag: rank 0 holds chunks 0 and 3


def test_torch_range_and_cpu_pin_are_declared():
    """pyproject admits the GPU image's torch 2.11; CPU installs keep the exact 2.13.0 through the
    constraints file the README's commands and .ci/run use."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.11,<2.14"' in pyproject
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().splitlines()
    readme = (REPO / "README.md").read_text()
    assert "pip install -e . -c constraints.txt && python -m recipes.finetune" in readme
    assert "pip install -e '.[dev]' -c constraints.txt && pytest -q" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -e '.[dev]' -c constraints.txt" in ci and '/pytest" -q' in ci


# ------------------------------------------------------------------------------------------ on a GPU
@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or kernels._cuda_conv() is None, reason="needs causal_conv1d")
@pytest.mark.parametrize("tp,cp_size", [(4, 1), (1, 4), (2, 2), (4, 2)])
def test_cuda_conv_kernel_takes_the_parallel_layouts(monkeypatch, tp, cp_size):
    mixer = _local_mixer(tp).cuda()
    g, r = mixer.A_log.numel() // mixer.heads_per_group, mixer.heads_per_group
    xbc = torch.randn(2, 64, g, mixer.conv_group, device="cuda")
    dt = torch.randn(2, 64, g, r, device="cuda")
    docs = _documents(2, 64).cuda()

    def run():
        if cp_size == 1:
            return mixer.conv_and_scan(xbc, dt, document_ids=docs)
        return model_cp.context_parallel_conv_and_scan(mixer, xbc, dt, _identity_cp(monkeypatch, cp_size, 1), docs)

    out = run()
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ())
    torch.testing.assert_close(out, run(), rtol=1e-4, atol=1e-4)


@cuda
def test_cuda_attention_reaches_flash_or_memory_efficient_kernels():
    """Restricted to one backend, SDPA raises if the call cannot run there (never the math kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    docs = _documents(2, 256).cuda()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        causal_attention(q, k, k)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        causal_attention(q, k, k, docs)
        causal_attention(q.float(), k.float(), k.float())
        causal_attention(q.float(), k.float(), k.float(), docs)


@cuda
def test_cuda_training_step_has_no_host_sync(monkeypatch):
    """The tiny preset in bf16 on the GPU, PyTorch scan and conv, under CUDA's sync debug mode."""
    monkeypatch.setattr(kernels, "_triton_scan", lambda: None)
    monkeypatch.setattr(kernels, "_KERNEL_DEVICES", ())
    torch.manual_seed(0)
    model = NemotronHForCausalLM(PRESETS["tiny"]).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    docs = _documents(2, 128).cuda()
    model(ids, targets=ids, loss_chunk_size=64, document_ids=docs).loss_sum.backward()  # warm caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(ids, targets=ids, loss_chunk_size=64, document_ids=docs).loss_sum.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------ GPU check carry
# What travels to a lent GPU machine is limited to 64 MiB, working tree included.
WHEELS_LIMIT = 20 * 2**20
# A pin this environment does not have is counted at this much: every pure-Python wheel of the list is
# below it, and the large binary ones (pyarrow, pandas) come with `datasets` in the dev install.
UNMEASURED_WHEEL = 2**20


def _installed_size(name: str) -> int | None:
    """Bytes the distribution `name` occupies installed (an upper bound on its compressed wheel), or None."""
    import importlib.metadata as metadata

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return sum(p.stat().st_size for f in dist.files or [] if (p := Path(dist.locate_file(f))).is_file())


def test_gpu_check_wheels_fit_the_carry():
    proc = _gpu_check("--dry-run", WHEELS="/nonexistent")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("wheels --download fetches:"))
    pins = line.split(":", 1)[1].split()
    names = [p.split("==")[0].lower() for p in pins]
    assert "hydra-core" in names and "pytest" in names, pins
    assert not {"datasets", "pyarrow", "pandas"} & set(names), pins
    sizes = {n: _installed_size(n) for n in names}
    total = sum(UNMEASURED_WHEEL if s is None else s for s in sizes.values())
    assert total <= WHEELS_LIMIT, sizes


# In the children below these are missing, as on an image without them.
_BLOCK_IMPORTS = """
import importlib.abc, importlib.util, runpy, sys
class Missing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("datasets", "pyarrow", "pandas"):
            return importlib.util.spec_from_loader(name, self)  # no origin: torch's probes pass over it
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (hidden)", name=spec.name)
sys.meta_path.insert(0, Missing())
"""


def test_default_run_and_gpu_check_need_neither_pyarrow_nor_pandas(tmp_path):
    """The GPU check's modules import, and a default run trains, with datasets, pyarrow and pandas missing;
    a Parquet source then asks for the install line."""
    modules = ["benchmarks.throughput", "recipes.export", "recipes.plan", "nemotron_recipe.training.finetune"]
    code = _BLOCK_IMPORTS + f"""
import importlib
for m in {modules!r}:
    importlib.import_module(m)
sys.argv = ["recipes.finetune", "hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2", "trainer.val_every=0",
            "data.val_max_batches=1", "trainer.preflight=false", "logger.console.progress_bar=false"]
runpy.run_module("recipes.finetune", run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    parquet = tmp_path / "rows.parquet"
    parquet.write_bytes(b"PAR1")
    code = _BLOCK_IMPORTS + f"""
from nemotron_recipe.data import Columns, DataError, load_rows
try:
    load_rows({str(parquet)!r}, field_name="data.train_file", cols=Columns())
except DataError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    assert f"data.train_file={str(parquet)!r}: reading a parquet file needs the `datasets` package" in out, out
    assert "pip install -e '.[datasets]' -c constraints.txt" in out
