"""Ending a run early but cleanly: on SIGTERM/SIGUSR1/SIGINT or when `trainer.max_minutes` runs out.

A signal only sets a flag; the training loop polls at each step boundary, where the model and
optimizer are consistent, then saves a checkpoint and returns normally (exit code 0). Ranks can
receive a signal at different moments, or only some of them receive it, and their clocks differ,
so the poll is an all-reduce: every rank stops after the same step.

Ctrl-C (SIGINT) saves like SIGTERM; a second Ctrl-C aborts at once (KeyboardInterrupt), leaving
the newest complete checkpoint as it was.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopConditions:
    """`install` before the training loop and `restore` after it: it owns the signal handlers meanwhile."""

    # A Ctrl-C in a terminal reaches every process of the group, and torchrun then forwards its own
    # SIGINT to the ranks: a SIGINT this soon after the first is that copy, not a second Ctrl-C.
    REPEAT_WINDOW_S = 2.0

    def __init__(self, *, max_minutes: float | None, started: float, device: torch.device) -> None:
        self.deadline = None if max_minutes is None else started + 60.0 * max_minutes
        self.device = device
        self.received: str | None = None
        self._signum = 0
        self._first_interrupt: float | None = None  # monotonic time of the first SIGINT
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        # Python delivers signals to the main thread only; elsewhere (a run started from a worker
        # thread) the process keeps its own handling and only the time limit applies.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Repeats are ignored: schedulers may signal the launcher and the ranks alike, and torchrun
        # forwards its own copy, so one preemption can arrive twice. Only a user's second Ctrl-C,
        # past the window of forwarded copies, means "stop now, without saving".
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt >= self.REPEAT_WINDOW_S:
                raise KeyboardInterrupt("second Ctrl-C: aborted without saving")
        if self._signum == 0:
            self._signum = signum

    def poll(self) -> str | None:
        """'signal', 'max_minutes' or None, the same on every rank (a collective: call it on all).

        After 'signal', `received` names the signal on every rank, not only on those it reached.
        """
        time_up = self.deadline is not None and time.perf_counter() >= self.deadline
        flags = torch.tensor([self._signum, time_up], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            self.received = signal.Signals(int(flags[0])).name
            return "signal"
        if flags[1]:
            return "max_minutes"
        return None
