"""The paged attention backends on one layer's step: decode of 1, 64 and 256 sequences and prompt chunks,
beside the machine's streaming read rate measured in the same run.

    python bench/bench_attention.py [--threads 2] [--dtypes float32,bfloat16] [--backends cpu,sdpa]
    python bench/bench_attention.py --backends cpu --base HEAD~1 [--work "decode 1 x 544,prompt 512"] [--cold]

The shapes are bench_peers.py's model (16 query heads, 4 KV heads of 64, blocks of 16 tokens, 8 layers): every
call goes to the next layer, and a sequence's blocks are scattered over the pool in random order, as a
long-running server's are. Decode reports the rate at which the step's context (keys and values) is read,
beside the machine's streaming rate (a single-pass sum over 1 GiB); prompts report the attention's GFLOP/s.

`--base REV` builds the CPU kernels' library as it was at git revision REV and times the cpu backend on it against
this tree's, in one process, taking turns (this machine's read rate drifts within seconds), with each round's ratio
printed as a median and a range and the two builds' outputs compared bit for bit (a kernel change that keeps the
multiply-adds' order keeps the bits): as bench/ab_cpu_linear.py does for the linear kernels.

`--cold` reads 256 MiB before each call (not timed), so that a call finds none of its keys, values or metadata in the
caches. Without it a decode's eight layers of context stay in the last-level cache when they fit (1 x 544: 8.9 MB). An
engine's step lies between the two: its weights stream through the caches between two layers' attention, yet a long
batch-1 decode's attention ran at about the warm rate there (perf, a Zen 3); a 64-sequence step's context (39 MB a
layer) comes from memory either way.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from torch_shift.attention import attention_backend
from torch_shift.attention.backend import AttentionBatch
from torch_shift.kv.cache import KVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 16, 4, 64, 16, 8
WORK = {  # name: runs of (cached tokens, new tokens)
    "decode 1 x 544": [(543, 1)],
    "decode 64 x 300": [(299, 1)] * 64,
    "decode 256 x 300": [(299, 1)] * 256,
    "prompt 512": [(0, 512)],
    "chunk 512 after 1024": [(1024, 512)],
    "chunk 2048 after 2048": [(2048, 2048)],  # a 4,096-token prompt's second chunk
}


def make_step(runs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_run = [-(-(c + n) // BLOCK_SIZE) for c, n in runs]
    max_blocks = max(blocks_per_run)
    cache = KVCache(NUM_LAYERS, len(runs) * max_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    cache.k_store.normal_(generator=g)
    cache.v_all.normal_(generator=g)
    table = torch.randperm(len(runs) * max_blocks, generator=g).view(len(runs), max_blocks).to(torch.int32).numpy()
    slots, positions = [], []
    for r, (cached, n) in enumerate(runs):
        pos = np.arange(cached, cached + n)
        slots.append(table[r][pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
        positions.append(pos)
    num_tokens = sum(n for _, n in runs)
    batch = AttentionBatch(
        num_decodes=sum(n == 1 for _, n in runs),
        query_start=np.cumsum([0] + [n for _, n in runs])[:-1].astype(np.int32),
        query_len=np.array([n for _, n in runs], np.int32), num_computed=np.array([c for c, _ in runs], np.int32),
        block_table=table, block_table_rows=np.arange(len(runs), dtype=np.int32), tokens_per_block=BLOCK_SIZE,
        slot_mapping=torch.from_numpy(np.concatenate(slots)), positions=torch.from_numpy(np.concatenate(positions)),
        sliding_window=None)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return cache, batch, q, k, v


def evicting(nbytes: int = 256 << 20) -> Callable[[], object]:
    """A read of `nbytes`, more than a CPU's last-level cache holds (`--cold`)."""
    data = torch.ones(nbytes // 4)
    return data.sum


def call_seconds(fn, calls: int, evict: Callable[[], object] | None = None) -> float:
    """The seconds of `calls` calls of fn(i); with `evict`, each call after evict(), which is not timed."""
    if evict is None:
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        return time.perf_counter() - start
    total = 0.0
    for i in range(calls):
        evict()
        start = time.perf_counter()
        fn(i)
        total += time.perf_counter() - start
    return total


def best_seconds(fn, calls: int, rounds: int = 5, evict: Callable[[], object] | None = None) -> float:
    for i in range(2):
        fn(i)
    return min(call_seconds(fn, calls, evict) / calls for _ in range(rounds))


def streaming_read_rate() -> float:
    """A sum's read rate over 1 GiB on huge pages (as the KV cache's; 4 KiB pages read at 0.74x on a Zen 4 EPYC)."""
    from torch_shift.memory import huge_page_allocations

    with huge_page_allocations():
        data = torch.ones(1 << 28)
    return data.numel() * 4 / best_seconds(lambda _: data.sum(), 1, rounds=5)


def alternated(calls_a, calls_b, rounds: int = 9, round_seconds: float = 0.2,
               evict: Callable[[], object] | None = None) -> list[float]:
    """Per round, the seconds of calls of calls_b over those of as many calls of calls_a (about `round_seconds`
    each, evictions included), the two taking turns going first (the machine's read rate drifts within seconds: side
    by side, not one after the other)."""
    start = time.perf_counter()
    for i in range(2):
        call_seconds(calls_a, 1, evict), call_seconds(calls_b, 1, evict)
    calls = max(1, int(round_seconds / ((time.perf_counter() - start) / 4)))
    ratios = []
    for r in range(rounds):
        seconds = {}
        for name, fn in (("a", calls_a), ("b", calls_b)) if r % 2 == 0 else (("b", calls_b), ("a", calls_a)):
            seconds[name] = call_seconds(fn, calls, evict)
        ratios.append(seconds["b"] / seconds["a"])
    return ratios


def build_at(revision: str, directory: Path):
    """The CPU kernels' library (torch_shift.kernels' sources and headers) as they were at git `revision`."""
    from ab_cpu_linear import write_kernel_sources

    from torch_shift.kernels import _HEADERS, _SOURCES, CpuKernels, _compile_and_link, compiler

    write_kernel_sources(revision, (*_SOURCES, *_HEADERS), directory, optional=_HEADERS)
    library = directory / "libbase_cpu.so"
    error = _compile_and_link(compiler(), [directory / name for name in _SOURCES], library, native=True)
    if error:
        raise SystemExit(f"building the CPU kernels at {revision} failed:\n{error}")
    return CpuKernels(library)


def compare_builds(revision: str, work: dict[str, list[tuple[int, int]]], dtypes: list[torch.dtype],
                   evict: Callable[[], object] | None = None) -> None:
    """The cpu backend on the kernels built at `revision` against this tree's, alternated (`--base`)."""
    from torch_shift.attention.cpu import CpuBackend
    from torch_shift.kernels import cpu_kernels

    with tempfile.TemporaryDirectory() as directory:
        this, other = CpuBackend(cpu_kernels()), CpuBackend(build_at(revision, Path(directory)))
    print(f"the cpu backend built at {revision} against this tree's: its time over this tree's (above 1: this tree is "
          f"faster), and whether the outputs are the same bits")
    for dtype in dtypes:
        for name, runs in work.items():
            cache, batch, q, k, v = make_step(runs, dtype)
            mine, theirs = this.build(batch, cache), other.build(batch, cache)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            outputs = [attention(layer, q, k, v) for attention in (mine, theirs) for layer in range(NUM_LAYERS)]
            same = all(torch.equal(a.view(bits), b.view(bits))
                       for a, b in zip(outputs[:NUM_LAYERS], outputs[NUM_LAYERS:], strict=True))
            ratios = alternated(lambda i: mine(i % NUM_LAYERS, q, k, v), lambda i: theirs(i % NUM_LAYERS, q, k, v),
                                evict=evict)
            print(f"{name:<22} {str(dtype).removeprefix('torch.'):<9} {float(np.median(ratios)):>6.3f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})  {'same bits' if same else 'OUTPUTS DIFFER'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backends", default="cpu,sdpa")
    parser.add_argument("--work", help="a comma list of the work's names (default: all of them)")
    parser.add_argument("--base", metavar="REV", help="a git revision whose CPU kernels this tree's are timed against "
                        "(see above)")
    parser.add_argument("--cold", action="store_true", help="each call after a read of 256 MiB, not timed (see above)")
    args = parser.parse_args(argv)
    work = WORK
    if args.work:
        unknown = [name for name in args.work.split(",") if name not in WORK]
        if unknown:
            raise SystemExit(f"--work: {', '.join(map(repr, unknown))} not among {', '.join(map(repr, WORK))}")
        work = {name: WORK[name] for name in args.work.split(",")}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        bandwidth = streaming_read_rate()
        evict = evicting() if args.cold else None
        print(f"streaming read: {bandwidth / 1e9:.1f} GB/s on {args.threads} threads"
              f"{'; each call after a read of 256 MiB (--cold)' if evict else ''}")
        print(f"{'work':<22} {'dtype':<9} {'backend':<7} {'us/call':>9} {'rate':>16} {'of streaming':>13}")
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for name, runs in work.items():
                cache, batch, q, k, v = make_step(runs, dtype)
                context_bytes = sum(c + n for c, n in runs) * NUM_KV_HEADS * HEAD_DIM * 2 * q.element_size()
                # QK and PV of every query against the keys it sees: n * c + n (n + 1) / 2 of them per run
                flops = sum(n * c + n * (n + 1) // 2 for c, n in runs) * NUM_HEADS * HEAD_DIM * 4
                decode = all(n == 1 for _, n in runs)
                for backend_name in args.backends.split(","):
                    attention = attention_backend(backend_name, torch.device("cpu"), dtype).build(batch, cache)
                    calls = max(1, min(20 if evict else 200, int(2e8 // context_bytes)))
                    seconds = best_seconds(lambda i: attention(i % NUM_LAYERS, q, k, v), calls, evict=evict)
                    if decode:
                        rate = context_bytes / seconds
                        figures = f"{rate / 1e9:>10.1f} GB/s {rate / bandwidth:>13.2f}"
                    else:
                        figures = f"{flops / seconds / 1e9:>7.1f} GFLOP/s"
                    print(f"{name:<22} {dtype_name:<9} {backend_name:<7} {seconds * 1e6:>9.0f} {figures}")
        if args.base:
            compare_builds(args.base, work, [getattr(torch, name) for name in args.dtypes.split(",")], evict)
    finally:
        torch.set_num_threads(previous_threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
