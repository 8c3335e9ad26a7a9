"""The Triton paged attention's tiles and launch options swept on a GPU, on the steps of bench_gpu.py's 1B model
(32 query heads, 8 KV heads of 64, blocks of 16 tokens, 16 layers): decode batches and a 2k-token prompt.

    python bench/bench_triton_attention.py [--quick]

Each case is one step's attention over the 16 layers, captured in a CUDA graph (as the engine's decode steps
run) and replayed; it reports microseconds per layer, the context's read rate (decode) or TFLOP/s (prefill),
and each option set's largest difference from the default's output. The defaults are
`torch_shift.attention.triton_paged.DECODE_LAUNCH` / `PREFILL_LAUNCH` / `PREFILL_ROWS` / `SPLIT_KEYS`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np
import torch

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 64, 16, 16
DECODE_CASES = [(1, 160), (1, 2048), (8, 160), (64, 160), (64, 2048), (256, 512)]  # (sequences, context)
PREFILL_CASES = [2047]


def make_step(runs: list[tuple[int, int]], device: str, seed: int = 0):
    """A KV cache of LAYERS layers holding each run's context in shuffled blocks, the step's metadata and q."""
    from torch_shift.attention.backend import AttentionBatch
    from torch_shift.attention.triton_paged import build_triton_metadata
    from torch_shift.kv.cache import KVCache

    rng = np.random.default_rng(seed)
    blocks_per_run = [-(-(c + n) // BLOCK) for c, n in runs]
    num_blocks = sum(blocks_per_run)
    cache = KVCache(LAYERS, num_blocks, BLOCK, KV_HEADS, DIM, torch.bfloat16, device=device)
    cache.k_store.normal_()
    cache.v_all.normal_()
    order = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(runs), max(blocks_per_run)), np.int32)
    start = 0
    for i, n in enumerate(blocks_per_run):
        table[i, :n] = order[start:start + n]
        start += n
    lengths = np.array([n for _, n in runs], np.int32)
    computed = np.array([c for c, _ in runs], np.int32)
    slots = np.concatenate([table[i, p // BLOCK].astype(np.int64) * BLOCK + p % BLOCK
                            for i, (c, n) in enumerate(runs) for p in [np.arange(c, c + n)]])
    batch = AttentionBatch(
        num_decodes=int((lengths == 1).sum()), query_start=(np.cumsum(lengths) - lengths).astype(np.int32),
        query_len=lengths, num_computed=computed, block_table=table, block_table_rows=np.arange(len(runs),
                                                                                                 dtype=np.int32),
        tokens_per_block=BLOCK, slot_mapping=torch.from_numpy(slots).to(device),
        positions=torch.from_numpy(slots).to(device), sliding_window=None)
    q = torch.randn(int(lengths.sum()), HEADS, DIM, dtype=torch.bfloat16, device=device)
    return cache, build_triton_metadata(batch), q


def run_layers(cache, md, q, out):
    from torch_shift.attention.triton_paged import paged_attention

    for layer in range(LAYERS):
        paged_attention(out[layer], q, cache, layer, md, None, None)


def timed(cache, md, q, out, replays: int = 20) -> float:
    """Seconds per layer: the 16 layers' calls in a CUDA graph, replayed."""
    run_layers(cache, md, q, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(cache, md, q, out)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays / LAYERS


def set_splits(cases, split_keys: int) -> None:
    """Decode contexts in chunks of `split_keys` keys (0: never split)."""
    from torch_shift.attention import triton_paged

    triton_paged.SPLIT_KEYS = split_keys or 1 << 30
    for _, (_, md, _, _, context) in cases:
        md.decode_splits, md.split_keys = triton_paged.split_plan(context, context)
        md.partials.clear()


def sweep(name: str, cases, options_grid: list[dict], apply, measure_unit) -> None:
    from torch_shift.attention import triton_paged

    saved = (dict(triton_paged.DECODE_LAUNCH), dict(triton_paged.PREFILL_LAUNCH), triton_paged.PREFILL_ROWS,
             triton_paged.SPLIT_KEYS)
    print(f"\n{name}: us per layer (and {measure_unit}); max |difference| from the default's output")
    header = "options".ljust(44) + "".join(f"{label:>22}" for label, _ in cases)
    print(header)
    reference = {}
    for options in [None] + options_grid:
        cells = []
        for label, (cache, md, q, work, _) in cases:
            out = torch.empty(LAYERS, *q.shape, dtype=q.dtype, device=q.device)
            try:
                if options is not None:
                    apply(options)
                seconds = timed(cache, md, q, out)
                if options is None:
                    reference[label] = out.clone()
                diff = (out.float() - reference[label].float()).abs().max().item()
                cells.append(f"{seconds * 1e6:7.1f} ({work / seconds / 1e12:5.2f}) {diff:6.0e}")
            except Exception as error:  # an option set that does not compile or fit: reported, not fatal
                cells.append(f"{type(error).__name__[:20]:>22}")
            finally:
                (triton_paged.DECODE_LAUNCH.clear(), triton_paged.DECODE_LAUNCH.update(saved[0]),
                 triton_paged.PREFILL_LAUNCH.clear(), triton_paged.PREFILL_LAUNCH.update(saved[1]))
                triton_paged.PREFILL_ROWS = saved[2]
                set_splits(cases, saved[3])
        label = "default" if options is None else ", ".join(f"{k}={v}" for k, v in options.items())
        print(label.ljust(44) + "".join(f"{c:>22}" for c in cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer option sets")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_attention.py needs a CUDA GPU")
    from torch_shift.attention import triton_paged

    started = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; defaults: decode {triton_paged.DECODE_LAUNCH}, "
          f"prefill {triton_paged.PREFILL_LAUNCH}, {triton_paged.PREFILL_ROWS} rows a prefill tile, decode contexts "
          f"in chunks of {triton_paged.SPLIT_KEYS} keys")
    kv_bytes = 2 * KV_HEADS * DIM * 2  # bf16 K and V per token of one layer
    decode = []
    for seqs, context in DECODE_CASES:
        cache, md, q = make_step([(context - 1, 1)] * seqs, "cuda")
        decode.append((f"{seqs} x {context}", (cache, md, q, seqs * context * kv_bytes, context)))
    sweep("decode contexts split in chunks (SPLIT_KEYS; 0: not split)", decode,
          [{"SPLIT_KEYS": n} for n in (0, 128, 512)], lambda o: set_splits(decode, o["SPLIT_KEYS"]),
          "TB/s of context read")
    block_n, warps, stages = (32, 64, 128), (2, 4, 8), (2, 3)
    if args.quick:
        block_n, warps, stages = (64,), (2, 4), (2, 3)
    grid = [{"BLOCK_N": b, "num_warps": w, "num_stages": s} for b, w, s in itertools.product(block_n, warps, stages)
            if triton_paged.SPLIT_KEYS % b == 0]
    sweep("decode", decode, grid, lambda o: triton_paged.DECODE_LAUNCH.update(o), "TB/s of context read")

    prefill = []
    for tokens in PREFILL_CASES:
        cache, md, q = make_step([(0, tokens)], "cuda")
        flops = 2 * 2 * HEADS * DIM * tokens * tokens / 2
        prefill.append((f"prompt {tokens}", (cache, md, q, flops, 0)))

    def apply_prefill(options):
        options = dict(options)
        triton_paged.PREFILL_ROWS = options.pop("rows")
        for _, (_, md, _, _, _) in prefill:
            md.prefill_tiles.clear()  # tiles are cut by PREFILL_ROWS
        triton_paged.PREFILL_LAUNCH.update(options)

    rows, block_n, warps, stages = (64, 128, 256), (64, 128), (4, 8), (2, 3)
    if args.quick:
        rows, block_n, warps, stages = (128, 256), (64, 128), (8,), (2, 3)
    grid = [{"rows": r, "BLOCK_N": b, "num_warps": w, "num_stages": s}
            for r, b, w, s in itertools.product(rows, block_n, warps, stages)]
    sweep("prefill", prefill, grid, apply_prefill, "TFLOP/s")
    for _, (_, md, _, _, _) in prefill:
        md.prefill_tiles.clear()
    for label, (_, _, q, flops, _) in prefill:  # what the engine runs for a prompt with nothing cached before it
        k, v = torch.randn_like(q[:, :KV_HEADS]), torch.randn_like(q[:, :KV_HEADS])
        graph = torch.cuda.CUDAGraph()
        triton_paged.causal_attention(q, k, v)
        with torch.cuda.graph(graph):
            for _ in range(LAYERS):
                triton_paged.causal_attention(q, k, v)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10 / LAYERS
        print(f"{label} through SDPA (triton_paged.causal_attention): {seconds * 1e6:.1f} us per layer "
              f"({flops / seconds / 1e12:.2f} TFLOP/s)")
    print(f"\nswept in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
