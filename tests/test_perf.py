"""Fast paths against the plain paths they replace, and the benchmark harness (FLOP counts: test_flops.py).

No test here times anything: speed is measured by `benchmarks/throughput.py`, side by side with
the reference, and recorded in benchmarks/RESULTS.md.
"""

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.kernels import (
    SSDChunkScan,
    causal_conv1d_silu,
    cpu_chunk_size,
    linear_cross_entropy_sum,
    ssd_scan,
)
from nemotron_recipe.models.nemotron_v3.ssd import ssd_chunked, ssd_naive
from nemotron_recipe.training.compile import compile_blocks
from nemotron_recipe.training.loss import cross_entropy_sum

from helpers import SMALL_DIMS, loss_and_grads, scan_inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ------------------------------------------------------------------------------------------ Mamba2 ops
def _scan_inputs(seq, dtype=torch.float64, docs=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    inputs = scan_inputs(seq, g, dtype=dtype)
    doc = None
    if docs:  # three documents per row, cut at random places (one row may start a document mid-chunk)
        cuts = torch.sort(torch.randint(1, seq, (inputs[0].shape[0], 2), generator=g), dim=1).values
        doc = (torch.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1).to(device)
    inputs = [t.to(device).requires_grad_() for t in inputs]
    return inputs, doc


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("seq_len,chunk", [(64, 16), (50, 16), (7, 16), (33, 8)])
def test_scan_node_matches_recurrence_with_gradients(seq_len, chunk, docs):
    inputs, doc = _scan_inputs(seq_len, docs=docs, seed=seq_len)
    ref = ssd_naive(*inputs, document_ids=doc)
    out = SSDChunkScan.apply(*inputs, chunk, doc)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad_y = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, inputs, grad_y), torch.autograd.grad(ref, inputs, grad_y)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_scan_node_gradcheck():
    inputs, doc = _scan_inputs(12, docs=True, seed=3)
    assert torch.autograd.gradcheck(lambda *t: SSDChunkScan.apply(*t, 4, doc), inputs)


def test_scan_node_matches_plain_scan_fp32():
    inputs, _ = _scan_inputs(70, dtype=torch.float32, seed=5)
    plain = ssd_chunked(*inputs, 16)
    fast = ssd_scan(*inputs, 16)  # on CPU it may pick another chunk: same function
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    grad_y = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(fast, inputs, grad_y), torch.autograd.grad(plain, inputs, grad_y)):
        assert _rel(a, b) <= 1e-5



@pytest.mark.parametrize("docs", [False, True])
def test_scan_node_bf16_products_stay_at_bf16_precision(docs):
    """bf16 inputs: the products take bf16 operands, decays and sums stay fp32. Against the exact
    (fp64) scan of the same bf16 values, outputs and gradients are within a few bf16 roundings
    (measured 1e-3 to 5e-3; a broken layout would be off by O(1)). A's gradient, a sum over every
    position with heavy cancellation, scatters more (up to 6e-2 over 20 random output gradients);
    test_model.py checks the whole bf16 model's gradients against transformers' in bf16."""
    inputs, doc = _scan_inputs(128, docs=docs, seed=3)
    bf16 = [t.detach().to(torch.bfloat16).requires_grad_() for t in inputs]
    exact_in = [t.detach().double().requires_grad_() for t in bf16]
    exact = ssd_naive(*exact_in, document_ids=doc)
    out = SSDChunkScan.apply(*bf16, 32, doc)
    assert out.dtype == torch.float32 and _rel(out, exact) <= 1e-2
    grad_y = torch.randn(exact.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = torch.autograd.grad(out, bf16, grad_y.float())
    for name, a, b in zip("x dt A B C D".split(), ours, torch.autograd.grad(exact, exact_in, grad_y)):
        assert a.dtype == torch.bfloat16 and _rel(a, b) <= (1e-1 if name == "A" else 1e-2), name

def _conv_per_document(x, weight, bias, doc):
    """Reference: each document convolved on its own, zero-padded at its start."""
    k = weight.shape[-1]
    rows = []
    for i in range(x.shape[0]):
        pieces = []
        for d in doc[i].unique_consecutive():
            part = x[i, doc[i] == d].T[None]
            pieces.append(F.silu(F.conv1d(F.pad(part, (k - 1, 0)), weight, bias, groups=x.shape[-1]))[0].T)
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


@pytest.mark.parametrize("docs", [False, True])
def test_conv_node_matches_conv1d(docs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 23, 6, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(6, 1, 4, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_()
    doc = torch.tensor([[0] * 9 + [1] * 2 + [2] * 12, [5] * 23]) if docs else torch.zeros(2, 23, dtype=torch.long)
    ref = _conv_per_document(x, weight, bias, doc)
    out = causal_conv1d_silu(x, weight, bias, doc if docs else None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad_y = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, weight, bias), grad_y),
                    torch.autograd.grad(ref, (x, weight, bias), grad_y)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("docs,bias", [(False, True), (True, False)])
def test_conv_under_compile_matches_conv1d(docs, bias):
    """Under torch.compile the conv takes its compiler-friendly form (`TracedCausalConv1dSiLU` on
    `conv_taps`); it computes the same function and gradients, documents kept apart."""
    from nemotron_recipe.models.nemotron_v3 import kernels

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 23, 6, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(6, 1, 4, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    doc = torch.tensor([[0] * 9 + [1] * 2 + [2] * 12, [5] * 23]) if docs else None
    ref = _conv_per_document(x, weight, b, doc if docs else torch.zeros(2, 23, dtype=torch.long))
    grad_y = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    inputs = [t for t in (x, weight, b) if t is not None]
    ref_grads = torch.autograd.grad(ref, inputs, grad_y)

    ops = []

    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(causal_conv1d_silu, backend=record, fullgraph=True)(x, weight, b, doc)
    assert any("conv_taps" in op for op in ops), ops
    torch._dynamo.reset()  # so that the compile below runs inductor, not the recorded graph
    taps = kernels.conv_taps(weight.reshape(6, 4), torch.float64)
    outputs = {
        "traced, eager": kernels.TracedCausalConv1dSiLU.apply(x, taps, b, doc),
        "compiled": torch.compile(causal_conv1d_silu, fullgraph=True)(x, weight, b, doc),
    }
    for name, out in outputs.items():
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=name)
        for got, want in zip(torch.autograd.grad(out, inputs, grad_y), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
    torch._dynamo.reset()


def test_conv_node_bf16_accumulates_in_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 8, generator=g).to(torch.bfloat16)
    weight = torch.randn(8, 1, 4, generator=g).to(torch.bfloat16)
    ref = _conv_per_document(x.double(), weight.double(), None, torch.zeros(2, 40, dtype=torch.long))
    out = causal_conv1d_silu(x, weight, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=8e-3)  # one bf16 rounding of the output


def test_scan_blocks_carry_state_and_documents(monkeypatch):
    from nemotron_recipe.models.nemotron_v3 import kernels

    inputs, doc = _scan_inputs(100, docs=True, seed=11)
    ref = ssd_naive(*inputs, document_ids=doc)
    grad_y = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad_y)
    monkeypatch.setattr(kernels, "SCAN_BLOCK_TOKENS", 16)  # 8 tokens per row: one chunk per block
    out = SSDChunkScan.apply(*inputs, 8, doc)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(out, inputs, grad_y), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_expert_loop(dtype, monkeypatch):
    from nemotron_recipe.models.nemotron_v3 import model as model_module

    torch.manual_seed(0)
    experts = model_module.Experts(NemotronHConfig(pattern="E", **SMALL_DIMS))
    torch.nn.init.normal_(experts.up_proj)
    torch.nn.init.normal_(experts.down_proj)
    experts = experts.to(dtype)
    x = torch.randn(50, 32, dtype=dtype, requires_grad=True)
    idx = torch.stack([torch.randint(0, 3, (50,)), torch.full((50,), 3)], dim=1)  # expert 3: all; none: none
    idx[:10, 1] = 0
    weights = torch.rand(50, 2)
    grad_out = torch.randn(50, 32, dtype=dtype)

    def run():
        out = experts(x, weights, idx)
        return (out, *torch.autograd.grad(out, (x, experts.up_proj, experts.down_proj), grad_out))

    assert model_module._grouped_mm_supported(x, experts.up_proj)
    grouped = run()
    monkeypatch.setattr(model_module, "_grouped_mm_supported", lambda *a: False)
    for a, b in zip(grouped, run()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("docs", [False, True])
def test_model_fast_ops_match_plain_ops(docs, monkeypatch):
    from nemotron_recipe.models.nemotron_v3.model import Mamba2Mixer

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*EM-", **SMALL_DIMS))
    ids = torch.randint(0, 64, (2, 40))
    doc = torch.tensor([[0] * 17 + [1] * 23, [0] * 40]) if docs else None

    fast_loss, fast = loss_and_grads(model, ids, doc)
    monkeypatch.setattr(Mamba2Mixer, "fast_ops", False)
    plain_loss, plain = loss_and_grads(model, ids, doc)
    assert abs(fast_loss.item() - plain_loss.item()) <= 1e-6 * abs(plain_loss.item())
    for name, g in plain.items():
        assert _rel(fast[name], g) <= 1e-5, name


def test_cpu_chunk_size_never_exceeds_the_model_chunk():
    assert cpu_chunk_size(8, 64, 128) == 8
    assert cpu_chunk_size(128, 64, 64) == 32 and cpu_chunk_size(128, 64, 128) == 64


# Triton runs an fp32 `tl.dot` on TF32 operands (10-bit mantissa) unless a kernel asks otherwise, and
# mamba_ssm's scan kernels do not ask: their fp32 results carry TF32 rounding, 4.6e-3 to 6.6e-3 here
# when emulated. The bound is TF32's, 2e-2; the PyTorch scan (no mamba_ssm) meets 1e-3.
TF32_SCAN_TOL = 2e-2


@cuda
def test_cuda_scan_matches_plain_scan():
    from nemotron_recipe.models.nemotron_v3.kernels import _triton_scan

    tol = TF32_SCAN_TOL if _triton_scan() is not None else 1e-3
    inputs, doc = _scan_inputs(300, dtype=torch.float32, docs=True, seed=7, device="cuda")
    plain = ssd_chunked(*inputs, 64, document_ids=doc)
    fast = ssd_scan(*inputs, 64, doc)  # the Triton kernels when mamba_ssm is installed
    torch.testing.assert_close(fast.float(), plain, rtol=tol, atol=tol)
    grad_y = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(fast.float(), inputs, grad_y), torch.autograd.grad(plain, inputs, grad_y)):
        assert _rel(a, b) <= tol


@cuda
def test_cuda_model_matches_cpu_model():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*-E", **SMALL_DIMS))
    ids = torch.randint(0, 64, (2, 40))
    loss_cpu, grads_cpu = loss_and_grads(model, ids)
    model.cuda()
    loss_gpu, grads_gpu = loss_and_grads(model, ids.cuda())
    from nemotron_recipe.models.nemotron_v3.kernels import _triton_scan

    tf32 = _triton_scan() is not None  # the Triton scan's TF32 products (TF32_SCAN_TOL)
    assert abs(loss_gpu.item() - loss_cpu.item()) <= (1e-3 if tf32 else 1e-4) * abs(loss_cpu.item())
    for name, g in grads_cpu.items():
        assert _rel(grads_gpu[name].cpu(), g) <= (TF32_SCAN_TOL if tf32 else 1e-3), name


# ------------------------------------------------------------------------------------------ loss
@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
def test_chunked_loss_equals_plain_fp32(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 37, 32, requires_grad=True)
    weight = (0.1 * torch.randn(300, 32)).requires_grad_()
    targets = torch.randint(0, 300, (3, 37))
    targets[0, :5] = -100
    targets[2, -1] = -100

    plain, count = cross_entropy_sum(F.linear(hidden, weight).float(), targets)
    (plain / count).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    chunked, count2 = linear_cross_entropy_sum(hidden, weight, targets, chunk)
    (chunked / count2).backward()
    assert count2 == count == 3 * 37 - 6
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())
    assert _rel(hidden.grad, grads[0]) <= 1e-6
    assert _rel(weight.grad, grads[1]) <= 1e-6


def test_chunked_loss_bf16_and_no_grad():
    torch.manual_seed(1)
    hidden = torch.randn(2, 20, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.1 * torch.randn(50, 16)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (2, 20))
    plain, _ = cross_entropy_sum(F.linear(hidden, weight).float(), targets)
    plain.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked, _ = linear_cross_entropy_sum(hidden, weight, targets, 8)
    chunked.backward()
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())  # both fp32 from the same logits
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert _rel(hidden.grad, grads[0]) <= 1e-2 and _rel(weight.grad, grads[1]) <= 1e-2
    with torch.no_grad():
        again, _ = linear_cross_entropy_sum(hidden, weight, targets, 8)
    assert again.item() == chunked.item()


def test_model_chunked_loss_equals_plain_loss():
    from nemotron_recipe.training.loss import forward_loss_sum

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M-", **SMALL_DIMS))
    ids = torch.randint(0, 64, (3, 30))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    results = []
    for chunk in (None, 16):
        model.zero_grad(set_to_none=True)
        loss_sum, count = forward_loss_sum(model, ids, targets, loss_chunk_size=chunk, backward_denominator=87.0)
        results.append((loss_sum.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, n0, g0), (chunked, n1, g1) = results
    assert n0 == n1 == 87
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())
    for name, g in g0.items():
        assert _rel(g1[name], g) <= 1e-5, name
    assert model(ids, targets=targets, loss_chunk_size=16).logits is None  # never materialised


def test_recipe_with_chunked_loss_matches_plain(tmp_path):
    from hydra import compose, initialize_config_dir

    from nemotron_recipe.training.finetune import run

    conf = Path(__file__).resolve().parents[1] / "conf"
    base = ["trainer.max_steps=2", "trainer.val_every=0", "trainer.log_every=1", "trainer.seq_len=32",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "data.val_max_batches=1",
            "logger.console.progress_bar=false", "checkpoint.save_final=false"]
    summaries = []
    for i, extra in enumerate(([], ["trainer.loss_chunk_size=24"])):
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = compose(config_name="finetune", overrides=[*base, f"run_dir={tmp_path / str(i)}", *extra])
        summaries.append(run(cfg))
    plain, chunked = summaries
    assert abs(chunked["final_loss"] - plain["final_loss"]) <= 1e-5 * abs(plain["final_loss"])
    assert abs(chunked["last_val_loss"] - plain["last_val_loss"]) <= 1e-5 * abs(plain["last_val_loss"])


def test_chunked_loss_refuses_dtensors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.zeros(4, 3), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(TypeError, match="cross_entropy_sum"):
            linear_cross_entropy_sum(torch.zeros(2, 3), weight, torch.zeros(2, dtype=torch.long), 1)
    finally:
        if created:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ compile


def test_compiled_blocks_match_eager():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="M*", **SMALL_DIMS))
    ids = torch.randint(0, 64, (2, 16))
    loss0, grads0 = loss_and_grads(model, ids)
    assert compile_blocks(model, probe=lambda: loss_and_grads(model, ids))
    loss1, grads1 = loss_and_grads(model, ids)
    assert abs(loss1.item() - loss0.item()) <= 1e-5 * abs(loss0.item())
    for name, g in grads0.items():
        assert _rel(grads1[name], g) <= 1e-4, name
    torch._dynamo.reset()


def test_compile_failure_falls_back_with_a_warning(caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler on this machine")

    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(pattern="-", **SMALL_DIMS))
    ids = torch.randint(0, 64, (2, 16))
    loss0, _ = loss_and_grads(model, ids)
    with caplog.at_level(logging.WARNING):
        ok = compile_blocks(model, probe=lambda: loss_and_grads(model, ids), backend=broken_backend)
    assert not ok
    assert "running the blocks eagerly" in caplog.text and "no compiler on this machine" in caplog.text
    loss1, _ = loss_and_grads(model, ids)
    assert loss1.item() == loss0.item()
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ harness
def test_throughput_harness_runs_and_records(tmp_path, capsys, monkeypatch):
    from benchmarks import throughput

    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(throughput, "RESULTS", results)
    throughput.main([
        "--preset", "tiny", "--hidden", "32", "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1",
        "--set", "chunk_size=16", "--batch", "2", "--seq-len", "32", "--warmup", "0", "--steps", "1",
        "--peak-size", "256",
    ])
    out = capsys.readouterr().out
    assert "ours/theirs tokens/s" in out and "MFU" in out
    text = results.read_text()
    assert throughput.COMPARE_HEADER in text
    row = text.strip().splitlines()[-1]
    assert row.startswith("| ") and "--seq-len 32" in row and "tiny (" in row


def test_ac_harness_times_every_mode_against_none(tmp_path, capsys, monkeypatch):
    from benchmarks import throughput
    from nemotron_recipe.distributed.activation_checkpoint import AC_MODES

    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(throughput, "RESULTS", results)
    throughput.main([
        "--ac", "--preset", "tiny", "--hidden", "32", "--set", "num_attention_heads=2", "--set",
        "num_key_value_heads=1", "--set", "chunk_size=16", "--batch", "2", "--seq-len", "32", "--warmup", "0",
        "--steps", "1",
    ])
    out = capsys.readouterr().out
    assert all(f" {mode} " in out for mode in AC_MODES) and "kept for backward" in out
    lines = results.read_text().splitlines()
    rows = lines[lines.index(throughput.AC_HEADER) + 2:]
    assert [row.split(" | ")[6] for row in rows] == ["none", "blocks", "full", "selective", "every_nth (every=2)"]
    assert all("`python -m benchmarks.throughput --ac " in row for row in rows)
    assert rows[0].split(" | ")[8].startswith("1.00x") and rows[0].split(" | ")[10] == "1.00x"


def test_results_rows_go_under_their_own_table(tmp_path):
    from benchmarks.results import append_row
    from benchmarks.throughput import COMPARE_HEADER, SWEEP_HEADER

    path = tmp_path / "R.md"
    append_row(COMPARE_HEADER, "| a |", path)
    append_row(SWEEP_HEADER, "| s |", path)
    append_row(COMPARE_HEADER, "| b |", path)
    lines = path.read_text().splitlines()
    assert lines.index("| b |") == lines.index("| a |") + 1
    assert lines.index("| s |") > lines.index(SWEEP_HEADER) > lines.index("| b |")


def test_sweep_needs_a_mamba_only_pattern():
    from benchmarks import throughput

    with pytest.raises(SystemExit, match="Mamba-only"):
        throughput.main(["--sweep-seq", "--pattern", "M*", "--no-record"])


def test_peak_is_finite():
    from benchmarks.throughput import peak_matmul_flops

    peak = peak_matmul_flops(torch.device("cpu"), torch.float32, n=64, reps=2)
    assert math.isfinite(peak) and peak > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_stops_at_once_without_cuda():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "SKIP_INSTALL": "1"})
    assert proc.returncode == 1
    assert "no usable torch with CUDA" in proc.stdout and "CUDA is not available" in proc.stderr
