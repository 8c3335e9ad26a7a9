"""The GEMV kernel's decode pool against OpenMP's split (issue 20): one engine, one process, the peer benchmark's
model (bench_peers.py; `--small`: the same shape at hidden 256, whose weights read in microseconds), a 512-token
prompt, then `--tokens` tokens at batch 1, the pool switched on and off between generations (pairs in alternating
order). Prints the median decode step of each generation, the per-pair ratios and whether the tokens were the same.

    python bench/bench_decode_pool.py [--dtype bfloat16] [--pairs 8] [--tokens 128] [--small]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench_peers import INIT_STD, MODEL
from paired_runs import alternate_generations, per_pair_ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--small", action="store_true", help="hidden 256 (MLP 512, 4 / 1 heads): fixed cost only")
    args = parser.parse_args()

    from torch_shift import LLM, SamplingParams
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    config = dict(MODEL)
    if args.small:
        config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "model", tiny_llama_config(**config), init_std=INIT_STD)
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_batched_tokens=2048,
                  max_model_len=config["max_position_embeddings"], enable_prefix_caching=False, seed=0)
        pool = llm.engine.worker.runner.decode_pool
        if not pool.enabled:
            raise SystemExit("the decode pool does not run here (no GEMV kernel, or --no-decode-pool)")
        prompt = {"prompt_token_ids": [(7 * i) % (config["vocab_size"] - 2) + 2 for i in range(512)]}
        params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)

        def switch(pooled: bool) -> None:
            pool.enabled = pooled

        results = alternate_generations(llm, prompt, params, switch, args.pairs)
    pooled_ms, split_ms, ratios = per_pair_ratios(results)
    reference = list(results[False][0][1].token_ids)
    same = all(list(c.token_ids) == reference for _, c in results[True] + results[False])
    print(f"{args.dtype}{' (small)' if args.small else ''}, batch 1, {args.tokens} tokens after a 512-token prompt, "
          f"{args.pairs} pairs")
    print(f"decode pool:    median step {statistics.median(pooled_ms):.2f} ms")
    print(f"OpenMP's split: median step {statistics.median(split_ms):.2f} ms")
    print(f"pool / split per pair: {' '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")
    print(f"tokens: {'the same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
