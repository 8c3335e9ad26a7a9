"""torch_shift on one GPU, against the GPU's own limits and against transformers (not a test).

A random Llama of 1.1B parameters in bf16 (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64, MLP 8192,
vocab 32000). Measured in one run, with the GPU's HBM bandwidth (a device copy) and bf16 GEMM rate:
- decode TPOT at batch 1, 8 and 64 against the bytes a step must read (weights + KV) / bandwidth;
- the prefill of one 2,048-token prompt against the GEMM rate (MFU);
- offline throughput (256 requests of 128-512 prompt tokens, 128 new tokens each) against
  `transformers.generate` at its best batch size;
for each engine configuration given (the engine's default: Triton attention, compiled, with CUDA graphs, scheduled
asynchronously; the same scheduled synchronously; every prompt through the paged kernel; every linear through
cuBLAS; Triton with graphs, not compiled; Triton eager; SDPA eager). With --profile, where a decode step's and the
prefill's time goes (wall against GPU time, the kernels, the Python functions, and, timed without the profiler, how
much of a decode step the host spends waiting for the GPU); with --planner, the planner
calibrated on this GPU (`torch-shift calibrate --device cuda`) against the first configuration's steps.

    python bench/bench_gpu.py --configs default,synchronous --hf-batches 256 [--profile 1,64] [--planner]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
             dtype="bfloat16")
CONFIGS = {
    "default": {},  # Triton attention, compiled, CUDA graphs, asynchronous scheduling
    "synchronous": {"async_scheduling": False},  # the default, each step scheduled after the last one's tokens
    "paged prompts": {"sdpa_prompt_tokens": None},  # every prompt through the paged kernel, none through SDPA
    "cublas linears": {"triton_linears": False},  # the default with every linear through cuBLAS, no Triton tile
    # the default with RoPE as inductor compiles it and every token's K/V written by a kernel before the attention
    "kernels apart": {"triton_rotary": False, "decode_writes_kv": False},
    "triton+graphs": {"attention_backend": "triton", "cuda_graphs": True, "compile": False},
    "triton eager": {"attention_backend": "triton", "cuda_graphs": False, "compile": False},
    "sdpa eager": {"attention_backend": "sdpa", "cuda_graphs": False, "compile": False},
}
DECODE_BATCHES = (1, 8, 64)
DECODE_PROMPT, DECODE_STEPS = 128, 64
PREFILL_TOKENS = 2048
OFFLINE_REQUESTS, OFFLINE_NEW = 256, 128
HF_BATCHES = (64, 128, 256)


def log(message: str) -> None:
    print(f"[bench_gpu] {message}", file=sys.stderr, flush=True)


def cuda_seconds(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def machine_limits() -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_s = cuda_seconds(lambda: y.copy_(x), 20)
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                                dtype=torch.bfloat16)
    gemm_s = cuda_seconds(lambda: a @ b, 10)
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "hbm_bytes_per_s": 2 * (1 << 30) / copy_s, "bf16_flop_per_s": 2 * n ** 3 / gemm_s}


def model_numbers(config) -> dict:
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    matmul = layers * per_layer + vocab * h  # the LM head, not the embedding (a gather)
    return {"parameters": matmul + vocab * h, "matmul_parameters": matmul, "weight_bytes": 2 * (matmul + 2 * h),
            "kv_bytes_per_token": 2 * 2 * layers * kv}


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def gpu_kernels(prof) -> tuple[float, int]:
    """(seconds of GPU kernel time, kernels launched) in a torch profile."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6, len(kernels)


def profile_decode(llm, prompts, steps: int) -> dict:
    """Where a decode step's time goes: its wall time against the GPU's busy time (the sum of its kernels'
    times, from the profiler; a generation of `steps` + 1 tokens minus one of 1 token), the kernels a step
    launches, the heaviest kernels, one step's kernels in order (name, us), and the heaviest Python functions
    (cProfile) of the same generation."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from torch_shift import SamplingParams

    def run(max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()

    totals = {}
    for max_tokens in (1, steps + 1):
        run(max_tokens)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            run(max_tokens)
            wall = time.perf_counter() - start
        totals[max_tokens] = (wall, *gpu_kernels(prof), prof)
    wall = (totals[steps + 1][0] - totals[1][0]) / steps
    busy = (totals[steps + 1][1] - totals[1][1]) / steps
    launched = (totals[steps + 1][2] - totals[1][2]) / steps
    table = totals[steps + 1][3].key_averages().table(sort_by="self_device_time_total", row_limit=40)
    kernels = [e for e in totals[steps + 1][3].events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    n = round(launched)  # a step from the middle of the generation: the last one is its own kind
    step = kernels[-2 * n:-n]
    step_kernels = [(e.name[:100], round(e.device_time, 2)) for e in step]
    # the GPU idle between one kernel's end and the next one's start, within that step: the largest gaps with the
    # kernels on either side (where the host's work or a transfer holds the GPU back)
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:60], b.name[:60]) for a, b in zip(step, step[1:])),
                  reverse=True)
    profiler = cProfile.Profile()
    profiler.enable()
    run(steps + 1)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(25)
    unprofiled = {max_tokens: host_blocked(lambda: run(max_tokens)) for max_tokens in (1, steps + 1)}
    return {"wall_per_step_s": wall, "gpu_busy_per_step_s": busy, "kernels_per_step": launched,
            "kernel_table": table, "step_kernels": step_kernels, "python_profile": stream.getvalue(),
            "idle_in_step_us": sum(max(0.0, g) for g, _, _ in gaps), "largest_gaps_us": gaps[:8],
            "unprofiled_wall_per_step_s": (unprofiled[steps + 1][0] - unprofiled[1][0]) / steps,
            "host_blocked_per_step_s": (unprofiled[steps + 1][1] - unprofiled[1][1]) / steps}


def host_blocked(fn) -> tuple[float, float]:
    """(seconds, of them the host's blocked in `torch.cuda.Event.synchronize`) of `fn()`, with no profiler on. A step
    whose host waits for the GPU for much of its time is bound by the GPU. Under the profiler, whose own host cost
    runs in every operator, an H200's batch-1 steps showed a 117 us gap before each graph, while the host waited 0.64
    ms of each 1.14 ms step without it (docs/performance.md, sixty-eighth session)."""
    blocked = 0.0
    synchronize = torch.cuda.Event.synchronize

    def timed(event):
        nonlocal blocked
        start = time.perf_counter()
        try:
            return synchronize(event)
        finally:
            blocked += time.perf_counter() - start

    torch.cuda.Event.synchronize = timed
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, blocked
    finally:
        torch.cuda.Event.synchronize = synchronize


def profile_prefill(llm, prompt) -> dict:
    """The prefill's wall time against the GPU's busy time, and its heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from torch_shift import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    busy, launched = gpu_kernels(prof)
    return {"wall_per_step_s": wall, "gpu_busy_per_step_s": busy, "kernels_per_step": launched, "python_profile": "",
            "kernel_table": prof.key_averages().table(sort_by="self_device_time_total", row_limit=15)}


def measure_engine(model_dir: Path, engine_args: dict, numbers: dict, limits: dict, offline,
                   profile_batches: tuple[int, ...] = ()) -> dict:
    from torch_shift.attention import triton_paged
    from torch_shift.kernels import triton_linear
    from torch_shift.models import fused, linear

    engine_args = dict(engine_args)
    switches = [(triton_paged, "SDPA_PROMPT_TOKENS", "sdpa_prompt_tokens"),
                (linear, "GPU_TRITON_LINEARS", "triton_linears"), (fused, "GPU_TRITON_ROTARY", "triton_rotary"),
                (triton_paged, "DECODE_WRITES_KV", "decode_writes_kv")]
    defaults = [getattr(module, name) for module, name, _ in switches]
    for (module, name, arg), default in zip(switches, defaults):
        setattr(module, name, engine_args.pop(arg, default))
    triton_linear._choices.clear()  # each configuration times its own kernels
    try:
        return _measure_engine(model_dir, engine_args, numbers, limits, offline, profile_batches)
    finally:
        for (module, name, _), default in zip(switches, defaults):
            setattr(module, name, default)


def _measure_engine(model_dir: Path, engine_args: dict, numbers: dict, limits: dict, offline,
                    profile_batches: tuple[int, ...]) -> dict:
    from torch_shift import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=PREFILL_TOKENS,
              max_num_seqs=256, enable_prefix_caching=False, seed=0, **engine_args)
    result: dict = {"start_s": time.perf_counter() - started}
    vocab = llm.engine.model_config.vocab_size

    def timed(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outs

    for batch in DECODE_BATCHES:
        prompts = prompts_of([DECODE_PROMPT] * batch, vocab, batch)
        timed(prompts, 4)  # warm-up
        first = min(timed(prompts, 1)[0] for _ in range(3))
        full = min(timed(prompts, DECODE_STEPS + 1)[0] for _ in range(3))
        tpot = (full - first) / DECODE_STEPS
        context = DECODE_PROMPT + DECODE_STEPS / 2
        step_bytes = numbers["weight_bytes"] + batch * context * numbers["kv_bytes_per_token"]
        result[f"tpot_b{batch}_s"] = tpot
        result[f"roofline_b{batch}"] = step_bytes / limits["hbm_bytes_per_s"] / tpot
    prompt = prompts_of([PREFILL_TOKENS - 1], vocab, 7)
    timed(prompt, 1)
    prefill_s = min(timed(prompt, 1)[0] for _ in range(3))
    cfg = llm.engine.model_config
    n = PREFILL_TOKENS - 1
    attention_flop = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n / 2
    flop = 2 * numbers["matmul_parameters"] * n + attention_flop
    result["prefill_s"] = prefill_s
    result["prefill_mfu"] = flop / prefill_s / limits["bf16_flop_per_s"]
    timed(offline["prompts"][:16], 8)  # warm-up
    runs = [timed(offline["prompts"], OFFLINE_NEW) for _ in range(3)]  # one run takes about a second: the best of 3
    offline_s, outs = min(runs, key=lambda run: run[0])
    result["offline_s"] = offline_s
    result["offline_tok_per_s"] = OFFLINE_REQUESTS * OFFLINE_NEW / offline_s
    result["offline_token_ids"] = [list(o.outputs[0].token_ids) for o in outs[:16]]
    result["steps_by_layout"] = llm.stats()["steps_by_layout"]
    for batch in profile_batches:
        result[f"profile_b{batch}"] = profile_decode(llm, prompts_of([DECODE_PROMPT] * batch, vocab, batch), 32)
    if profile_batches:
        result["profile_prefill"] = profile_prefill(llm, prompt)
    llm.shutdown()
    return result


def measure_transformers(model_dir: Path, offline, batches: list[int]) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    result = {}
    prompts = offline["prompts"]
    for batch in batches:
        start = time.perf_counter()
        tokens = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=OFFLINE_NEW,
                                     min_new_tokens=OFFLINE_NEW, do_sample=False, pad_token_id=0)
            tokens += out[:, width:].tolist()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        result[f"b{batch}_tok_per_s"] = len(prompts) * OFFLINE_NEW / seconds
        result.setdefault("token_ids", tokens[:16])
        log(f"transformers batch {batch}: {result[f'b{batch}_tok_per_s']:.0f} tok/s")
    result["best_tok_per_s"] = max(v for k, v in result.items() if k.endswith("_tok_per_s"))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def planner_rows(model_dir: Path, engine: dict) -> list[dict]:
    """The planner's one-step predictions from a calibration of this GPU (`torch-shift calibrate --device
    cuda`) beside the steps measured for one engine configuration."""
    from torch_shift.planner import Layout, ModelShape, Seq, step_cost
    from torch_shift.planner.calibrate import calibrate

    hw = calibrate(device="cuda", world=1, dtypes=("bf16",), log=log)
    shape = ModelShape.from_pretrained(model_dir)
    rows = []
    context = DECODE_PROMPT + DECODE_STEPS // 2
    steps = [(f"decode, batch {b}, context {context}", [Seq(1, context)] * b, engine[f"tpot_b{b}_s"])
             for b in DECODE_BATCHES]
    steps.append((f"prefill, 1 x {PREFILL_TOKENS - 1} tokens", [Seq(PREFILL_TOKENS - 1)], engine["prefill_s"]))
    for name, seqs, measured in steps:
        cost = step_cost(shape, hw, Layout("tp", tp=1), seqs)
        rows.append({"step": name, "measured_s": measured, "predicted_s": cost.total_s,
                     "predicted_overhead_s": cost.overhead_s})
    return rows


def common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean number of leading tokens two runs' outputs share."""
    lengths = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lengths.append(n)
    return sum(lengths) / max(1, len(lengths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--hf-batches", default=",".join(map(str, HF_BATCHES)),
                        help="transformers.generate's batch sizes tried (empty: not run)")
    parser.add_argument("--profile", default="", help="decode batch sizes to profile (e.g. 1,64): a step's wall "
                        "time against its GPU time, its kernels and the Python functions that take the most time")
    parser.add_argument("--planner", action="store_true", help="calibrate the planner on this GPU and compare "
                        "its one-step predictions with the first configuration's measured steps")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU")
    from torch_shift.config import ModelConfig
    from torch_shift.models.toy import build_tokenizer, tiny_llama_config, write_random_checkpoint

    limits = machine_limits()
    torch.cuda.empty_cache()
    log(f"{limits['gpu']}: HBM {limits['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM "
        f"{limits['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
    report: dict = {"limits": limits, "model": MODEL, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama-1b"
        config = tiny_llama_config(**MODEL)
        write_random_checkpoint(model_dir, config, init_std=0.02, dtype=torch.bfloat16)
        build_tokenizer(model_dir, vocab_size=MODEL["vocab_size"])
        numbers = model_numbers(ModelConfig.from_hf_dict(config))
        report["numbers"] = numbers
        rng = random.Random(0)
        offline = {"prompts": prompts_of([rng.randint(128, 512) for _ in range(OFFLINE_REQUESTS)],
                                         MODEL["vocab_size"], 1)}
        for config in args.configs.split(","):  # a configuration named again runs again (an engine of its own)
            name = config if config not in report["engines"] else f"{config} ({len(report['engines']) + 1})"
            log(f"torch_shift {name}")
            try:
                report["engines"][name] = measure_engine(model_dir, CONFIGS[config], numbers, limits, offline,
                                                         tuple(int(b) for b in args.profile.split(",") if b))
            except Exception:  # the other configurations still run; the failure is printed whole
                traceback.print_exc()
                continue
            finally:  # the engine's memory back before the next one sizes its KV cache
                gc.collect()
                torch.cuda.empty_cache()
            result = report["engines"][name]
            log(json.dumps({k: v for k, v in result.items()
                            if k != "offline_token_ids" and not k.startswith("profile")}))
            for key in [k for k in result if k.startswith("profile")]:
                p = result[key]
                idle = f", idle between its kernels {p['idle_in_step_us']:.0f} us" if "idle_in_step_us" in p else ""
                if "host_blocked_per_step_s" in p:
                    idle += (f"; without the profiler {p['unprofiled_wall_per_step_s'] * 1e3:.3f} ms a step, the host "
                             f"waiting for the GPU {p['host_blocked_per_step_s'] * 1e3:.3f} ms of it")
                log(f"{name} {key}: wall {p['wall_per_step_s'] * 1e3:.3f} ms a step, GPU busy "
                    f"{p['gpu_busy_per_step_s'] * 1e3:.3f} ms, {p['kernels_per_step']:.0f} kernels{idle}\n"
                    f"largest gaps (us, after, before): {p.get('largest_gaps_us', [])}\n"
                    f"{p['kernel_table']}\n{p['python_profile']}")
        if args.planner and report["engines"]:
            report["planner"] = planner_rows(model_dir, next(iter(report["engines"].values())))
        if args.hf_batches:
            report["transformers"] = measure_transformers(model_dir, offline,
                                                          [int(b) for b in args.hf_batches.split(",")])
    hf = report.get("transformers", {}).get("best_tok_per_s")
    print(f"{limits['gpu']}, torch {limits['torch']}: HBM {limits['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {limits['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s; model {numbers['parameters'] / 1e9:.2f}B")
    header = ["config", "start s"] + [f"TPOT b{b} ms (roofline)" for b in DECODE_BATCHES] + [
        "prefill 2k ms (MFU)", "offline tok/s (x transformers)"]
    print(" | ".join(header))
    for name, r in report["engines"].items():
        cells = [name, f"{r['start_s']:.1f}"]
        cells += [f"{r[f'tpot_b{b}_s'] * 1e3:.2f} ({r[f'roofline_b{b}']:.2f})" for b in DECODE_BATCHES]
        cells.append(f"{r['prefill_s'] * 1e3:.1f} ({r['prefill_mfu']:.2f})")
        ratio = f" ({r['offline_tok_per_s'] / hf:.2f}x)" if hf else ""
        cells.append(f"{r['offline_tok_per_s']:.0f}{ratio}")
        print(" | ".join(cells))
        if "transformers" in report:  # bf16 on random weights: greedy paths part where two logits tie closely
            ours, theirs = r["offline_token_ids"], report["transformers"]["token_ids"]
            print(f"  greedy tokens equal to transformers' up to where they part: {common_prefix(ours, theirs):.0f} "
                  f"of {OFFLINE_NEW} on average over {len(ours)} requests")
    if hf:
        print(f"transformers.generate: {hf:.0f} tok/s at its best batch size "
              f"({', '.join(f'{k}: {v:.0f}' for k, v in report['transformers'].items() if k.endswith('tok_per_s'))})")
    if "planner" in report:
        print(f"planner (calibrated on this GPU) against {next(iter(report['engines']))}: step | measured ms | "
              "predicted ms (of it engine overhead) | error")
        for row in report["planner"]:
            print(f"  {row['step']} | {row['measured_s'] * 1e3:.2f} | {row['predicted_s'] * 1e3:.2f} "
                  f"({row['predicted_overhead_s'] * 1e3:.2f}) | {row['predicted_s'] / row['measured_s'] - 1:+.0%}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
