"""Load time: a Hugging Face checkpoint directory against its `torch-shift convert` output.

    python bench/bench_load.py [--hidden-size 1024 --layers 16] [--repeats 3]

Writes a random Llama checkpoint in Hugging Face layout (sharded safetensors, as
`save_pretrained` writes them), converts it, and times loading the weights, alternating the two
directories `--repeats` times (the page cache is warm for both after the first round):
  mesh 1 : `load_model` (the single-device engine's loader)
  mesh 4 : sp=2 x tp=2 local ranks (gloo), each building its ShiftModule (base + shift shards),
           reporting the slowest rank
Two cases: the checkpoint's own dtype served as is (bfloat16 -> bfloat16), and a float32
checkpoint served in bfloat16 (converted with --dtype bfloat16). Prints medians and ratios.
`--cold` drops the page cache before every load, so each load reads from the disk (needs root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from torch_shift.config import ModelConfig
from torch_shift.models.convert import convert_checkpoint
from torch_shift.models.loader import CheckpointReader, expected_parts, load_model
from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint
from torch_shift.parallel.launch import run_ranks


def shard_like_save_pretrained(model_dir: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Rewrite model.safetensors as `model-0000i-of-0000n.safetensors` + index, in `dtype`."""
    tensors = {k: v.to(dtype) for k, v in load_file(model_dir / "model.safetensors").items()}
    (model_dir / "model.safetensors").unlink()
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, model_dir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(config))


def drop_page_cache() -> None:
    """Cold-cache loads (Linux, root): the next read of every file comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def time_single(model_dir: Path, dtype: torch.dtype, cold: bool = False) -> float:
    if cold:
        drop_page_cache()
    start = time.perf_counter()
    load_model(model_dir, dtype)
    return time.perf_counter() - start


def _mesh_rank(rank, world, dirs, dtype, repeats, cold):
    import torch.distributed as dist

    from torch_shift.parallel.groups import build_shift_groups
    from torch_shift.parallel.shift import build_shift_module

    dist.init_process_group("gloo")
    groups = build_shift_groups(2, 2)
    times: dict[str, list[float]] = {name: [] for name in dirs}
    for _ in range(repeats):
        for name, model_dir in dirs.items():
            if cold and rank == 0:
                drop_page_cache()
            dist.barrier()
            start = time.perf_counter()
            config = ModelConfig.from_dir(model_dir)
            reader = CheckpointReader(model_dir, config)
            build_shift_module(config, groups, reader, dtype, torch.device("cpu"))
            reader.close()
            times[name].append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return times


def measure(dirs: dict[str, Path], dtype: torch.dtype, repeats: int, cold: bool) -> dict[str, dict[str, float]]:
    for model_dir in dirs.values():  # warm the page cache for both (and the code paths)
        time_single(model_dir, dtype)
    single: dict[str, list[float]] = {name: [] for name in dirs}
    for _ in range(repeats):
        for name, model_dir in dirs.items():
            single[name].append(time_single(model_dir, dtype, cold))
    per_rank = run_ranks(_mesh_rank, 4, dirs, dtype, repeats, cold, timeout_s=1800)
    mesh = {name: [max(r[name][i] for r in per_rank) for i in range(repeats)] for name in dirs}
    return {"mesh 1": {n: statistics.median(t) for n, t in single.items()},
            "mesh 4 (sp2 x tp2)": {n: statistics.median(t) for n, t in mesh.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (root)")
    args = parser.parse_args()
    d = args.hidden_size
    config = tiny_llama_config(vocab_size=32000, hidden_size=d, intermediate_size=int(d * 8 / 3) // 64 * 64,
                               num_hidden_layers=args.layers, num_attention_heads=d // 64, num_key_value_heads=4,
                               head_dim=64, max_position_embeddings=2048)
    num_params = sum(torch.Size(shape).numel() for shape in expected_parts(ModelConfig.from_hf_dict(config)).values())
    print(f"model: {num_params / 1e6:.0f} M parameters", flush=True)
    cases = {"bf16 checkpoint -> bf16": (torch.bfloat16, "auto", "bf16"),
             "fp32 checkpoint -> bf16": (torch.float32, "bfloat16", "fp32")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (stored, convert_dtype, tag) in cases.items():
            hf_dir = write_random_checkpoint(Path(tmp) / f"hf-{tag}", config, init_std=0.02)
            shard_like_save_pretrained(hf_dir, stored, max_shard_bytes=1 << 30)
            start = time.perf_counter()
            converted = convert_checkpoint(hf_dir, Path(tmp) / f"converted-{tag}", dtype=convert_dtype,
                                           progress=False)
            convert_s = time.perf_counter() - start
            results[case] = measure({"hugging face": hf_dir, "converted": converted}, torch.bfloat16, args.repeats,
                                    args.cold)
            results[case]["convert_s"] = convert_s
    print(f"\n{'case':26s} {'mesh':20s} {'HF dir (s)':>11s} {'converted (s)':>14s} {'HF / converted':>15s}")
    for case, r in results.items():
        for mesh in ("mesh 1", "mesh 4 (sp2 x tp2)"):
            a, b = r[mesh]["hugging face"], r[mesh]["converted"]
            print(f"{case:26s} {mesh:20s} {a:11.3f} {b:14.3f} {a / b:14.2f}x")
        print(f"{case:26s} {'(conversion)':20s} {r['convert_s']:11.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
