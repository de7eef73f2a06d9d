"""Keep freed memory in the process on CPU, so large activations are not page-faulted every step.

glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh `mmap`s and
unmaps them on free. Every step then touches its large activations page by page for the first time
again: the kernel zeroes each 4 KiB page on a fault, which made elementwise ops on tensors above
32 MiB about 5x slower per element here, and training time grow faster than the sequence length.
Raising the mmap and trim thresholds makes glibc keep and reuse those blocks, as PyTorch's CUDA
caching allocator does on GPUs. Numerics are untouched; the resident set stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # bytes; mallopt takes an int


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep blocks up to 1 GiB in the heap; False where that is not possible
    (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_THRESHOLD)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_THRESHOLD)) == 1 and ok
    if ok:
        log.debug("glibc malloc keeps freed blocks up to %d MiB", _THRESHOLD >> 20)
    return ok
