"""What the benchmarks measure: step times (interleaved, so a shared machine's load falls on every
variant alike), matmul peaks for MFU, and memory (peak resident set or CUDA allocator peak, bytes
autograd keeps for backward), and which device it was."""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call. On a CPU that other jobs share, CPU
    time leaves out the time spent waiting for a core, so its ratio is the steadier one."""
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def interleaved_times(steps: dict[str, Callable[[], None]], device: torch.device, warmup: int,
                      rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, CPU seconds) of each step over `rounds` rounds after `warmup` untimed ones. The
    steps alternate within a round, so a change in the machine's load falls on all of them alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu_times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            wall, cpu = timed(step, device)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    return times, cpu_times


# ---------------------------------------------------------------------------------------- measures
# Dense bf16 tensor-core peaks from NVIDIA's datasheets (without sparsity), by device name; the
# first key the name contains wins (so "H100 PCIe" before "H100", which reads as the SXM part).
NOMINAL_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
}


def nominal_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak for bf16 on the device called `name`; None when not in the table."""
    if dtype != torch.bfloat16:
        return None
    return next((peak for key, peak in NOMINAL_BF16_FLOPS.items() if key in name), None)


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul of `dtype` on `device` (the MFU denominator)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(reps):
        seconds, _ = timed(lambda: a @ b, device)
        best = max(best, 2 * n**3 / seconds)
    return best


def _rss_hwm() -> tuple[int, int] | None:
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _reset_hwm() -> bool:
    """Return freed heap pages to the kernel, then restart the high-water mark from the current RSS.

    Without the trim, memory that the allocator keeps from earlier steps would be reused unseen and
    the peak above the start would read near zero.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_allocator_peak(step: Callable[[], None]) -> int:
    """Peak bytes PyTorch's CPU allocator holds during `step` above what it held at its start: the
    CPU counterpart of CUDA's allocator peak, from the profiler's allocation and free events (every
    tensor allocation, in any thread), so malloc's reuse and the kernel's paging do not blur it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a plain tensor's storage; None for one without live storage (FSDP
    frees the storage of its gathered parameters between uses) or a tensor subclass."""
    if type(t) is not torch.Tensor:
        return None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return None


@contextlib.contextmanager
def saved_tensor_bytes(model: torch.nn.Module, total: list[int]):
    """Adds to total[0] the bytes of every storage autograd saves for backward, parameters excluded."""
    params = {s[0] for p in model.parameters() if (s := _storage(p.to_local() if hasattr(p, "to_local") else p))}
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        s = _storage(t) if isinstance(t, torch.Tensor) else None
        if s is not None and s[0] not in params and s[0] not in seen:
            seen.add(s[0])
            total[0] += s[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the storages of the model's parameters, buffers and gradients and of the optimizer's
    state, each storage counted once (sharded parameters: this rank's shards)."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def step_memory(step: Callable[[], None], model: torch.nn.Module, device: torch.device,
                optimizer: torch.optim.Optimizer | None = None, *, saved: bool = True) -> dict[str, int | None]:
    """Peak memory of one step: on CUDA the model's own weights, gradients and optimizer state plus
    the allocator's peak above the step's start (the peak it would have alone on the device); on CPU
    the peak RSS above the pre-step RSS. With `saved`, a second step counts the bytes autograd saves
    for backward (`activations`)."""
    out: dict[str, int | None] = {"peak": None, "activations": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        own = resident_bytes(model, optimizer)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        out["peak_above_start"] = torch.cuda.max_memory_allocated(device) - base
        out["peak"] = own + out["peak_above_start"]
        out["device_peak"] = torch.cuda.max_memory_allocated(device)  # both models on the device
    else:
        if _reset_hwm() and (before := _rss_hwm()) is not None:
            step()
            after = _rss_hwm()
            out["peak"] = after[1] - before[0]
        else:
            step()
    if saved:
        total = [0]
        with saved_tensor_bytes(model, total):
            step()
        out["activations"] = total[0]
    return out


class _StoragesMade(TorchDispatchMode):
    """Weak references to the storage of every plain tensor an op returns while the mode is active."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled region is one op here, its outputs (saved activations too) tracked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is torch.Tensor:
                ref = StorageWeakRef(t.untyped_storage())
                known = self.refs.get(ref.cdata)
                if known is None or known.expired():  # a freed storage's address may be reused
                    self.refs[ref.cdata] = ref
        return out

    def live_bytes(self, excluded: set[int]) -> int:
        total = 0
        for key, ref in self.refs.items():
            if key not in excluded and not ref.expired():
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


def kept_for_backward(forward: Callable[[], Any], model: torch.nn.Module) -> tuple[int, Any]:
    """(bytes of the storages `forward` creates that are still alive when it returns, parameters
    excluded; what `forward` returned). Called before backward, that is the memory autograd keeps for
    backward, whatever keeps it: saved tensors, the inputs of checkpointed blocks, selective
    checkpointing's cache of kept outputs (plus the forward's own result). `saved_tensor_bytes` sees
    none of what a checkpointed block keeps: checkpointing installs saved-tensor hooks of its own,
    and only the innermost hooks run. Tensors made inside a tensor subclass's dispatch (DTensor's
    local shards under tensor parallel) are not seen."""
    tracker = _StoragesMade()
    with tracker:
        result = forward()
    params = {StorageWeakRef(p.untyped_storage()).cdata
              for p in (q.to_local() if hasattr(q, "to_local") else q for q in model.parameters())}
    return tracker.live_bytes(params), result


# ---------------------------------------------------------------------------------------- devices
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} threads"


def cpu_bf16_support() -> str:
    """Which bf16 matmul the CPU offers (AMX tiles, AVX-512 BF16, or none: bf16 is then emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    if "amx_bf16" in flags:
        return "amx_bf16"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "none"
