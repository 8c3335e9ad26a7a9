"""The CPU's linear layers side by side, in one process: every way this machine can run a weight of the 106M peer
model's shapes (bench_peers.py), at a few row counts, in GFLOP/s.

    python bench/bench_linear.py                       # float32 and bfloat16, 1/4/16/512 rows, all threads
    python bench/bench_linear.py --rows 1,512 --threads 1
    python bench/bench_linear.py --rows 1,2,4,8 --copies 8    # weights streamed from memory, as in a decode step

Columns, where they run here: torch_shift's 16-feature blocks (`PackedWeight(w, blocked=True)`: the AVX2 kernel, any CPU
with AVX2), oneDNN's matmul on its packed weight (`blocked=False`), the AVX-512 GEMV kernel on the same packed weight
(which `PackedWeight` runs instead of oneDNN's matmul up to `gemv_max_rows` rows; bfloat16 packed for AMX on the tile
unit, `torch_shift.kernels.gemv_on_tile_unit`), and `F.linear` on the dense weight.
The engine takes the blocks where the AVX-512 kernel does not run (`torch_shift.models.linear.blocked_layout`). Each
figure is the best of `--repeats` timings after two warm-ups; a weight that fits in the L3 is read from there between
repeats. With `--copies N` each way runs N copies of the weight in turn, the rate over all of them: enough copies to
exceed the caches read the weights from memory, as a decode step does (one hot weight hid that the GEMV's rate fell
with its rows on cold weights: docs/performance.md, forty-third session).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate/up": (5632, 1024), "down": (1024, 2816)}


def best_seconds(fn, repeats: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,512", help="comma list of row counts")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: as torch starts)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copies", type=int, default=1,
                        help="copies of each weight run in turn (enough to exceed the caches: weights from memory)")
    args = parser.parse_args(argv)
    if args.copies < 1:
        parser.error(f"--copies must be at least 1, not {args.copies}")

    from torch_shift.kernels import cpu_kernels
    from torch_shift.models.linear import PackedWeight, blocked_layout, packing_supported

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    blocks_run = kernels is not None and bool(kernels.packed_gemv_dtypes & 4)
    print(f"{torch.get_num_threads()} threads; GFLOP/s (x: over F.linear)")
    print(f"{'dtype':<9} {'weight':<8} {'rows':>5} {'blocks':>14} {'oneDNN':>14} {'GEMV':>14} {'F.linear':>9}  "
          "engine takes")
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            onednn = packing_supported(torch.device("cpu"), dtype) and not (
                dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
            for label, (out_features, in_features) in SHAPES.items():
                weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(args.copies)]
                ways = {}
                if blocks_run:
                    blocks = [PackedWeight(weight, blocked=True) for weight in weights]
                    ways["blocks"] = lambda x, ws=blocks: [w(x, None) for w in ws]
                if onednn:
                    packs = [PackedWeight(weight, blocked=False) for weight in weights]
                    packed = packs[0]
                    ways["oneDNN"] = lambda x, ws=packs: [
                        torch.ops.mkldnn._linear_pointwise(x, w.tensor, None, "none", [], "") for w in ws]
                    if packed.gemv is not None:
                        ways["GEMV"] = lambda x, ws=packs: [w._gemv(x, None, x.shape[0]) for w in ws]
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, in_features).to(dtype)
                    flop = 2 * rows * out_features * in_features * args.copies
                    dense = flop / best_seconds(lambda: [F.linear(x, w) for w in weights], args.repeats) / 1e9
                    cells = []
                    for way in ("blocks", "oneDNN", "GEMV"):
                        if way in ways:
                            rate = flop / best_seconds(lambda w=ways[way]: w(x), args.repeats) / 1e9
                            cells.append(f"{rate:7.1f} ({rate / dense:4.1f}x)")
                        else:
                            cells.append("-")
                    takes = ("blocks" if blocked_layout(dtype) else "F.linear" if not onednn
                             else "GEMV" if rows <= packed.gemv_max_rows else "oneDNN")
                    print(f"{name:<9} {label:<8} {rows:>5} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {dense:9.1f}  "
                          f"{takes}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
