"""CPU threads for a run on a machine other jobs may share: settled before torch is imported.

OpenMP reads its settings once, when torch loads it. By default its threads spin between parallel
regions, waiting for the next one; on busy cores each spinning thread holds a time slice that the
other threads (of this run or of another job) needed, and every region then waits for its slowest
thread: on two cores under a load average of 10-20 a default run's step took 10-25 s. With the
`passive` wait policy idle threads sleep instead, and the same step takes a fraction of a second,
faster than with one thread (benchmarks/threads.py measures all three in one run, idle and under load).
Fewer threads would not help: a thread that sleeps while it waits costs the others nothing, and each
thread is one more share of the busy cores.

An explicit `OMP_WAIT_POLICY` (or `OMP_NUM_THREADS`, which this never sets) always wins, and
`NR_THREADS=torch` leaves OpenMP's defaults untouched. This module imports nothing heavy, so the
recipes call `choose_threads` before anything imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass

OFF = "torch"  # NR_THREADS=torch: OpenMP's defaults


@dataclass(frozen=True)
class ThreadChoice:
    """What `choose_threads` set (None: left as it was), for the run's log."""

    wait_policy: str | None

    def describe(self, num_threads: int) -> str:
        """One log line; `num_threads`: the intra-op threads torch came up with."""
        policy = os.environ.get("OMP_WAIT_POLICY", "OpenMP's default").lower()
        how = "chosen" if self.wait_policy is not None else "as set"
        load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        return f"threads: {num_threads} intra-op, OpenMP wait policy {policy} ({how}{load})"


def choose_threads(environ: MutableMapping[str, str] | None = None) -> ThreadChoice:
    """Sets `OMP_WAIT_POLICY=PASSIVE` in `environ` (default: this process's environment) unless it is set
    or `NR_THREADS=torch`; call it before torch is imported. Once torch is loaded it is too late, and
    this process's environment is left alone."""
    own = environ is None
    environ = os.environ if environ is None else environ
    if environ.get("NR_THREADS", "").strip().lower() == OFF or environ.get("OMP_WAIT_POLICY"):
        return ThreadChoice(None)
    if own and "torch" in sys.modules:
        return ThreadChoice(None)
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return ThreadChoice("PASSIVE")
