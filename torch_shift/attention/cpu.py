"""Backend "cpu": torch_shift's paged attention kernel for the CPU (torch_shift/kernels/cpu_attention.cpp).

Every run reads its keys and values in place through its block table: no gathered copy of the context and
no padding to the longest one. The step's metadata is a handful of int32 arrays built once per step
(the persistent block table itself is passed, not copied); each layer is one call that writes the step's
K/V into their slots and attends. Runs on torch's intra-op threads.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from torch_shift.attention.backend import AttentionBatch
from torch_shift.kernels import CpuKernels, cpu_kernels, native_attention
from torch_shift.kv.cache import KVCache


def _layout(t: torch.Tensor, order: tuple[int, int, int, int]) -> np.ndarray:
    """Strides (elements) of one layer of a [blocks, layers, ...] cache tensor as (block, token, head, dim)."""
    strides = t.stride()
    return np.array([strides[0]] + [strides[i] for i in order], dtype=np.int64)


class _CacheLayout:
    """What every step's calls read of a KV cache (view): its dtype's code, base addresses, bytes per layer and
    element strides, resolved once per cache instead of once per step (two arrays and four addresses: several us
    each after a step's weights went through the caches). A step passes them to every layer's call as they are
    (resolved per call instead, a call took 35 us at batch 1 against 15)."""

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache
        self.dtype_code = CpuKernels.dtype_code(kv_cache.dtype)
        assert self.dtype_code is not None, kv_cache.dtype
        # keys dim-major [blocks, layers, heads, dim, tokens], values token-major [blocks, layers, tokens, heads, dim]
        self.k_layout = _layout(kv_cache.k_store, (4, 2, 3))
        self.v_layout = _layout(kv_cache.v_all, (2, 3, 4))
        element = kv_cache.v_all.element_size()
        self.k_base, self.v_base = kv_cache.k_store.data_ptr(), kv_cache.v_all.data_ptr()
        self.k_layer_bytes = kv_cache.k_store.stride(1) * element
        self.v_layer_bytes = kv_cache.v_all.stride(1) * element
        self.layouts = (self.k_layout.ctypes.data, self.v_layout.ctypes.data)
        self._table: np.ndarray | None = None  # the last block table seen (a replica's persistent one), its address
        self._table_address = 0

    def table_address(self, block_table: np.ndarray) -> int:
        if block_table is not self._table:
            assert block_table.dtype == np.int32 and block_table.flags.c_contiguous
            self._table, self._table_address = block_table, block_table.ctypes.data
        return self._table_address


class CpuBackend:
    name = "cpu"

    def __init__(self, kernels: CpuKernels | None = None):
        kernels = kernels or cpu_kernels()
        if kernels is None:
            raise ValueError("attention_backend 'cpu' needs torch_shift's CPU kernels, which could not be built "
                             "here (see the warning above); use 'sdpa'")
        self.kernels = kernels
        self._layouts: dict[int, _CacheLayout] = {}  # id(kv cache) -> its layout (which keeps the cache alive)

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and CpuKernels.dtype_code(dtype) is not None

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> CpuPagedAttention:
        layout = self._layouts.get(id(kv_cache))
        if layout is None or layout.kv_cache is not kv_cache:
            layout = self._layouts[id(kv_cache)] = _CacheLayout(kv_cache)
        return CpuPagedAttention(self.kernels, layout, batch)


class CpuPagedAttention:
    """The model's `attention(layer_idx, q, k, v)` for one step."""

    def __init__(self, kernels: CpuKernels, layout: _CacheLayout, batch: AttentionBatch):
        kv_cache = layout.kv_cache
        assert kv_cache.device.type == "cpu", kv_cache.device
        self.kernels = kernels
        self.kv_cache = kv_cache
        self.dtype_code = layout.dtype_code
        # the runs' query starts, query lengths, cached tokens and block-table rows, in one buffer kept alive while the
        # kernel reads it: one address instead of four (an address read costs 15-20 us after a step's weights went
        # through the caches); each array starts a cache line of its own (packed into one line, a bf16 prompt of 512
        # tokens took 335 ms to prefill against 265: the kernel's threads read them in their loops)
        num_runs = batch.num_runs
        width = -(-num_runs // 16) * 16  # int32s: whole cache lines
        buffer = self._runs_buffer = np.empty(4 * width + 16, dtype=np.int32)
        buffer_address = buffer.__array_interface__["data"][0]
        skip = (-buffer_address % 64) // 4
        runs = buffer[skip:skip + 4 * width].reshape(4, width)
        runs[0, :num_runs], runs[1, :num_runs], runs[2, :num_runs], runs[3, :num_runs] = (
            batch.query_start, batch.query_len, batch.num_computed, batch.block_table_rows)
        runs_address = buffer_address + 4 * skip
        self.block_table = batch.block_table
        slot_mapping = batch.slot_mapping
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        self.slot_mapping = slot_mapping
        self.k_layout, self.v_layout = layout.k_layout, layout.v_layout
        self.sliding_window = batch.sliding_window or 0
        self.num_runs = num_runs
        # the step's arguments of every layer's calls, resolved once
        self._k_base, self._v_base = layout.k_base, layout.v_base
        self._k_layer_bytes, self._v_layer_bytes = layout.k_layer_bytes, layout.v_layer_bytes
        self._layouts = layout.layouts
        row_bytes = 4 * width
        self._runs = (num_runs, runs_address, runs_address + row_bytes, runs_address + 2 * row_bytes,
                      layout.table_address(self.block_table), self.block_table.shape[1], runs_address + 3 * row_bytes,
                      kv_cache.block_size)
        self._slot_mapping_ptr = self.slot_mapping.data_ptr()

    def advance_arrays(self) -> tuple[int, int, int, int, int, int]:
        """Where a multi-step run's C++ steps move each decode on (NativeDecoder.steps): the runs' cached tokens (int32,
        read in place by the installed step), the slot mapping, the block table, its row stride, the runs' rows of
        it, and the tokens a block holds."""
        num_runs, _, _, num_computed, table, stride, table_rows, block_size = self._runs
        return num_computed, self._slot_mapping_ptr, table, stride, table_rows, block_size

    def over(self, kv_cache: KVCache) -> CpuPagedAttention:
        """This step's attention over another cache laid out as this one (an SP peer's, torch_shift.parallel.shared_kv):
        the same runs, block table and slots, that cache's memory."""
        mine = self.kv_cache
        assert (kv_cache.k_store.shape, kv_cache.k_store.stride(), kv_cache.v_all.stride(), kv_cache.dtype) == (
            mine.k_store.shape, mine.k_store.stride(), mine.v_all.stride(), mine.dtype)
        other = copy.copy(self)
        other.kv_cache = kv_cache
        other._k_base, other._v_base = kv_cache.k_store.data_ptr(), kv_cache.v_all.data_ptr()
        return other

    def cache_bases(self) -> tuple[int, int]:
        """The addresses of its cache's keys and values (the C++ step's k_base and v_base)."""
        return self._k_base, self._v_base

    def install_native(self) -> bool:
        """Give this step to the C++ implementation of `torch_shift::attention` (a compiled forward's calls then run
        without Python: kernels/cpu_ops.cpp); False where none is registered."""
        native = native_attention()
        if native is None:
            return False
        native.install(self.dtype_code, self._k_base, self._v_base, self._k_layer_bytes, self._v_layer_bytes,
                       *self._layouts, *self._runs, self.kv_cache.num_kv_heads, self._slot_mapping_ptr,
                       self.sliding_window)
        return True

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        kv = self.kv_cache
        num_tokens, num_heads, head_dim = q.shape
        assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and q.dtype == kv.dtype
        k_layer = self._k_base + layer_idx * self._k_layer_bytes
        v_layer = self._v_base + layer_idx * self._v_layer_bytes
        rc = self.kernels.write_kv(self.dtype_code, k_layer, v_layer, *self._layouts, k.data_ptr(), k.stride(0),
                                   k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), self._slot_mapping_ptr,
                                   num_tokens, kv.block_size, kv.num_kv_heads, head_dim)
        assert rc == 0, rc
        if sinks is not None:
            assert sinks.shape == (num_heads,), (sinks.shape, num_heads)
            sinks = sinks.to(torch.float32).contiguous()  # kept alive until the kernel returns
        window = self.sliding_window if sliding_window is None else sliding_window
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
        rc = self.kernels.paged_attention(
            self.dtype_code, out.data_ptr(), out.stride(0), out.stride(1), q.data_ptr(), q.stride(0), q.stride(1),
            k_layer, v_layer, *self._layouts, *self._runs, num_heads, kv.num_kv_heads, head_dim, window,
            1.0 / math.sqrt(head_dim), None if sinks is None else sinks.data_ptr())
        assert rc == 0, rc
        return out
