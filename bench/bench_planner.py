"""The planner's single-step cost model against the real engine on this machine.

    python bench/bench_planner.py [--profile this_machine.json] [--json bench/results/planner_steps.json]

Each round calibrates this machine (`torch-shift calibrate`, unless --profile names a profile) and runs
every configuration; the round that other processes disturbed least is reported. It writes a random
Llama whose weights are far beyond the last-level cache, then runs the engine at world 1 (one rank),
TP-2 (sp=1, tp=2), SP-2 (sp=2, tp=1, every step in the SP layout) and DP-2 (a replica alone with work runs on
both cores: `model_runner.step_threads`), one thread per rank, each in its own process, through the same
scenarios: decode steps at batch 1, 8 and 64, and a 512-token
prompt, greedy. Every step's wall time on rank 0 (`LLMEngine.step`) is compared with the cost model's
prediction for the same step plan (`torch_shift.planner.step_cost`): the median step per scenario of the
quietest round, predicted from that round's calibration, and the best step of all rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=2048)
CONFIGS = {
    "1 rank": dict(sp=1, tp=1),
    "TP-2": dict(sp=1, tp=2, shift_threshold=None),
    "SP-2": dict(sp=2, tp=1, shift_threshold=0),
    "DP-2": dict(dp=2),
}
# (name, sequences, prompt tokens, decode steps timed): decode scenarios time their decode steps, the
# prompt scenario its prefill steps (repeated with fresh prompts)
SCENARIOS = [("decode, batch 1, context 512", 1, 512, 8), ("decode, batch 8, context 256", 8, 256, 8),
             ("decode, batch 64, context 64", 64, 64, 6), ("prefill, 1 x 512 tokens", 1, 512, 3)]
WARMUP_DECODES = 2


def layout_for(config: dict):
    from torch_shift.planner import Layout

    if config.get("dp", 1) > 1:
        return Layout.dp_groups(*[1] * config["dp"])
    if config["sp"] > 1:
        return Layout("sp_tp", sp=config["sp"], tp=config["tp"])
    return Layout("tp", tp=config["tp"])


def run_config(model_dir: str, config: dict) -> dict:
    """Rank 0 of one configuration (the engine starts rank 1 itself): every timed step with its plan."""
    import torch

    from torch_shift import LLMEngine, SamplingParams
    from torch_shift.engine.llm_engine import EngineArgs
    from torch_shift.planner import Seq

    torch.set_num_threads(1)  # world 1: one thread, as each rank of world 2 has
    engine = LLMEngine(EngineArgs(model_dir, max_num_batched_tokens=2048, max_num_seqs=64, num_kv_blocks=1024,
                                  enable_prefix_caching=False, **config))
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: plans.append(schedule(*args)) or plans[-1]
    vocab = MODEL["vocab_size"]
    counter = iter(range(1 << 30))

    def steps(num_seqs: int, prompt: int, max_tokens: int) -> list[tuple[float, list]]:
        """Add the requests, run them to the end; every step's (seconds, sequences)."""
        for _ in range(num_seqs):
            i = next(counter)
            engine.add_request(f"r{i}", [(7 + 31 * i + 13 * j) % (vocab - 8) + 8 for j in range(prompt)],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        out = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            out.append((time.perf_counter() - start, [(Seq.from_scheduled(e), g.replicas[0])
                                                      for g in plans[-1].groups for e in g.entries]))
        return out

    steps(2, 300, 4)  # warm-up outside the measurement: both step shapes
    results = {}
    for name, num_seqs, prompt, timed in SCENARIOS:
        if name.startswith("prefill"):
            picked = [steps(num_seqs, prompt, 1)[0] for _ in range(timed)]
        else:
            all_steps = steps(num_seqs, prompt, WARMUP_DECODES + timed + 4)  # + the steps of chunked prompts
            decodes = [s for s in all_steps if len(s[1]) == num_seqs
                       and all(q.num_new_tokens == 1 for q, _ in s[1])]
            picked = decodes[WARMUP_DECODES:WARMUP_DECODES + timed]
        results[name] = [(t, [(q.num_new_tokens, q.num_computed_tokens, q.logits_rows, replica)
                              for q, replica in seqs])
                         for t, seqs in picked]
    engine.shutdown()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a hardware profile JSON (default: calibrate this machine first)")
    ap.add_argument("--json", help="write the results here (and the profile next to it)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every configuration, interleaved")
    ap.add_argument("--_run", help=argparse.SUPPRESS)  # internal: one configuration, prints RESULT json
    args = ap.parse_args(argv)
    if args._run:
        spec = json.loads(args._run)
        print("RESULT " + json.dumps(run_config(spec["model"], spec["config"])), flush=True)
        return 0

    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint
    from torch_shift.planner import ModelShape, Seq, get_profile, step_cost
    from torch_shift.planner.calibrate import calibrate, cpu_seconds, other_cores

    given = get_profile(args.profile) if args.profile else None
    if given:
        print(f"profile: {args.profile} ({given.source})")
    cache = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("L3 cache")), "unknown")
    rounds = []  # per round: its profile, the load of other processes, config -> scenario -> steps
    with tempfile.TemporaryDirectory(prefix="bench_planner_") as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "llama", tiny_llama_config(**MODEL))
        shape = ModelShape.from_pretrained(model_dir)
        print(f"model: random Llama {MODEL}, fp32, {shape.num_parameters() / 1e6:.1f}M parameters "
              f"({shape.num_parameters() * 4 / 1e6:.0f} MB); L3 cache {cache}")
        for round_ in range(args.rounds):  # a calibration, then every configuration
            hw = given or calibrate(world=2, threads=1)
            loads = [] if given else [hw.measurements["other_processes_cores"]]
            steps: dict[str, dict] = {}
            for name, config in CONFIGS.items():
                start = cpu_seconds()
                spec = json.dumps({"model": str(model_dir), "config": config})
                proc = subprocess.run([sys.executable, __file__, "--_run", spec], capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not lines:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"configuration {name} failed")
                steps[name] = json.loads(lines[-1][len("RESULT "):])
                loads.append(other_cores(start))
                print(f"round {round_ + 1}: ran {name} in {time.monotonic() - start[2]:.0f} s; other processes used "
                      f"{loads[-1]:.2f} cores meanwhile")
            rounds.append({"profile": hw, "other_processes_cores": max(loads), "steps": steps})

    quiet = min(range(len(rounds)), key=lambda i: rounds[i]["other_processes_cores"])
    hw = rounds[quiet]["profile"]
    print(f"\nthe quietest round: {quiet + 1} of {len(rounds)} (other processes used at most "
          f"{rounds[quiet]['other_processes_cores']:.2f} cores during it); its calibration predicts, its steps are "
          "the median; 'best' is the fastest step of all rounds")
    print(f"\n{'config':<8} {'scenario':<30} {'median':>9} {'best':>9} {'predicted':>10} {'err/med':>8} "
          f"{'err/best':>8}  predicted breakdown (ms)")
    rows = []
    for name, config in CONFIGS.items():
        layout = layout_for(config)
        for scenario, quiet_steps in rounds[quiet]["steps"][name].items():
            times = [t for t, _ in quiet_steps]
            best = min(t for r in rounds for t, _ in r["steps"][name][scenario])
            costs = [step_cost(shape, hw, layout, [Seq(*q[:3]) for q in seqs],
                               groups=[q[3] for q in seqs] if layout.kind == "dp" else None)
                     for _, seqs in quiet_steps]
            meas, pred = statistics.median(times), statistics.median(c.total_s for c in costs)
            example = costs[len(costs) // 2]
            parts = {"linear": sum(o.time_s for o in example.ops if o.name in ("qkv", "o_proj", "gate_up", "down")),
                     "attention": sum(o.time_s for o in example.ops if o.name.startswith("attention")),
                     "lm head": sum(o.time_s for o in example.ops if o.name in ("lm_head", "sampling")),
                     "other ops": sum(o.time_s for o in example.ops if o.name in ("elementwise", "embedding",
                                                                                   "final_norm")),
                     "comm": example.communication_s, "overhead": example.overhead_s}
            row = {"config": name, "layout": layout.name, "scenario": scenario, "measured_median_ms": 1e3 * meas,
                   "measured_best_ms": 1e3 * best, "predicted_ms": 1e3 * pred, "error_vs_median": pred / meas - 1,
                   "error_vs_best": pred / best - 1, "measured_ms": [1e3 * t for t in times],
                   "predicted_parts_ms": {k: 1e3 * v for k, v in parts.items()}}
            rows.append(row)
            print(f"{name:<8} {scenario:<30} {1e3 * meas:>7.1f}ms {1e3 * best:>7.1f}ms {1e3 * pred:>8.1f}ms "
                  f"{row['error_vs_median']:>+8.0%} {row['error_vs_best']:>+8.0%}  "
                  + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in parts.items()))
    for key in ("error_vs_median", "error_vs_best"):
        errors = [abs(r[key]) for r in rows]
        print(f"|{key}|: median {statistics.median(errors):.0%}, max {max(errors):.0%} over {len(rows)} rows")
    if args.json and not given:
        profile_path = Path(args.json).with_name(Path(args.json).stem + "_profile.json")
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        hw.save(profile_path)
        print(f"wrote {profile_path}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": MODEL, "parameters": shape.num_parameters(), "l3_cache": cache,
                                    "quietest_round": quiet + 1, "round_loads": [r["other_processes_cores"]
                                                                                 for r in rounds],
                                    "profile": hw.to_json(), "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
