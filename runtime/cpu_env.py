"""Process settings for the CPU path."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> None:
    """Stop glibc from handing large freed buffers back to the kernel. Every step allocates
    and frees activations of a few MB; with the default thresholds each one is a fresh mmap
    whose pages fault in again (measured: 13 ms -> 3 ms for one attention-sized op)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        logger.debug("mallopt unavailable; leaving the allocator as it is")


def bound_onednn_cache() -> None:
    """oneDNN (bf16 matmuls on CPU) keeps a compiled primitive for every shape it meets, up to
    1024 by default. Token counts per step vary all the time, so a server's memory kept growing
    with new shapes (measured: RSS +10% over 8 minutes of mixed load). One step needs up to ~40
    shapes (two attention matmuls per decode group, up to 16 groups, plus the linears): 16
    entries thrashed at 64 mixed-length streams (2x slower decode steps), 64 hold a step with
    room to spare. Set before the first matmul; an explicit ONEDNN_PRIMITIVE_CACHE_CAPACITY wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
