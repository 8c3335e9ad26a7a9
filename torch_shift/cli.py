"""The `torch-shift` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _threshold(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the embedded default model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting requests in arrival order, or by priority (lower first) then arrival")
    p = parser.add_argument_group("parallel (local ranks are started by this process)")
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree of the base layout")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the base layout")
    p.add_argument("--shift-threshold", type=_threshold, default=256,
                   help="steps with more tokens run the base layout, others full TP; 'none': base only")
    p.add_argument("--shift-weights", choices=["copy", "view"], default="copy")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (each with its own KV pool)")
    p.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1,
                   help="pipeline stages of each replica (with --policy seesaw: PP prefill, TP decode)")
    p.add_argument("--policy", default=None, choices=["static", "shift", "flying", "seesaw", "random"],
                   help="layout switching policy (default: shift for --sp > 1, else static; flying: DP replicas "
                        "bound into TP groups on demand, paper 004; seesaw: prefill in PP, decode in TP over the "
                        "same ranks, paper 003)")
    p.add_argument("--policy-config", type=json.loads, default=None, metavar="JSON",
                   help='the policy\'s options, e.g. \'{"dp_above": 4, "tp_below": 1}\' for flying')
    p.add_argument("--cpu-kv-gb", type=float, default=None,
                   help="host tier of the KV cache in GiB, shared by the local ranks (swap space; seesaw "
                        "buffers prefilled requests there; default: 4 for seesaw, none otherwise)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy, sp=args.sp, tp=args.tp, dp=args.dp, policy=args.policy,
        policy_config=args.policy_config, shift_threshold=args.shift_threshold, shift_weights=args.shift_weights,
        pp=args.pp, cpu_kv_gb=args.cpu_kv_gb,
    )


def _generate(args: argparse.Namespace) -> int:
    from torch_shift import LLM, SamplingParams
    from torch_shift.models.default import default_model_dir

    model = args.model
    if model is None:
        model = str(default_model_dir())
        print(f"[torch-shift] no --model given: using the embedded default model at {model}", file=sys.stderr)
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        logprobs=args.logprobs, ignore_eos=args.ignore_eos,
    )
    llm = LLM(model, **_engine_kwargs(args))
    prompts: list = []
    for p in args.prompts:
        if args.token_ids:
            prompts.append([int(t) for t in p.replace(",", " ").split()])
        elif args.chat:
            prompts.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True))
        else:
            prompts.append(p)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for out in outputs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}))
            else:
                head = f"--- prompt {out.prompt!r}" if out.prompt is not None else f"--- prompt {out.prompt_token_ids}"
                print(f"{head} [sample {c.index}, {len(c.token_ids)} tokens, finish={c.finish_reason}]")
                print((out.prompt or "") + c.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from torch_shift.engine.llm_engine import EngineArgs
    from torch_shift.models.default import default_model_dir
    from torch_shift.serve.api_server import run_server

    model = args.model
    if model is None:
        model = str(default_model_dir())
        print(f"[torch-shift] no --model given: serving the embedded default model at {model}", file=sys.stderr)
        args.served_model_name = args.served_model_name or "default"
    return run_server(EngineArgs(model=model, **_engine_kwargs(args)), args)


def _convert(args: argparse.Namespace) -> int:
    from torch_shift.models.convert import convert_checkpoint
    from torch_shift.models.hub import resolve_model_dir

    out = convert_checkpoint(resolve_model_dir(args.model, args.revision), args.out, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_size_mb * (1 << 20)), overwrite=args.overwrite)
    print(f"[torch-shift] wrote {out}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from torch_shift.bench.run import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-shift", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompt strings (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="each prompt is a list of token ids: '1 2 3'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    gen.set_defaults(func=_generate)

    from torch_shift.serve.options import add_server_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=_serve)

    convert = sub.add_parser("convert", help="convert a Hugging Face checkpoint into a torch_shift checkpoint")
    convert.add_argument("--model", required=True, help="Hugging Face checkpoint directory (or hub id)")
    convert.add_argument("--revision", default=None)
    convert.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    convert.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="dtype of the stored weights (default: the checkpoint's)")
    convert.add_argument("--max-shard-size-mb", type=float, default=2048.0)
    convert.add_argument("--overwrite", action="store_true", help="replace --out once the conversion succeeded")
    convert.set_defaults(func=_convert)

    from torch_shift.bench.run import add_bench_args

    bench = sub.add_parser("bench", help="serving benchmark: real HTTP traffic, latency/throughput report, plot")
    add_bench_args(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"torch-shift: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
