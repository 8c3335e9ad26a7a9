"""Weight memory of a parallel engine: resident memory of each rank and the bytes of the parameters it holds.

    python bench/bench_memory.py [--hidden-size 1024 --layers 8] [--config 'TP default:tp=2' ...]

Writes a random Llama checkpoint (float32), then builds `LLM(model, **config)` for each configuration, each in a
fresh process (so that one configuration's memory does not stay in the next one's figures), and reports for
rank 0 (this process) and the ranks it started: VmRSS after construction (from /proc) and the bytes of the
distinct parameter storages of its model (base and shift layouts together). The KV pool is kept to 128 blocks
(8 MiB per rank here) so that the weights dominate the resident memory. The default configurations compare
plain TP with the default shift threshold (256) against TP with no shift layout at all (shift_threshold=None),
and SP x TP with copied and with viewed shift shards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = ["TP=2 (default threshold 256):tp=2", "TP=2, no shift layout:tp=2,shift_threshold=none",
           "SP=2 shift copy:sp=2", "SP=2 shift view:sp=2,shift_weights=view"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def parse(spec: str) -> tuple[str, dict]:
    name, _, args = spec.rpartition(":")
    engine_args: dict = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        engine_args[key] = None if value == "none" else (value if not value.lstrip("-").isdigit() else int(value))
    return name, engine_args


def measure(model_dir: str, spec: str) -> dict:
    """In this (fresh) process: build the engine, report every rank's memory."""
    from torch_shift import LLM
    from torch_shift.parallel.launch import run_ranks

    _, engine_args = parse(spec)
    engine_args.setdefault("num_kv_blocks", 128)
    before = rss_mib(os.getpid())
    llm = LLM(model_dir, **engine_args)
    world = llm.engine.args.sp * llm.engine.args.tp
    ranks = {0: os.getpid(), **{r: p.pid for r, p in llm.engine.parallel.launched.procs.items()}}
    rss = {r: rss_mib(pid) for r, pid in ranks.items()}
    llm.shutdown()
    # the parameter bytes of each rank, measured by the same ranks forked here (torchrun-style)
    param_bytes = run_ranks(_param_bytes, world, model_dir, engine_args)
    return {"rss_mib_before_rank0": before, "rss_mib": rss, "param_mib": [b / 2**20 for b in param_bytes]}


def _param_bytes(rank: int, world: int, model_dir: str, engine_args: dict) -> int:
    from torch_shift import LLM

    model = LLM(model_dir, **engine_args).engine.model
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--config", action="append", default=None, help="NAME:key=value,... (repeatable)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--measure", nargs=2, metavar=("MODEL_DIR", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    d = args.hidden_size
    config = tiny_llama_config(vocab_size=8192, hidden_size=d, intermediate_size=d * 11 // 4,
                               num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                               head_dim=d // 16, max_position_embeddings=2048)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_checkpoint(Path(tmp) / "model", config))
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
        print(f"random Llama, hidden {d}, {args.layers} layers, 16 heads / 4 KV heads, vocab 8192: "
              f"{size:.0f} MiB of float32 weights")
        for spec in args.config or CONFIGS:
            out = subprocess.run([sys.executable, __file__, "--measure", model_dir, spec], capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
            results[spec] = json.loads(out.stdout.splitlines()[-1])
    print(f"{'configuration':40s} {'RSS per rank (MiB)':>24s} {'parameters per rank (MiB)':>28s}")
    for spec, r in results.items():
        rss = " / ".join(f"{v:.0f}" for v in r["rss_mib"].values())
        params = " / ".join(f"{v:.1f}" for v in r["param_mib"])
        print(f"{parse(spec)[0]:40s} {rss:>24s} {params:>28s}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
