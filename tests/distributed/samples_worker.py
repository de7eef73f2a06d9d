"""Runs under torchrun: greedy samples of the same seeded model under several meshes and on one process.

    torchrun --standalone --nproc-per-node 2 tests/distributed/samples_worker.py OUT.json CASE [CASE ...]

CASE as in parity_worker.py (`dp_replicate,dp_shard,cp,tp,sp,ac,dtype[,model[,epN]]`). Rank 0 writes,
per case, the continuations under the mesh and the single-process ones they must equal.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from parity_worker import build_model, parse_case
from worker_results import write_and_finish

from nemotron_recipe.models.nemotron_v3.parallelization import PARALLELIZER
from nemotron_recipe.training.samples import greedy_continue
from nemotron_recipe.training.setup import data_layout

MAX_NEW = 10
PAD = 0


def prompts() -> list[list[int]]:
    """Three prompts of different lengths (one shorter than any mesh's sequence divisor)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in (9, 3, 14)]


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    results, references = {}, {}
    for case in cases:
        plan, name, _ = parse_case(case)
        if name not in references:  # every rank computes it: greedy_continue keeps the ranks in step
            reference = greedy_continue(build_model(name), prompts(), MAX_NEW, eos_id=None, pad_id=PAD)
            # EOS: the 4th token of the first row, so that row ends early while the others go on.
            eos = reference[0][0][3]
            references[name] = (eos, greedy_continue(build_model(name), prompts(), MAX_NEW, eos_id=eos, pad_id=PAD))
        eos, reference = references[name]
        meshes = plan.build_meshes()
        model = build_model(name)
        PARALLELIZER.parallelize(model, plan, meshes)
        layout = data_layout(plan, meshes)
        got = greedy_continue(model, prompts(), MAX_NEW, eos_id=eos, pad_id=PAD,
                              seq_len_divisor=plan.seq_len_divisor, cp=layout.cp)
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, got)
        results[case] = {"samples": got, "reference": reference, "ranks_agree": all(r == got for r in every_rank),
                         "training": model.training}
        dist.barrier()
    write_and_finish(out_path, results)


if __name__ == "__main__":
    main()
