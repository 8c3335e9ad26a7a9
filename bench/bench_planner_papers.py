"""The planner at the papers' scale: predicted ratios beside the published ones (issue 15, part 4).

    python bench/bench_planner_papers.py                 # every experiment (a few minutes, one core)
    python bench/bench_planner_papers.py --parts fig1 --json bench/results/planner_papers.json

Every figure is a simulation (torch_shift.planner): the engine's own scheduler and policies with the cost
model's step times on data-sheet hardware; no GPU runs. Models are config.json shapes written here.

Experiments:
  fig1     paper 000 Fig. 1: Llama-3-70B FP8 on 8 x H200, 4096 input and 250 output tokens. Lowest latency
           with one request at a time (TTFT, TPOT); peak throughput with --fig1-requests at once.
           Paper: Shift's TTFT 1.56x lower than TP's and 6x lower than DP's; against DP's peak throughput TP
           loses 46%, Shift 18%.
  table5   paper 000 Table 5's shape: a bursty stream (a steady low rate with four bursts) of lengths from the
           Azure conversation trace, Llama-3-70B FP8 on 8 x H200: median TTFT, median TPOT and peak throughput
           (best 5 s window) of DP, TP and Shift. Paper: DP 1,355 / 83 / 75,535; TP 3,930 / 85 / 51,162;
           Shift 148 / 51 / 69,147 (ms, ms, tok/s).
  table1   paper 004 Table 1's shape: Llama-3-70B (FP8, so that one H200 holds a replica) on 8 x H200,
           arrivals modulated between a low and a
           high rate, 10% of the requests with priority -1: mean TTFT and TPOT of priority requests and of all,
           peak throughput, for static TP-8, static DP-8 and Flying. Paper: TP 63 / 2130 ms TTFT, DP 166 / 166,
           Flying 74 / 142; peak throughput 2530, 3164, 3040 tok/s.
  seesaw   paper 003: end-to-end throughput of Seesaw against the best static configuration of a sweep, 500
           arxiv-summarization requests at once, CodeLlama-34B and Llama-2-70B in FP16 on 8 x A10 and 8 x L4
           (PCIe 4.0 x8: 16 GiB/s per direction). Paper: geomean 1.45x on A10, 1.29x on L4.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench_seesaw import TRACES  # the shared traces beside the repository

from torch_shift.bench.traffic import DEFAULT_TRACE, RequestSpec, phase_arrivals
from torch_shift.config import ModelConfig
from torch_shift.planner import ModelShape, get_profile
from torch_shift.planner.collectives import CollectiveModel
from torch_shift.planner.hardware import ACHIEVABLE_FRACTION, LINK_LATENCY_S
from torch_shift.planner.plan import Candidate, run_candidate


LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
CODELLAMA_34B = dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48, num_attention_heads=64,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384)


def log(msg: str = "") -> None:
    print(msg, flush=True)


def model(shape: dict) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **shape})


def requests(lengths, arrivals, vocab: int, seed: int = 0, priorities=None) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(f"r{i}", t, [rng.randrange(8, vocab) for _ in range(p)], o,
                        priorities[i] if priorities else 0)
            for i, (t, (p, o)) in enumerate(zip(arrivals, lengths))]


def simulate_config(config, shape, hw, engine_args: dict, specs, weight_layouts, concurrency=None,
                    seesaw_tier_gb: float | None = None):
    """Simulate `engine_args` as `torch-shift plan` simulates a candidate: a KV pool per rank of 90% of the
    device less the weights of `weight_layouts`; (the simulation, None) or (None, why it cannot run)."""
    policy, params = ("seesaw", {"cpu_kv_gb": seesaw_tier_gb}) if seesaw_tier_gb is not None else ("static", {})
    candidate = Candidate(policy, params, {"enable_prefix_caching": False, **engine_args}, tuple(weight_layouts))
    result = run_candidate(candidate, config, shape, hw, specs, concurrency=concurrency, max_model_len=8192)
    return result.simulation, result.error


def peak_throughput(result, window_s: float) -> float:
    """Tokens computed (prompt and output) in the busiest window of `window_s`, per second."""
    starts = np.array([s.start_s for s in result.steps])
    ends = starts + np.array([s.seconds for s in result.steps])
    tokens = np.array([s.num_tokens for s in result.steps], dtype=float)
    best = 0.0
    for i in range(len(ends)):
        inside = (ends > ends[i] - window_s) & (ends <= ends[i])
        best = max(best, tokens[inside].sum() / window_s)
    return best


def ratio_line(name: str, predicted: float, paper: float) -> str:
    return f"  {name:52s} predicted {predicted:7.2f}   paper {paper:7.2f}   error {100 * (predicted / paper - 1):+6.0f}%"


# -- paper 000 Fig. 1 ---------------------------------------------------------------------------------------
SHIFT = {"sp": 8, "shift_threshold": 256, "shift_weights": "view"}
FIG1_LAYOUTS = {
    "DP": ({"dp": 8}, "dp"), "TP": ({"tp": 8}, "tp"), "SP": ({"sp": 8, "shift_threshold": None}, "sp"),
    "Shift": (SHIFT, "sp"),
}


def weight_layouts(kind: str, world: int = 8):
    from torch_shift.planner.cost import Layout

    return {"dp": [Layout("tp", tp=1)], "tp": [Layout("tp", tp=world)], "sp": [Layout("sp_tp", sp=world)],
            "pp": [Layout("pp", pp=world)]}[kind]


def fig1(args) -> dict:
    config = model(LLAMA3_70B)
    shape, hw = ModelShape.from_config(config, dtype="fp8", name="Llama-3-70B"), get_profile("h200x8")
    lengths = [(4096, 250)]
    out = {}
    for name, (engine_args, kind) in FIG1_LAYOUTS.items():
        one = requests(lengths * 4, [0.0] * 4, config.vocab_size, seed=1)
        latency, _ = simulate_config(config, shape, hw, engine_args, one, weight_layouts(kind), concurrency=1)
        many = requests(lengths * args.fig1_requests, [0.0] * args.fig1_requests, config.vocab_size, seed=2)
        peak, _ = simulate_config(config, shape, hw, engine_args, many, weight_layouts(kind))
        lm, pm = latency.metrics(), peak.metrics()
        out[name] = {"ttft_ms": lm["ttft_p50_ms"], "tpot_ms": lm["tpot_p50_ms"],
                     "throughput_tok_s": pm["total_throughput_tok_s"]}
        log(f"  {name:6s} TTFT {lm['ttft_p50_ms']:8.1f} ms  TPOT {lm['tpot_p50_ms']:6.2f} ms  peak "
            f"{pm['total_throughput_tok_s']:9.0f} tok/s")
    ttft, thr = {k: v["ttft_ms"] for k, v in out.items()}, {k: v["throughput_tok_s"] for k, v in out.items()}
    ratios = {
        "TP TTFT / Shift TTFT": (ttft["TP"] / ttft["Shift"], 1.56),
        "DP TTFT / Shift TTFT": (ttft["DP"] / ttft["Shift"], 6.0),
        "TP's throughput loss against DP": (1 - thr["TP"] / thr["DP"], 0.46),
        "Shift's throughput loss against DP": (1 - thr["Shift"] / thr["DP"], 0.18),
        "Shift TPOT (ms)": (out["Shift"]["tpot_ms"], 9.34),
    }
    for name, (predicted, paper) in ratios.items():
        log(ratio_line(name, predicted, paper))
    return {"configs": out, "ratios": {k: {"predicted": p, "paper": q} for k, (p, q) in ratios.items()}}


# -- paper 000 Table 5 ----------------------------------------------------------------------------------------
def azure_lengths(n: int, rng: random.Random, cap_prompt: int = 8192, cap_output: int = 1024):
    with open(DEFAULT_TRACE) as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    return [(max(1, min(cap_prompt, p)), max(2, min(cap_output, o))) for p, o in (rng.choice(rows) for _ in range(n))]


def bursty_arrivals(low: float, high: float, low_s: float, high_s: float, bursts: int, seed: int):
    phases = []
    for _ in range(bursts):
        phases += [(low_s, low), (high_s, high)]
    phases.append((low_s, low))
    return phase_arrivals(phases, random.Random(seed))


def table5(args) -> dict:
    config = model(LLAMA3_70B)
    shape, hw = ModelShape.from_config(config, dtype="fp8", name="Llama-3-70B"), get_profile("h200x8")
    arrivals = bursty_arrivals(args.table5_rates[0], args.table5_rates[1], 30.0, 10.0, 4, seed=0)
    specs = requests(azure_lengths(len(arrivals), random.Random(0)), arrivals, config.vocab_size)
    log(f"  {len(specs)} requests: {args.table5_rates[0]:g}/s with four 10 s bursts at {args.table5_rates[1]:g}/s")
    out = {}
    for name, (engine_args, kind) in (("DP", ({"dp": 8}, "dp")), ("TP", ({"tp": 8}, "tp")), ("Shift", (SHIFT, "sp"))):
        result, _ = simulate_config(config, shape, hw, engine_args, specs, weight_layouts(kind))
        m = result.metrics()
        out[name] = {"ttft_p50_ms": m["ttft_p50_ms"], "tpot_p50_ms": m["tpot_p50_ms"],
                     "peak_tok_s": peak_throughput(result, 5.0)}
        log(f"  {name:6s} median TTFT {m['ttft_p50_ms']:8.1f} ms  median TPOT {m['tpot_p50_ms']:6.1f} ms  peak "
            f"{out[name]['peak_tok_s']:8.0f} tok/s")
    paper = {"DP": (1355, 83, 75535), "TP": (3930, 85, 51162), "Shift": (148, 51, 69147)}
    ratios = {
        "DP TTFT / Shift TTFT": (out["DP"]["ttft_p50_ms"] / out["Shift"]["ttft_p50_ms"], 1355 / 148),
        "TP TTFT / Shift TTFT": (out["TP"]["ttft_p50_ms"] / out["Shift"]["ttft_p50_ms"], 3930 / 148),
        "DP TPOT / Shift TPOT": (out["DP"]["tpot_p50_ms"] / out["Shift"]["tpot_p50_ms"], 83 / 51),
        "Shift peak / DP peak": (out["Shift"]["peak_tok_s"] / out["DP"]["peak_tok_s"], 69147 / 75535),
        "TP peak / DP peak": (out["TP"]["peak_tok_s"] / out["DP"]["peak_tok_s"], 51162 / 75535),
    }
    for name, (predicted, p) in ratios.items():
        log(ratio_line(name, predicted, p))
    return {"configs": out, "paper": paper, "ratios": {k: {"predicted": a, "paper": b} for k, (a, b) in ratios.items()}}


# -- paper 004 Table 1 ----------------------------------------------------------------------------------------
def table1(args) -> dict:
    config = model(LLAMA3_70B)
    # FP8 weights: in BF16 (141 GB) one H200 holds no replica, and Flying binds replicas of one device
    shape, hw = ModelShape.from_config(config, dtype="fp8", name="Llama-3-70B"), get_profile("h200x8")
    low, high = args.table1_rates
    phases = [(20.0, low), (20.0, high)] * 3
    arrivals = phase_arrivals(phases, random.Random(3))
    rng = random.Random(4)
    priorities = [-1 if rng.random() < 0.1 else 0 for _ in arrivals]
    specs = requests(azure_lengths(len(arrivals), random.Random(5)), arrivals, config.vocab_size, seed=6,
                     priorities=priorities)
    log(f"  {len(specs)} requests ({sum(p < 0 for p in priorities)} with priority -1), rate {low:g} <-> {high:g}/s")
    out = {}
    configs = (("TP", {"tp": 8, "scheduling_policy": "priority"}, "tp"),
               ("DP", {"dp": 8, "scheduling_policy": "priority"}, "dp"),
               ("Flying", {"dp": 8, "policy": "flying"}, "dp"))
    for name, engine_args, kind in configs:
        result, err = simulate_config(config, shape, hw, engine_args, specs, weight_layouts(kind))
        if result is None:
            log(f"  {name}: {err}")
            continue
        prio = {s.id for s in specs if s.priority < 0}

        def mean(values):
            values = [v for v in values if v is not None]
            return sum(values) / len(values) * 1e3 if values else None

        done = [r for r in result.requests if r.finish_s is not None]
        out[name] = {
            "ttft_priority_ms": mean([r.ttft_s for r in done if r.request_id in prio]),
            "ttft_all_ms": mean([r.ttft_s for r in done]),
            "tpot_priority_ms": mean([r.tpot_s for r in done if r.request_id in prio]),
            "tpot_all_ms": mean([r.tpot_s for r in done]),
            "peak_tok_s": peak_throughput(result, 5.0),
        }
        o = out[name]
        log(f"  {name:7s} TTFT priority {o['ttft_priority_ms']:8.1f} all {o['ttft_all_ms']:8.1f} ms  TPOT priority "
            f"{o['tpot_priority_ms']:5.1f} all {o['tpot_all_ms']:5.1f} ms  peak {o['peak_tok_s']:8.0f} tok/s")
    paper = {"TP": (63, 2130, 22, 22, 2530), "DP": (166, 166, 32, 32, 3164), "Flying": (74, 142, 24, 28, 3040)}
    ratios = {}
    if len(out) == 3:
        ratios = {
            "TP TTFT(all) / Flying TTFT(all)": (out["TP"]["ttft_all_ms"] / out["Flying"]["ttft_all_ms"], 2130 / 142),
            "DP TTFT(priority) / Flying TTFT(priority)": (out["DP"]["ttft_priority_ms"]
                                                          / out["Flying"]["ttft_priority_ms"], 166 / 74),
            "DP TPOT(priority) / Flying TPOT(priority)": (out["DP"]["tpot_priority_ms"]
                                                          / out["Flying"]["tpot_priority_ms"], 32 / 24),
            "Flying peak / DP peak": (out["Flying"]["peak_tok_s"] / out["DP"]["peak_tok_s"], 3040 / 3164),
            "TP peak / DP peak": (out["TP"]["peak_tok_s"] / out["DP"]["peak_tok_s"], 2530 / 3164),
        }
        for name, (predicted, p) in ratios.items():
            log(ratio_line(name, predicted, p))
    return {"configs": out, "paper": paper, "ratios": {k: {"predicted": a, "paper": b} for k, (a, b) in ratios.items()}}


# -- paper 003 ------------------------------------------------------------------------------------------------
def pcie_x8(gpu: str, n: int):
    """A data-sheet node whose GPUs talk over PCIe 4.0 x8 (16 GiB/s per direction), as paper 003's."""
    hw = get_profile(f"{gpu}x{n}")
    base, per_step = LINK_LATENCY_S["pcie"]
    link = 16 * 2**30 * ACHIEVABLE_FRACTION["pcie"]
    return replace(hw, name=f"{gpu}x{n} (PCIe 4.0 x8)",
                   collectives=CollectiveModel.from_link(link, base, per_step, [2, 4, 8]), host_link_bandwidth=link)


SEESAW_STATIC = {  # name: (engine args, weight layouts as (kind, size))
    "TP8": ({"tp": 8}, [("tp", 8)]), "PP8": ({"pp": 8}, [("pp", 8)]),
    "D2T4": ({"dp": 2, "tp": 4}, [("tp", 4)]), "D4T2": ({"dp": 4, "tp": 2}, [("tp", 2)]),
    "D2P4": ({"dp": 2, "pp": 4}, [("pp", 4)]), "D4P2": ({"dp": 4, "pp": 2}, [("pp", 2)]),
}
SEESAW_DYNAMIC = {
    "P8->T8": ({"pp": 8, "policy": "seesaw"}, [("pp", 8), ("tp", 8)]),
    "D2P4->D2T4": ({"dp": 2, "pp": 4, "policy": "seesaw"}, [("pp", 4), ("tp", 4)]),
}


def seesaw(args) -> dict:
    from torch_shift.planner.cost import Layout

    with open(TRACES / "arxiv_summarization_lengths.csv") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(0)
    lengths = [(p, max(2, o)) for p, o in rng.sample(rows, args.seesaw_requests)]
    out, speedups = {}, {}
    for gpu in ("a10", "l4"):
        hw = pcie_x8(gpu, 8)
        for mname, mshape in (("CodeLlama-34B", CODELLAMA_34B), ("Llama-2-70B", LLAMA2_70B)):
            config = model({**mshape, "max_position_embeddings": 8192})
            shape = ModelShape.from_config(config, dtype="fp16", name=mname)
            specs = requests(lengths, [0.0] * len(lengths), config.vocab_size)
            row = {}
            for cname, (engine_args, layouts) in {**SEESAW_STATIC, **SEESAW_DYNAMIC}.items():
                wl = [Layout("pp", pp=s) if k == "pp" else Layout("tp", tp=s) for k, s in layouts]
                tier_gb = args.seesaw_tier_gb if "policy" in engine_args else None
                result, err = simulate_config(config, shape, hw, engine_args, specs, wl, seesaw_tier_gb=tier_gb)
                row[cname] = (result.metrics()["total_throughput_tok_s"] if result else None, err)
            static = {k: v for k, v in row.items() if k in SEESAW_STATIC and v[0] is not None}
            dynamic = {k: v for k, v in row.items() if k in SEESAW_DYNAMIC and v[0] is not None}
            best_static = max(static, key=lambda k: static[k][0]) if static else None
            best_dynamic = max(dynamic, key=lambda k: dynamic[k][0]) if dynamic else None
            key = f"{gpu} {mname}"
            out[key] = {k: {"throughput_tok_s": v[0], "error": v[1]} for k, v in row.items()}
            log(f"  {key}: " + ", ".join(f"{k} {v[0]:.0f}" if v[0] else f"{k} -" for k, v in row.items()) + " tok/s")
            if best_static and best_dynamic:
                speedups[key] = dynamic[best_dynamic][0] / static[best_static][0]
                log(f"    Seesaw ({best_dynamic}) / best static ({best_static}): {speedups[key]:.2f}x")
    ratios = {}
    for gpu, paper in (("a10", 1.45), ("l4", 1.29)):
        values = [v for k, v in speedups.items() if k.startswith(gpu)]
        if values:
            geomean = math.exp(sum(math.log(v) for v in values) / len(values))
            ratios[f"Seesaw / best static, {gpu.upper()} geomean"] = (geomean, paper)
            log(ratio_line(f"Seesaw / best static, {gpu.upper()} geomean", geomean, paper))
    return {"configs": out, "speedups": speedups,
            "ratios": {k: {"predicted": a, "paper": b} for k, (a, b) in ratios.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="fig1,table5,table1,seesaw")
    ap.add_argument("--fig1-requests", type=int, default=1024, help="requests at once for the peak throughput")
    ap.add_argument("--table5-rates", default="2,20", help="low,high requests/s of the bursty stream")
    ap.add_argument("--table1-rates", default="3,5", help="low,high requests/s (paper 004: 3 to 5)")
    ap.add_argument("--seesaw-requests", type=int, default=500)
    ap.add_argument("--seesaw-tier-gb", type=float, default=256.0, help="Seesaw's host tier (GiB)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.table5_rates = tuple(float(x) for x in args.table5_rates.split(","))
    args.table1_rates = tuple(float(x) for x in args.table1_rates.split(","))
    results = {}
    for part, fn in (("fig1", fig1), ("table5", table5), ("table1", table1), ("seesaw", seesaw)):
        if part in args.parts.split(","):
            log(f"\n== {part}")
            start = time.monotonic()
            results[part] = fn(args)
            log(f"  ({time.monotonic() - start:.0f} s of simulation)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
