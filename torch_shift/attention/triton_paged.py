"""Paged attention in Triton (backend "triton"): the GPU path, for decode tokens and prompt chunks alike.

Each program takes a tile of one run's queries (BLOCK_T consecutive tokens) times the GROUP query heads
of one KV head, and walks that run's context BLOCK_N keys at a time through its block table with an
online softmax (FlashAttention's recurrence), so every key and value is read once per tile and no
context is gathered or padded. Keys are stored dim-major per block (`KVCache.k_store`), which is the
K^T tile the score product wants. Decode runs (one token) go in a launch of BLOCK_T = 1, whose grid is
fixed by the number of decode rows: what a CUDA graph of a decode step captures. A decode step whose
contexts reach past one chunk splits each context into chunks (SPLIT_KEYS keys, more where max_model_len
would need over MAX_SPLITS of them), one program each (FlashDecoding: a batch of a few sequences otherwise
runs on a few of the GPU's multiprocessors), and a second kernel combines each row's own chunks in chunk
order; a row whose context fits one chunk is written by its chunk, and the combine passes it over. The chunk
size depends on max_model_len only and a row combines the chunks of its own context, so a CUDA graph launched for
the longest context computes what an eager step does, bit for bit. A decode row's own key and value go into their
slot in the decode launch, by the program whose chunk holds them, before it reads its keys; a prompt chunk's are
written by a kernel of their own before the prefill launch (slots < 0 skipped: a captured graph's padding rows).

On the CPU the same kernels run in Triton's interpreter, when TRITON_INTERPRET=1 was set before triton was
imported (tests only: it is slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_shift.attention.backend import AttentionBatch
from torch_shift.kernels import next_pow2
from torch_shift.kv.cache import KVCache
from torch_shift.memory import to_device

# the decode and the prefill launches' tiles and Triton launch options: the fastest bench/bench_triton_attention.py
# swept on an H200 (docs/performance.md)
DECODE_LAUNCH = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}
PREFILL_LAUNCH = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
PREFILL_ROWS = 128  # query rows (tokens x heads of one KV head) per prefill tile
SPLIT_KEYS = 256  # keys per chunk of a decode context split over several programs (a multiple of the decode BLOCK_N)
MAX_SPLITS = 32  # chunks a context of max_model_len keys is cut into, at most (larger chunks past 8k)
# A prompt's run of SDPA_PROMPT_TOKENS tokens or more with nothing cached attends to the step's own keys and values
# through torch's SDPA (FlashAttention on a GPU), where the layer has no sliding window and no sinks; None: never.
# On an H200 a 2k prompt prefilled in 0.89x the time, while prompts of 128-512 tokens (an SDPA call each, where the
# paged kernel takes a step's prompts in one launch) served offline in 1.19x the time (docs/performance.md).
SDPA_PROMPT_TOKENS: int | None = 1024
# A decode row's own key and value are written into the cache by the decode launch's program whose keys include it,
# before it reads them, instead of by a K/V write kernel before the attention (16 kernels fewer in a decode step of a
# 16-layer model); False: every token's by the K/V write kernel.
DECODE_WRITES_KV = True


# an argument that changes from step to step must not be specialized on (Triton compiles a kernel per
# divisibility of an integer by 16 and per value 1): a step would otherwise compile anew while serving
@triton.jit(do_not_specialize=["sm_scale", "window", "stride_bt", "num_splits"])
def _paged_attention(
    out_ptr, q_ptr, k_ptr, v_ptr, sinks_ptr,
    block_table_ptr, tile_run_ptr, tile_first_ptr, query_start_ptr, query_len_ptr, num_computed_ptr,
    partial_acc_ptr, partial_max_sum_ptr, new_k_ptr, new_v_ptr, slot_ptr,
    sm_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kh, stride_kd, stride_kn,
    stride_vb, stride_vn, stride_vh,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    stride_bt, num_splits,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, WRITE_KV: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    run = tl.load(tile_run_ptr + tile)
    first = tl.load(tile_first_ptr + tile)  # the tile's first query, counted within its run
    q_start = tl.load(query_start_ptr + run)
    q_len = tl.load(query_len_ptr + run)
    done = tl.load(num_computed_ptr + run)

    rows = tl.arange(0, BLOCK_M)  # row = token * GROUP + head within the group
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = (rows < BLOCK_T * GROUP) & (token < q_len)
    position = done + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    last_token = tl.minimum(first + BLOCK_T, q_len)  # keys [lo, hi) are visible to some row of the tile
    hi = done + last_token
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(done + first - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT_KEYS > 0:  # this program's chunk of a decode context (program_id 2); a padding row's is chunk 0
        split = tl.program_id(2)
        if split * SPLIT_KEYS >= tl.maximum(hi, 1):
            return
        one_chunk = hi <= SPLIT_KEYS  # the row's output written here, not by _combine_splits
        lo = tl.maximum(lo, split * SPLIT_KEYS)
        hi = tl.minimum(hi, (split + 1) * SPLIT_KEYS)
    if WRITE_KV:  # a decode row (BLOCK_T 1): its key and value (position `done`) into their slot, by the one program
        # whose keys include it, before any thread of the program reads them (the barrier orders the CTA's accesses)
        slot = tl.load(slot_ptr + q_start) + dims * 0  # per lane: masks of tensors (Triton's interpreter)
        key = done + dims * 0
        write = dim_ok & (slot >= 0) & (key >= lo) & (key < hi)
        new_block = (slot // BLOCK_SIZE).to(tl.int64)
        new_offset = slot % BLOCK_SIZE
        new_k = tl.load(new_k_ptr + q_start * stride_nkt + kv_head * stride_nkh + dims, mask=write)
        new_v = tl.load(new_v_ptr + q_start * stride_nvt + kv_head * stride_nvh + dims, mask=write)
        tl.store(k_ptr + new_block * stride_kb + kv_head * stride_kh + dims * stride_kd + new_offset * stride_kn,
                 new_k, mask=write)
        tl.store(v_ptr + new_block * stride_vb + new_offset * stride_vn + kv_head * stride_vh + dims, new_v,
                 mask=write)
        tl.debug_barrier()
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    row_table = block_table_ptr + run * stride_bt
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block = tl.load(row_table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        k_t = tl.load(k_ptr + block[None, :] * stride_kb + kv_head * stride_kh + dims[:, None] * stride_kd
                      + offset[None, :] * stride_kn, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision=PRECISION) * sm_scale
        else:
            scores = tl.dot(q, k_t, input_precision=PRECISION) * sm_scale
        visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vn + kv_head * stride_vh
                    + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    stored = valid
    if SPLIT_KEYS > 0:
        if not one_chunk:  # the chunk's unnormalised sum, its max and its denominator, combined by _combine_splits
            # partial_acc [decode rows, heads, num_splits, HEAD_DIM_PAD]; partial_max_sum [..., 2]
            at = ((tile * (GROUP * tl.num_programs(1)) + head) * num_splits + split).to(tl.int64)
            tl.store(partial_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=valid[:, None])
            tl.store(partial_max_sum_ptr + at * 2, m_i, mask=valid)
            tl.store(partial_max_sum_ptr + at * 2 + 1, l_i, mask=valid)
            return
        stored = rows < GROUP  # a decode row: a CUDA graph's padding row (no query) gets zeros, as a combine gave it
    if HAS_SINKS:  # a sink logit per head beside the keys: in the denominator only
        sink = tl.load(sinks_ptr + head, mask=valid, other=0.0).to(tl.float32)
        l_i = l_i + tl.exp(sink - m_i)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=stored[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits(
    out_ptr, partial_acc_ptr, partial_max_sum_ptr, sinks_ptr, query_start_ptr, query_len_ptr, num_computed_ptr,
    stride_ot, stride_oh, num_splits,
    SPLIT_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One decode row's head: the partial softmaxes of its context's chunks combined, in chunk order (a chunk
    below a sliding window holds max -1e30 and sum 0: it adds exactly 0)."""
    run = tl.program_id(0)
    head = tl.program_id(1)
    chunks = tl.cdiv(tl.load(num_computed_ptr + run) + tl.load(query_len_ptr + run), SPLIT_KEYS)
    if chunks <= 1:  # a context of one chunk (or a padding row): written by the attention kernel
        return
    base = ((run * tl.num_programs(1) + head) * num_splits).to(tl.int64)
    m = tl.full([], -1.0e30, tl.float32)
    for split in range(0, chunks):
        m = tl.maximum(m, tl.load(partial_max_sum_ptr + (base + split) * 2))
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    denominator = tl.full([], 0.0, tl.float32)
    for split in range(0, chunks):
        weight = tl.exp(tl.load(partial_max_sum_ptr + (base + split) * 2) - m)
        denominator += tl.load(partial_max_sum_ptr + (base + split) * 2 + 1) * weight
        acc += tl.load(partial_acc_ptr + (base + split) * HEAD_DIM_PAD + dims) * weight
    if HAS_SINKS:
        denominator += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m)
    out = acc / tl.where(denominator > 0, denominator, 1.0)
    token = tl.load(query_start_ptr + run)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _write_kv(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_ckh, stride_ckd, stride_ckn,
    stride_cvb, stride_cvn, stride_cvh,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        ok = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=ok)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=ok)
        tl.store(k_cache_ptr + block * stride_ckb + heads[:, None] * stride_ckh + dims[None, :] * stride_ckd
                 + offset * stride_ckn, k, mask=ok)
        tl.store(v_cache_ptr + block * stride_cvb + offset * stride_cvn + heads[:, None] * stride_cvh
                 + dims[None, :], v, mask=ok)


def _launcher(kernel, device: torch.device):
    """The kernel compiled for the GPU, or run by Triton's interpreter for CPU tensors."""
    if device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(kernel.fn)
    return kernel


@dataclass
class TritonMetadata:
    """A step's attention inputs on the device, copied in one transfer: per run its first row in the step, its
    query count, its cached tokens and its row of the block table; and the tiles of each launch."""

    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # int32 [R, max_blocks]: the runs' rows of the block table, in run order
    query_start: torch.Tensor  # int32 [R]
    query_len: torch.Tensor  # int32 [R]
    num_computed: torch.Tensor  # int32 [R]
    decode_tiles: tuple[torch.Tensor, torch.Tensor] | None  # (run, first query) per tile of the decode launch
    prefill_query_len: np.ndarray  # the prompt runs' query counts (runs num_decodes.. in order)
    sliding_window: int | None
    decode_splits: int = 1  # chunks of split_keys keys the longest decode context is split into (1: not split)
    split_keys: int = 0  # keys per chunk (split_plan)
    # (first row, tokens) of the prompt runs SDPA takes (SDPA_PROMPT_TOKENS or more, nothing cached)
    fresh_prompts: list[tuple[int, int]] = field(default_factory=list)
    prefill_fresh: np.ndarray | None = None  # bool per prompt run: in fresh_prompts
    decodes_lead: bool = True  # the decode rows are the step's first tokens (0..num_decodes-1)
    prefill_tiles: dict[tuple[int, bool], tuple[tuple[torch.Tensor, torch.Tensor] | None, int]] = field(
        default_factory=dict)
    partials: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        return self.query_len.numel() - len(self.prefill_query_len)

    def prefill_tiles_of(self, group: int, fresh_apart: bool = False
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int]:
        """The prefill launch's tiles for `group` query heads per KV head (PREFILL_ROWS rows a tile), and its
        tokens per tile, over every prompt run or (`fresh_apart`) those with tokens cached; built when the first
        layer asks."""
        key = (group, fresh_apart)
        if key not in self.prefill_tiles:
            block_t = max(1, PREFILL_ROWS // group)
            tiles = None
            query_len = self.prefill_query_len.astype(np.int64)
            if fresh_apart:
                query_len = np.where(self.prefill_fresh, 0, query_len)
            if query_len.any():
                tiles_per_run = -(-query_len // block_t)
                run = np.repeat(np.arange(self.num_decodes, self.query_len.numel()), tiles_per_run)
                first = (np.arange(len(run)) - np.repeat(np.cumsum(tiles_per_run) - tiles_per_run,
                                                          tiles_per_run)) * block_t
                tiles = tuple(to_device([run, first], np.int32, self.query_len.device))
            self.prefill_tiles[key] = (tiles, block_t)
        return self.prefill_tiles[key]

    def partials_of(self, num_heads: int, dim_pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split decode's partial sums and (max, sum) pairs, one buffer for every layer of the step."""
        key = (num_heads, dim_pad)
        if key not in self.partials:
            rows = num_heads * self.num_decodes * self.decode_splits
            self.partials[key] = (torch.empty(rows, dim_pad, dtype=torch.float32, device=device),
                                  torch.empty(rows, 2, dtype=torch.float32, device=device))
        return self.partials[key]


def split_plan(max_context: int, capacity: int) -> tuple[int, int]:
    """(chunks, keys per chunk) of a decode step whose longest context is `max_context` keys, in an engine whose
    contexts hold up to `capacity` keys (its block table's width): chunks of SPLIT_KEYS keys, or larger where
    `capacity` would need more than MAX_SPLITS. The size depends on `capacity` alone, so a CUDA graph (sized
    for `capacity`) and an eager step cut a context alike."""
    block_n = DECODE_LAUNCH["BLOCK_N"]
    per_chunk = -(-capacity // MAX_SPLITS)
    keys = max(SPLIT_KEYS, -(-per_chunk // block_n) * block_n)  # whole tiles of the unsplit kernel
    return max(1, -(-max_context // keys)), keys


def _head_dim_pad(head_dim: int) -> int:
    """The head dimension as the attention kernel's tiles hold it (and the split decode's partial sums)."""
    return max(16, next_pow2(head_dim))


def split_decode_bytes(num_decodes: int, num_heads: int, head_dim: int, capacity: int) -> int:
    """Device memory of a decode step's partial sums (TritonMetadata.partials_of) at its longest; 0 where no
    context is split."""
    splits, _ = split_plan(capacity, capacity)
    if splits == 1:
        return 0
    return num_decodes * num_heads * splits * (_head_dim_pad(head_dim) + 2) * 4


def build_triton_metadata(batch: AttentionBatch) -> TritonMetadata:
    runs, nd = batch.num_runs, batch.num_decodes
    context = batch.num_computed.astype(np.int64) + batch.query_len
    max_blocks = max(1, int(-(-context.max() // batch.tokens_per_block))) if runs else 1
    table = batch.block_table[batch.block_table_rows, :max_blocks]
    flat = to_device([table, batch.query_start, batch.query_len, batch.num_computed, np.arange(nd), np.zeros(nd)],
                     np.int32, batch.device)
    prefill_fresh = np.zeros(runs - nd, dtype=bool)
    if SDPA_PROMPT_TOKENS is not None:
        prefill_fresh = (batch.num_computed[nd:] == 0) & (batch.query_len[nd:] >= SDPA_PROMPT_TOKENS)
    fresh = list(zip(batch.query_start[nd:][prefill_fresh].tolist(), batch.query_len[nd:][prefill_fresh].tolist()))
    splits, split_keys = split_plan(int(context[:nd].max()) if nd else 0,
                                    batch.block_table.shape[1] * batch.tokens_per_block)
    return TritonMetadata(batch.slot_mapping, flat[0].view(runs, max_blocks), flat[1], flat[2], flat[3],
                          (flat[4], flat[5]) if nd else None, batch.query_len[nd:].copy(), batch.sliding_window,
                          splits, split_keys, fresh, prefill_fresh,
                          decodes_lead=np.array_equal(batch.query_start[:nd], np.arange(nd)))


def write_kv(kv_cache: KVCache, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] into their slots of `layer_idx` (slots < 0: skipped)."""
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache.k_store[:, layer_idx], kv_cache.v_all[:, layer_idx]
    assert k.stride(2) == v.stride(2) == 1 and v_cache.stride(3) == 1
    _launcher(_write_kv, k.device)[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride(), *v_cache.stride()[:3], BLOCK_SIZE=kv_cache.block_size, NUM_HEADS=heads, HEAD_DIM=dim,
        HEADS_PAD=next_pow2(heads), HEAD_DIM_PAD=next_pow2(dim))


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, layer_idx: int, md: TritonMetadata,
                    sinks: torch.Tensor | None, window: int | None, fresh_apart: bool = False,
                    decode_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[t] = attention of query row t over its run's context in `kv_cache` (written already, but for the decode
    rows' own keys and values where `decode_kv` gives the step's k and v: written by the decode launch); with
    `fresh_apart`, not for the rows of md.fresh_prompts."""
    num_heads, dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.num_kv_heads
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache.k_store[:, layer_idx], kv_cache.v_all[:, layer_idx]
    assert q.stride(2) == 1 and out.stride(2) == 1 and v_cache.stride(3) == 1
    launch = _launcher(_paged_attention, q.device)
    dim_pad = _head_dim_pad(dim)
    common = dict(BLOCK_SIZE=kv_cache.block_size, GROUP=group, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad,
                  HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  # Triton's interpreter (the CPU) multiplies 16-bit tiles wrongly: the same rounding in float32
                  DOT_FP32=q.device.type == "cpu")
    sinks_arg = sinks if sinks is not None else q  # any tensor where the layer has none: the kernel reads none
    splits = md.decode_splits
    for tiles, block_t, options in ((md.decode_tiles, 1, DECODE_LAUNCH),
                                    (*md.prefill_tiles_of(group, fresh_apart), PREFILL_LAUNCH)):
        if tiles is None:
            continue
        tile_run, tile_first = tiles
        split_decode = block_t == 1 and splits > 1
        assert not split_decode or md.split_keys % options["BLOCK_N"] == 0, "chunks start on the unsplit tiles"
        partial_acc, partial_max_sum = md.partials_of(num_heads, dim_pad, q.device) if split_decode else (q, q)
        writes_kv = block_t == 1 and decode_kv is not None
        new_k, new_v = decode_kv if writes_kv else (q, q)  # any tensors where the launch writes none
        launch[(tile_run.numel(), num_kv_heads, splits if split_decode else 1)](
            out, q, k_cache, v_cache, sinks_arg, md.block_table, tile_run, tile_first,
            md.query_start, md.query_len, md.num_computed, partial_acc, partial_max_sum, new_k, new_v,
            md.slot_mapping, 1.0 / math.sqrt(dim), window or 0, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), *k_cache.stride(), *v_cache.stride()[:3], new_k.stride(0), new_k.stride(1),
            new_v.stride(0), new_v.stride(1), md.block_table.stride(0), splits, BLOCK_T=block_t,
            BLOCK_M=max(16, next_pow2(block_t * group)), SPLIT_KEYS=md.split_keys if split_decode else 0,
            WRITE_KV=writes_kv, **options, **common)
        if split_decode:
            _launcher(_combine_splits, q.device)[(tile_run.numel(), num_heads)](
                out, partial_acc, partial_max_sum, sinks_arg, md.query_start, md.query_len, md.num_computed,
                out.stride(0), out.stride(1), splits, SPLIT_KEYS=md.split_keys, HEAD_DIM=dim, HEAD_DIM_PAD=dim_pad,
                HAS_SINKS=sinks is not None)


class TritonBackend:
    name = "triton"

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> TritonPagedAttention:
        return TritonPagedAttention(kv_cache, build_triton_metadata(batch))


class TritonPagedAttention:
    """The model's `attention(layer_idx, q, k, v, sinks, sliding_window)` for one step, in Triton."""

    def __init__(self, kv_cache: KVCache, metadata: TritonMetadata):
        self.kv_cache = kv_cache
        self.metadata = metadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        md = self.metadata
        window = md.sliding_window if sliding_window is None else sliding_window
        decode_kv = None
        if DECODE_WRITES_KV and md.decode_tiles is not None and md.decodes_lead and k.stride(2) == v.stride(2) == 1:
            decode_kv = (k, v)  # the decode rows' by the decode launch, the prompt chunks' here
            nd = md.num_decodes
            write_kv(self.kv_cache, layer_idx, md.slot_mapping[nd:], k[nd:], v[nd:])
        else:
            write_kv(self.kv_cache, layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)
        fresh_apart = bool(md.fresh_prompts) and window is None and sinks is None
        paged_attention(out, q.contiguous() if q.stride(2) != 1 else q, self.kv_cache, layer_idx, md, sinks,
                        window, fresh_apart, decode_kv)
        if fresh_apart:
            for start, length in md.fresh_prompts:
                rows = slice(start, start + length)
                out[rows] = causal_attention(q[rows], k[rows], v[rows])
        return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, heads, dim] over k/v [n, kv_heads, dim], causal (a prompt with nothing before it), through SDPA as
    its fused kernels take it: 4-D [1, heads, n, dim] (3-D inputs go to the math kernel). FlashAttention reads
    each query head's K/V head in place (SDPA's `enable_gqa`); the memory-efficient kernel (fp32 on a GPU) does not
    take that, and there K/V are repeated per query head (each layer's copies of a prompt's keys and values; the same
    bits either way)."""
    group = q.shape[1] // k.shape[1]
    key = (q.device, q.dtype, q.shape[-1])
    q = q.transpose(0, 1).unsqueeze(0)
    with sdpa_kernel(_PROMPT_BACKENDS):
        # FlashAttention runs 16-bit inputs only (float32 goes to the memory-efficient kernel)
        if group > 1 and q.dtype != torch.float32 and _GQA_IN_PLACE.get(key, True):
            try:
                out = F.scaled_dot_product_attention(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                     is_causal=True, enable_gqa=True)
                return out[0].transpose(0, 1)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # no fused kernel here takes GQA (a GPU without FlashAttention): repeated from now on
                _GQA_IN_PLACE[key] = False
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        k, v = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)


# (device, dtype, head_dim): False where no fused kernel took `enable_gqa`
_GQA_IN_PLACE: dict[tuple[torch.device, torch.dtype, int], bool] = {}


# FlashAttention, else the memory-efficient kernel (fp32 on a GPU); not cuDNN's, which SDPA tries first on sm90 and
# sm100 and which builds an execution graph per shape (a serving step's prompts come in every length), nor the math
# one: inputs no fused kernel takes raise instead
_PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
