"""The end of a torchrun test worker: rank 0 writes the results, then every rank leaves together."""

from __future__ import annotations

import json

import torch.distributed as dist


def write_and_finish(out_path: str, results: dict) -> None:
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    # Destroying the group while a peer still uses it can abort the process: meet first.
    dist.barrier()
    dist.destroy_process_group()
