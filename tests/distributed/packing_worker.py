"""Runs under torchrun (2 ranks): packed documents with context parallel give each document's own
per-token losses and the same gradients as the unsharded model.

    torchrun --standalone --nproc-per-node 2 tests/distributed/packing_worker.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_packing import CFG, packed_batch, per_token_losses  # noqa: E402

from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence  # noqa: E402
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM  # noqa: E402
from nemotron_recipe.models.nemotron_v3.parallelization import _decoder_blocks, apply_context_parallel  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    ids, docs = packed_batch()

    torch.manual_seed(0)
    reference = NemotronHForCausalLM(CFG)
    ref_losses = per_token_losses(reference(ids, document_ids=docs).logits, ids, docs)
    ref_losses.sum().backward()

    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFG)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    apply_context_parallel(_decoder_blocks(model)[1], mesh["cp"])
    cp = ContextParallel(mesh.get_group(), mesh.get_local_rank(), world)
    logits = model(shard_sequence(ids, cp), document_ids=shard_sequence(docs, cp)).logits
    # Losses need each position's next token, so take them from the full-length targets.
    full_targets_losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1),
        shard_sequence(torch.nn.functional.pad(torch.where(docs[:, 1:] == docs[:, :-1], ids[:, 1:], -100), (0, 1),
                                               value=-100), cp).flatten(),
        reduction="none",
    ).view(logits.shape[:2])
    torch.testing.assert_close(full_targets_losses, shard_sequence(ref_losses, cp).detach(), rtol=1e-5, atol=1e-6)
    full_targets_losses.sum().backward()
    worst = 0.0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each cp rank holds the gradient of its own tokens
        # Measured against the tensor's scale: sums of many fp32 terms in another order differ by a
        # few ulps of the largest entries, which an elementwise bound would flag near zero.
        err = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, err)
        assert err <= 2e-6, f"{name}: max|g - g_ref| / max|g_ref| = {err:.2e} > 2e-6"
    if dist.get_rank() == 0:
        print(f"packed cp={world} matches documents run alone (gradients {worst:.1e} of scale)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
