"""The host tier's memory and the copies between it and a rank's device pool (paper 003, Sec. 4.2, 5.2).

One host tensor for the whole KV cache, heads-major: `[kv_heads, layers, 2 (K, V), tier_blocks,
block_size, head_dim]`, so that a TP rank's heads are one contiguous range. It is shared by the local
ranks: created in shared memory before the ranks are started (inherited by forked ranks, passed
to spawned ones), or under torchrun a file in /dev/shm that every rank maps.

A rank's pool holds a `KVRegion` of the whole cache under a layout: a pipeline stage its layers with
every head, a TP rank every layer with its heads. A swap-out writes the region of its blocks into
the tier, a swap-in reads a region out of it: KV swapped out under one layout and in under another
is re-sharded by the copy, byte for byte.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from torch_shift.kv.cache import KVCache
from torch_shift.kv.tier import SwapOp


@dataclass(frozen=True)
class KVRegion:
    """The part of the whole KV cache a rank's pool holds under a layout."""

    layer_start: int
    num_layers: int
    head_start: int
    num_heads: int


def tier_shape(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
               block_size: int) -> tuple[int, ...]:
    return (num_kv_heads, num_layers, 2, num_blocks, block_size, head_dim)


def create_host_tier(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """The tier's memory in this process, zero-filled; `shared`: in shared memory, for ranks started after this."""
    if not shared:
        return torch.zeros(shape, dtype=dtype)
    # made in shared memory (zero-filled by the kernel) rather than moved there: `share_memory_()` copies the
    # tensor into a new shared storage, so the tier took twice its size until the copy was freed
    numel = math.prod(shape)
    error = _shm_room_error(numel * dtype.itemsize)
    if error is not None:  # torch's error, where /dev/shm is too small, named no option and left its file there
        raise ValueError(error)
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def map_host_tier(shape: tuple[int, ...], dtype: torch.dtype, rank: int, broadcast: Callable,
                  barrier: Callable) -> torch.Tensor:
    """Under torchrun: every local rank maps one file in /dev/shm that rank 0 creates (zero-filled);
    the file is removed once all have mapped it (the memory lives while a mapping does), and by rank 0
    whatever happens. `broadcast(obj)` returns rank 0's object on every rank; `barrier()` waits for every rank."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    path = None
    if rank == 0:
        # a sparse file larger than /dev/shm maps fine and dies of SIGBUS at the first touch
        error = _shm_room_error(nbytes)
        path = os.path.join("/dev/shm", f"torch_shift_kv_tier_{uuid.uuid4().hex}")
    path, error = broadcast((path, error) if rank == 0 else None)
    if error is not None:
        raise ValueError(error)
    try:
        if rank == 0:
            tier = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        barrier()
        if rank != 0:
            tier = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        barrier()
    finally:
        if rank == 0 and os.path.exists(path):
            os.unlink(path)
    return tier.view(shape)


def _shm_room_error(nbytes: int) -> str | None:
    """Why a tier of `nbytes` does not fit in /dev/shm's free space; None where it does (or /dev/shm is not there)."""
    free = _shm_free_bytes()
    if free is None or free >= nbytes:
        return None
    return (f"the host KV tier needs {nbytes / 2**30:.2f} GiB of /dev/shm, which has {free / 2**30:.2f} GiB free: "
            "lower cpu_kv_gb or enlarge /dev/shm")


def _shm_free_bytes() -> int | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def swap_out(tier: torch.Tensor, cache: KVCache, region: KVRegion, device_blocks: torch.Tensor,
             tier_blocks: torch.Tensor) -> None:
    """Write `device_blocks` of `cache` (viewed as `region`: [blocks, layers, block_size, heads, dim])
    into `tier_blocks` of the tier."""
    heads = slice(region.head_start, region.head_start + region.num_heads)
    layers = slice(region.layer_start, region.layer_start + region.num_layers)
    for kv, pool in enumerate((cache.k_all, cache.v_all)):
        blocks = pool.index_select(0, device_blocks).to(tier.device)  # [n, layers, block_size, heads, dim]
        tier[heads, layers, kv].index_copy_(2, tier_blocks, blocks.permute(3, 1, 0, 2, 4))


def swap_in(tier: torch.Tensor, cache: KVCache, region: KVRegion, device_blocks: torch.Tensor,
            tier_blocks: torch.Tensor) -> None:
    """Read `tier_blocks` of the tier's `region` into `device_blocks` of `cache`."""
    heads = slice(region.head_start, region.head_start + region.num_heads)
    layers = slice(region.layer_start, region.layer_start + region.num_layers)
    for kv, pool in enumerate((cache.k_all, cache.v_all)):
        blocks = tier[heads, layers, kv].index_select(2, tier_blocks)  # [heads, layers, n, block_size, dim]
        pool.index_copy_(0, device_blocks, blocks.permute(2, 1, 3, 0, 4).to(pool.device))


class SwapExecutor:
    """A rank's side of the tier: runs the swap operations of a step plan for its replica, before the
    step's forward ("sync"), or in a prefetch thread beside it ("async": rank 0 plans them to be done
    by the next step, when this rank waits for them).

    The tier is shared, and a rank reads what other ranks wrote (a TP rank's heads of every layer come
    from every pipeline stage): in a step with swap operations every rank first waits at a barrier
    until every rank's earlier copies are done, and with synchronous copies once more between the
    step's swap-outs and its swap-ins (rank 0 plans no swap-in of a swap-out of the same step with
    asynchronous copies)."""

    def __init__(self, tier: torch.Tensor, mode: str, replica: int,
                 resolve: Callable[[str], tuple[KVCache, KVRegion]], barrier: Callable[[], None] | None):
        if mode not in ("sync", "async"):
            raise ValueError(f"kv_swap must be 'sync' or 'async', got {mode!r}")
        self.tier = tier
        self.replica = replica
        self.resolve = resolve  # layout name -> this rank's pool in its view, and its region
        self.barrier = barrier or (lambda: None)  # over every rank sharing the tier
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="torch-shift-kv-swap") if mode == "async" else None
        self._pending: Future | None = None
        self.copy_seconds = 0.0  # time spent copying (in the thread when async)

    def run(self, swap_outs: list[SwapOp], swap_ins: list[SwapOp]) -> None:
        """Every rank calls this with the whole plan's operations; it copies those of its replica.
        Swap-outs first: a swap-in may reuse the device blocks a swap-out of the same step read."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if not (swap_outs or swap_ins):
            return
        self.barrier()
        outs = [op for op in swap_outs if op.replica == self.replica]
        ins = [op for op in swap_ins if op.replica == self.replica]
        if self._copier is not None:
            self._pending = self._copier.submit(self._copy, outs, ins)
            return
        self._copy(outs, [])
        if swap_outs and swap_ins:
            self.barrier()
        self._copy([], ins)

    def _copy(self, swap_outs: list[SwapOp], swap_ins: list[SwapOp]) -> None:
        start = time.perf_counter()
        for ops, copy in ((swap_outs, swap_out), (swap_ins, swap_in)):
            for op in ops:
                cache, region = self.resolve(op.layout)
                copy(self.tier, cache, region, torch.tensor(op.device_blocks, device=cache.k_all.device),
                     torch.tensor(op.tier_blocks))
        self.copy_seconds += time.perf_counter() - start

    def close(self) -> None:
        """End the prefetch thread (its last copies are left to finish)."""
        if self._copier is not None:
            self._copier.shutdown(wait=False)
            self._copier = None
