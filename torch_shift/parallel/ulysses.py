"""Ulysses attention for inference over "sp" (paper 000, Alg. 2 lines 4-6).

Each SP rank holds a contiguous part of the step's n tokens (n // SP or one more; none when n < SP) and all
its TP-local heads. One fused all-to-all of q, k and v turns that into all n tokens of 1/SP of the heads: head
chunk tp * SP + sp, the rank's shift rank. Attention runs on them, and a second all-to-all brings the output
back to the ranks that hold the tokens. Both all-to-alls send messages of ceil(n / SP) tokens, a rank with fewer
padding its own (nothing computes on the padding).

KV heads: with more head chunks than KV heads, the K/V heads are repeated before the all-to-all
so that segment s carries the KV heads of head chunk tp * SP + s (the repeat-interleave
equivalent of paper 000, Alg. 1). That keeps q, k and v in one all-to-all; it sends the
replicated heads once each instead of running Alg. 1's all-to-all plus all-gather.

In a compiled CPU forward whose SP group shares memory, both all-to-alls and the paged attention between them run
in C++ (`install_native`; kernels/cpu_ops.cpp), on the same protocol as this Python path; so do the C++ decoder's
steps of an SP rank (torch_shift.parallel.layers.UlyssesDecoder).

A rank that holds every token of a step and has every SP rank's KV cache mapped (`chunk_attention`: a one-token step
on SP rank 0 over the group's shared KV, torch_shift.parallel.shared_kv) exchanges nothing: it attends each head
chunk into that chunk's rank's cache itself, as that rank would after the first all-to-all.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from torch_shift.models.decoder import AttentionFn
from torch_shift.parallel import comm


class UlyssesAttention:
    def __init__(self, inner: AttentionFn, group: dist.ProcessGroup, counts: list[int],
                 kv_send_index: torch.Tensor | None, chunk_attention: list | None = None):
        self.inner = inner
        self.group = group
        self.sp = len(counts)
        self.sp_rank = dist.get_rank(group)
        self.counts = counts  # tokens held by each SP rank, in token order, the first ranks holding the most
        self.kv_send_index = kv_send_index  # TP-local KV head for each (segment, head) slot; None: identity
        self._real_rows: torch.Tensor | None = None  # of the all-to-all's padded messages, where counts differ
        # per head chunk the step's CpuPagedAttention over that chunk's rank's cache, where this rank holds every
        # token and reads them all (the SP group's shared KV); None: the all-to-alls
        assert chunk_attention is None or (len(chunk_attention) == self.sp and counts[self.sp_rank] == sum(counts))
        self.chunk_attention = chunk_attention

    def advance_arrays(self) -> tuple[int, ...]:
        """Where a multi-step run moves its decodes on (NativeDecoder.steps), for a step this rank attends alone over
        every head chunk's cache: the inner paged step's arrays, which each chunk's view of it shares."""
        assert self.chunk_attention is not None, "a run's steps exchange nothing"
        return self.inner.advance_arrays()

    @property
    def exchanges(self) -> bool:
        """Whether the step's attention runs the all-to-alls (not where this rank attends every chunk itself)."""
        return self.chunk_attention is None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        sp, counts = self.sp, self.counts
        n_local, hq, d = q.shape
        assert n_local == counts[self.sp_rank], (n_local, counts)
        if self.kv_send_index is not None:
            k = k.index_select(1, self.kv_send_index)
            v = v.index_select(1, self.kv_send_index)
        hq_chunk, hkv_chunk = hq // sp, k.shape[1] // sp
        if self.chunk_attention is not None:
            outs = []
            for s, attention in enumerate(self.chunk_attention):
                heads, kv_heads = slice(s * hq_chunk, (s + 1) * hq_chunk), slice(s * hkv_chunk, (s + 1) * hkv_chunk)
                extras = () if sinks is None and sliding_window is None else (
                    None if sinks is None else sinks[heads], sliding_window)
                outs.append(attention(layer_idx, q[:, heads], k[:, kv_heads], v[:, kv_heads], *extras))
            return torch.cat(outs, dim=1)
        # [n_local, SP, heads of one chunk * d] per tensor, fused, then segment-major for the all-to-all
        send = torch.cat((q.reshape(n_local, sp, hq_chunk * d), k.reshape(n_local, sp, hkv_chunk * d),
                          v.reshape(n_local, sp, hkv_chunk * d)), dim=-1)
        # messages of equal size (the communicator's fast path: unequal parts took 44 against 23 us a call at world
        # 2): a rank with fewer tokens pads its own with rows that nothing reads
        n_max = counts[0]
        if n_local < n_max:
            send = torch.cat((send, send.new_zeros(n_max - n_local, *send.shape[1:])))
        recv = comm.all_to_all(send.transpose(0, 1).reshape(sp * n_max, send.shape[-1]), self.group)
        real_rows = self._rows(q.device)
        if real_rows is not None:
            recv = recv.index_select(0, real_rows)
        # rows of recv: SP rank 0's tokens, then rank 1's ...: the global token order
        n = recv.shape[0]
        q_all, k_all, v_all = recv.split((hq_chunk * d, hkv_chunk * d, hkv_chunk * d), dim=-1)
        if sinks is not None:  # this rank attends with head chunk `sp_rank` of the TP-local heads
            sinks = sinks[self.sp_rank * hq_chunk:(self.sp_rank + 1) * hq_chunk]
        extras = () if sinks is None and sliding_window is None else (sinks, sliding_window)
        out = self.inner(layer_idx, q_all.reshape(n, hq_chunk, d), k_all.reshape(n, hkv_chunk, d),
                         v_all.reshape(n, hkv_chunk, d), *extras).reshape(n, hq_chunk * d)
        if real_rows is not None:
            out = out.new_zeros(sp * n_max, hq_chunk * d).index_copy_(0, real_rows, out)
        back = comm.all_to_all(out, self.group)  # [SP (head chunk), n_max, hq_chunk * d]
        return back.view(sp, n_max, hq_chunk, d)[:, :n_local].transpose(0, 1).reshape(n_local, hq, d)

    def message_bytes(self, num_heads: int, num_kv_heads: int, head_dim: int, element_size: int) -> tuple[int, int]:
        """The sizes of the two all-to-alls' messages (bytes) for a layer of `num_heads` query and `num_kv_heads` KV
        heads (TP-local), as `__call__` makes them: q, k and v of every head chunk for counts[0] tokens (the KV heads
        repeated where `kv_send_index` says), and the attention's output."""
        kv_heads = num_kv_heads if self.kv_send_index is None else len(self.kv_send_index)
        rows = self.sp * self.counts[0]
        return (rows * (num_heads + 2 * kv_heads) // self.sp * head_dim * element_size,
                rows * num_heads // self.sp * head_dim * element_size)

    def install_native(self) -> bool:
        """Give this step to the C++ implementation of `torch_shift::attention` (a compiled forward's calls, and the C++
        decoder's, then run both all-to-alls and the paged attention between them without Python: kernels/cpu_ops.cpp):
        where the inner attention installs natively and the SP group's collectives run through a shared-memory
        communicator in C++. False (nothing installed) otherwise."""
        from torch_shift.kernels import native_attention

        install = getattr(self.inner, "install_native", None)
        communicator = comm.native_communicator(self.group)
        native = native_attention()
        if install is None or communicator is None or native is None or not install():
            return False
        counts = np.asarray(self.counts, dtype=np.int64)
        index = self.kv_send_index
        if index is not None:
            index = np.ascontiguousarray(index.cpu().numpy(), dtype=np.int64)
        bases = None
        if self.chunk_attention is not None:
            bases = np.array([attention.cache_bases() for attention in self.chunk_attention], dtype=np.int64).T.copy()
        native.install_ulysses(communicator, self.sp, self.sp_rank, counts.ctypes.data,
                               None if index is None else index.ctypes.data, 0 if index is None else len(index),
                               None if bases is None else bases[0].ctypes.data,
                               None if bases is None else bases[1].ctypes.data)
        return True

    def _rows(self, device: torch.device) -> torch.Tensor | None:
        """Where the counts differ, the rows of the padded messages that hold tokens, in token order."""
        counts = self.counts
        if self._real_rows is None and counts[-1] != counts[0]:
            self._real_rows = torch.tensor([j * counts[0] + i for j, count in enumerate(counts) for i in range(count)],
                                           device=device)
        return self._real_rows


def kv_send_index(num_kv_heads: int, sp: int, tp: int, tp_rank: int) -> torch.Tensor | None:
    """For each SP segment s, the TP-local indices of the KV heads of head chunk tp_rank * SP + s."""
    from torch_shift.parallel.plan import shard_bounds

    tp_first, tp_count = shard_bounds(num_kv_heads, tp, tp_rank)
    index = []
    for s in range(sp):
        first, count = shard_bounds(num_kv_heads, sp * tp, tp_rank * sp + s)
        index.extend(range(first - tp_first, first - tp_first + count))
    if index == list(range(tp_count)):
        return None
    return torch.tensor(index, dtype=torch.long)
