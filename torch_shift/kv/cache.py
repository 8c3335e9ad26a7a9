"""The paged KV tensors: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import os

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self._init([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    def _init(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v
        self.num_blocks, self.block_size, self.num_kv_heads, _ = k[0].shape
        # Gather buffers reused by every layer and step: a fresh allocation per gather was handed back
        # to the OS each time and paid page faults on every step (8x slower per layer, bench_engine.py).
        self._k_buffer = k[0].new_empty(0)
        self._v_buffer = v[0].new_empty(0)

    def view(self, width: int) -> KVCache:
        """The same memory at KV width `width` (paper 004's KV adaptor): each block holds
        width * block_size tokens of num_kv_heads / width heads. KV written at one width is only
        ever read at that width."""
        if width == 1:
            return self
        assert self.num_kv_heads % width == 0, (self.num_kv_heads, width)
        nb, bs, h, d = self.k[0].shape
        shape = (nb, bs * width, h // width, d)
        viewed = object.__new__(KVCache)
        viewed._init([t.view(shape) for t in self.k], [t.view(shape) for t in self.v])
        return viewed

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v: [T, kv_heads, head_dim]; slot = block_id * block_size + offset in the block."""
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def gather(self, layer_idx: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table: [B, max_blocks] -> k, v: [B, kv_heads, max_blocks * block_size, head_dim], views of
        buffers that the next gather overwrites."""
        b, nb = block_table.shape
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        _, bs, h, d = k_cache.shape
        if self._k_buffer.numel() < b * nb * bs * h * d:
            self._k_buffer = k_cache.new_empty(b * nb * bs * h * d)
            self._v_buffer = v_cache.new_empty(b * nb * bs * h * d)
        flat = block_table.reshape(-1)
        k = torch.index_select(k_cache, 0, flat, out=self._k_buffer[: b * nb * bs * h * d].view(b * nb, bs, h, d))
        v = torch.index_select(v_cache, 0, flat, out=self._v_buffer[: b * nb * bs * h * d].view(b * nb, bs, h, d))
        return k.view(b, nb * bs, h, d).transpose(1, 2), v.view(b, nb * bs, h, d).transpose(1, 2)
