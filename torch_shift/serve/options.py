"""`torch-shift serve` options of the HTTP server (kept apart from api_server so that building the CLI parser
imports neither FastAPI nor uvicorn)."""

from __future__ import annotations

import argparse

API_KEY_ENV = "TORCH_SHIFT_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: --model, or 'default' for the default model)")
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (default: the "
                        f"{API_KEY_ENV} environment variable, which keeps the key out of `ps`)")
    g.add_argument("--max-waiting-seqs", "--max-waiting-requests", dest="max_waiting_seqs", type=int, default=256,
                   help="sequences (n per prompt) that may wait to run; a request that would pass it gets 429")
    g.add_argument("--max-n", type=int, default=128, help="largest n (samples per prompt) of one request")
    g.add_argument("--max-prompts-per-request", type=int, default=256, help="most prompts in one completion request")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413 as soon as the limit is passed (chunked bodies included)")
    g.add_argument("--step-deadline-s", type=float, default=30.0,
                   help="an engine step running longer than this (or 20x the longest recent step, if more), or a "
                        "rank silent for this long, fails the requests in flight and the server exits non-zero; "
                        "keep it below --distributed-timeout, raise it with --compile (first steps compile)")
    g.add_argument("--log-level", default="warning", help="uvicorn's log level")
