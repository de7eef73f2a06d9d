"""The fused norms, the scan's output and gradient dtypes, its chunk-length knob, and the harnesses
that profile a step and time the PyTorch path (no test here times anything)."""

import pytest
import torch

from nemotron_recipe.models.nemotron_v3 import kernels
from nemotron_recipe.models.nemotron_v3.model import GatedGroupRMSNorm, RMSNorm
from nemotron_recipe.models.nemotron_v3.ssd import ssd_naive

from helpers import scan_inputs

TINY = ["--preset", "tiny", "--hidden", "32", "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1",
        "--set", "chunk_size=16", "--batch", "2", "--seq-len", "32"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _norm_outputs(module, inputs, grad, fused):
    type(module).fused = fused
    try:
        out = module(*inputs)
        return out, torch.autograd.grad(out, [*inputs, module.weight], grad)
    finally:
        type(module).fused = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "gated"])
def test_fused_norms_match_the_plain_modules(kind, dtype):
    """Forward bit for bit (the same ops in the same order); gradients within fp32 rounding (fp32
    inputs; the backward's ops run in another order), and bit for bit in bf16 (rounded once from fp32)."""
    g = torch.Generator().manual_seed(0)
    module = (RMSNorm(32, 1e-5) if kind == "rms" else GatedGroupRMSNorm(32, 8, 1e-5)).to(dtype)
    module.weight.data = torch.randn(32, generator=g).to(dtype)
    inputs = [torch.randn(2, 5, 32, generator=g).to(dtype).requires_grad_() for _ in range(1 if kind == "rms" else 2)]
    grad = torch.randn(2, 5, 32, generator=g).to(dtype)
    out, grads = _norm_outputs(module, inputs, grad, fused=True)
    ref, ref_grads = _norm_outputs(module, inputs, grad, fused=False)
    assert torch.equal(out, ref)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert a.dtype == b.dtype
        assert _rel(a, b) <= (1e-6 if dtype == torch.float32 else 0), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "gated"])
def test_fused_norms_by_row_blocks_match_one_pass(kind, dtype, monkeypatch):
    """On CPU the fused norms run block by block of rows (here 3 rows a block, the last one short).
    Every row is computed as in one pass: outputs and input gradients bit for bit. The weight
    gradient adds the blocks' fp32 partial sums: fp32 summation order apart (fp32), or one bf16
    rounding of that sum apart (bf16). Both stay within the plain module's tolerances above."""
    from nemotron_recipe.models.nemotron_v3 import norms

    width = 32
    g = torch.Generator().manual_seed(2)
    module = (RMSNorm(width, 1e-5) if kind == "rms" else GatedGroupRMSNorm(width, 8, 1e-5)).to(dtype)
    module.weight.data = torch.randn(width, generator=g).to(dtype)
    inputs = [torch.randn(2, 5, width, generator=g).to(dtype).requires_grad_() for _ in range(2 - (kind == "rms"))]
    grad = torch.randn(2, 5, width, generator=g).to(dtype)
    one_pass, one_pass_grads = _norm_outputs(module, inputs, grad, fused=True)
    ref, ref_grads = _norm_outputs(module, inputs, grad, fused=False)
    monkeypatch.setattr(norms, "ROW_BLOCK_ELEMENTS_PER_THREAD", 3 * width)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert len(norms._row_blocks(10, norms._block_rows(inputs[0]))) == 4
    out, grads = _norm_outputs(module, inputs, grad, fused=True)
    assert torch.equal(out, one_pass)
    for a, b in zip(grads[:-1], one_pass_grads[:-1]):
        assert torch.equal(a, b)
    assert grads[-1].dtype == one_pass_grads[-1].dtype
    assert _rel(grads[-1], one_pass_grads[-1]) <= (1e-6 if dtype == torch.float32 else 2 ** -8)
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) <= (1e-6 if dtype == torch.float32 else 2 ** -8)
    with torch.no_grad():  # generation and evaluation take the blocked forward too
        assert torch.equal(module(*inputs), one_pass)


def test_scan_output_and_gradients_in_their_dtypes():
    """`out_dtype` rounds the fp32 result once; gradients come back in the inputs' dtypes, equal to
    the fp32 path's rounded once, and the fp32 result still matches the recurrence."""
    g = torch.Generator().manual_seed(1)
    x, dt, A, B, C, D = scan_inputs(40, g)
    inputs = [x.to(torch.bfloat16), dt, A, B.to(torch.bfloat16), C.to(torch.bfloat16), D]
    inputs = [t.requires_grad_() for t in inputs]
    grad = torch.randn(2, 40, 6, 4, generator=g)
    y32 = kernels.SSDChunkScan.apply(*inputs, 8, None)
    y16 = kernels.SSDChunkScan.apply(*inputs, 8, None, torch.bfloat16)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))
    exact = ssd_naive(*[t.detach().double() for t in inputs])
    assert _rel(y32, exact) <= 1e-2
    g32 = torch.autograd.grad(y32, inputs, grad)
    g16 = torch.autograd.grad(y16, inputs, grad.to(torch.bfloat16))
    for a, b, t in zip(g16, g32, inputs):
        assert a.dtype == b.dtype == t.dtype
        assert _rel(a, b) <= 1e-2  # the incoming gradient rounded to bf16, nothing else


def test_scan_chunk_knob_per_device(monkeypatch):
    x = torch.zeros(1, 4, 2, 64)
    B = torch.zeros(1, 4, 1, 64)
    assert kernels.scan_chunk_size(x, B, 128) == kernels.cpu_chunk_size(128, 64, 64) == 32
    monkeypatch.setitem(kernels.SCAN_CHUNK_SIZE, "cpu", 64)
    assert kernels.scan_chunk_size(x, B, 128) == 64 and kernels.scan_chunk_size(x, B, 16) == 16
    assert kernels._triton_scan_call(x, None) is None  # on CPU the PyTorch scan runs


def test_profile_categories_add_up_and_record(tmp_path, capsys, monkeypatch):
    from benchmarks import profile_step

    monkeypatch.setattr(profile_step, "RESULTS", tmp_path / "R.md")
    profile_step.main([*TINY, "--dtype", "fp32", "--warmup", "0", "--steps", "1", "--copies", "3", "--label", "t",
                       "--peak-size", "256"])
    out = capsys.readouterr().out
    shares = [float(line.split(":")[1].rstrip("%")) for line in out.splitlines()
              if line.strip().split(":")[0] in profile_step.CATEGORIES]
    assert len(shares) == len(profile_step.CATEGORIES) and abs(sum(shares) - 100) < 0.5
    assert shares[0] > 0 and shares[2] > 0 and shares[3] > 0  # matmul, scan, norms all found
    row = (tmp_path / "R.md").read_text().strip().splitlines()[-1]
    assert " | t | " in row and "MFU" not in row and row.count("|") == profile_step.HEADER.count("|")


def test_pytorch_path_harness_runs_on_cpu(tmp_path, capsys, monkeypatch):
    from benchmarks import pytorch_path

    monkeypatch.setattr(pytorch_path, "RESULTS", tmp_path / "R.md")
    pytorch_path.main([*TINY, "--device", "cpu", "--warmup", "0", "--steps", "1", "--scan-chunks", "8,16",
                       "--no-compile"])
    out = capsys.readouterr().out
    assert "kernels installed: False" in out and "step  pytorch" in out and "scan    pytorch eager chunk    8" in out
    text = (tmp_path / "R.md").read_text()
    assert pytorch_path.STEP_HEADER in text and pytorch_path.SCAN_HEADER in text
    assert kernels._triton_scan is not None and kernels._cuda_conv is not None  # restored
