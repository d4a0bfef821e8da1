"""Process settings for the CPU path."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
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
    1024 by default, in two caches: its own, and ideep's in front of it (LRU_CACHE_CAPACITY),
    about 0.5 MB each (JIT code and descriptors). Token counts per step vary all the time, so a
    server's memory kept growing with new shapes: a soak's RSS rose 13% in 7 minutes, all of
    it ideep's entries for the linears (memray). One step needs up to ~40 shapes (two
    attention matmuls per decode group, up to 16 groups, plus the linears): 16 entries thrashed
    at 64 mixed-length streams (2x slower decode steps), 64 hold a step with room to spare. Set
    before the first matmul; explicit values in the environment win."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "64")


_HUGE_PAGE = 2 << 20


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel, once: what loading freed (the float32
    weights, the copies moved into huge pages) otherwise stays resident, since keep_freed_memory
    keeps freed memory for the steps' activations (default model: 6.93 -> 5.96 GB resident)."""
    name = ctypes.util.find_library("c")
    try:
        if name:
            ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def huge_page_bytes(nbytes: int):
    """An untouched uint8 tensor of `nbytes` that the kernel is asked to back with 2 MiB
    transparent huge pages, or None where the mapping or madvise is not to be had. Where THP is
    in `madvise` mode, the usual setting, torch's memory gets 4 KiB pages, and a step that streams
    every weight walks a page-table entry every 4 KiB. The memory is a fresh anonymous mapping:
    madvise only shapes the pages faulted in after it, and torch's own allocations come from
    glibc's heap (keep_freed_memory keeps it), whose pages were most often touched before (the
    float32 weights freed while loading): there it asked for huge pages and got 16 of 87 MiB."""
    import torch

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    try:
        region = mmap.mmap(-1, length + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not yet touched
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for as long as it lives
    start = (-raw.data_ptr()) % _HUGE_PAGE
    try:  # mmap.madvise takes offsets that are multiples of the 4 KiB page
        region.madvise(mmap.MADV_HUGEPAGE, start, length)
    except OSError as e:
        logger.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
        return None
    return raw[start:start + nbytes]


def resident_kib(tensor) -> tuple[int, int] | None:
    """(KiB resident, KiB of it in huge pages) of the mapping that holds `tensor`, from Linux's
    /proc/self/smaps; None where that is not to be read. huge_page_bytes's memory is a mapping
    of its own, so it says whether the kernel granted what was asked for."""
    addr, found = tensor.data_ptr(), {}
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    if inside:
                        break
                    lo, hi = (int(a, 16) for a in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head in ("Rss:", "AnonHugePages:"):
                    found[head] = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return (found["Rss:"], found["AnonHugePages:"]) if len(found) == 2 else None


def weights_in_huge_pages(module, min_bytes: int = 64 << 10, values: bool = True,
                          exclude: frozenset = frozenset()) -> int:
    """Move a module's parameters of `min_bytes` and more (the matrices; small ones and the
    norms' vectors stay), but those at the addresses `exclude`, into one huge-page buffer.
    `values` False: parameters not loaded yet, which are loaded there, never copied (the peak
    memory of a load is then the weights once, not twice). Returns the bytes moved, 0 where huge
    pages are not to be had. Tied weights are one parameter and move once. Measured (default
    model, one stream, both ways in one process): 10.34 -> 10.01 ms a decode step in its GGUF
    blocks, 13.69 -> 13.37 in bfloat16."""
    params = [p for p in module.parameters() if p.numel() * p.element_size() >= min_bytes
              and p.data_ptr() not in exclude]
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]  # 64-byte aligned pieces
    buf = huge_page_bytes(sum(sizes)) if params else None
    if buf is None:
        return 0
    offset = 0
    for p, size in zip(params, sizes):
        nbytes = p.numel() * p.element_size()
        view = buf[offset:offset + nbytes].view(p.dtype).view(p.shape)
        if values:
            view.copy_(p.data)
        p.data = view
        offset += size
    kib = resident_kib(buf)
    logger.info("weights in transparent huge pages: %.0f MB asked for, %s", offset / 1e6,
                f"{kib[1] / 1024:.0f} of {kib[0] / 1024:.0f} MiB resident granted" if kib else "grant unknown")
    return offset
