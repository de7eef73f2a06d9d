"""`torch.compile` of each decoder block (`trainer.compile=true`), falling back to eager on failure.

Blocks are compiled one by one rather than the whole model: blocks of one kind share their compiled
code, the graphs stay small, and the parallelizer's per-block wrappers (FSDP units, activation
checkpointing) stay outside the compiled regions (dynamo skips FSDP's hooks by default).

Compilation is lazy, so a machine without a working compiler toolchain fails only at the first
call, possibly in the backward pass. `compile_blocks` therefore runs one probe forward and backward
at the training shape right away; if anything in it fails, every block goes back to eager and a
warning says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's `Block` modules (inside any wrappers the parallelizer put around them)."""
    from nemotron_recipe.models.nemotron_v3.model import Block

    return [m for m in model.modules() if isinstance(m, Block)]


def _restore_eager(blocks: list[nn.Module]) -> None:
    for block in blocks:
        block._compiled_call_impl = None


def compile_blocks(
    model: nn.Module,
    probe: Callable[[], None] | None = None,
    **compile_kwargs,
) -> bool:
    """Compile every decoder block in place; True if they run compiled.

    `probe`, when given, runs a forward and backward that exercises the compiled blocks (and must
    leave no state behind, e.g. zero the gradients it made). Any exception during compilation or
    the probe restores eager blocks and logs a warning; the model then trains exactly as without
    `trainer.compile`.
    """
    blocks = decoder_blocks(model)
    if not blocks:
        log.warning("trainer.compile: no decoder blocks found; running eagerly")
        return False
    # Every block kind shares `Block.forward`, so each kind's training and evaluation graphs, and
    # the dynamic-length graph a new batch length (batches are padded to their longest row) brings,
    # all count against that one function's limit of compiled variants; past it, blocks run eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    try:
        for block in blocks:
            block.compile(**compile_kwargs)
        if probe is not None:
            probe()
    except Exception as e:  # noqa: BLE001 - any compiler failure means: run eagerly
        _restore_eager(blocks)
        torch._dynamo.reset()
        # Dynamo wraps the compiler's own error; the innermost one names the actual problem.
        cause = e
        while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
            cause = inner
        first_line = next((line for line in str(cause).splitlines() if line.strip()), "")
        log.warning("trainer.compile: torch.compile failed (%s: %s); running the blocks eagerly",
                    type(cause).__name__, first_line)
        return False
    log.info("trainer.compile: %d blocks compiled", len(blocks))
    return True
