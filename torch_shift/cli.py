"""The `torch-shift` command. Optional dependencies are imported only by the command that needs them."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import re
import sys
from collections.abc import Sequence

from torch_shift.argtypes import positive, typed

DESCRIPTION = """\
torch-shift: PyTorch-native LLM inference that changes its parallel layout while it serves.

Without --model, generate and serve use the embedded default model (a 2.2M-parameter Llama trained on the
King James Bible). `torch-shift COMMAND --help` lists a command's options and their defaults."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default after its help (a switch's as on or off), unless it has none
    worth showing (a flag that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            return text + (" (default: on)" if action.default else " (default: off)")
        if action.nargs != 0:
            text += " (default: %(default)s)"
        return text

    def _format_usage(self, usage, actions, groups, prefix) -> str:
        """A command's usage as `PROG [OPTIONS] POSITIONALS` where listing every option would take several lines: the
        help lists them below it, and an error (argparse prints the usage first) stays beside its message."""
        if usage is None:
            full = super()._format_usage(usage, actions, groups, prefix)
            if full.count("\n") <= 4:
                return full
            positionals = [self._format_args(action, self._get_default_metavar_for_positional(action))
                           for action in actions if not action.option_strings]
            usage = " ".join([self._prog, "[OPTIONS]", *positionals])
        return super()._format_usage(usage, actions, groups, prefix)


def _subcommand(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=summary, description=description, formatter_class=_HelpFormatter)
    parser.set_defaults(command_parser=parser)  # an unknown option is reported with this command's usage
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit with `parser`'s usage and, for a misspelt option, the option meant (`--temprature`: --temperature)."""
    import difflib

    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    hints = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            # close enough to be a misspelling (vLLM's --tokenizer-mode is not --tokenizer), and never the opposite
            # of what was asked (--no-enforce-eager is not --enforce-eager)
            plain = name.removeprefix("--").removeprefix("no-")
            close = [option for option in difflib.get_close_matches(name, options, n=3, cutoff=0.86)
                     if option.removeprefix("--").removeprefix("no-") != plain]
            close = close or [option for option in options if _transposed(name, option)]  # --modle: --model
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}" + ("; " + "; ".join(hints) if hints else ""))


def _transposed(a: str, b: str) -> bool:
    """Whether `a` is `b` with two neighbouring characters swapped."""
    if len(a) != len(b):
        return False
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    i = differ[0] if len(differ) == 2 and differ[1] == differ[0] + 1 else None
    return i is not None and a[i] == b[i + 1] and a[i + 1] == b[i]


def _require_extra(extra: str, command: str, *modules: str) -> None:
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ValueError(f"torch-shift {command} needs {', '.join(missing)}: scripts/install.sh {extra} in a checkout "
                         f"of torch_shift, or pip install 'torch_shift[{extra}]'")


def dtype_name(value: str) -> str:
    """--dtype: every name `LLM(dtype=...)` takes ('bf16', 'half', ...), as its full name."""
    from torch_shift.config import dtype_name

    return dtype_name(value)


def _short_dtype_name(value: str) -> str:
    """The planner's --dtype: the short names (fp32, bf16, fp16, fp8), from any name `LLM(dtype=...)` takes too."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype_name(value), value)


def _threshold(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a token count or 'none', got {value!r}") from None


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {value!r}")
    return parsed


def _size(value: str) -> int:
    """An integer, or one with vLLM's suffixes: k, m, g, t decimal ('32k': 32,000; '25.6k'), K, M, G, T binary
    ('4K': 4,096)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value.strip())
    if match is None or (match[2].isupper() and "." in match[1]) or (not match[2] and "." in match[1]):
        raise argparse.ArgumentTypeError(f"an integer (or with vLLM's k, m, g or K, M, G suffixes), got {value!r}")
    number, suffix = match.groups()
    if not suffix:
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    return int(float(number) * 1000 ** power) if suffix.islower() else int(number) * 1024 ** power


def _context_length(value: str) -> int | None:
    """--max-model-len: a size, or 'auto' / -1 for the model's own (vLLM's spellings)."""
    return None if value.strip() in ("auto", "-1") else _size(value)


# options whose type the field's annotation does not say, or that the command line treats apart
_OPTION_TYPES = {"shift_threshold": _threshold, "policy_config": _json_object, "speculative_config": _json_object,
                 "dtype": dtype_name, "max_model_len": _context_length, "max_num_batched_tokens": _size,
                 "kv_cache_memory_bytes": _size}
_COMMAND_LINE_DEFAULTS = {"seed": None, "model": None}  # no --seed: a fresh seed each run; no --model: the default
_GROUP_TITLES = {"engine": "engine", "parallel": "parallel (this process starts the other local ranks)"}


def engine_options() -> list[tuple[str, dict]]:
    """(field, its option's definition) for every EngineArgs field: the command line's engine options."""
    import dataclasses
    import typing

    from torch_shift.engine.args import EngineArgs

    hints = typing.get_type_hints(EngineArgs)
    options = []
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        flags = (f"--{f.name.replace('_', '-')}",) + tuple(flag for flag in meta["flags"] if flag != "--enforce-eager")
        default = _COMMAND_LINE_DEFAULTS.get(f.name, f.default)
        spec: dict = {"flags": flags, "dest": f.name, "default": default, "help": meta["help"],
                      "group": meta["group"]}
        if base is bool:
            spec["action"] = argparse.BooleanOptionalAction
        else:
            spec["type"] = _OPTION_TYPES.get(f.name) or {int: typed(int), float: typed(float)}.get(base, base)
            if meta["choices"]:
                spec["choices"] = meta["choices"]
        options.append((f.name, spec))
    return options


class _EnforceEager(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.compile = False
        namespace.cuda_graphs = False


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    groups = {}
    for name, spec in engine_options():
        group = groups.get(spec["group"])
        if group is None:
            group = groups[spec["group"]] = parser.add_argument_group(_GROUP_TITLES[spec["group"]])
        kwargs = {k: v for k, v in spec.items() if k not in ("flags", "group")}
        group.add_argument(*spec["flags"], **kwargs)
        if name == "compile":  # vLLM's name for running eagerly
            group.add_argument("--enforce-eager", dest="compile", action=_EnforceEager,
                               help="vLLM's: --no-compile --no-cuda-graphs")
        if name == "enable_prefix_caching":  # the name this command line had before
            group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                               help=argparse.SUPPRESS)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate per prompt (an error if the prompt plus these exceed the context)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1: none")
    g.add_argument("--n", type=int, default=1, help="samples per prompt (more than 1 needs --temperature above 0)")
    g.add_argument("--sample-seed", type=int, default=None,
                   help="seed of every prompt's own sampling, as SamplingParams(seed=...); --seed seeds the engine "
                        "(default: none)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, help="top logprobs per generated token")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the command line was given (every EngineArgs field but the model)."""
    return {name: getattr(args, name) for name, _ in engine_options() if name != "model"}


def _model_or_default(args: argparse.Namespace, doing: str) -> str:
    from torch_shift.models.default import default_model_dir

    if args.model is not None:
        return args.model
    model = str(default_model_dir())
    print(f"[torch-shift] no --model given: {doing} the embedded default model at {model}", file=sys.stderr)
    return model


def _token_ids(prompt: str, index: int) -> list[int]:
    """One prompt of `generate --token-ids`: integers separated by spaces or commas."""
    ids = prompt.replace(",", " ").split()
    bad = [t for t in ids if not t.isdigit()]
    if bad or not ids:
        what = f"{bad[0]!r} is not a token id" if bad else "it is empty"
        raise ValueError(f"--token-ids: prompt {index} ({prompt!r}) must be token ids, non-negative integers "
                         f"separated by spaces or commas like '1 2 3', but {what}")
    return [int(t) for t in ids]


def _generate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from torch_shift import LLM, SamplingParams

    model = _model_or_default(args, "using")
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        logprobs=args.logprobs, ignore_eos=args.ignore_eos,
    )
    token_id_prompts = [_token_ids(p, i) for i, p in enumerate(args.prompts)] if args.token_ids else []
    llm = LLM(model, **_engine_kwargs(args))
    try:
        prompts: list = []
        for p in args.prompts:
            if args.token_ids:
                prompts.append(token_id_prompts[len(prompts)])
            elif args.chat:
                prompts.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True))
            else:
                prompts.append(p)
        engine = llm.engine
        context = engine.max_context_tokens
        if context < engine.scheduler_config.max_model_len:
            hint = " (or raise the KV cache's memory, --kv-cache-memory-bytes)"
        elif context < engine.model_config.max_position_embeddings:
            hint = " (or raise --max-model-len)"
        else:  # the model's own context
            hint = ""
        for i, prompt in enumerate(prompts):
            n = len(engine.tokenize_prompt(prompt).token_ids)
            if n + args.max_tokens > context:
                raise ValueError(f"prompt {i} has {n} tokens; with --max-tokens {args.max_tokens} that is "
                                 f"{n + args.max_tokens}, more than the context of {context} tokens: lower "
                                 f"--max-tokens{hint}")
        # a bar only on a terminal, cleared when done: the outputs printed after it are what stays
        bar = functools.partial(tqdm, leave=False) if sys.stderr.isatty() else False
        outputs = llm.generate(prompts, params, use_tqdm=bar)
    finally:
        llm.shutdown()
    for out, given in zip(outputs, args.prompts):
        for c in out.outputs:
            logprobs = None if c.logprobs is None else [_position_logprobs(t, p) for t, p in zip(c.token_ids,
                                                                                              c.logprobs)]
            if args.json:
                record = {"prompt": given, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                          "finish_reason": c.finish_reason}
                if args.token_ids:
                    record["prompt"], record["prompt_token_ids"] = None, out.prompt_token_ids
                if logprobs is not None:
                    record["logprobs"] = logprobs
                print(json.dumps(record))
                continue
            kind = "chat message" if args.chat else "prompt"
            head = f"--- {kind} {given!r}" if not args.token_ids else f"--- prompt {out.prompt_token_ids}"
            print(f"{head} [sample {c.index}, {len(c.token_ids)} tokens, finish={c.finish_reason}]")
            print((out.prompt or "") + c.text)
            for position in logprobs or []:
                top = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in position["top"])
                print(f"  {position['token']!r} {position['logprob']:.3f}  (top: {top})")
    return 0


def _position_logprobs(token_id: int, logprobs: dict) -> dict:
    """A generated token's logprob and the top ones at its position, as `--logprobs` prints them."""
    def entry(tid: int) -> dict:
        return {"token_id": tid, "token": logprobs[tid].decoded_token, "logprob": logprobs[tid].logprob}

    top = sorted((tid for tid, lp in logprobs.items() if lp.rank is not None and lp.rank >= 1),
                 key=lambda tid: logprobs[tid].rank)
    return {**entry(token_id), "rank": logprobs[token_id].rank, "top": [entry(tid) for tid in top]}


def _serve(args: argparse.Namespace) -> int:
    _require_extra("serve", "serve", "fastapi", "uvicorn", "prometheus_client")
    from torch_shift.engine.llm_engine import EngineArgs
    from torch_shift.serve.api_server import run_server

    if not args.enable_chunked_prefill:
        raise ValueError("--no-enable-chunked-prefill: torch_shift always chunks prompts (--max-num-batched-tokens "
                         "tokens a step)")
    if args.model_tag is not None:  # vLLM's positional model
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    model = _model_or_default(args, "serving")
    args.served_model_name = args.served_model_name or ("default" if args.model is None else model)
    return run_server(EngineArgs(model=model, **_engine_kwargs(args)), args)


def _convert(args: argparse.Namespace) -> int:
    from torch_shift.models.convert import convert_checkpoint
    from torch_shift.models.hub import resolve_model_dir

    out = convert_checkpoint(resolve_model_dir(args.model, args.revision), args.out, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_size_mb * (1 << 20)), overwrite=args.overwrite)
    print(f"[torch-shift] wrote {out}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    _require_extra("bench", "bench", "httpx", "matplotlib")
    from torch_shift.bench.run import run_bench

    return run_bench(args)


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torch_shift.planner.calibrate import calibrate

    if not Path(args.out).resolve().parent.is_dir():
        raise ValueError(f"--out {args.out}: its directory does not exist")
    world = args.world if args.world is not None else 1 if args.device == "cuda" else 2
    profile = calibrate(world=world, threads=args.threads, name=args.name, device=args.device,
                        log=lambda line: print(line, file=sys.stderr))
    profile.save(args.out)
    print(f"[torch-shift] wrote {args.out}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from torch_shift.planner import ModelShape, get_profile
    from torch_shift.planner.plan import (
        DEFAULT_DP_ABOVE,
        DEFAULT_THRESHOLDS,
        POLICIES,
        load_model_config,
        parse_dp_above,
        parse_slo,
        plan,
        synthetic_requests,
        trace_requests,
    )

    if args.model is None:
        from torch_shift.models.default import default_model_dir

        model = default_model_dir()
    elif Path(args.model).expanduser().exists():
        model = Path(args.model).expanduser()
    else:
        from torch_shift.models.hub import looks_like_path, resolve_model_dir

        if looks_like_path(args.model):
            raise ValueError(f"--model {args.model}: no such file or directory (plan takes a model directory, "
                             "its config.json, or a Hugging Face hub id)")
        model = resolve_model_dir(args.model, None)
    if args.plot:  # before the simulations, not after them
        _require_extra("bench", "plan --plot", "matplotlib")
    config = load_model_config(model)
    label = Path(args.model or model)  # a hub id's name, not its snapshot's
    label = label.parent if label.suffix == ".json" else label  # .../Llama-3-70B/config.json
    shape = ModelShape.from_config(config, dtype=args.dtype, name=label.name)
    hw = get_profile(args.hardware)
    world = args.world or hw.num_devices
    slo = parse_slo(args.slo)
    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("give a workload: --trace FILE or --synthetic IN:OUT")
    if args.rate is not None and args.concurrency is not None:
        raise ValueError("--rate (open loop) and --concurrency (closed loop) exclude each other")
    for name in ("rate", "time_scale", "num_requests", "concurrency", "cpu_kv_gb", "max_prompt", "max_output"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.trace is not None:
        if not Path(args.trace).is_file():
            raise ValueError(f"--trace {args.trace}: no such file")
        requests = trace_requests(Path(args.trace), args.num_requests, args.time_scale or 1.0, args.rate,
                                  config.vocab_size, args.seed, args.max_prompt, args.max_output)
        workload = f"trace {Path(args.trace).name} ({len(requests)} requests"
    else:
        try:
            prompt_len, output_len = (int(x) for x in args.synthetic.split(":"))
        except ValueError:
            raise ValueError(f"--synthetic takes IN:OUT token counts, e.g. 4096:250, got {args.synthetic!r}") from None
        if prompt_len < 1 or output_len < 1:
            raise ValueError("--synthetic lengths must be >= 1")
        requests = synthetic_requests(prompt_len, output_len, args.num_requests or 200, args.rate, config.vocab_size,
                                      args.seed)
        workload = f"synthetic {prompt_len}:{output_len} ({len(requests)} requests"
    workload += (f", Poisson {args.rate:g}/s)" if args.rate else f", {args.concurrency} clients)" if args.concurrency
                 else f", arrivals / {args.time_scale:g})" if args.time_scale else ", trace arrivals)"
                 if args.trace else ", all at once)")
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    if longest > config.max_position_embeddings:
        raise ValueError(f"the workload's longest request has {longest} tokens (prompt and output), more than the "
                         f"model's context of {config.max_position_embeddings}: clip the trace's lengths "
                         "(--max-prompt, --max-output) or plan a model with a longer context")
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else list(POLICIES)
    try:
        thresholds = [int(t) for t in args.thresholds.split(",")] if args.thresholds else list(DEFAULT_THRESHOLDS)
    except ValueError:
        raise ValueError(f"--thresholds takes a comma list of token counts, got {args.thresholds!r}") from None
    dp_above = parse_dp_above(args.dp_above) if args.dp_above else list(DEFAULT_DP_ABOVE)
    report = plan(config, shape, hw, requests, world=world, workload=workload, model_name=shape.name,
                  policies=policies, thresholds=thresholds, dp_above=dp_above, cpu_kv_gb=args.cpu_kv_gb, slo=slo,
                  concurrency=args.concurrency, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                  log=lambda line: print(f"[torch-shift] {line}", file=sys.stderr))
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"[torch-shift] wrote {args.json}", file=sys.stderr)
    if args.plot:
        report.plot(args.plot)
        print(f"[torch-shift] wrote {args.plot}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from torch_shift import __version__

    parser = argparse.ArgumentParser(prog="torch-shift", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"torch-shift {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = _subcommand(sub, "generate", "generate text offline from prompts on the command line",
                      "Generate text offline for each prompt and print it (or one JSON object per line).\n"
                      "Example: torch-shift generate \"And God said\" --max-tokens 40")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt strings (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="each prompt is a list of token ids: '1 2 3'")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    gen.set_defaults(func=_generate)

    from torch_shift.serve.options import add_server_args

    serve = _subcommand(sub, "serve", "an OpenAI-compatible HTTP server (needs the serve extra)",
                        "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics over HTTP.\n"
                        "Needs the serve extra. Example: torch-shift serve --port 8000")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    _add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=_serve)

    convert = _subcommand(sub, "convert", "convert a Hugging Face checkpoint for fast sharded loading",
                          "Convert a Hugging Face checkpoint into torch_shift's layout: each rank of any SP x TP mesh "
                          "then reads only its shards.")
    convert.add_argument("--model", required=True, help="Hugging Face checkpoint directory (or hub id)")
    convert.add_argument("--revision", default=None, help="hub revision")
    convert.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    convert.add_argument("--dtype", default="auto", type=dtype_name,
                         choices=["auto", "float32", "bfloat16", "float16"],
                         help="dtype of the stored weights ('auto': the checkpoint's)")
    convert.add_argument("--max-shard-size-mb", type=positive(float), default=2048.0, help="largest output file")
    convert.add_argument("--overwrite", action="store_true", help="replace --out once the conversion succeeded")
    convert.set_defaults(func=_convert)

    calibrate = _subcommand(sub, "calibrate", "measure this machine into a hardware profile for the planner",
                            "Measure matmul FLOP/s, memory bandwidth and collective latency and bandwidth per group size\n"
                            "in forked ranks, and write them as a hardware profile (docs/planner.md).\n"
                            "Example: torch-shift calibrate --out this_machine.json (a GPU: --device cuda)")
    calibrate.add_argument("--out", required=True, help="the JSON profile to write")
    calibrate.add_argument("--world", type=int, default=None,
                           help="local ranks (devices) to measure together (default: 2 CPU ranks, one GPU)")
    calibrate.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    calibrate.add_argument("--name", default=None, help="the profile's name (default: host name and ranks)")
    calibrate.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                           help="measure CPU ranks over gloo, or one GPU")
    calibrate.set_defaults(func=_calibrate)

    plan = _subcommand(sub, "plan", "simulate every layout and policy on a workload and recommend one",
                       "Run the engine's own scheduler and policies over a request stream with step times from the\n"
                       "cost model, for every candidate (static DP, TP, SP, PP; Shift over a threshold sweep; Flying\n"
                       "over a sweep of the load that splits it; Seesaw), print the predicted latencies, throughput\n"
                       "and memory, and recommend one.\n"
                       "Example: torch-shift plan --model config.json --hardware h200x8 --dtype fp8 "
                       "--synthetic 4096:250 --rate 2")
    plan.add_argument("--model", default=None, help="model directory or config.json (no weights needed); "
                                                     "default: the embedded model")
    plan.add_argument("--hardware", required=True, help="h100, h200, a100, a100-pcie, l4, a10 with an optional "
                                                        "count (h200x8), or a profile from torch-shift calibrate")
    plan.add_argument("--world", type=positive(int), default=None,
                      help="devices to deploy on (default: the hardware's)")
    plan.add_argument("--dtype", default="auto", type=_short_dtype_name,
                      choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                      help="weight dtype ('auto': the checkpoint's)")
    plan.add_argument("--trace", default=None, help="CSV with num_prefill_tokens,num_decode_tokens[,arrived_at]")
    plan.add_argument("--synthetic", default=None, metavar="IN:OUT", help="fixed prompt and output lengths")
    plan.add_argument("--num-requests", type=int, default=None, help="requests (trace: its first N; synthetic: 200)")
    plan.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    plan.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients")
    plan.add_argument("--time-scale", type=float, default=None, help="divide the trace's arrival times by this")
    plan.add_argument("--max-prompt", type=int, default=None, help="clip the trace's prompt lengths to this")
    plan.add_argument("--max-output", type=int, default=None, help="clip the trace's output lengths to this")
    plan.add_argument("--slo", default=None, help="bounds on p90 TTFT and TPOT, e.g. ttft=500ms,tpot=50ms")
    plan.add_argument("--policies", default=None, help="a comma list of candidates' policies (default: all)")
    plan.add_argument("--thresholds", default=None, help="Shift's thresholds to sweep (tokens, comma list)")
    plan.add_argument("--dp-above", default=None,
                      help="Flying's loads to sweep at which its TP groups split into DP replicas (requests per "
                           "replica, comma list; 'never': load never splits them) (default: 2,4,8,16,never)")
    plan.add_argument("--cpu-kv-gb", type=float, default=None,
                      help="Seesaw's host KV tier (GiB; default 64, or on CPU ranks a quarter of the memory up to 4)")
    plan.add_argument("--max-num-seqs", type=int, default=256, help="the simulated engine's running sequences")
    plan.add_argument("--max-num-batched-tokens", type=int, default=2048,
                      help="the simulated engine's tokens per step")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="the share of each device's memory the weights and KV cache may take")
    plan.add_argument("--seed", type=int, default=0, help="seed of the workload's token ids and arrivals")
    plan.add_argument("--json", default=None, help="write the candidates and the recommendation as JSON")
    plan.add_argument("--plot", default=None, help="write TTFT against throughput per candidate (PNG)")
    plan.set_defaults(func=_plan)

    from torch_shift.bench.run import add_bench_args  # argument definitions only: no optional dependency

    bench = _subcommand(sub, "bench", "serving benchmark: HTTP traffic, latency/throughput report and plot "
                                        "(needs the bench extra)",
                        "Send a request stream (Poisson, gamma, phases or trace replay) to a running server (--url)\n"
                        "or to servers it starts, one per --config, and report latency and throughput side by side.\n"
                        "Needs the bench extra. Example: torch-shift bench --table5")
    add_bench_args(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(_dashed_flags(sys.argv[1:] if argv is None else argv))
    if unknown:
        _refuse_unknown(args.command_parser, unknown)
    _show_library_log()
    try:
        return args.func(args)
    except ValueError as e:
        print(f"torch-shift: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C: the engine's ranks are ended as the interrupt unwound; no traceback
        print("[torch-shift] interrupted", file=sys.stderr)
        return 130


def _dashed_flags(argv: Sequence[str]) -> list[str]:
    """vLLM's command lines spell a flag with underscores too (`--max_model_len 4096`, `--tensor_parallel_size=2`):
    the flag's name (not its value) with dashes."""
    dashed = list(argv)
    for i, arg in enumerate(dashed):
        if arg == "--":  # what follows is positional (a prompt may begin with dashes)
            break
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            dashed[i] = name.replace("_", "-") + sep + value
    return dashed


def _show_library_log() -> None:
    """The library's INFO lines (a first run building the CPU kernels) on stderr, as this command's own notes."""
    log = logging.getLogger("torch_shift")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[torch-shift] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
