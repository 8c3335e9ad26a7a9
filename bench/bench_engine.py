"""Benchmark torch_shift on this machine.

1. Offline throughput, torch_shift vs `transformers` `model.generate`, on a random Llama checkpoint,
   with request sizes sampled from a real trace (Azure LLM inference 2023, conversation service).
2. Engine overhead per step: the same engine with a model whose forward does no work, at N concurrent
   requests in steady-state decode, with a per-phase breakdown (and a cProfile when the target is missed).

    python bench/bench_engine.py --json bench/results/engine.json

Prompts are random token ids (no tokenizer); both engines decode greedily without stopping at EOS, so
every request produces exactly the number of tokens it asked for.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import gc
import json
import math
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from torch_shift.bench.traffic import DEFAULT_TRACE
from torch_shift.planner.calibrate import NullModel

# The throughput model: Llama architecture, fp32, random weights.
MODEL_CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408,
    vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)
# The overhead model's checkpoint only sizes the engine (its forward is replaced): keep the KV cache tiny.
TINY_CONFIG = dict(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, intermediate_size=32,
    vocab_size=256, max_position_embeddings=4096, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)

# The broadcast probe runs TP-2: two heads, so that each rank has one.
TINY2_CONFIG = {**TINY_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 2}


FINAL_ONLY = True  # engine.step(final_only=...) in the overhead runs; --all-outputs turns it off

# ------------------------------------------------------------------------------------------------ helpers
def log(msg: str = "") -> None:
    print(msg, flush=True)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class OtherLoad:
    """Average number of cores busy with other processes over an interval: all non-idle CPU time in
    /proc/stat minus this process's own CPU time (the load average would count this benchmark too)."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle and iowait
        t = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic()

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[2] <= self.start[2]:
            return None
        other = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(0.0, other / (end[2] - self.start[2]))


def fmt_cores(c: float | None) -> str:
    return "n/a" if c is None else f"{c:.2f} cores"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def build_checkpoint(out_dir: Path, config: dict, seed: int):
    import transformers

    cfg = transformers.LlamaConfig(**config)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(out_dir)
    return model


# ------------------------------------------------------------------------------------------------ workload
def load_requests(trace: Path, n: int, seed: int, max_prompt: int, max_output: int, context: int):
    """Sample n (prompt_len, output_len) rows of the trace and clip them.

    Rule: output = min(trace output, max_output); prompt = min(trace prompt, max_prompt); then, if
    prompt + output > context, prompt = context - output (the output is kept, the prompt shortened).
    """
    with open(trace, newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    picked = rng.sample(rows, n)
    if max_output >= context:
        raise SystemExit(f"--max-output {max_output} must be below the context {context}")
    reqs, stats = [], {"prompt_capped": 0, "output_capped": 0, "context_clipped": 0, "any_clipped": 0}
    for p, o in picked:
        p2, o2 = min(p, max_prompt), min(o, max_output)
        stats["prompt_capped"] += p2 < p
        stats["output_capped"] += o2 < o
        if p2 + o2 > context:
            p2 = context - o2
            stats["context_clipped"] += 1
        p2, o2 = max(p2, 1), max(o2, 1)
        stats["any_clipped"] += (p2, o2) != (p, o)
        reqs.append({"trace_prompt": p, "trace_output": o, "prompt_len": p2, "output_len": o2})
    tok_rng = random.Random(seed + 1)
    vocab = MODEL_CONFIG["vocab_size"]
    for r in reqs:  # random ids, avoiding the special ids 0..2 (pad, bos, eos)
        r["prompt"] = [tok_rng.randrange(3, vocab) for _ in range(r["prompt_len"])]
    return reqs, stats


def dist(values: list[int]) -> str:
    return (f"min {min(values)}, p50 {percentile(values, 0.5):.0f}, mean {statistics.mean(values):.1f}, "
            f"max {max(values)}")


# ------------------------------------------------------------------------------------------------ part 1
class TorchShiftRunner:
    """One LLM, built and warmed up once; each run generates every request at once."""

    def __init__(self, model_dir: Path, reqs: list[dict], context: int, warm_prompts: list[list[int]]):
        from torch_shift import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        bs = 16
        self.num_blocks = sum(math.ceil((r["prompt_len"] + r["output_len"]) / bs) for r in reqs) + 4 * len(reqs)
        self.max_num_seqs = len(reqs)
        t0 = time.perf_counter()
        self.llm = LLM(str(model_dir), dtype="float32", max_num_seqs=len(reqs), max_num_batched_tokens=2048,
                       num_kv_blocks=self.num_blocks, max_model_len=context)
        self.load_s = time.perf_counter() - t0
        # warm-up: a few short requests (prefill and decode paths), prompts unlike the measured ones
        self.llm.generate(warm_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
        gc.collect()  # as the processes torch_shift starts do (the engine no longer does it in the user's process)
        gc.freeze()

    def run(self, reqs: list[dict]):
        engine = self.llm.engine
        engine.block_manager.reset_prefix_cache()  # a repeated run must not hit the previous run's blocks
        steps0, hits0, pre0 = engine.num_steps, engine.block_manager.num_prefix_hits, engine.scheduler.num_preemptions
        params = [self.SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True) for r in reqs]
        t0 = time.perf_counter()
        outs = self.llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        for r, t in zip(reqs, tokens):
            assert len(t) == r["output_len"], (len(t), r["output_len"])
        info = {"steps": engine.num_steps - steps0, "prefix_cache_hit_tokens": engine.block_manager.num_prefix_hits - hits0,
                "preemptions": engine.scheduler.num_preemptions - pre0}
        return elapsed, tokens, info


def hf_generate_batch(model, batch: list[dict]):
    """Left-padded batch, greedy, run to the batch's longest requested output."""
    from transformers import GenerationConfig

    width = max(r["prompt_len"] for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r["prompt_len"]:] = torch.tensor(r["prompt"])
        mask[i, width - r["prompt_len"]:] = 1
    new = max(r["output_len"] for r in batch)
    gc = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                          eos_token_id=None, bos_token_id=None)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    gen = out[:, width:]
    assert gen.shape[1] == new, gen.shape
    return [gen[i, : r["output_len"]].tolist() for i, r in enumerate(batch)], width * len(batch), new * len(batch)


def run_hf(model, reqs: list[dict], batch_size: int, sort: bool):
    order = list(range(len(reqs)))
    if sort:  # give HF its best case: similar lengths share a batch, so little padding
        order.sort(key=lambda i: (reqs[i]["output_len"], reqs[i]["prompt_len"]))
    tokens: list[list[int] | None] = [None] * len(reqs)
    padded_in = padded_out = 0
    t0 = time.perf_counter()
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        toks, pin, pout = hf_generate_batch(model, [reqs[i] for i in idx])
        padded_in += pin
        padded_out += pout
        for i, t in zip(idx, toks):
            tokens[i] = t
    elapsed = time.perf_counter() - t0
    return elapsed, tokens, {"padded_input_tokens": padded_in, "generated_tokens_incl_padding": padded_out}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = sum(x[0] == y[0] for x, y in zip(a, b))
    full = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < len(x) and x[k] == y[k]:
            k += 1
        prefix.append(k / len(x))
    return {"first_token": first, "full_sequence": full, "n": len(a), "mean_matching_prefix": statistics.mean(prefix)}


def throughput_part(args, workdir: Path) -> dict:
    log("=" * 100)
    log("1. Offline throughput: torch_shift LLM.generate vs transformers model.generate")
    log("=" * 100)
    context = min(args.context, MODEL_CONFIG["max_position_embeddings"])
    reqs, clip = load_requests(Path(args.trace), args.num_requests, args.seed, args.max_prompt, args.max_output,
                               context)
    model_dir = workdir / "llama-random"
    t0 = time.perf_counter()
    hf_model = build_checkpoint(model_dir, MODEL_CONFIG, args.seed)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in hf_model.parameters())
    n_embed = hf_model.model.embed_tokens.weight.numel() + hf_model.lm_head.weight.numel()
    log(f"model: random LlamaForCausalLM fp32, hidden {MODEL_CONFIG['hidden_size']}, "
        f"{MODEL_CONFIG['num_hidden_layers']} layers, {MODEL_CONFIG['num_attention_heads']} heads / "
        f"{MODEL_CONFIG['num_key_value_heads']} KV heads, intermediate {MODEL_CONFIG['intermediate_size']}, "
        f"vocab {MODEL_CONFIG['vocab_size']}, max_position_embeddings {MODEL_CONFIG['max_position_embeddings']}")
    log(f"       {n_params / 1e6:.1f}M parameters ({(n_params - n_embed) / 1e6:.1f}M without the input embedding "
        f"and the untied LM head), built and saved in {build_s:.1f}s")
    log(f"trace: {args.trace}")
    log(f"workload: {len(reqs)} requests sampled with seed {args.seed}; context used {context} tokens")
    log(f"  clipping: output = min(output, --max-output={args.max_output}); prompt = min(prompt, "
        f"--max-prompt={args.max_prompt}); if prompt + output > {context}: prompt = {context} - output")
    log(f"  clipped: {clip['any_clipped']}/{len(reqs)} requests (prompt capped {clip['prompt_capped']}, output "
        f"capped {clip['output_capped']}, shortened to fit the context {clip['context_clipped']})")
    log(f"  trace prompt lengths:   {dist([r['trace_prompt'] for r in reqs])}")
    log(f"  trace output lengths:   {dist([r['trace_output'] for r in reqs])}")
    log(f"  used prompt lengths:    {dist([r['prompt_len'] for r in reqs])}")
    log(f"  used output lengths:    {dist([r['output_len'] for r in reqs])}")
    n_in = sum(r["prompt_len"] for r in reqs)
    n_out = sum(r["output_len"] for r in reqs)
    log(f"  totals: {n_in} input tokens, {n_out} output tokens")
    log(f"threads: torch.set_num_threads({torch.get_num_threads()}) for both; load average before: {loadavg()}")

    warm_rng = random.Random(args.seed + 2)
    warm_prompts = [[warm_rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(32)] for _ in range(4)]

    results: dict = {"model": {"config": MODEL_CONFIG, "params": n_params, "params_non_embedding": n_params - n_embed},
                     "workload": {"num_requests": len(reqs), "seed": args.seed, "trace": str(args.trace),
                                  "context": context, "max_prompt": args.max_prompt, "max_output": args.max_output,
                                  "clipping": clip, "input_tokens": n_in, "output_tokens": n_out,
                                  "requests": [{k: r[k] for k in ("trace_prompt", "trace_output", "prompt_len",
                                                                  "output_len")} for r in reqs]},
                     "threads": torch.get_num_threads(), "loadavg_before": loadavg()}

    log("\n[torch_shift] loading and warming up ...")
    ts_runner = TorchShiftRunner(model_dir, reqs, context, warm_prompts)
    results["torch_shift_setup"] = {"load_s": ts_runner.load_s, "num_kv_blocks": ts_runner.num_blocks,
                                    "max_num_seqs": ts_runner.max_num_seqs, "max_num_batched_tokens": 2048}
    hf_model.generation_config.eos_token_id = None
    log("[transformers] warming up ...")
    for bs in (1, 4):
        hf_generate_batch(hf_model, [{"prompt": p, "prompt_len": len(p), "output_len": 8} for p in warm_prompts[:bs]])

    # Rounds alternate the engines, so that a change in machine load hits both; best of the rounds is kept.
    runs: dict[str, list[dict]] = {"torch_shift": [], **{f"hf_bs{bs}": [] for bs in args.hf_batch_sizes}}
    ts_tokens = None
    other_cores: list[float | None] = []
    for rnd in range(args.rounds):
        log(f"\nround {rnd + 1}/{args.rounds}")
        mon = OtherLoad()
        el, ts_tokens, info = ts_runner.run(reqs)
        runs["torch_shift"].append({"elapsed_s": el, **info})
        log(f"  torch_shift, all {len(reqs)} at once: {el:.2f}s, {info['steps']} engine steps, preemptions "
            f"{info['preemptions']}, prefix-cache hit tokens {info['prefix_cache_hit_tokens']}")
        for bs in args.hf_batch_sizes:
            el, hf_tokens, hf_info = run_hf(hf_model, reqs, bs, sort=not args.hf_no_sort)
            runs[f"hf_bs{bs}"].append({"elapsed_s": el, **hf_info,
                                       "agreement_with_torch_shift": agreement(ts_tokens, hf_tokens)})
            log(f"  HF generate, batch {bs}: {el:.2f}s; padded input tokens {hf_info['padded_input_tokens']} "
                f"(useful {n_in}), tokens generated incl. padding {hf_info['generated_tokens_incl_padding']} "
                f"(useful {n_out})")
        other_cores.append(mon.cores())
        log(f"  CPU used by other processes during this round: {fmt_cores(other_cores[-1])}")
    results["loadavg_after"] = loadavg()
    results["other_processes_cores_per_round"] = other_cores
    busiest = max((c for c in other_cores if c is not None), default=0.0)

    def summary(rs: list[dict]) -> dict:
        best = min(r["elapsed_s"] for r in rs)
        return {"rounds": rs, "best_elapsed_s": best, "output_tok_s": n_out / best, "total_tok_s": (n_in + n_out) / best}

    ts = results["torch_shift"] = summary(runs["torch_shift"])
    hf_runs = {bs: summary(runs[f"hf_bs{bs}"]) for bs in args.hf_batch_sizes}
    results["hf"] = {str(k): v for k, v in hf_runs.items()}
    best_bs = max(hf_runs, key=lambda b: hf_runs[b]["output_tok_s"])
    results["hf_best_batch_size"] = best_bs
    log("")
    log(f"best of {args.rounds} round(s), torch threads {torch.get_num_threads()}:")
    log(f"{'engine':<30}{'time s':>9}{'output tok/s':>15}{'total tok/s':>14}{'torch_shift / this':>20}")
    log(f"{'torch_shift (all at once)':<30}{ts['best_elapsed_s']:>9.2f}{ts['output_tok_s']:>15.1f}"
        f"{ts['total_tok_s']:>14.1f}{'1.00x':>20}")
    for bs, r in hf_runs.items():
        label = f"HF generate, batch {bs}" + (" (best HF)" if bs == best_bs else "")
        log(f"{label:<30}{r['best_elapsed_s']:>9.2f}{r['output_tok_s']:>15.1f}{r['total_tok_s']:>14.1f}"
            f"{ts['output_tok_s'] / r['output_tok_s']:>19.2f}x")
    best = hf_runs[best_bs]
    results["ratio_output_tok_s_vs_best_hf"] = ts["output_tok_s"] / best["output_tok_s"]
    results["ratio_total_tok_s_vs_best_hf"] = ts["total_tok_s"] / best["total_tok_s"]
    per_round = [h["elapsed_s"] / t["elapsed_s"]
                 for t, h in zip(runs["torch_shift"], runs[f"hf_bs{best_bs}"])]
    results["ratio_per_round_vs_best_hf"] = per_round
    log(f"torch_shift / HF batch {best_bs}: output tok/s {results['ratio_output_tok_s_vs_best_hf']:.2f}x, total tok/s "
        f"{results['ratio_total_tok_s_vs_best_hf']:.2f}x (same-round ratios: "
        f"{', '.join(f'{x:.2f}x' for x in per_round)})")
    log("HF batching: requests sorted by (output length, prompt length)" if not args.hf_no_sort else
        "HF batching: requests in sampled order")
    log("  then cut into consecutive batches; each batch is left-padded (attention mask), decoded greedily with "
        "min_new_tokens = max_new_tokens = the batch's longest output, and only the tokens each request asked "
        "for are counted.")
    if 1 not in args.hf_batch_sizes:
        log("HF batch size 1 is not run by default (about 64 x max-output single-sequence decode steps per round); add it "
            "with --hf-batch-sizes 1,16,64")
    for bs, r in hf_runs.items():
        a = r["rounds"][-1]["agreement_with_torch_shift"]
        log(f"greedy agreement torch_shift vs HF batch {bs} (sanity check, last round): first token "
            f"{a['first_token']}/{a['n']}, whole sequence {a['full_sequence']}/{a['n']}, mean matching prefix "
            f"{a['mean_matching_prefix']:.0%}")
    if busiest > 0.1:
        log(f"NOTE: other processes used up to {busiest:.2f} of the {os.cpu_count()} cores during a round, so single "
            "rounds are noisy; compare the best-of-rounds times, and rerun on an idle machine for firm numbers.")
    return results


# ------------------------------------------------------------------------------------------------ part 2
class _TimedModel:
    """Stands in for runner.model: times the model's step."""

    def __init__(self, model, acc):
        self._model, self._acc = model, acc

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward_step(self, *a):
        t = time.perf_counter()
        r = self._model.forward_step(*a)
        self._acc["model"] += time.perf_counter() - t
        return r


class _TimedSampler:
    def __init__(self, sampler, acc):
        self._s, self._acc = sampler, acc

    def __call__(self, *a):
        t = time.perf_counter()
        r = self._s(*a)
        self._acc["sampler"] += time.perf_counter() - t
        return r


def _timed(fn, acc, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        acc[key] += time.perf_counter() - t
        return r
    return wrapper


PHASES = ["schedule", "prepare", "model", "execute_other", "sample", "update", "outputs"]
PHASE_DOC = {
    "schedule": "Scheduler.schedule",
    "prepare": "InputBatch.prepare (persistent batch -> tensors)",
    "model": "null model forward_step",
    "execute_other": "rest of the executor (plan build and deltas, InputBatch.apply, inference_mode, attention build)",
    "sample": "OutputProcessor.sample (incl. Sampler: argmax, .tolist())",
    "update": "Scheduler.update_from_output",
    "outputs": "rest of LLMEngine.step: detokenization, make_outputs, bookkeeping",
}


def make_overhead_engine(tiny_dir: Path, n: int, prompt_len: int, decode_steps: int, seed: int):
    from torch_shift import LLM, SamplingParams

    bs = 16
    # requests admitted first decode while later ones are still prefilling, and their decodes take a token
    # each of the step's budget: the budget leaves room for two prompts beside n decodes, and the first
    # requests' outputs for every prefill step
    budget = max(2048, 2 * n + prompt_len)
    max_tokens = math.ceil(n * prompt_len / (budget - n)) + 2 + decode_steps
    num_blocks = n * (math.ceil((prompt_len + max_tokens + 1) / bs) + 1)
    llm = LLM(str(tiny_dir), dtype="float32", max_num_seqs=n, max_num_batched_tokens=budget,
              num_kv_blocks=num_blocks)
    # what the processes torch_shift starts (`torch-shift serve`, the ranks) do once the engine is built; the
    # engine itself no longer does it, since an offline LLM lives in the user's process
    gc.collect()
    gc.freeze()
    engine = llm.engine
    engine.runner.model = NullModel(TINY_CONFIG["vocab_size"], budget, engine.runner.model)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(prompt_len)], params)
    # prefill until every request is in decode
    while not (len(engine.scheduler.running) == n and all(r.num_output_tokens >= 1 for r in engine.scheduler.running)):
        engine.step()
    return engine, num_blocks


def overhead_run(tiny_dir: Path, n: int, prompt_len: int, warmup: int, steps: int, seed: int, mode: str):
    """One fresh engine: prefill, warm up, then time `steps` decode steps.
    mode: 'clean' (step times only), 'gc_off' (the same with the cyclic GC disabled while timing),
    'gc_freeze' (gc.collect(); gc.freeze() after the warm-up),
    'phases' (wrapped phases), 'profile' (cProfile)."""
    engine, num_blocks = make_overhead_engine(tiny_dir, n, prompt_len, warmup + steps + 8, seed)
    for _ in range(warmup):
        engine.step()
    acc = dict.fromkeys(PHASES + ["sampler", "make_output", "execute"], 0.0)
    if mode == "phases":
        sched, runner, core, outputs = engine.scheduler, engine.runner, engine.core, engine.output_processor
        sched.schedule = _timed(sched.schedule, acc, "schedule")
        sched.update_from_output = _timed(sched.update_from_output, acc, "update")
        runner.batch.prepare = _timed(runner.batch.prepare, acc, "prepare")
        core.executor = _timed(core.executor, acc, "execute")
        runner.model = _TimedModel(runner.model, acc)
        core.sample = _timed(core.sample, acc, "sample")
        outputs.sampler = _TimedSampler(outputs.sampler, acc)
        outputs.make_outputs = _timed(outputs.make_outputs, acc, "make_output")
    times, cpu_times = [], []
    profiler = cProfile.Profile() if mode == "profile" else None
    ctx_start = engine.scheduler.running[0].num_tokens
    gc0 = [g["collections"] for g in gc.get_stats()]
    if mode == "gc_off":
        gc.disable()
    elif mode == "gc_freeze":  # what LLMEngine could do once built: exempt startup objects from collections
        gc.collect()
        gc.freeze()
    for _ in range(steps):
        if profiler:
            profiler.enable()
        c = time.thread_time()
        t = time.perf_counter()
        outs = engine.step(final_only=FINAL_ONLY)
        times.append(time.perf_counter() - t)
        cpu_times.append(time.thread_time() - c)
        if profiler:
            profiler.disable()
        assert len(outs) == (0 if FINAL_ONLY else n), (len(outs), n)  # nobody finished: steady state
    gc.enable()
    gc.unfreeze()
    gc1 = [g["collections"] for g in gc.get_stats()]
    res = {"times": times, "cpu_times": cpu_times, "num_kv_blocks": num_blocks,
           "context_range": [ctx_start, engine.scheduler.running[0].num_tokens],
           "gc_collections_per_step": [(b - a) / steps for a, b in zip(gc0, gc1)]}
    if mode == "phases":
        total = sum(times)
        phases = dict(acc)
        phases["execute_other"] = acc["execute"] - acc["prepare"] - acc["model"]
        phases["outputs"] = total - acc["schedule"] - acc["execute"] - acc["sample"] - acc["update"]
        res["phases_ms"] = {k: 1e3 * phases[k] / steps for k in PHASES + ["sampler", "make_output"]}
        res["phase_total_ms"] = 1e3 * total / steps
    if profiler:
        res["profile"] = profile_table(profiler, steps)
    return res


def python_opcodes_per_step(tiny_dir: Path, n: int, prompt_len: int, warmup: int, steps: int, seed: int) -> float:
    """The Python bytecodes one decode step executes (sys.settrace's opcode events): a count that machine load
    does not move, for comparing two commits' step cost where wall times on a shared machine differ by 10-25%
    from run to run. Work in C (torch, numpy, builtins) is not counted."""
    engine, _ = make_overhead_engine(tiny_dir, n, prompt_len, warmup + steps + 8, seed)
    for _ in range(warmup):
        engine.step(final_only=FINAL_ONLY)
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(steps):
            engine.step(final_only=FINAL_ONLY)
    finally:
        sys.settrace(None)
    return count / steps


def step_stats(times: list[float]) -> dict:
    return {"steps": len(times), "mean_ms": 1e3 * statistics.mean(times), "p50_ms": 1e3 * percentile(times, 0.5),
            "p90_ms": 1e3 * percentile(times, 0.9), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}


def timed_config(args, tiny_dir: Path, n: int, plen: int, variants: dict | None = None) -> dict:
    """Repeated clean runs (pooled) and one run with phase timers. `variants` (name -> (mode, threads)) are
    what-if runs interleaved with the clean ones, repeat by repeat, so that drifts in machine speed hit all."""
    variants = variants or {}
    names = ["clean", *variants]
    pooled = {k: {"times": [], "cpu_times": [], "per_run": []} for k in names}
    default_threads = torch.get_num_threads()
    for r in range(args.overhead_repeats):
        for name in names:
            mode, threads = variants.get(name, ("clean", default_threads))
            torch.set_num_threads(threads)
            run = overhead_run(tiny_dir, n, plen, args.overhead_warmup, args.overhead_steps, args.seed + r, mode)
            torch.set_num_threads(default_threads)
            acc = pooled[name]
            acc["times"] += run["times"]
            acc["cpu_times"] += run["cpu_times"]
            acc["per_run"].append(1e3 * statistics.mean(run["times"]))
            if name == "clean":
                last_clean = run
    phases = overhead_run(tiny_dir, n, plen, args.overhead_warmup, args.overhead_steps, args.seed, "phases")
    clean = pooled["clean"]
    res = {"n": n, "prompt_len": plen, "threads": default_threads, "repeats": args.overhead_repeats,
           "warmup": args.overhead_warmup, "num_kv_blocks": last_clean["num_kv_blocks"],
           "context_range": last_clean["context_range"], **step_stats(clean["times"]),
           "mean_ms_per_run": clean["per_run"],
           "cpu_mean_ms": 1e3 * statistics.mean(clean["cpu_times"]),
           "cpu_p50_ms": 1e3 * percentile(clean["cpu_times"], 0.5),
           "gc_collections_per_step": last_clean["gc_collections_per_step"],
           "phases_ms": phases["phases_ms"], "phase_run_mean_ms": phases["phase_total_ms"], "variants": {}}
    for name in variants:
        v = pooled[name]
        res["variants"][name] = {"mode": variants[name][0], "threads": variants[name][1], **step_stats(v["times"]),
                                 "mean_ms_per_run": v["per_run"]}
    return res


def profile_table(profiler: cProfile.Profile, steps: int, top: int = 18) -> dict:
    st = pstats.Stats(profiler)
    total = st.total_tt
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        short = file
        for marker in ("torch_shift/", "site-packages/", "lib/python3.11/"):
            if marker in file:
                short = marker.rstrip("/").split("/")[-1] + "/" + file.split(marker, 1)[1] if marker == "torch_shift/" \
                    else file.split(marker, 1)[1]
                break
        rows.append({"where": f"{short}:{line}({func})" if line else func, "calls_per_step": nc / steps,
                     "tottime_us_per_step": 1e6 * tt / steps, "cumtime_us_per_step": 1e6 * ct / steps,
                     "tottime_share": tt / total if total else 0.0})
    by_tot = sorted(rows, key=lambda r: -r["tottime_us_per_step"])[:top]
    engine_rows = [r for r in rows if r["where"].startswith("torch_shift/")]
    by_cum = sorted(engine_rows, key=lambda r: -r["cumtime_us_per_step"])[:top]
    return {"profiled_us_per_step": 1e6 * total / steps, "top_tottime": by_tot, "top_cumtime_torch_shift": by_cum}


def print_profile(prof: dict) -> None:
    log(f"  cProfile (profiled time {prof['profiled_us_per_step'] / 1e3:.2f} ms/step, inflated by the profiler)")
    log("  top functions by own time:")
    log(f"    {'own us/step':>11} {'share':>6} {'calls/step':>10}  function")
    for r in prof["top_tottime"]:
        log(f"    {r['tottime_us_per_step']:>11.1f} {r['tottime_share']:>6.1%} {r['calls_per_step']:>10.1f}  {r['where']}")
    log("  torch_shift functions by cumulative time:")
    log(f"    {'cum us/step':>11} {'calls/step':>10}  function")
    for r in prof["top_cumtime_torch_shift"]:
        log(f"    {r['cumtime_us_per_step']:>11.1f} {r['calls_per_step']:>10.1f}  {r['where']}")


def overhead_part(args, workdir: Path) -> dict:
    log("")
    log("=" * 100)
    log("2. Engine overhead per step (null model, steady-state decode, "
        + ("every request's output built each step)" if not FINAL_ONLY else "outputs of finished requests only, as LLM.generate)"))
    log("=" * 100)
    tiny_dir = workdir / "tiny"
    build_checkpoint(tiny_dir, TINY_CONFIG, args.seed)
    main_threads = torch.get_num_threads()
    torch.set_num_threads(args.overhead_threads)
    log("engine built on a tiny Llama checkpoint (KV cache: 1 layer, 1 KV head, head_dim 16); runner.model "
        "replaced by a module whose forward returns zeros [T, 8] and compute_logits a fixed zeros "
        f"[rows, {TINY_CONFIG['vocab_size']}] (no attention, no KV write); greedy, ignore_eos, max_tokens beyond "
        "the measured steps, so every request decodes in every timed step")
    log(f"per configuration: {args.overhead_repeats} x ({args.overhead_warmup} warm-up + {args.overhead_steps} timed "
        f"engine.step() calls) on fresh engines, steps pooled; then one more run with phase timers; "
        f"torch threads {args.overhead_threads}; load average before: {loadavg()}")
    configs = [(n, plen) for n in args.overhead_requests
               for plen in (args.overhead_prompt_len, args.overhead_long_prompt) if plen]
    results = {"target_ms": args.target_ms, "threads": args.overhead_threads, "runs": []}
    mon = OtherLoad()
    n_max = args.target_requests
    variants = {"gc_freeze": ("gc_freeze", args.overhead_threads), "gc_off": ("gc_off", args.overhead_threads)}
    if main_threads != args.overhead_threads:
        variants[f"threads_{main_threads}"] = ("clean", main_threads)
    variant_doc = {"gc_freeze": "what-if: gc.collect(); gc.freeze() after warm-up",
                   "gc_off": "what-if: cyclic GC disabled while timing",
                   f"threads_{main_threads}": f"torch threads {main_threads} (as in part 1)"}
    for n, plen in configs:
        is_main = n == n_max and plen == args.overhead_prompt_len
        run = timed_config(args, tiny_dir, n, plen, variants if is_main else None)
        log("")
        log(f"-- {n} running requests, prompt {plen} tokens; contexts {run['context_range'][0]}..."
            f"{run['context_range'][1]} tokens over a timed run; threads {run['threads']}")
        log(f"   per step: mean {run['mean_ms']:.3f} ms, p50 {run['p50_ms']:.3f} ms, p90 {run['p90_ms']:.3f} ms, "
            f"min {run['min_ms']:.3f} ms, max {run['max_ms']:.3f} ms  (run means "
            f"{', '.join(f'{m:.3f}' for m in run['mean_ms_per_run'])} ms; CPU time of the thread: mean "
            f"{run['cpu_mean_ms']:.3f} ms)")
        log(f"   GC collections/step (gen0, gen1, gen2): "
            f"{', '.join(f'{g:.3f}' for g in run['gc_collections_per_step'])}")
        for name, v in run["variants"].items():
            log(f"   {variant_doc[name]:<48}: mean {v['mean_ms']:.3f} ms, p50 {v['p50_ms']:.3f} ms, max "
                f"{v['max_ms']:.3f} ms (run means {', '.join(f'{m:.3f}' for m in v['mean_ms_per_run'])})")
        run["python_opcodes_per_step"] = python_opcodes_per_step(tiny_dir, n, plen, args.overhead_warmup, 20,
                                                                 args.seed)
        log(f"   Python bytecodes per step (deterministic, C work not counted): {run['python_opcodes_per_step']:,.0f}")
        log(f"   breakdown (separate run with timers around each phase, mean {run['phase_run_mean_ms']:.3f} ms/step):")
        for k in PHASES:
            v = run["phases_ms"][k]
            log(f"     {k:<14}{v:>8.3f} ms {v / run['phase_run_mean_ms']:>6.1%}  {PHASE_DOC[k]}")
        log(f"     (of which Sampler.__call__ {run['phases_ms']['sampler']:.3f} ms, LLMEngine._make_output "
            f"{run['phases_ms']['make_output']:.3f} ms)")
        results["runs"].append(run)

    main = max((r for r in results["runs"] if r["n"] == n_max), key=lambda r: r["mean_ms"])  # the worse context
    full = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - full
    results["full_gc_collect_ms"] = 1e3 * full
    results["gc_tracked_objects"] = len(gc.get_objects())
    log("")
    log(f"GC: one full gc.collect() in this process takes {1e3 * full:.0f} ms over {results['gc_tracked_objects']} "
        f"tracked objects (torch + transformers loaded); every generation-2 collection during stepping costs that.")
    met_mean, met_p50 = main["mean_ms"] < args.target_ms, main["p50_ms"] < args.target_ms
    results["target_met_mean"], results["target_met_p50"] = met_mean, met_p50
    log("")
    verdict = "MET" if met_mean and met_p50 else ("MET by p50 only" if met_p50 else "NOT MET")
    log(f"target: < {args.target_ms} ms per step at {n_max} requests: {verdict} "
        f"(wall mean {main['mean_ms']:.3f} ms, p50 {main['p50_ms']:.3f} ms; CPU mean {main['cpu_mean_ms']:.3f} ms, "
        f"p50 {main['cpu_p50_ms']:.3f} ms; threads {main['threads']})")
    if not (met_mean and met_p50) or args.profile:
        log(f"cProfile of {n_max} requests, prompt {args.overhead_prompt_len}, {args.overhead_steps} steps:")
        prof = overhead_run(tiny_dir, n_max, args.overhead_prompt_len, args.overhead_warmup,
                            args.overhead_steps, args.seed, "profile")
        results["profile"] = prof["profile"]
        print_profile(prof["profile"])
    torch.set_num_threads(main_threads)
    results["other_processes_cores"] = mon.cores()
    log(f"CPU used by other processes during part 2: {fmt_cores(results['other_processes_cores'])}")
    return results


# ------------------------------------------------------------------------------------------------ part 3
def _broadcast_rank(rank: int, world: int, tiny_dir: Path, n: int, prompt_len: int, steps: int, seed: int):
    """World 2 (TP-2) with the null model on both ranks: the pickled size of every step message rank 0
    broadcasts (what broadcast_object_list sends), over steady-state decode steps."""
    import pickle

    from torch_shift import LLM, SamplingParams

    torch.set_num_threads(1)
    bs = 16
    max_tokens = 2 * math.ceil(n * prompt_len / max(2048, n)) + steps + 16  # nobody finishes before the timed steps
    llm = LLM(str(tiny_dir), tp=2, dtype="float32", num_scheduler_steps=1, max_num_seqs=n,
              max_num_batched_tokens=max(2048, n),
              num_kv_blocks=n * (math.ceil((prompt_len + max_tokens + 1) / bs) + 1), max_model_len=prompt_len + max_tokens + 8)
    engine = llm.engine
    engine.runner.model = NullModel(TINY2_CONFIG["vocab_size"], max(2048, n), engine.runner.model)
    if rank != 0:
        engine.follow()
        return None
    sizes: list[int] = []
    send = engine.parallel.broadcast

    def recording(message=None):
        sizes.append(len(pickle.dumps(message)))
        return send(message)

    engine.parallel.broadcast = recording
    full_sizes: list[int] = []  # what a full plan (every token id and block table, as before deltas) would pickle to
    build = engine.core.plan_builder.build

    def build_recording(output):
        full = [(e.request_id, e.token_ids, e.num_computed_tokens, list(e.block_table), e.sample, e.prompt_logprobs)
                for e in output.scheduled]
        full_sizes.append(len(pickle.dumps(("step", full))))
        return build(output)

    engine.core.plan_builder.build = build_recording
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(3, TINY2_CONFIG["vocab_size"]) for _ in range(prompt_len)], params)
    while not all(r.num_output_tokens >= 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    first_decode = len(sizes)
    for _ in range(steps):
        engine.step(final_only=True)
        assert len(engine.scheduler.running) == n
    decode = sizes[first_decode:]
    send(("result", None))
    return {"n": n, "prompt_len": prompt_len, "steps": len(decode), "mean_bytes": statistics.mean(decode),
            "max_bytes": max(decode), "prefill_bytes": sum(sizes[:first_decode]),
            "full_plan_mean_bytes": statistics.mean(full_sizes[first_decode:])}


def broadcast_part(args, workdir: Path) -> dict:
    from torch_shift.parallel.launch import run_ranks

    log("")
    log("=" * 100)
    log("3. Step-plan broadcast per decode step at world 2 (TP-2, null model): pickled bytes of each message")
    log("=" * 100)
    tiny_dir = workdir / "tiny2"
    build_checkpoint(tiny_dir, TINY2_CONFIG, args.seed)
    rows = []
    for n in args.overhead_requests:
        for plen in (args.overhead_prompt_len, args.overhead_long_prompt or 1024):
            result = run_ranks(_broadcast_rank, 2, tiny_dir, n, plen, 50, args.seed, timeout_s=600)[0]
            rows.append(result)
            log(f"  {n:>5} requests, prompts of {plen:>5} tokens: decode step {result['mean_bytes']:>9.0f} bytes on "
                f"average ({result['mean_bytes'] / n:6.1f} per request), max {result['max_bytes']} (a full plan: "
                f"{result['full_plan_mean_bytes']:.0f}); the prompts' admission sent {result['prefill_bytes']} bytes once")
    return {"runs": rows}


# ------------------------------------------------------------------------------------------------ main
def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="CSV with arrived_at,num_prefill_tokens,num_decode_tokens")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt", type=int, default=192, help="cap on prompt lengths (default 192)")
    ap.add_argument("--max-output", type=int, default=48, help="cap on output lengths (default 48)")
    ap.add_argument("--context", type=int, default=2048, help="model context used for clipping (<= 2048)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: all cores)")
    ap.add_argument("--hf-batch-sizes", type=int_list, default=[16, 64],
                    help="comma-separated HF generate batch sizes to try (default 16,64; add 1 if time allows)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds (torch_shift, then each HF batch size); the best time of each is kept")
    ap.add_argument("--hf-no-sort", action="store_true", help="batch HF requests in sampled order, not by length")
    ap.add_argument("--overhead-requests", type=int_list, default=[32, 256, 1024])
    ap.add_argument("--overhead-prompt-len", type=int, default=16)
    ap.add_argument("--overhead-long-prompt", type=int, default=1024,
                    help="also measure every request count at this prompt length (0: skip)")
    ap.add_argument("--overhead-threads", type=int, default=1,
                    help="torch threads for the overhead runs (default 1: the engine's per-step work is serial "
                         "Python and tiny ops; with more threads on a busy machine, each OpenMP region in a "
                         "tiny op can stall for a scheduler time slice). The largest run is repeated with "
                         "--threads for comparison.")
    ap.add_argument("--overhead-repeats", type=int, default=3,
                    help="timed runs per configuration, each on a fresh engine; steps are pooled")
    ap.add_argument("--overhead-warmup", type=int, default=30)
    ap.add_argument("--overhead-steps", type=int, default=400)
    ap.add_argument("--target-ms", type=float, default=1.0)
    ap.add_argument("--target-requests", type=int, default=256,
                    help="the target applies at this many running requests, short and long contexts")
    ap.add_argument("--all-outputs", action="store_true",
                    help="overhead: build every request's output each step (streaming) instead of only the "
                         "finished ones (what LLM.generate asks for)")
    ap.add_argument("--profile", action="store_true", help="cProfile the overhead run even when the target is met")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-broadcast", action="store_true")
    ap.add_argument("--json", help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    global FINAL_ONLY
    FINAL_ONLY = not args.all_outputs

    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except ImportError:
        pass

    start = time.perf_counter()
    log(f"bench_engine: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"threads {torch.get_num_threads()}, load average {loadavg()}")
    log(f"command: {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    out: dict = {"argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                 "loadavg_start": loadavg()}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        workdir = Path(tmp)
        if not args.skip_throughput:
            out["throughput"] = throughput_part(args, workdir)
        if not args.skip_overhead:
            out["overhead"] = overhead_part(args, workdir)
        if not args.skip_broadcast:
            out["broadcast"] = broadcast_part(args, workdir)
    out["wall_s"] = time.perf_counter() - start
    log(f"\ntotal wall time {out['wall_s']:.1f}s")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
