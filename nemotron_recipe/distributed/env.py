"""Process-group setup that serves torchrun launches and plain single-process runs alike.

A plain `python -m recipes.finetune` still gets a (world-size-1) default process group, so the
training loop, the device mesh and FSDP always take the same distributed code path.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# After a failure on some ranks the others may never reach the barrier; waiting this long keeps a
# failed run from hanging until the collective timeout before torchrun can report it.
_FAILURE_BARRIER_TIMEOUT = datetime.timedelta(seconds=30)

# Counts the default groups this process has created; every rank runs the same jobs in the same
# order, so all ranks agree on it.
_GROUP_GENERATION = itertools.count()


class DistributedSetupError(RuntimeError):
    """The requested device or launch environment cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device_type(device: str) -> str:
    if device not in DEVICE_CHOICES:
        raise DistributedSetupError(
            f"trainer.device={device!r}: unknown device. Fix: use one of {list(DEVICE_CHOICES)}."
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DistributedSetupError(
            "trainer.device='cuda': no CUDA device is visible to this process. "
            "Fix: run on a machine with a GPU, or set trainer.device=cpu (or auto)."
        )
    return device


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The number of processes the launcher started (1 without torchrun)."""
    return int(os.environ["WORLD_SIZE"]) if _launched_by_torchrun() else 1


def init_distributed(device: str = "auto") -> DistEnv:
    """Initialise the default process group (once) and pick this rank's device.

    `device` is `auto`, `cpu` or `cuda`. CPU tensors always communicate over gloo; CUDA tensors
    over NCCL.
    """
    device_type = resolve_device_type(device)
    if _launched_by_torchrun():
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        rank, world_size, local_rank = 0, 1, 0

    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedSetupError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
                "Fix: launch at most one process per GPU (torchrun --nproc-per-node), or use trainer.device=cpu."
            )
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        torch_device = torch.device("cpu")
        backend = "gloo"

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedSetupError(
                f"a process group is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {rank} of {world_size}."
            )
    else:
        # Binding the GPU up front lets NCCL initialise eagerly and barriers know their device.
        device_id = torch_device if device_type == "cuda" else None
        if _launched_by_torchrun():
            # A Hydra sweep re-creates the group once per job in the same processes, against the
            # same launcher store. torch names every new default group alike, so gloo would find
            # the previous job's peer addresses under its keys and may hang dialling dead ports;
            # each generation of the group therefore gets keys of its own.
            store, _, _ = next(dist.rendezvous("env://"))
            store = dist.PrefixStore(f"nemotron_recipe/{next(_GROUP_GENERATION)}", store)
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, device_id=device_id
            )
        else:
            # An in-process store needs no free port and no rendezvous, so single runs (and tests
            # running several recipes in one interpreter) never collide.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
            )
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)


def teardown(*, failed: bool = False) -> None:
    """Synchronise all ranks, then destroy the default process group.

    Destroying the group while a peer is still using it aborts the process at random on this
    torch version, hence the barrier. After a failure the barrier is bounded, because ranks that
    did not fail may be blocked elsewhere and never arrive.
    """
    if not dist.is_initialized():
        return
    try:
        if failed and dist.get_world_size() > 1:
            dist.barrier(timeout=_FAILURE_BARRIER_TIMEOUT)
        else:
            dist.barrier()
    except Exception:
        if not failed:
            raise
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(device: str = "auto") -> Iterator[DistEnv]:
    """`init_distributed` for the duration of a block; tears the group down however it exits.

    A group that already existed on entry belongs to the caller and is left alone.
    """
    owned = not dist.is_initialized()
    env = init_distributed(device)
    try:
        yield env
    except BaseException:
        if owned:
            teardown(failed=True)
        raise
    if owned:
        teardown()
