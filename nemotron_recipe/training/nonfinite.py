"""Non-finite losses and gradients: a diverged step is never taken and never saved.

One NaN step poisons the weights, every later step and every checkpoint saved after it, and
checkpoint rotation would then delete the last good ones. The guard checks each step's loss and
gradient norm before the optimizer step, with every rank agreeing (one all-reduce), and either
ends the run (`trainer.nonfinite=stop`) or drops the step (`skip`) up to a limit. Parameters are
checked once more before every save, so no checkpoint ever holds a non-finite value.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemotron_recipe.models.nemotron_v3.nf4 import is_nf4

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient or parameter; the message names the step,
    the last good checkpoint and a fix."""


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (a collective when several ranks run)."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def nonfinite_parameters(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of the parameters holding a non-finite value on any rank; the same list on every rank
    (each rank checks its own shards, and the names are gathered)."""
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if is_nf4(local):  # a frozen 4-bit base: codes and scales, finite when quantized
            continue
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    if dist.is_initialized() and dist.get_world_size() > 1 and _any_rank(bool(bad), device):
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)
        bad = sorted({n for names in gathered for n in names or []})
    return bad


class NonFiniteGuard:
    """Decides, with every rank agreeing, whether a step may be taken, and what to do when not.

    `skipped` counts the steps this run dropped (`trainer.nonfinite=skip`); the run fails once it
    exceeds `max_skipped`.
    """

    def __init__(self, mode: str, max_skipped: int, device: torch.device) -> None:
        self.mode, self.max_skipped, self.device = mode, max_skipped, device
        self.skipped = 0

    def step_is_finite(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether this rank's loss and the gradient norm are finite on every rank (a collective)."""
        local_bad = not (bool(torch.isfinite(loss_sum).all()) and bool(torch.isfinite(grad_norm).all()))
        return not _any_rank(local_bad, self.device)

    def reject(self, step: int, grad_norm: float, last_good: Path | None) -> None:
        """Handles step `step` (1-based, as in the metrics rows), which was not taken: raises under
        `stop` or once too many steps were skipped, else counts it and warns."""
        good = f"last good checkpoint: {last_good}" if last_good else "this run has no checkpoint yet"
        what = (f"step {step}: the loss or the gradient norm (grad norm {grad_norm}) is not finite on at least "
                "one rank; the step was not taken and nothing of it was saved")
        if self.mode == "stop":
            raise NonFiniteError(
                f"{what}; {good}. Fix: resume from that checkpoint with a lower optim.lr (or trainer.max_grad_norm), "
                "or set trainer.nonfinite=skip to drop such steps."
            )
        self.skipped += 1
        if self.skipped > self.max_skipped:
            raise NonFiniteError(
                f"{what}; that is {self.skipped} skipped steps, more than trainer.max_skipped_steps="
                f"{self.max_skipped}; {good}. Fix: resume from that checkpoint with a lower optim.lr, "
                "or raise trainer.max_skipped_steps."
            )
        log.warning("%s; skipped (%d of at most %d)", what, self.skipped, self.max_skipped)

    def check_parameters(self, model: torch.nn.Module, step: int, last_good: Path | None) -> None:
        """Refuses to save parameters holding a non-finite value (a collective)."""
        bad = nonfinite_parameters(model, self.device)
        if bad:
            raise NonFiniteError(
                f"step {step}: parameters {bad[:6]}{' ...' if len(bad) > 6 else ''} hold non-finite values, so "
                f"the checkpoint was not saved; last good checkpoint: {last_good or 'none'}. Fix: resume from it "
                "with a lower optim.lr."
            )
