"""The C++ decoder against the model's forward (issue 20): one engine, one process, a 512-token prompt, then `--tokens`
tokens at batch 1, the decoder switched on and off between generations (pairs in alternating order). The engine
starts with it off (so a compiled model also has the one-thread graphs its pooled steps need without it) and the
decoder is built on the same weights. Prints the median decode step of each generation, the per-pair ratios and
whether tokens and logprobs were the same: they are, eager or compiled (a compiled CPU forward rounds as the eager
one the decoder reproduces: models/fused.py).

    python bench/bench_native_decoder.py [--model default|peer|small] [--dtype bfloat16] [--pairs 6] [--tokens 128]
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
    parser.add_argument("--model", default="peer", choices=["default", "peer", "small"],
                        help="the default model (2M, eager), the peer benchmark's 106M model, or its shape at hidden "
                             "256")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--compile", choices=["true", "false", "auto"], default="auto")
    args = parser.parse_args()

    from torch_shift import LLM, SamplingParams
    from torch_shift.models.default import default_model_dir
    from torch_shift.models.native_decoder import NativeDecoder
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "default":
            model_dir, max_len = default_model_dir(), 1024
        else:
            config = dict(MODEL)
            if args.model == "small":
                config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1)
            model_dir = write_random_checkpoint(Path(tmp) / "model", tiny_llama_config(**config), init_std=INIT_STD)
            max_len = config["max_position_embeddings"]
        compile_arg = {"auto": None, "true": True, "false": False}[args.compile]
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_batched_tokens=2048, max_model_len=max_len,
                  enable_prefix_caching=False, seed=0, native_decode=False, compile=compile_arg)
        replica = llm.engine.worker.runner.model
        native = NativeDecoder.build(replica.model)
        if native is None:
            raise SystemExit("the C++ decoder does not run this model here")
        vocab = replica.model.config.vocab_size
        prompt = {"prompt_token_ids": [(7 * i) % (vocab - 2) + 2 for i in range(512)]}
        params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True, logprobs=1)

        def switch(on: bool) -> None:
            replica.native_decoder = native if on else None

        results = alternate_generations(llm, prompt, params, switch, args.pairs)
    native_ms, forward_ms, ratios = per_pair_ratios(results)
    outputs = {on: [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                    for _, c in results[on]] for on in (True, False)}
    reference = outputs[False][0]
    print(f"{args.model} model, {args.dtype}, batch 1, {args.tokens} tokens after a 512-token prompt, "
          f"{args.pairs} pairs")
    print(f"C++ decoder:    median step {statistics.median(native_ms):.2f} ms")
    print(f"model forward:  median step {statistics.median(forward_ms):.2f} ms")
    print(f"decoder / forward per pair: {' '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f})")
    print(f"tokens: {'the same' if all(r[0] == reference[0] for r in outputs[True]) else 'DIFFERENT'}; "
          f"logprobs: {'the same' if all(r == reference for r in outputs[True]) else 'different'}")


if __name__ == "__main__":
    main()
