"""Memory and communication planning for a fine-tuning launch, on one CPU, at any world size.

The model is built on the meta device and parallelized by the recipe's own parallelizer in a fake
world of the launch's size (`world`); its sharded parameters give the state bytes (`state`), a
fake-tensor trace of one micro-batch the activations (`activations`), the plan's collectives the
bytes moved and a step-time floor (`comms`); `suggest` ranks the changes that would make a plan fit.
"""

from .activations import ActivationTrace, Workload
from .estimate import MemoryEstimate, Planner, memory_estimate
from .state import StateBytes
from .world import PlannerError, fake_world

__all__ = ["ActivationTrace", "MemoryEstimate", "Planner", "PlannerError", "StateBytes", "Workload", "fake_world",
           "memory_estimate"]
