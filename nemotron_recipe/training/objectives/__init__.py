"""What one optimizer step computes: the objective seam between the trainer and its loss.

The trainer owns the loop (batch plan, optimizer step, clipping, the non-finite guard, MoE balance,
checkpoints, metrics rows); an `Objective` owns everything that depends on what is being optimized:
how a micro-batch is collated from example indices, the step's global normalisers (a collective,
before any backward), each micro-batch's forward and backward, the reduction of a step's sums into
its metrics row, and a validation pass. `sft` is next-token cross-entropy over trained tokens;
`dpo` is direct preference optimization over (chosen, rejected) pairs.
"""

from __future__ import annotations

from typing import Any

from .protocol import Objective, StepSums

__all__ = ["Objective", "StepSums", "build_objective"]


def build_objective(name: str, **kwargs: Any) -> Objective:
    """The objective `objective.name` names, built from the trainer's pieces."""
    if name == "sft":
        from .sft import SFTObjective

        return SFTObjective(**kwargs)
    from .dpo import DPOObjective

    return DPOObjective(**kwargs)
