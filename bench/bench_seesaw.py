"""Seesaw (paper 003) against static layouts, offline throughput at world 2, one thread per rank.

    python bench/bench_seesaw.py                       # every part
    python bench/bench_seesaw.py --quick               # a smoke run: small model, few requests
    python bench/bench_seesaw.py --parts main,ablation --json bench/results/seesaw.json

A random Llama whose weights are far beyond the last-level cache (106M parameters, fp32 424 MB, 212 MB per
rank under TP-2 or PP-2; the printout gives `lscpu`'s cache sizes). Two workloads of N requests each, all
submitted at once to `LLM.generate` (throughput-oriented, as the paper): long prompts and short outputs
sampled from the arxiv-summarization lengths, and balanced ones from the Azure conversation trace; prompt
and output lengths both multiplied by --scale (the prompt:output ratio of the trace is kept), then capped.
Every configuration has the same KV memory per rank (--kv-mb) and runs in a fresh pair of processes; the
figures are total tokens (prompt + output) over the wall time of `generate`, after a warm-up; with
--repeats, configurations are interleaved round by round and the median run is reported.

Parts:
  main      TP-2 with chunked prefill at each --tp-chunks (its best is "the best chunk size"), PP-2, DP-2,
            Shift (SP-2 base, TP-2 for small steps) and Seesaw P2 -> T2, on both workloads: throughput, the
            time split (prefill / decode / mixed steps, re-sharding, swapping), transitions, mean decode batch
  ablation  Seesaw's scheduling with a tier that holds about a third of the workload (--ablation-tier-gb):
            tiered (the paper), tiered with the artifact's 20% refill, prefill-first, decode-first:
            transitions and mean decode batch (arxiv)
  variants  weights resident vs host copies (weight memory per rank and time per transition), tier copies
            synchronous vs in a prefetch thread (arxiv)
  links     an emulated interconnect (every collective and pipeline send waits bytes / bandwidth) swept over
            --links GB/s for TP (best chunk), PP and Seesaw (paper 003 Fig. 14), DP as the reference, on
            --links-requests arxiv requests. The paper's A10s compute about 7.8 kFLOP per byte their PCIe link
            moves (125 TFLOPS, 16 GiB/s); a core here computes about 50 GFLOP/s, so the same ratio is a link
            of about 6.4 MB/s: the sweep's 0.004 to 0.256 GB/s is about 0.6x to 40x of "PCIe" here.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# ../shared/traces beside the repository (or beside the directory of worktrees)
TRACES = next((p / "shared" / "traces" for p in REPO_ROOT.parents if (p / "shared" / "traces").is_dir()),
              REPO_ROOT.parent / "shared" / "traces")

# DESIGN.md section 3's model: 106M parameters, fp32 424 MB, 212 MB per rank under TP-2 or PP-2
# (head_dim given: tiny_llama_config's default of 16 would shrink attention and the KV cache 4x)
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192)
QUICK_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=8192)


def log(msg: str = "") -> None:
    print(msg, flush=True)


def workload(traces: Path, name: str, num: int, scale: float, max_prompt: int, max_output: int, vocab: int,
             seed: int) -> list:
    path = traces / ("arxiv_summarization_lengths.csv" if name == "arxiv" else "azure_conv_2023.csv")
    with open(path) as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    requests = []
    for prompt, output in rng.sample(rows, num):
        n_in = max(1, min(max_prompt, round(prompt * scale)))
        n_out = max(2, min(max_output, round(output * scale)))
        requests.append(([rng.randrange(8, vocab) for _ in range(n_in)], n_out))
    return requests


def configs(args) -> dict[str, dict]:
    common = {"kv_cache_memory_bytes": args.kv_mb << 20, "enable_prefix_caching": False,
              "max_num_batched_tokens": args.budget, "max_num_seqs": args.max_seqs,
              "max_model_len": args.max_prompt + args.max_output}
    out = {f"TP c={c}": {**common, "tp": 2, "max_num_batched_tokens": c} for c in args.tp_chunks}
    out["PP"] = {**common, "pp": 2}
    out["DP"] = {**common, "dp": 2}
    out["Shift"] = {**common, "sp": 2, "shift_threshold": args.shift_threshold}
    out["Seesaw"] = {**common, "pp": 2, "policy": "seesaw", "cpu_kv_gb": args.tier_gb}
    return out


def run_one(model_dir: str, engine_args: dict, requests: list) -> dict:
    """In a fresh process: build the engine (it starts rank 1), warm up, time `generate` on the workload."""
    import torch

    from torch_shift import LLM, SamplingParams

    llm = LLM(model_dir, **engine_args)
    warm = [list(range(8, 8 + 96))] * 2
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.stats()
    params = [SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0) for _, n_out in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outputs, requests))
    model = llm.engine.model
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    host = model.memory_bytes()["host"] if hasattr(model, "memory_bytes") else 0
    decode_requests = (after["mean_decode_batch"] or 0) * after["num_decode_steps"] - (
        (before["mean_decode_batch"] or 0) * before["num_decode_steps"])
    decode_steps = after["num_decode_steps"] - before["num_decode_steps"]
    result = {
        "wall_s": wall,
        "tokens": sum(len(p) + n for p, n in requests),
        "steps": after["num_steps"] - before["num_steps"],
        "time_s": {k: after["time_s"][k] - before["time_s"][k] for k in after["time_s"]},
        "transitions": after.get("num_transitions", 0) - before.get("num_transitions", 0),
        "swap_outs": after["num_swap_outs"] - before["num_swap_outs"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "mean_decode_batch": decode_requests / decode_steps if decode_steps else None,
        "weights_mb_rank0": {"device": sum(storages.values()) / 2**20, "host": host / 2**20},
        "torch_threads": torch.get_num_threads(),
    }
    result["throughput"] = result["tokens"] / wall
    llm.shutdown()
    return result


def launch(model_dir: str, engine_args: dict, requests: list) -> dict:
    spec = json.dumps({"model": model_dir, "args": engine_args, "requests": requests})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(spec)
    try:
        proc = subprocess.run([sys.executable, __file__, "--_run", f.name], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{engine_args}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def predict_throughput(model_dir: str, profile, all_configs: dict, requests: list) -> dict[str, float]:
    """The planner's simulation of each configuration on the same requests, all submitted at once:
    prompt and output tokens per second (torch_shift.planner)."""
    from torch_shift.bench.traffic import RequestSpec
    from torch_shift.planner.plan import load_model_config
    from torch_shift.planner.simulate import predict

    config = load_model_config(model_dir)
    specs = [RequestSpec(f"r{i}", 0.0, prompt, n_out) for i, (prompt, n_out) in enumerate(requests)]
    return {name: predict(args, config, profile, specs, dtype="fp32").metrics()["total_throughput_tok_s"]
            for name, args in all_configs.items()}


def describe(r: dict) -> str:
    t = r["time_s"]
    split = " / ".join(f"{t[k]:.1f}" for k in ("prefill", "decode", "mixed", "resharding", "swapping"))
    batch = f"{r['mean_decode_batch']:.1f}" if r["mean_decode_batch"] else "-"
    return (f"{r['throughput']:8.0f} tok/s  {r['wall_s']:6.1f} s  split {split} s  transitions {r['transitions']:3d}"
            f"  decode batch {batch:>5s}  swap-outs {r['swap_outs']}  preemptions {r['preemptions']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="main,ablation,variants,links")
    ap.add_argument("--traces", default=str(TRACES), help="directory of the shared traces")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.125, help="trace prompt and output lengths are multiplied by this")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--kv-mb", type=int, default=64, help="KV cache memory per rank, MiB (the same for all)")
    ap.add_argument("--tier-gb", type=float, default=1.0, help="Seesaw's host KV tier, GiB")
    ap.add_argument("--ablation-tier-gb", type=float, default=0.08, help="the tier in the ablation, GiB")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (but TP's chunk sweep)")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--tp-chunks", default="256,512,2048", help="TP's chunked-prefill sizes")
    ap.add_argument("--shift-threshold", type=int, default=64)
    ap.add_argument("--links", default="0.004,0.016,0.064,0.256", help="emulated interconnect bandwidths, GB/s")
    ap.add_argument("--links-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the main part (medians reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--predict", default=None, metavar="PROFILE",
                    help="main part: also print the planner's predicted throughput of each configuration with this "
                         "hardware profile (torch-shift calibrate --out PROFILE)")
    ap.add_argument("--_run", help=argparse.SUPPRESS)  # internal: one configuration, prints RESULT <json>
    args = ap.parse_args(argv)
    if args._run:
        spec = json.loads(Path(args._run).read_text())
        print("RESULT " + json.dumps(run_one(spec["model"], spec["args"], spec["requests"])), flush=True)
        return 0
    profile = None
    if args.predict:
        from torch_shift.planner import get_profile

        profile = get_profile(args.predict)
    args.tp_chunks = [int(c) for c in args.tp_chunks.split(",")]
    links = [float(b) for b in args.links.split(",")]
    parts = set(args.parts.split(","))
    model_config = QUICK_MODEL if args.quick else MODEL
    if args.quick:
        args.num_requests, args.links_requests, args.tp_chunks, links = 8, 4, [512], links[-2:]

    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    log(f"machine: {platform.machine()}, {os.cpu_count()} cores; {_caches()}; torch threads per rank 1; "
        "shared with other jobs while measured: timings are noisy")
    workloads = {name: workload(Path(args.traces), name, args.num_requests, args.scale, args.max_prompt,
                                args.max_output, model_config["vocab_size"], args.seed) for name in ("arxiv", "azure")}
    for name, reqs in workloads.items():
        prompts, outs = [len(p) for p, _ in reqs], [n for _, n in reqs]
        log(f"workload {name}: {len(reqs)} requests, lengths x{args.scale} (capped at {args.max_prompt} / "
            f"{args.max_output}): prompts {min(prompts)}..{max(prompts)} (sum {sum(prompts)}), outputs "
            f"{min(outs)}..{max(outs)} (sum {sum(outs)}), prompt:output {sum(prompts) / sum(outs):.1f}")
    results: dict = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "model": model_config}
    all_configs = configs(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_checkpoint(Path(tmp) / "model", tiny_llama_config(**model_config)))
        num_params = _num_params(model_config)
        log(f"model: random Llama {model_config}: {num_params / 1e6:.0f}M parameters, fp32 "
            f"{num_params * 4 / 2**20:.0f} MiB; KV {args.kv_mb} MiB per rank; Seesaw tier {args.tier_gb} GiB")

        if "main" in parts:
            results["main"] = {}
            for wname, reqs in workloads.items():
                log(f"\n[main] {wname}")
                runs: dict[str, list] = {c: [] for c in all_configs}
                for _ in range(args.repeats):  # interleaved, so that drifts in the machine's load hit all
                    for cname, cargs in all_configs.items():
                        runs[cname].append(launch(model_dir, cargs, reqs))
                res = {}
                for cname, rs in runs.items():
                    res[cname] = sorted(rs, key=lambda r: r["throughput"])[len(rs) // 2]
                    res[cname]["all_throughputs"] = [r["throughput"] for r in rs]
                    log(f"  {cname:10s} {describe(res[cname])}  weights {res[cname]['weights_mb_rank0']['device']:.0f}"
                        f" MiB" + (f"  runs {', '.join(f'{t:.0f}' for t in res[cname]['all_throughputs'])}"
                                   if args.repeats > 1 else ""))
                if profile is not None:
                    predicted = predict_throughput(model_dir, profile, all_configs, reqs)
                    log(f"  the planner's predictions ({profile.name}), tok/s predicted / measured: " + ", ".join(
                        f"{c} {predicted[c]:.0f} / {res[c]['throughput']:.0f} "
                        f"({100 * (predicted[c] / res[c]['throughput'] - 1):+.0f}%)" for c in res))
                    for c in res:
                        res[c]["predicted_throughput"] = predicted[c]
                best_tp = max((c for c in res if c.startswith("TP")), key=lambda c: res[c]["throughput"])
                static = max((c for c in res if c != "Seesaw"), key=lambda c: res[c]["throughput"])
                log(f"  best TP chunk: {best_tp}; best static: {static}; Seesaw / best static "
                    f"{res['Seesaw']['throughput'] / res[static]['throughput']:.2f}x; Seesaw / best TP "
                    f"{res['Seesaw']['throughput'] / res[best_tp]['throughput']:.2f}x")
                results["main"][wname] = res
                results.setdefault("best_tp", {})[wname] = best_tp

        arxiv = workloads["arxiv"]
        seesaw = all_configs["Seesaw"]
        if "ablation" in parts:
            log(f"\n[ablation] Seesaw scheduling, arxiv, tier {args.ablation_tier_gb} GiB")
            results["ablation"] = {}
            for name, options in (("tiered", {}), ("tiered, refill 20%", {"refill_below": 0.2}),
                                  ("prefill-first", {"scheduling": "prefill_first"}),
                                  ("decode-first", {"scheduling": "decode_first"})):
                r = launch(model_dir, {**seesaw, "cpu_kv_gb": args.ablation_tier_gb, "policy_config": options}, arxiv)
                results["ablation"][name] = r
                log(f"  {name:18s} {describe(r)}")

        if "variants" in parts:
            log("\n[variants] Seesaw weights and tier copies, arxiv")
            results["variants"] = {}
            for name, extra in (("resident, sync", {}), ("host copies, sync", {"seesaw_weights": "host"}),
                                ("resident, async", {"kv_swap": "async"})):
                r = launch(model_dir, {**seesaw, **extra}, arxiv)
                results["variants"][name] = r
                per = r["time_s"]["resharding"] / max(1, r["transitions"])
                log(f"  {name:18s} {describe(r)}\n  {'':18s} weights on rank 0: {r['weights_mb_rank0']['device']:.0f} "
                    f"MiB device + {r['weights_mb_rank0']['host']:.0f} MiB host; {1e3 * per:.2f} ms per transition")

        if "links" in parts:
            log(f"\n[links] emulated interconnect, {args.links_requests} arxiv requests (GB/s; unemulated first)")
            best_tp = results.get("best_tp", {}).get("arxiv", f"TP c={args.tp_chunks[-1]}")
            sweep = {"DP": all_configs["DP"], best_tp: all_configs[best_tp], "PP": all_configs["PP"], "Seesaw": seesaw}
            results["links"] = {}
            for bandwidth in [None] + links:
                row = {}
                for cname, cargs in sweep.items():
                    if cname == "DP" and bandwidth is not None:
                        continue  # no collective in its forward
                    row[cname] = launch(model_dir, {**cargs, "interconnect_gbps": bandwidth},
                                        arxiv[:args.links_requests])
                results["links"][str(bandwidth)] = row
                log(f"  {'none' if bandwidth is None else bandwidth:>6} GB/s: " + ", ".join(
                    f"{c} {r['throughput']:.0f}" for c, r in row.items()) + " tok/s  (Seesaw split "
                    + " / ".join(f"{row['Seesaw']['time_s'][k]:.1f}" for k in ("prefill", "decode")) + " s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _num_params(c: dict) -> int:
    h, inter, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    qkv = h * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    return 2 * v * h + layers * (qkv + h * h + 3 * h * inter + 2 * h) + h


def _caches() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "lscpu unavailable"
    return ", ".join(" ".join(line.split()) for line in out.splitlines() if "cache" in line)


if __name__ == "__main__":
    sys.exit(main())
