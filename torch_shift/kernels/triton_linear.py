"""Linear layers of a few rows on a GPU (a decode step's matmuls) in Triton, chosen against cuBLAS by timing.

At batch 1 a decode step's linears are matrix-vector products bound by reading each weight once. On an H100, cuBLAS
read the 8-13 MB attention projections of a 1.1B Llama at 1.3-1.7 TB/s (a device copy: 3.0) and ran the down
projection as a split-K product and a reduction. `_skinny_linear_kernel` streams the weight in tiles of BLOCK_N output
features x BLOCK_K inputs, one program per BLOCK_N features, every row of x (ROWS: the rows padded to a power of two,
up to MAX_ROWS) against each tile, and sums once at the end. At 1 row it was 1.06-1.22x faster than cuBLAS on every
weight of a 1.1B and an 8B Llama; from 4 rows on cuBLAS was mostly faster and is kept (docs/performance.md, issue 25).

Which kernel runs is measured once per (device, dtype, ROWS, out_features, in_features), at the shape's first call:
each candidate tile and cuBLAS's `F.linear` run inside a CUDA graph over enough copies of the weight to overflow
the L2 cache (a decode step reads each weight from HBM), and the fastest is kept for the process, so eager steps
and CUDA graphs run the same kernel. A shape first met while a graph is being captured keeps cuBLAS (nothing is
timed or compiled during a capture; the engine's warm-up runs each bucket eagerly before capturing it).

On the CPU the kernel runs in Triton's interpreter when TRITON_INTERPRET=1 was set before triton was imported
(tests only); the engine calls it for CUDA tensors alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 8  # rows of x up to which a Triton tile may replace cuBLAS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEMENTS_PER_THREAD = 64  # ROWS x BLOCK_N x BLOCK_K running sums a thread holds, at most
_TIMED_REPLAYS = 5


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# candidates: few output features per program keep many programs (and their loads) in flight on the 8-13 MB
# projections; a wide BLOCK_K keeps each row's reads long and contiguous. The tiles that were fastest for some shape
# of a 1.1B or an 8B Llama at 1-8 rows on an H100 (bench/bench_triton_linear.py); (2, 2048), (8, 1024), (16, 256)
# and (16, 512) never were
TILES = (Tile(2, 512), Tile(2, 1024), Tile(4, 256), Tile(4, 512), Tile(4, 1024), Tile(4, 2048, 8), Tile(8, 256),
         Tile(8, 512))


@triton.jit(do_not_specialize=["rows"])
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, rows, N, K, stride_xm, stride_wn, stride_om,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    n_in = offs_n < N
    m_in = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    # products summed elementwise across the loop and reduced once at its end (no reduction per step)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], mask=n_in[:, None], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=m_in[:, None], other=0.0)
        else:
            k_in = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    total = tl.sum(acc, axis=2)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def padded_rows(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << max(0, rows - 1).bit_length()


def tiles_for(rows: int, in_features: int) -> list[Tile]:
    """The candidate tiles for `rows` (padded) rows of x: BLOCK_K no wider than the input (padded), and at most
    _ELEMENTS_PER_THREAD products a thread."""
    widest = max(16, padded_rows(in_features))
    tiles = dict.fromkeys(Tile(t.block_n, min(t.block_k, widest), t.num_warps, t.num_stages) for t in TILES)
    return [t for t in tiles if rows * t.block_n * t.block_k <= _ELEMENTS_PER_THREAD * 32 * t.num_warps]


def run_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T (+ bias) through the Triton kernel with `tile`."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and rows <= MAX_ROWS, (x.stride(), weight.stride(), rows)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(out_features, tile.block_n),)
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, rows, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0),
        ROWS=padded_rows(rows), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=in_features % tile.block_k == 0, HAS_BIAS=bias is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


_choices: dict[tuple, Tile | None] = {}


def choice(rows: int, weight: torch.Tensor, x_dtype: torch.dtype) -> Tile | None:
    """The kernel for x of `rows` rows times `weight` on its GPU: a Triton tile, or None for cuBLAS."""
    key = (weight.device, x_dtype, padded_rows(rows), *weight.shape)
    if key not in _choices:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            _choices[key] = None
        else:
            timings = time_candidates(padded_rows(rows), weight.shape[0], weight.shape[1], x_dtype, weight.device)
            _choices[key] = min(timings, key=timings.get)
    return _choices[key]


def time_candidates(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                    device: torch.device) -> dict[Tile | None, float]:
    """Seconds a call of each candidate (None: cuBLAS) takes on a weight read from HBM: each runs in a CUDA graph
    (no launch cost from Python, as in a captured decode step) over enough copies of the weight to overflow the L2
    cache (one copy of a weight twice the L2's size), the best of a few replays."""
    timings = _time_on_copies(rows, out_features, in_features, dtype, device)
    torch.cuda.empty_cache()  # the copies' memory back to the device, outside the KV cache's budget
    return timings


def _time_on_copies(rows: int, out_features: int, in_features: int, dtype: torch.dtype,
                    device: torch.device) -> dict[Tile | None, float]:
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    weight_bytes = out_features * in_features * dtype.itemsize
    copies = 1 if weight_bytes >= 2 * l2_bytes else min(64, math.ceil(3 * l2_bytes / weight_bytes))
    weights = torch.empty(copies, out_features, in_features, dtype=dtype, device=device).normal_(0, 0.02)
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    timings: dict[Tile | None, float] = {}
    for candidate in [None, *tiles_for(rows, in_features)]:
        def calls(candidate=candidate):
            for w in weights:
                F.linear(x, w) if candidate is None else run_tile(x, w, None, candidate)
        timings[candidate] = graph_seconds(calls) / copies
    return timings


def graph_seconds(fn, replays: int = _TIMED_REPLAYS) -> float:
    """Seconds `fn`'s GPU work takes, captured in a CUDA graph after one eager call (which compiles what it
    launches): the fastest of `replays` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on a GPU: a few rows through the kernel timed fastest for the shape, else cuBLAS."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= MAX_ROWS and x.dtype == weight.dtype and x.dtype in _DTYPES and weight.stride(-1) == 1
            and (bias is None or bias.is_contiguous())):
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) == 1:
            tile = choice(rows, weight, x.dtype)
            if tile is not None:
                return run_tile(flat, weight, bias, tile).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)

