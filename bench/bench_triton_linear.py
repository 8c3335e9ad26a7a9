"""The GPU's few-row linears: each Triton tile against cuBLAS on a decode step's weight shapes (not a test).

For each weight shape of a 1.1B Llama (the model of bench_gpu.py) and an 8B one, and 1, 2, 4 and 8 rows of x:
microseconds a call, and the weight bytes read per second, for cuBLAS (`F.linear`) and the fastest Triton tile,
each timed as the engine times them (torch_shift.kernels.triton_linear.time_candidates: in a CUDA graph, over
copies of the weight that overflow the L2 cache). Then every linear of one decode step of the 1.1B model (16
layers and the LM head, 2.08 GB) in one CUDA graph, cuBLAS against the kernels the engine would choose, beside a
device copy of as many bytes.

    python bench/bench_triton_linear.py [--rows 1,2,4,8] [--all]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

# (name, out_features, in_features)
LLAMA_1B = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
            ("lm_head", 32000, 2048)]
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
            ("lm_head", 128256, 4096)]
LAYERS_1B = 16


def shapes_table(rows_list: list[int], show_all: bool) -> None:
    from torch_shift.kernels import triton_linear

    dtype, device = torch.bfloat16, torch.device("cuda")
    print(f"{'model':6} {'shape':8} {'out x in':>13} {'rows':>4} | {'cuBLAS us':>9} {'TB/s':>5} | "
          f"{'Triton us':>9} {'TB/s':>5} {'x':>5}  tile")
    for model, shapes in (("1.1B", LLAMA_1B), ("8B", LLAMA_8B)):
        for name, n, k in shapes:
            for rows in rows_list:
                timings = triton_linear.time_candidates(rows, n, k, dtype, device)
                tiles = {t: s for t, s in timings.items() if t is not None}
                best = min(tiles, key=tiles.get)
                nbytes = n * k * dtype.itemsize
                cublas, triton_s = timings[None], tiles[best]
                print(f"{model:6} {name:8} {n:>6}x{k:<6} {rows:>4} | "
                      f"{cublas * 1e6:9.2f} {nbytes / cublas / 1e12:5.2f} | "
                      f"{triton_s * 1e6:9.2f} {nbytes / triton_s / 1e12:5.2f} {cublas / triton_s:5.2f}  {best}",
                      flush=True)
                if show_all:
                    for tile, seconds in sorted(tiles.items(), key=lambda item: item[1]):
                        print(f"{'':40} {seconds * 1e6:9.2f} {nbytes / seconds / 1e12:5.2f}  {tile}")


def step_of_linears(rows_list: list[int]) -> None:
    """One decode step's linears of the 1.1B model, every weight its own (read from HBM), in one graph."""
    from torch_shift.kernels import triton_linear
    from torch_shift.kernels.triton_linear import graph_seconds

    dtype = torch.bfloat16
    weights = [torch.empty(n, k, dtype=dtype, device="cuda").normal_(0, 0.02)
               for _ in range(LAYERS_1B) for name, n, k in LLAMA_1B if name != "lm_head"]
    weights.append(torch.empty(32000, 2048, dtype=dtype, device="cuda").normal_(0, 0.02))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = graph_seconds(lambda: (dst.copy_(src), dst.copy_(src)), 10)  # reads and writes nbytes in all
    print(f"\none decode step's linears of the 1.1B model ({nbytes / 1e9:.2f} GB), in one CUDA graph; "
          f"a device copy of as many bytes (read + write): {copy_s * 1e3:.3f} ms ({nbytes / copy_s / 1e12:.2f} TB/s)")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, dtype=dtype, device="cuda") for k in {w.shape[1] for w in weights}}
        cublas = graph_seconds(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], 10)
        chosen = graph_seconds(lambda: [triton_linear.linear(xs[w.shape[1]], w, None) for w in weights],
                               10)
        print(f"rows {rows}: cuBLAS {cublas * 1e3:.3f} ms ({nbytes / cublas / 1e12:.2f} TB/s), chosen kernels "
              f"{chosen * 1e3:.3f} ms ({nbytes / chosen / 1e12:.2f} TB/s): {cublas / chosen:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--all", action="store_true", help="every tile's time, not only the fastest")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    shapes_table(rows_list, args.all)
    step_of_linears(rows_list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
