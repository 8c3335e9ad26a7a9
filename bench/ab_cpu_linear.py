"""This tree's linear kernels (torch_shift/kernels/cpu_linear.cpp: the AVX2 `ts_blocked_linear`, or with `--kernel
packed` the AVX-512 GEMV on oneDNN's packed weights, `ts_packed_gemv`) against the same file at another git
revision, both built into libraries of their own and loaded into one process, timed in alternation on the same
weights: the peer model's linears (bench_peers.py's shapes), `--layers` of them so that the weights come from memory
as a step's do, at each row count. Prints GFLOP/s (best and median of `--repeats` passes) per build, the
ratio of the best passes, and whether the two builds' outputs are the same bits. This machine's rate drifts by a
third within minutes; separate processes cannot compare kernels that differ by 5-20%, alternation in one can.

    python bench/ab_cpu_linear.py --base HEAD~1 --rows 1,2,512
    python bench/ab_cpu_linear.py --base 69d0193 --rows 512 --threads 1 --layers 1
    python bench/ab_cpu_linear.py --kernel packed --base HEAD~1 --rows 1,6,7,12,16
    python bench/ab_cpu_linear.py --base HEAD~1 --rows 7,8 --shapes gate/up=24576x192,down=192x12288

`--shapes`: the weights as name=NxK (out x in features) instead of the peer model's; the example is a TP-2 rank's MLP
of bench_spec.py's widened default model (`--intermediate 24576`).

Needs AVX2 and FMA (`--kernel packed`: AVX-512, and AVX512-BF16 for bfloat16), and a C++ compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from torch_shift.kernels import _HEADERS, _compile_and_link, compiler
from torch_shift.models.linear import PackedWeight

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate/up": (5632, 1024), "down": (1024, 2816)}
KERNELS = Path(__file__).resolve().parents[1] / "torch_shift" / "kernels"
i64, ptr = ctypes.c_int64, ctypes.c_void_p


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """`name=NxK,...` as SHAPES: each weight's output and input features."""
    shapes = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        n, _, k = size.partition("x")
        if not (name and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
            raise SystemExit(f"--shapes: {item!r} is not name=NxK with N and K positive integers")
        shapes[name] = (int(n), int(k))
    return shapes


def write_kernel_sources(revision: str | None, names: tuple[str, ...], directory: Path,
                         optional: tuple[str, ...] = ()) -> None:
    """torch_shift/kernels/`names` as they were at git `revision` (None: this tree), written into `directory`; a name
    in `optional` that the revision lacks is left out (a header newer than it)."""
    for name in names:
        if revision is None:
            text = (KERNELS / name).read_text()
        else:
            shown = subprocess.run(["git", "show", f"{revision}:torch_shift/kernels/{name}"], cwd=KERNELS,
                                   capture_output=True, text=True)
            if shown.returncode != 0:
                if name in optional:
                    continue
                raise SystemExit(f"{revision}: git show found no torch_shift/kernels/{name}: {shown.stderr.strip()}")
            text = shown.stdout
        (directory / name).write_text(text)


def build(revision: str | None, directory: Path) -> ctypes.CDLL:
    """cpu_linear.cpp and the headers it includes at `revision` (None: this tree), built into `directory`."""
    directory.mkdir(parents=True)
    write_kernel_sources(revision, ("cpu_linear.cpp", *_HEADERS), directory)
    library = directory / "libab_linear.so"
    error = _compile_and_link(compiler(), [directory / "cpu_linear.cpp"], library, native=True)
    if error:
        raise RuntimeError(f"building cpu_linear.cpp at {revision or 'this tree'} failed:\n{error}")
    lib = ctypes.CDLL(str(library))
    lib.ts_blocked_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
    lib.ts_blocked_linear.restype = ctypes.c_int
    lib.ts_packed_gemv.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64]
    lib.ts_packed_gemv.restype = ctypes.c_int
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare this tree against")
    parser.add_argument("--rows", default="1,2,4,512", help="comma list of row counts")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=8, help="layers of weights (8: 360 MiB in float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: as torch starts)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default=None, help="name=NxK,... (default: the peer model's linears)")
    parser.add_argument("--kernel", choices=("blocked", "packed"), default="blocked",
                        help="blocked: the AVX2 kernel on torch_shift's 16-feature blocks; packed: the AVX-512 GEMV "
                             "on oneDNN's packed weights (up to GEMV_MAX_ROWS rows: 64)")
    args = parser.parse_args(argv)
    if compiler() is None:
        raise SystemExit("no C++ compiler")
    shapes = SHAPES if args.shapes is None else parse_shapes(args.shapes)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build(args.base, Path(tmp) / "base"), "this": build(None, Path(tmp) / "this")}
        print(f"cpu_linear.cpp ({args.kernel}): this tree against {args.base}; {args.layers} layers of "
              f"{', '.join(shapes)}, {torch.get_num_threads()} threads; GFLOP/s best (median) of {args.repeats}")
        print(f"{'dtype':9s} {'rows':>5s} {'base':>16s} {'this':>16s} {'this/base':>10s}  same bits")
        for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
            packed = args.kernel == "packed"
            layers = [[PackedWeight(torch.randn(shape).to(dtype) * 0.05, blocked=not packed)
                       for shape in shapes.values()] for _ in range(args.layers)]
            if packed and layers[0][0].gemv is None:
                raise SystemExit(f"the AVX-512 GEMV does not run {dtype} on this CPU")
            code = layers[0][0].gemv_code if packed else {torch.float32: 0, torch.bfloat16: 1}[dtype]
            for rows in [int(r) for r in args.rows.split(",")]:
                xs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes.values()}
                outs = {name: [[torch.empty(rows, w.out_features, dtype=dtype) for w in layer] for layer in layers]
                        for name in builds}

                def run(name: str) -> None:
                    for layer, layer_outs in zip(layers, outs[name]):
                        for w, out in zip(layer, layer_outs):
                            x = xs[w.in_features].data_ptr()
                            if packed:
                                status = builds[name].ts_packed_gemv(code, x, w.in_features, rows, w._weight_ptr,
                                                                     w.out_features, w.in_features, None,
                                                                     out.data_ptr(), w.out_features)
                            else:
                                status = builds[name].ts_blocked_linear(
                                    code, x, w.in_features, rows, w._weight_ptr, w.out_features, w.in_features, None,
                                    out.data_ptr(), w.out_features, 16)
                            assert status == 0

                seconds: dict[str, list[float]] = {name: [] for name in builds}
                for name in builds:  # warm-up, and the outputs compared
                    run(name)
                same = all(torch.equal(a, b) for la, lb in zip(outs["base"], outs["this"]) for a, b in zip(la, lb))
                for i in range(args.repeats):
                    for name in (("base", "this") if i % 2 == 0 else ("this", "base")):
                        start = time.perf_counter()
                        run(name)
                        seconds[name].append(time.perf_counter() - start)
                flops = 2 * rows * sum(n * k for n, k in shapes.values()) * args.layers
                rate = {name: (flops / min(s) / 1e9, flops / statistics.median(s) / 1e9) for name, s in seconds.items()}
                print(f"{str(dtype)[6:]:9s} {rows:5d} " + " ".join(f"{b:7.1f} ({m:6.1f})" for b, m in rate.values())
                      + f" {rate['this'][0] / rate['base'][0]:10.2f}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
