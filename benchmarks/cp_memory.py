"""Per-rank activation memory with context parallel against without, at a long sequence.

    torchrun --standalone --nproc-per-node 2 benchmarks/cp_memory.py --seq-len 8192

Activation memory is measured as the bytes autograd saves for the backward pass during one forward
(parameters excluded, each storage counted once), which is what context parallel divides; on a GPU
the CUDA allocator's peak is printed beside it. The reference (cp 1) runs on every rank in the same
job: the whole sequence through the same model without context parallel.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence
from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.parallelization import _decoder_blocks, apply_context_parallel


@contextlib.contextmanager
def saved_activation_bytes(model: torch.nn.Module, out: list[int]):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            out[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def forward_backward(model, ids, device) -> tuple[int, int]:
    """(saved activation bytes, CUDA peak bytes or 0) of one forward and backward."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    total = [0]
    with saved_activation_bytes(model, total):
        loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return total[0], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pattern", default="M*M-ME")
    args = parser.parse_args()

    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = NemotronHConfig(pattern=args.pattern, hidden_size=args.hidden, chunk_size=128)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), device=device)

    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg).to(device)
    ref_saved, ref_peak = forward_backward(model, ids, device)

    mesh = dist.device_mesh.init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    apply_context_parallel(_decoder_blocks(model)[1], mesh["cp"])
    cp = ContextParallel(mesh.get_group(), rank, world)
    cp_saved, cp_peak = forward_backward(model, shard_sequence(ids, cp), device)

    rows = [torch.tensor([ref_saved, cp_saved, ref_peak, cp_peak], dtype=torch.float64, device=device)]
    gathered = [torch.zeros_like(rows[0]) for _ in range(world)]
    dist.all_gather(gathered, rows[0])
    if rank == 0:
        print(f"pattern {args.pattern}, hidden {args.hidden}, seq_len {args.seq_len}, cp {world}, {device.type}")
        print(f"{'rank':>4} {'cp=1 saved MiB':>15} {f'cp={world} saved MiB':>15} {'ratio':>6}"
              + (f" {'cp=1 peak MiB':>14} {f'cp={world} peak MiB':>14} {'ratio':>6}" if device.type == "cuda" else ""))
        for r, row in enumerate(gathered):
            a, b, pa, pb = (x / 2**20 for x in row.tolist())
            line = f"{r:>4} {a:>15.1f} {b:>15.1f} {b / a:>6.3f}"
            if device.type == "cuda":
                line += f" {pa:>14.1f} {pb:>14.1f} {pb / pa:>6.3f}"
            print(line)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
