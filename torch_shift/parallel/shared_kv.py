"""A sequence-parallel group's KV caches where its first rank reads and writes them all: one-token steps on one rank.

Ulysses SP (paper 000) gives each SP rank a part of a step's tokens and a head chunk of every token's KV. A step of
one token (a batch-1 decode) leaves every SP rank but the first without rows, yet each layer still sent the token's
q/k/v of each head chunk to that chunk's rank and its attention back: two exchanges a layer with ranks whose cores
the first rank had borrowed for its matmuls (`step_threads`). Static SP-2's batch-1 decode of the 106M model took
21.0-21.5 ms a token against 14.7-15.4 in one process (docs/performance.md).

On one host the other SP ranks' caches can live in one /dev/shm segment that the first rank maps too. Then SP rank 0
(with its TP group) runs a one-token step's layers alone: it writes and attends each head chunk's KV in that chunk's
rank's cache, the kernel and rows that rank would run after the first all-to-all (so the same bits), and the other SP
ranks only join the LM head, whose vocabulary the SP ranks share (ShiftModule._solo_step). SP rank 0 keeps its own
cache private, in transparent huge pages: /dev/shm has 4 KiB pages unless the host's shmem_enabled allows more, and
the paged kernel's decodes read such a cache 7-14% slower (bench_attention.py's 64 and 256 sequences of 300 tokens,
float32, 2 threads).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_shift.kv.cache import KVCache
from torch_shift.parallel import comm
from torch_shift.parallel.groups import ShiftGroups
from torch_shift.parallel.shm import _create_segment_file, _map_segment

_REGION_ALIGN = 1 << 21  # each rank's cache on a 2 MiB boundary of the segment


@dataclass
class SharedKV:
    """This rank's cache, and on SP rank 0 every SP rank's (`peers[s]`; None at 0: its own), else None."""

    own: KVCache
    peers: list[KVCache | None] | None


def share_kv_caches(groups: ShiftGroups, min_over_ranks: Callable[[int], int], possible: bool, num_layers: int,
                    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> SharedKV | None:
    """Collective over the deployment's ranks (every one calls it; `min_over_ranks`: ParallelRuntime's): this rank's
    KV cache of these sizes, the SP ranks but the first in one segment of /dev/shm per SP group that its first rank
    maps too; None, on every rank, where any rank finds it `possible` not, its SP group not served by a shared-memory
    communicator (ranks on different hosts), or the segment cannot be made or mapped (a /dev/shm too small for the
    caches: containers often give it 64 MiB). The segment's file is removed as soon as every rank mapped it."""
    sp_group, sp, sp_rank = groups.sp_group, groups.sp, groups.sp_rank
    possible = possible and sp > 1 and comm.shares_memory(sp_group)
    if not min_over_ranks(int(possible)):
        return None
    nbytes = KVCache.nbytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    region = -(-nbytes // _REGION_ALIGN) * _REGION_ALIGN
    path = _create_segment_file((sp - 1) * region) if sp_rank == 0 else None
    try:
        paths: list = [None] * sp
        dist.all_gather_object(paths, path, group=sp_group)
        segment = _map_segment(paths[0], (sp - 1) * region) if paths[0] is not None else None
        mapped = bool(min_over_ranks(int(segment is not None)))
    finally:
        if path is not None:
            os.unlink(path)
    if not mapped:
        return None

    def cache(memory: torch.Tensor | None = None) -> KVCache:
        return KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu", memory)

    regions = [segment[i * region:i * region + nbytes] for i in range(sp - 1)]
    if sp_rank == 0:
        return SharedKV(cache(), [None] + [cache(memory) for memory in regions])
    return SharedKV(cache(regions[sp_rank - 1]), None)

