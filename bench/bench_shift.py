"""TP vs SP vs Shift on this machine: one request stream, three layouts, side by side.

    python bench/bench_shift.py [--json bench/results/shift.json]

World 2, one intra-op thread per rank, a random Llama of a few million parameters. Every
configuration serves the same stream (Poisson arrivals, prompt and output lengths sampled from
the Azure conversation trace and scaled down to the model, see the printed workload) through the
same engine code path:
  TP    : sp=1, tp=2, no shift layout (plain TP)
  SP    : sp=2, tp=1, shift_threshold=0 (every step in the base layout: pure Ulysses SP)
  Shift : sp=2, tp=1, shift_threshold=T (base for steps with more than T tokens, full TP otherwise)
  Shift-view : the same with shift_weights="view" (zero-copy shift shards) instead of "copy"
Each runs in its own process (ranks 0 and 1), rank 0 adds requests at their arrival times and
steps the engine; it records each request's arrival, first-token and finish times. Reported:
TTFT and TPOT p50/p90, throughput (input + output tokens over the makespan), steps per layout
and the communication ledger (bytes rank 0 sent, per layout and per token).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch_shift.bench.run import TABLE5_MODEL as MODEL  # the same ~5M-parameter model
from torch_shift.bench.traffic import DEFAULT_TRACE

CONFIGS = {
    "TP": dict(sp=1, tp=2, shift_threshold=None),
    "SP": dict(sp=2, tp=1, shift_threshold=0),
    "Shift": dict(sp=2, tp=1, shift_threshold=None),  # threshold from --threshold
    "Shift-view": dict(sp=2, tp=1, shift_threshold=None, shift_weights="view"),  # zero-copy shift shards
}


def workload(trace: Path, num: int, rate: float, scale: float, max_prompt: int, max_output: int, seed: int):
    with open(trace) as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for i in range(num):
        prompt, output = rng.choice(rows)
        t += rng.expovariate(rate)
        n_in = max(1, min(max_prompt, round(prompt * scale)))
        n_out = max(2, min(max_output, round(output * scale)))
        requests.append({"id": f"r{i}", "arrival": t, "prompt": [rng.randrange(8, MODEL["vocab_size"]) for _ in
                                                                 range(n_in)], "max_tokens": n_out})
    return requests


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def serve(model_dir: str, config: dict, requests: list[dict], budget: int) -> dict:
    """Rank 0 of one configuration (this process starts rank 1 itself)."""
    from torch_shift import LLMEngine, SamplingParams
    from torch_shift.engine.llm_engine import EngineArgs

    engine = LLMEngine(EngineArgs(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False, **config))
    # warm-up, outside the measurement: one request through both layouts
    engine.add_request("warm", list(range(8, 8 + 300)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.model.ledger.bytes.clear()
    engine.model.ledger.calls.clear()
    engine.model.layout_counts.clear()

    start = time.monotonic()
    pending = list(requests)
    arrival, first, finish, counts = {}, {}, {}, {}
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(r["id"], r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                                                    ignore_eos=True), arrival_time=start + r["arrival"])
            arrival[r["id"]] = r["arrival"]
        if not engine.has_unfinished_requests():
            time.sleep(min(0.001, max(0.0, pending[0]["arrival"] - now)))
            continue
        for out in engine.step():
            t = time.monotonic() - start
            first.setdefault(out.request_id, t)
            if out.finished:
                finish[out.request_id] = t
                counts[out.request_id] = len(out.outputs[0].token_ids)
    makespan = max(finish.values()) - min(arrival.values())
    ttft = [first[r] - arrival[r] for r in arrival]
    tpot = [(finish[r] - first[r]) / (counts[r] - 1) for r in arrival if counts[r] > 1]
    tokens = sum(len(r["prompt"]) + r["max_tokens"] for r in requests)
    ledger = engine.model.ledger
    result = {
        "ttft_ms": {"p50": 1e3 * percentile(ttft, 50), "p90": 1e3 * percentile(ttft, 90)},
        "tpot_ms": {"p50": 1e3 * percentile(tpot, 50), "p90": 1e3 * percentile(tpot, 90)},
        "throughput_tok_s": tokens / makespan,
        "makespan_s": makespan,
        "steps": dict(engine.model.layout_counts),
        "ledger_bytes": {f"{layout}/{op}": b for (layout, op), b in sorted(ledger.bytes.items())},
        "ledger_calls": {f"{layout}/{op}": c for (layout, op), c in sorted(ledger.calls.items())},
        "tokens": tokens,
    }
    engine.shutdown()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=12.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--scale", type=float, default=0.125, help="trace token counts are multiplied by this")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--threshold", type=int, default=64, help="Shift: steps with more tokens use the base layout")
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (medians are reported)")
    ap.add_argument("--json")
    ap.add_argument("--_run", help=argparse.SUPPRESS)  # internal: serve one configuration, print JSON
    args = ap.parse_args(argv)

    if args._run:
        spec = json.loads(args._run)
        print("RESULT " + json.dumps(serve(spec["model"], spec["config"], spec["requests"], args.budget)), flush=True)
        return 0

    requests = workload(Path(args.trace), args.num_requests, args.rate, args.scale, args.max_prompt,
                        args.max_output, args.seed)
    print(f"workload: {len(requests)} requests from {args.trace}, Poisson arrivals at {args.rate}/s "
          f"(seed {args.seed}); token counts x{args.scale}, prompts capped at {args.max_prompt}, outputs at "
          f"{args.max_output} (min 2); prompts {min(len(r['prompt']) for r in requests)}.."
          f"{max(len(r['prompt']) for r in requests)} tokens, outputs "
          f"{min(r['max_tokens'] for r in requests)}..{max(r['max_tokens'] for r in requests)}")
    print(f"model: random Llama {MODEL}, fp32; world 2, 1 thread per rank; max_num_batched_tokens {args.budget}")

    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_checkpoint(Path(tmp) / "model", tiny_llama_config(**MODEL), init_std=0.05))
        for round_idx in range(args.repeats):  # configurations interleaved, so drifts in machine load hit all
            for name, config in CONFIGS.items():
                config = dict(config)
                if name.startswith("Shift"):
                    config["shift_threshold"] = args.threshold
                spec = json.dumps({"model": model_dir, "config": config, "requests": requests})
                proc = subprocess.run([sys.executable, __file__, "--budget", str(args.budget), "--_run", spec],
                                      capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **_env()})
                line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
                if line is None:
                    print(proc.stdout, proc.stderr[-4000:], file=sys.stderr)
                    return 1
                runs[name].append(json.loads(line[len("RESULT "):]))
                print(f"  round {round_idx + 1}/{args.repeats} {name:10s} makespan {runs[name][-1]['makespan_s']:.1f} s",
                      flush=True)
    results = {name: _median_run(r) for name, r in runs.items()}
    print(f"\nmedians over {args.repeats} runs per configuration:")
    print()
    print(f"{'config':10s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} {'TPOT p90':>9s} {'tok/s':>8s}  steps")
    for name, r in results.items():
        print(f"{name:10s} {r['ttft_ms']['p50']:8.1f}ms {r['ttft_ms']['p90']:8.1f}ms {r['tpot_ms']['p50']:8.2f}ms "
              f"{r['tpot_ms']['p90']:8.2f}ms {r['throughput_tok_s']:8.0f}  {r['steps']}")
    tp = results["TP"]
    for name, r in results.items():
        print(f"{name:10s} vs TP: TTFT p50 x{r['ttft_ms']['p50'] / tp['ttft_ms']['p50']:.2f}, "
              f"TPOT p50 x{r['tpot_ms']['p50'] / tp['tpot_ms']['p50']:.2f}, "
              f"throughput x{r['throughput_tok_s'] / tp['throughput_tok_s']:.2f}")
    print()
    print("communication ledger (bytes rank 0 sent during the stream; per token = over all tokens served):")
    for name, r in results.items():
        total = sum(r["ledger_bytes"].values())
        parts = ", ".join(f"{k} {v / 1e6:.2f} MB ({r['ledger_calls'][k]} calls)" for k, v in r["ledger_bytes"].items())
        print(f"  {name:10s} {total / 1e6:7.2f} MB, {total / r['tokens']:8.0f} B/token: {parts}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def _median_run(runs: list[dict]) -> dict:
    """Each latency and throughput figure: the median over the runs; steps and ledger of the first."""
    out = dict(runs[0])
    for key in ("ttft_ms", "tpot_ms"):
        out[key] = {q: statistics.median(r[key][q] for r in runs) for q in ("p50", "p90")}
    out["throughput_tok_s"] = statistics.median(r["throughput_tok_s"] for r in runs)
    out["runs"] = runs
    return out


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}


if __name__ == "__main__":
    sys.exit(main())
