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
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Gather buffers reused by every layer and step: a fresh allocation per gather was handed back
        # to the OS each time and paid page faults on every step (8x slower per layer, bench_engine.py).
        self._k_buffer = torch.empty(0, dtype=dtype, device=device)
        self._v_buffer = torch.empty(0, dtype=dtype, device=device)

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
