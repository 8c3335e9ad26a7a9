"""The paged KV tensors: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import os

import torch

from torch_shift.memory import advise_huge_pages


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor; on Linux CPUs in transparent huge pages where the kernel offers them on request
    (`madvise` mode): a sequence's blocks are scattered over the pool, and with 4 KiB pages the paged kernel
    waits on a TLB miss at each one (decode attention 1.4x slower measured, bench_peers.py)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu":
        advise_huge_pages(tensor.data_ptr(), nbytes)  # before zero_() faults the pages in
    return tensor.zero_()


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


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


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory (the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """A ValueError where a size the user gave (`what`) cannot fit the device's whole memory at all (the
    allocator's own error named no option)."""
    total = total_memory_bytes(device)
    if nbytes > total:
        where = "this machine" if device.type == "cpu" else f"the GPU ({device})"
        raise ValueError(f"{what}: {nbytes / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of memory {where} "
                         "has")


class KVCache:
    """Per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim], views of one
    buffer per K and V laid out block-major: a block's bytes are one contiguous run holding every layer, so
    that other groupings of the same bytes per block (`view`: more tokens of fewer heads; `regroup`: fewer
    layers of more heads) keep every block where it is and never overlap another block.

    Values are stored token-major, `[num_blocks, num_layers, block_size, kv_heads, head_dim]`; keys
    dim-major, `[num_blocks, num_layers, kv_heads, head_dim, block_size]` (`k_store`), so that the
    consecutive keys of one head and dimension are one vector (the paged CPU kernel scores 16 keys with
    one multiply-add per dimension; vLLM's paged kernels split keys the same way). `k_all` and `k` are
    the keys in the values' order, as strided views."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        memory: torch.Tensor | None = None,
    ):
        """`memory`: bytes of the CPU to hold it (`nbytes` of them, zeros), as a shared mapping; None: its own."""
        k_shape = (num_blocks, num_layers, num_kv_heads, head_dim, block_size)
        v_shape = (num_blocks, num_layers, block_size, num_kv_heads, head_dim)
        if memory is None:
            self._init(_zeros(k_shape, dtype, device), _zeros(v_shape, dtype, device))
            return
        half = KVCache.nbytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype) // 2
        assert memory.dtype == torch.uint8 and memory.device.type == "cpu" and memory.numel() == 2 * half
        self._init(memory[:half].view(dtype).view(k_shape), memory[half:].view(dtype).view(v_shape))

    @staticmethod
    def nbytes(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
        """The bytes of a cache of these sizes (its keys', then its values')."""
        return num_blocks * kv_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)

    def _init(self, k_store: torch.Tensor, v_all: torch.Tensor) -> None:
        self.k_store, self.v_all = k_store, v_all
        self.k_all = k_store.permute(0, 1, 4, 2, 3)  # [num_blocks, num_layers, block_size, kv_heads, head_dim]
        self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim = v_all.shape
        self.k, self.v = list(self.k_all.unbind(1)), list(v_all.unbind(1))
        # rows of [blocks * layers * block_size, heads, dim]: where a slot of a layer's values is written and read
        self._v_rows = v_all.view(-1, self.num_kv_heads, self.head_dim)
        # Gather buffers reused by every layer and step: a fresh allocation per gather was handed back
        # to the OS each time and paid page faults on every step (8x slower per layer, bench_engine.py).
        self._k_buffer = v_all.new_empty(0)
        self._v_buffer = v_all.new_empty(0)

    @property
    def dtype(self) -> torch.dtype:
        return self.v_all.dtype

    @property
    def device(self) -> torch.device:
        return self.v_all.device

    def _viewed(self, num_layers: int, block_size: int, num_kv_heads: int) -> KVCache:
        nb, d = self.num_blocks, self.head_dim
        viewed = object.__new__(KVCache)
        viewed._init(self.k_store.view(nb, num_layers, num_kv_heads, d, block_size),
                     self.v_all.view(nb, num_layers, block_size, num_kv_heads, d))
        return viewed

    def view(self, width: int) -> KVCache:
        """The same memory at KV width `width` (paper 004's KV adaptor): each block holds
        width * block_size tokens of num_kv_heads / width heads. KV written at one width is only
        ever read at that width."""
        if width == 1:
            return self
        assert self.num_kv_heads % width == 0, (self.num_kv_heads, width)
        return self._viewed(self.num_layers, self.block_size * width, self.num_kv_heads // width)

    def regroup(self, num_layers: int, num_kv_heads: int) -> KVCache:
        """The same memory as `num_layers` layers of `num_kv_heads` heads, blocks unchanged: a pipeline
        stage's layers with every head, or every layer with a TP rank's heads (paper 003's two layouts
        over one pool). KV written in one grouping is only ever read in it."""
        nl, h = self.num_layers, self.num_kv_heads
        if (num_layers, num_kv_heads) == (nl, h):
            return self
        assert num_layers * num_kv_heads == nl * h, (num_layers, num_kv_heads, nl, h)
        return self._viewed(num_layers, self.block_size, num_kv_heads)

    def _v_slots(self, layer_idx: int, slot_mapping: torch.Tensor) -> torch.Tensor:
        """slot = block_id * block_size + offset -> its row of `layer_idx` in the values' buffer."""
        bs = self.block_size
        return (slot_mapping // bs) * (self.num_layers * bs) + (layer_idx * bs) + slot_mapping % bs

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v: [T, kv_heads, head_dim]; slot = block_id * block_size + offset in the block."""
        bs = self.block_size
        self.k[layer_idx][slot_mapping // bs, slot_mapping % bs] = k
        self._v_rows.index_copy_(0, self._v_slots(layer_idx, slot_mapping), v)

    def read_slots(self, layer_idx: int, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer_idx` at the given slots: [n, kv_heads, head_dim] each."""
        bs = self.block_size
        return self.k[layer_idx][slot_mapping // bs, slot_mapping % bs], self._v_rows[self._v_slots(layer_idx,
                                                                                                    slot_mapping)]

    def gather(self, layer_idx: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_table: [B, max_blocks] -> k, v: [B, kv_heads, max_blocks * block_size, head_dim], views of
        buffers that the next gather overwrites."""
        b, nb = block_table.shape
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        _, bs, h, d = v_cache.shape
        if self._k_buffer.numel() < b * nb * bs * h * d:
            self._k_buffer = v_cache.new_empty(b * nb * bs * h * d)
            self._v_buffer = v_cache.new_empty(b * nb * bs * h * d)
        flat = block_table.reshape(-1)
        k = torch.index_select(k_cache, 0, flat, out=self._k_buffer[: b * nb * bs * h * d].view(b * nb, bs, h, d))
        v = torch.index_select(v_cache, 0, flat, out=self._v_buffer[: b * nb * bs * h * d].view(b * nb, bs, h, d))
        return k.view(b, nb * bs, h, d).transpose(1, 2), v.view(b, nb * bs, h, d).transpose(1, 2)
