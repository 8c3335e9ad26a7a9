"""`torch-shift serve` options of the HTTP server (kept apart from api_server so that building the CLI parser
imports neither FastAPI nor uvicorn)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "TORCH_SHIFT_API_KEY"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'a JSON list of strings, such as \'["http://localhost:3000"]\', got {text!r}')
    return value


@dataclass(frozen=True)
class CorsOptions:
    """Which browser origins may call the server (vLLM's defaults: any origin, method and header, no
    credentials), as Starlette's CORSMiddleware takes them."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CorsOptions:
        return cls(tuple(args.allowed_origins), args.allow_credentials, tuple(args.allowed_methods),
                   tuple(args.allowed_headers))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name clients use (default: --model, or 'default' for the default model); several "
                        "names are all accepted, the first is the main one (vLLM's)")
    g.add_argument("--api-key", nargs="+", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize, any of several "
                        f"keys (default: the {API_KEY_ENV} environment variable, which keeps the key out of `ps`)")
    g.add_argument("--max-waiting-seqs", "--max-waiting-requests", dest="max_waiting_seqs", type=int, default=256,
                   help="sequences (n per prompt) that may wait to run; a request that would pass it gets 429")
    g.add_argument("--max-n", type=int, default=128, help="largest n (samples per prompt) of one request")
    g.add_argument("--max-prompts-per-request", type=int, default=256, help="most prompts in one completion request")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413 as soon as the limit is passed (chunked bodies included)")
    g.add_argument("--step-deadline-s", type=float, default=30.0,
                   help="an engine step running longer than this (or 20x the longest recent step, if more), or a "
                        "rank silent for this long, fails the requests in flight and the server exits non-zero; "
                        "keep it below --distributed-timeout (a compiled engine compiles before it serves, not in "
                        "its first steps)")
    # vLLM's flags that ask for what torch_shift always does
    g.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's: accepted; torch_shift runs no code from a checkpoint (its model classes are its own)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's: prompts are always chunked by --max-num-batched-tokens (the --no- form is refused)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="vLLM's: accepted; torch_shift logs no periodic statistics (GET /metrics serves them)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request as it is admitted (its id, prompt length and sampling parameters) at INFO "
                        "on stderr, as vLLM's flag does")
    g.add_argument("--log-level", "--uvicorn-log-level", default="warning", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (vLLM's --uvicorn-log-level)")
    from torch_shift.serve.reasoning import REASONING_PARSERS
    from torch_shift.serve.tool_parsers import TOOL_PARSERS

    c = parser.add_argument_group("CORS (vLLM's flags: browsers' cross-origin requests)")
    c.add_argument("--allowed-origins", type=_json_list, default=["*"], help="origins allowed, a JSON list")
    c.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies, auth headers)")
    c.add_argument("--allowed-methods", type=_json_list, default=["*"], help="methods allowed, a JSON list")
    c.add_argument("--allowed-headers", type=_json_list, default=["*"], help="headers allowed, a JSON list")
    t = parser.add_argument_group("tools and reasoning (vLLM's flags)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='honour tool_choice "auto" (the default when a request gives tools): the model\'s calls are '
                        "parsed out of its text by --tool-call-parser")
    t.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the format the model writes tool calls in: hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
                        '(Llama 3.1/3.2), mistral. tool_choice "required" and a named function need none')
    t.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="send the model's <think> reasoning as reasoning (and reasoning_content), apart from "
                        "content: deepseek_r1 (DeepSeek-R1 and its distills, QwQ), qwen3")
    t.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the checkpoint's")


@dataclass(frozen=True)
class ChatOptions:
    """How /v1/chat/completions reads tools and reasoning (vLLM's flags)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # a template (or a file holding one) instead of the checkpoint's

    def __post_init__(self) -> None:
        from torch_shift.serve.reasoning import REASONING_PARSERS
        from torch_shift.serve.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: torch_shift has "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r}: torch_shift has "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes its "
                             "calls in: hermes, llama3_json or mistral)")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto", or None when the server cannot honour it."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def template(self) -> str | None:
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        if "{" not in self.chat_template and path.is_file():
            return path.read_text(encoding="utf-8")
        if "{" not in self.chat_template:
            raise ValueError(f"--chat-template {self.chat_template!r}: no such file (or give the template itself)")
        return self.chat_template

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatOptions:
        return cls(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser, args.chat_template)
