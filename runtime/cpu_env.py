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


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int):
    """An untouched uint8 tensor of `nbytes` (at least) that the kernel is asked to back with
    2 MiB transparent huge pages (madvise before any page is touched), or None where madvise
    is not to be had. Where THP is in `madvise` mode, the usual setting, torch's memory gets
    4 KiB pages, and a step that streams every weight walks ~130k page-table entries."""
    import torch

    name = ctypes.util.find_library("c")
    if not name:
        return None
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE_PAGE
    length = nbytes - nbytes % _HUGE_PAGE
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        if length and libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length),
                                   _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
            return None
    except (OSError, AttributeError):
        return None
    return raw[start:start + nbytes]


def weights_in_huge_pages(module) -> int:
    """Move a module's large parameters (1 MiB and up) into one huge-page buffer (measured:
    one decode step of the default model in float32, 23.8-25.9 -> 18.1-18.9 ms). Returns the
    bytes moved, 0 where huge pages are not to be had. Tied weights are one parameter and
    move once."""
    params = [p for p in module.parameters() if p.numel() * p.element_size() >= 1 << 20]
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]  # 64-byte aligned pieces
    buf = huge_page_bytes(sum(sizes)) if params else None
    if buf is None:
        return 0
    offset = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        view = buf[offset:offset + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += size
    return offset

