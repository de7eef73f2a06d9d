"""Runs under torchrun: LoRA on an NF4 base on several meshes against one process.

    torchrun --standalone --nproc-per-node N tests/distributed/nf4_worker.py OUT.json CASE [CASE ...]

A CASE is lora_worker's (`dp_replicate,dp_shard,cp,tp,sp,ac[,epN]`). The model is parity_worker's with
every width a multiple of the NF4 block (64) and every rowwise projection's input two blocks wide (so
tensor parallel over 2 cuts its columns between blocks), in fp32: the base is quantized whole to NF4
before parallelizing, every split cuts those bits along whole groups, so every mesh dequantizes the
same weights in fp32 and the curves must agree to fp32 rounding. Rank 0 writes both loss curves and
the bytes each rank stores of the 4-bit base.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from lora_worker import SPEC, SEED, train, train_on_mesh
from parity_worker import CFG, make_batch
from torch.distributed.tensor import DTensor
from worker_results import write_and_finish

from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import add_adapters, freeze_base, init_adapters, quantize_base
from nemotron_recipe.models.nemotron_v3.nf4 import is_nf4

NF4_CFG = dataclasses.replace(CFG, hidden_size=64, head_dim=32, intermediate_size=128, mamba_head_dim=16,
                              moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)


def build_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NF4_CFG)
    add_adapters(model, SPEC)
    quantize_base(model)
    return model


def stored_nf4_bytes(model: torch.nn.Module) -> int:
    """Bytes of 4-bit data this rank stores (its shards, not the gathered tensors)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        if is_nf4(t):
            total += t.quantized_data.numel()
    return total


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids, targets = make_batch()
    ref_model = build_model()
    ref_bytes = stored_nf4_bytes(ref_model)
    if rank == 0:
        freeze_base(ref_model)
        init_adapters(ref_model, SEED)
        ref_losses = train(ref_model, ids, targets)
    results = {}
    for case in cases:
        model, losses = train_on_mesh(case, build_model, ids, targets)
        if rank == 0:
            results[case] = {"losses": losses, "ref_losses": ref_losses, "nf4_bytes": stored_nf4_bytes(model),
                             "ref_nf4_bytes": ref_bytes}
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
