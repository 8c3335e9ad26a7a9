"""Transparent huge pages for the large tensors the engine streams: the paged KV cache and the packed weights.

With 4 KiB pages a stream pays a TLB miss at every page, and the CPU's prefetchers stop at page boundaries.
Where the kernel offers huge pages on request (`madvise` mode, the common default), memory advised before it
is first touched is backed by 2 MiB pages as it faults in; memory already written (a weight packed by oneDNN)
is moved into huge pages by MADV_COLLAPSE (Linux 6.1+). Only the whole 2 MiB pages inside a tensor are
advised, so no memory outside it changes. Advice that the kernel refuses changes nothing and is not an error.
Weights packed inside `huge_page_allocations()` lie one after another in address space of their own, so that the
huge page at each boundary between two is one page: allocated at PyTorch's alignment, a weight of a few MB has a
2 MiB page at each end that is partly another allocation's, which only 4 KiB pages can back.

Also: a step's small host arrays onto a GPU in one pinned copy (`to_device`).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


@lru_cache(maxsize=1)
def _madvise():
    if sys.platform != "linux":
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(address: int, nbytes: int, collapse: bool = False) -> int:
    """Ask for huge pages under the whole 2 MiB pages of [address, address + nbytes): for memory faulted in
    later, and with `collapse` also for memory already there. Returns the bytes advised (0 where none)."""
    madvise = _madvise()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return 0
    if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        madvise(start, end - start, _MADV_COLLAPSE)  # synchronous; refused before Linux 6.1 or without THP
    return end - start


@contextmanager
def huge_page_allocations() -> Iterator[None]:
    """Inside, this thread's CPU tensors of 64 KiB or more (a weight oneDNN packs, a copy in the GEMV's layout) are
    mapped one after another in address space reserved for them and advised huge pages before they are written, the
    huge page at each boundary between two collapsed into one (kernels/cpu_ops.cpp's HugePageArena); a freed one's
    memory goes back to the system. Other threads' allocations are unchanged. PyTorch's default CPU allocator is
    stood in for (HugePageAllocator, which hands it every other allocation) from the first scope on until a scope
    ends with no tensor allocated inside alive: oneDNN frees a packed weight through whichever CPU allocator is
    installed then, so another one installed meanwhile must not be. Where the process's address space is limited
    (RLIMIT_AS, which the reservation would count against), tensors of 2 MiB or more start on a 2 MiB boundary
    instead. Without the operator library, or with a CPU allocator other than PyTorch's default installed,
    allocations are as outside."""
    from torch_shift.kernels import huge_page_scope

    scope = huge_page_scope()
    entered = False
    try:
        entered = scope is not None and scope(1) == 1
        yield
    finally:
        if entered:
            scope(0)


def to_device(arrays: list[np.ndarray], dtype: np.dtype, device: torch.device) -> list[torch.Tensor]:
    """`arrays` as tensors of `dtype` on `device`: on the CPU, views of them (copies where the dtype differs); on a
    GPU through one asynchronous copy from pinned memory (a step's inputs were several pageable, synchronous
    copies), each tensor starting 16-byte aligned: Triton compiles a kernel per alignment of its pointer
    arguments, and slices of one buffer at offsets that change from step to step made it compile while serving."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(-1)) for a in arrays]
    per_16_bytes = 16 // np.dtype(dtype).itemsize
    sizes = [np.size(a) for a in arrays]
    padded = [-(-n // per_16_bytes) * per_16_bytes for n in sizes]
    flat = np.zeros(sum(padded), dtype)
    for a, start in zip(arrays, np.cumsum([0] + padded[:-1])):
        flat[start: start + np.size(a)] = np.asarray(a).reshape(-1)
    host = torch.from_numpy(flat).pin_memory()
    return [t[:n] for t, n in zip(host.to(device, non_blocking=True).split(padded), sizes)]
