"""`torch-shift bench`: real HTTP traffic against a running server, or against servers it starts.

    torch-shift bench --url http://127.0.0.1:8000 --workload poisson --rate 4 --num-requests 64
    torch-shift bench --model DIR --config TP:sp=1,tp=2,shift_threshold=none --config SP:sp=2,shift_threshold=0
    torch-shift bench --table5          # the paper's Table 5 shape on this machine (world 2, a small model)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch_shift.argtypes import positive
from torch_shift.bench.traffic import (
    DEFAULT_TRACE,
    LengthSource,
    gamma_arrivals,
    phase_arrivals,
    poisson_arrivals,
    trace_replay,
    workload,
)
from torch_shift.parallel.launch import free_port

# The Table 5 model: a random Llama of about 5M parameters (fp32), small enough for 2 CPU ranks.
TABLE5_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
TABLE5_CONFIGS = ["TP:sp=1,tp=2,shift_threshold=none", "SP:sp=2,tp=1,shift_threshold=0",
                  "Shift:sp=2,tp=1,shift_threshold=64"]


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="a running OpenAI-compatible server (else --model starts one per --config)")
    target.add_argument("--model", help="checkpoint directory for servers this command starts")
    target.add_argument("--served-model-name", default=None, help="model name sent with --url")
    target.add_argument("--api-key", default=None, help="API key of the --url server")
    target.add_argument("--config", action="append", default=None,
                        help="NAME:key=value,... engine arguments of one server to start, e.g. "
                             "'Shift:sp=2,tp=1,shift_threshold=64' (repeatable; compared side by side)")
    target.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this")
    target.add_argument("--table5", action="store_true",
                        help="preset: TP, SP and Shift at world 2 on a locally built ~5M-parameter model, "
                             "alternating low/high load")
    load = parser.add_argument_group("workload")
    load.add_argument("--workload", choices=["poisson", "gamma", "phases", "trace"], default="poisson",
                      help="arrival process")
    load.add_argument("--num-requests", type=positive(int), default=64, help="requests (poisson, gamma, trace)")
    load.add_argument("--rate", type=positive(float), default=4.0, help="mean requests/s (poisson, gamma)")
    load.add_argument("--cv", type=positive(float), default=2.0, help="gamma: coefficient of variation of the gaps")
    load.add_argument("--phases", default="5:1,5:12,5:1,5:12",
                      help="phases: duration_s:rate,... (alternating low/high load, paper 004 style)")
    load.add_argument("--prompt-len", type=positive(int), default=128, help="prompt tokens (fixed lengths)")
    load.add_argument("--output-len", type=positive(int), default=32, help="output tokens (fixed lengths)")
    load.add_argument("--lengths-from-trace", action="store_true", help="sample lengths from --trace")
    load.add_argument("--trace", default=str(DEFAULT_TRACE),
                      help="CSV with arrived_at,num_prefill_tokens,num_decode_tokens (default: the first 2,000 "
                           "requests of the Azure LLM inference trace 2023, shipped with torch_shift)")
    load.add_argument("--length-scale", type=positive(float), default=1.0, help="trace lengths are multiplied by this")
    load.add_argument("--max-prompt", type=positive(int), default=1024, help="trace prompt lengths are clipped to this")
    load.add_argument("--max-output", type=positive(int), default=256, help="trace output lengths are clipped to this")
    load.add_argument("--time-compression", type=positive(float), default=10.0,
                      help="trace replay: arrivals divided by this")
    load.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompt tokens")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="bench/results/serve", help="folder for results.json and timeline.png")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_config(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition(":")
    args: dict = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        args[key.strip()] = value.strip()
    return name, args


def build_workload(args, vocab_size: int) -> tuple[list, str]:
    rng = random.Random(args.seed)
    lengths = LengthSource(prompt_len=args.prompt_len, output_len=args.output_len,
                           trace=Path(args.trace) if args.lengths_from_trace or args.workload == "trace" else None,
                           scale=args.length_scale, max_prompt=args.max_prompt, max_output=args.max_output)
    if args.workload == "trace":
        specs = trace_replay(Path(args.trace), args.num_requests, args.time_compression, lengths, vocab_size,
                             args.seed)
        return specs, (f"replay of the first {len(specs)} requests of {args.trace}, arrival times divided by "
                       f"{args.time_compression}; {lengths.describe()}")
    if args.workload == "phases":
        phases = [tuple(float(x) for x in p.split(":")) for p in args.phases.split(",")]
        arrivals = phase_arrivals(phases, rng)
        what = "phases " + ", ".join(f"{d:g} s at {r:g}/s" for d, r in phases)
    elif args.workload == "gamma":
        arrivals = gamma_arrivals(args.num_requests, args.rate, args.cv, rng)
        what = f"gamma arrivals at {args.rate:g}/s, cv {args.cv:g}"
    else:
        arrivals = poisson_arrivals(args.num_requests, args.rate, rng)
        what = f"Poisson arrivals at {args.rate:g}/s"
    specs = workload(arrivals, lengths, vocab_size, args.seed)
    return specs, f"{len(specs)} requests, {what}; {lengths.describe()}"


def serve_command(model: str, port: int, name: str, engine_args: dict) -> list[str]:
    """`torch-shift serve` with `engine_args` as its flags: a string value after its flag, a bool as the switch
    (`--flag` or `--no-flag`)."""
    cmd = [sys.executable, "-m", "torch_shift", "serve", "--model", model, "--port", str(port),
           "--served-model-name", name, "--no-prefix-caching"]
    for key, value in engine_args.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            cmd += [f"--{flag}", value]
    return cmd


class ServerProcess:
    """`torch-shift serve` in a child process (it starts its own ranks), stopped with SIGINT. `command`: another
    OpenAI-compatible server's command instead (a peer engine, for benchmarks), given the port as `{port}`;
    `env`: variables added to its environment."""

    def __init__(self, model: str, engine_args: dict, name: str, command: list[str] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 300.0):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if command is None:
            cmd = serve_command(model, self.port, name, engine_args)
        else:
            cmd = [part.replace("{port}", str(self.port)) for part in command]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server {name} exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {name} did not come up in {start_timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_bench(args) -> int:
    from torch_shift.bench.loadgen import run_load
    from torch_shift.bench.report import format_table, format_table5, report

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = args.config
    model = args.model
    tmp = None
    if args.table5:
        from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

        tmp = tempfile.TemporaryDirectory()
        model = str(write_random_checkpoint(Path(tmp.name) / "model", tiny_llama_config(**TABLE5_MODEL),
                                            init_std=0.05))
        configs = configs or TABLE5_CONFIGS
        if args.workload == "poisson":  # the default: replace by alternating low and saturating load
            args.workload, args.phases = "phases", "5:1,5:30,5:1,5:30"
        if not args.lengths_from_trace:
            args.lengths_from_trace, args.length_scale = True, 0.125
            args.max_prompt, args.max_output = 512, 48
        print(f"Table 5 preset: random Llama {TABLE5_MODEL} (fp32) built in {model}")
    if args.url is None and model is None:
        raise ValueError("give --url, --model or --table5")
    vocab_size = args.vocab_size
    if vocab_size is None:
        if model is None:
            raise ValueError("with --url, give --vocab-size (prompt token ids are drawn below it)")
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    specs, description = build_workload(args, vocab_size)
    print(f"workload: {description}")

    records: dict[str, list[dict]] = {}
    try:
        if args.url is not None:
            name = args.served_model_name or "server"
            _check_reachable(args.url, args.api_key)
            records[name] = asyncio.run(run_load(args.url, specs, args.served_model_name, name, args.api_key,
                                                 not args.no_progress))
        else:
            for text in configs or ["default:"]:
                name, engine_args = parse_config(text)
                server = ServerProcess(model, engine_args, name)
                try:
                    records[name] = asyncio.run(run_load(server.url, specs, name, name, None, not args.no_progress))
                finally:
                    server.stop()
    finally:
        if tmp is not None:
            tmp.cleanup()
    result = report(records, path_json=out_dir / "results.json", path_png=out_dir / "timeline.png",
                    title=description.replace("; ", "\n"))
    summaries = {name: r["summary"] for name, r in result["configs"].items()}
    print(format_table(summaries))
    if args.table5:
        print(format_table5(summaries))
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'timeline.png'}")
    failed = {name: next(r for r in rs if r["error"] is not None) for name, rs in records.items()
              if rs and all(r["error"] is not None for r in rs)}
    for name, record in failed.items():
        print(f"[torch-shift] every request to {name} failed; the first: status {record['status']}, "
              f"{record['error']}", file=sys.stderr)
    return 1 if failed else 0


def _check_reachable(url: str, api_key: str | None) -> None:
    """A server that does not answer is the user's mistake (a wrong --url), said before any request is timed."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ValueError(f"--url {url}: no server answers there ({type(e).__name__}: {e})") from None
