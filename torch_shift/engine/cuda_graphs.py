"""CUDA graphs of decode steps: one graph per batch-size bucket, captured at start-up, replayed for every step
whose runs are all single decode tokens (vLLM's piecewise-free "full" decode graphs).

A decode step of a small batch on a GPU is bound by launching its few hundred kernels, not by reading the
weights; a graph launches them all at once. A graph replays fixed addresses and a fixed grid, so
every input lives in a static buffer: token ids, positions and slots, and the Triton attention's per-run
metadata (query counts, cached tokens, block-table rows), written from the step's host arrays into pinned
host memory and copied in two transfers (int64 and int32); outside the graph only the logits are copied out,
and with asynchronous scheduling the ids of the decodes whose input token is still on the device are copied in
from the last step's tokens.
A bucket of b rows serves steps of up to b decodes; its padding rows have no query (attention skips them)
and slot -1 (their K/V are not written), and their logits are dropped.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_shift.attention.triton_paged import TritonMetadata, TritonPagedAttention, split_plan
from torch_shift.engine.input_batch import HostInputs
from torch_shift.kv.cache import KVCache
from torch_shift.parallel.layout_model import LayoutModel, MicroBatch
from torch_shift.parallel.layouts import Layout

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def graph_buckets(max_num_seqs: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    # the static inputs are inference tensors, as every step's inputs are: a compiled forward guards on it
    @torch.inference_mode()
    def __init__(self, model: LayoutModel, layout: Layout, kv_cache: KVCache, max_num_seqs: int,
                 max_model_len: int, sliding_window: int | None):
        device = kv_cache.device
        self.model, self.layout, self.kv_cache = model, layout, kv_cache
        self.sliding_window = sliding_window
        self.buckets = graph_buckets(max_num_seqs)
        n = self.max_rows = self.buckets[-1]
        self.max_blocks = math.ceil(max_model_len / kv_cache.block_size)
        # token ids | positions | slots | placeholders | their sources (asynchronous scheduling): one copy per step
        self.inputs = torch.zeros(5 * n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.placeholders, self.sources = self.inputs.split(n)
        self.slot_mapping.fill_(-1)
        self.logits_indices = torch.arange(n, device=device)
        # query counts | cached tokens | block-table rows (max_blocks each): one copy per step
        self.metadata = torch.zeros(2 * n + n * self.max_blocks, dtype=torch.int32, device=device)
        self.staging = torch.zeros(self.metadata.numel(), dtype=torch.int32)
        self.staging_inputs = torch.zeros(self.inputs.numel(), dtype=torch.long)
        self._staged = None  # the last copies out of the staging buffers were done (CUDA)
        if device.type == "cuda":
            self.staging = self.staging.pin_memory()
            self.staging_inputs = self.staging_inputs.pin_memory()
            self._staged = torch.cuda.Event()
        self.query_start = torch.arange(n, dtype=torch.int32, device=device)
        self.tile_first = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # steps run through the static inputs

    def _forward(self, rows: int) -> torch.Tensor:
        n, mb = self.max_rows, self.max_blocks
        # launched for the longest context a replay may see; each row combines the chunks of its own
        splits, split_keys = split_plan(mb * self.kv_cache.block_size, mb * self.kv_cache.block_size)
        metadata = TritonMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_table=self.metadata[2 * n: 2 * n + rows * mb].view(rows, mb),
            query_start=self.query_start[:rows], query_len=self.metadata[:rows],
            num_computed=self.metadata[n: n + rows], decode_tiles=(self.query_start[:rows], self.tile_first[:rows]),
            prefill_query_len=np.zeros(0, np.int32), sliding_window=self.sliding_window, decode_splits=splits,
            split_keys=split_keys)
        batch = MicroBatch(self.input_ids[:rows], self.positions[:rows],
                           TritonPagedAttention(self.kv_cache, metadata), self.logits_indices[:rows])
        return self.model.forward_step(self.layout, [batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool. The static inputs hold no query (query counts
        0, slots -1): the warm-up run before each capture (which compiles the Triton kernels outside it) and
        the captured run touch no KV block."""
        assert self.kv_cache.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.buckets):
            self._forward(rows)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[rows] = self._forward(rows)
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket of at least `num_rows` rows (None: more rows than the largest)."""
        for rows in self.buckets:
            if rows >= num_rows:
                return rows
        return None

    def replay(self, batch: HostInputs, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [num_decodes, vocab] of a step of decodes only (one token and one logits row per run);
        `previous_tokens`: the last step's sampled tokens on the device, where placeholders take their ids."""
        num_rows = batch.num_runs
        rows = self.bucket(num_rows)
        assert rows is not None and batch.num_decodes == num_rows == len(batch.input_ids)
        n, mb = self.max_rows, self.max_blocks
        context = int(batch.num_computed.max()) + 1
        used = -(-context // batch.tokens_per_block)
        if self._staged is not None:
            self._staged.synchronize()
        host = self.staging.numpy()
        host[:rows] = 0
        host[:num_rows] = 1
        host[n: n + rows] = 0
        host[n: n + num_rows] = batch.num_computed
        table = host[2 * n: 2 * n + rows * mb].reshape(rows, mb)
        table[:num_rows, :used] = batch.block_table[batch.block_table_rows, :used]
        size = 2 * n + rows * mb
        self.metadata[:size].copy_(self.staging[:size], non_blocking=True)
        staged = self.staging_inputs.numpy()
        staged[:rows] = 0
        staged[:num_rows] = batch.input_ids
        staged[n: n + rows] = 0
        staged[n: n + num_rows] = batch.positions
        staged[2 * n: 2 * n + rows] = -1  # padding rows write no K/V
        staged[2 * n: 2 * n + num_rows] = batch.slot_mapping
        num_placeholders = 0 if batch.placeholders is None else len(batch.placeholders)
        if num_placeholders:
            staged[3 * n: 3 * n + num_placeholders] = batch.placeholders
            staged[4 * n: 4 * n + num_placeholders] = batch.placeholder_sources
        self.inputs.copy_(self.staging_inputs, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        if num_placeholders:
            assert previous_tokens is not None, "a step with placeholders needs the last step's sampled tokens"
            self.input_ids[self.placeholders[:num_placeholders]] = previous_tokens[self.sources[:num_placeholders]]
        self.num_replays += 1
        if rows not in self.graphs:  # not captured (the CPU, in tests): the same static inputs, run eagerly
            return self._forward(rows)[:num_rows].clone()
        self.graphs[rows].replay()
        self.model.layout_counts[self.layout.name] += 1
        return self.logits[rows][:num_rows].clone()
