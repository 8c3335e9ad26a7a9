"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health, /metrics.

Bad input gets a 4xx with an OpenAI-style error body and the server keeps serving; a field the server
cannot honour is a 400 that names it. A full waiting queue is a 429 with Retry-After; an engine that
failed, stalled or is shutting down a 503. The body is counted as it arrives (chunked or not) and a 413
answers as soon as it passes the limit. A client that goes away (streaming or not) aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from torch_shift.engine.llm_engine import TokenizedPrompt
from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.serve.async_engine import AsyncEngine, EngineFull, EngineStopped, Submission
from torch_shift.serve.chat_output import ChatOutputFormat
from torch_shift.serve.metrics import EngineMetrics
from torch_shift.serve.options import ChatOptions, CorsOptions
from torch_shift.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from torch_shift.serve.reasoning import REASONING_PARSERS
from torch_shift.serve.responses import (
    DeltaTracker,
    EchoedPrompt,
    TextOffsets,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    sse,
)
from torch_shift.serve.tool_parsers import TOOL_PARSERS
from torch_shift.serve.tools import check_tools, template_messages, tool_choice

logger = logging.getLogger("torch_shift.serve")

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key when one is set
_FATAL_EXIT_DELAY_S = 1.0
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # pydantic union branches in error locations


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        # vLLM's `code` is the status where nothing more specific applies
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = status if code is None else code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # ASCII escapes: an error may quote what the client sent, lone surrogates included
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _parameter_error(e: ValueError | TypeError, fields: dict[str, str] | None = None) -> APIError:
    """A 400 for an error of the engine or the request checks, naming the request field where it knows it
    (`fields` maps engine parameter names to this endpoint's field names)."""
    param = getattr(e, "param", None)
    if param is not None:
        param = (fields or {}).get(param, param)
    return APIError(400, str(e), param=param)


def _generation_error(reason: str, field: str) -> APIError:
    """A request whose output could not be kept to its grammar (finish reason "error")."""
    return APIError(400, f"{field}: {reason}; the output would not have matched it (simplify the schema)",
                    param=field, code="grammar_failed")


def _field_path(loc: Sequence[str | int]) -> str | None:
    """A pydantic error's location as the request checks name fields (`messages[0].content`), without pydantic's
    tags for the branches of a union."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not ("[" in part or part in _TYPE_TAGS):
            path += f".{part}" if path else part
    return path or None


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _status_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


class _Guard:
    """ASGI middleware in front of the app: the API key, and the body limit counted as the bytes arrive
    (FastAPI >= 0.164 has `max_body_size` for the latter; the `serve` extra supports older ones)."""

    def __init__(self, app, api_key: str | Sequence[str] | None, max_body_bytes: int):
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [f"Bearer {key}".encode() for key in keys]  # any of them (vLLM's --api-key takes several)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys and scope["path"].startswith(_PROTECTED):
            given = headers.get(b"authorization", b"")
            if not any([hmac.compare_digest(given, key) for key in self.api_keys]):  # every key compared
                error = APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        too_large = f"the request body is larger than {self.max_body_bytes} bytes"
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await APIError(413, too_large, code=413).response()(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # chunked bodies have no Content-Length: count them
                    raise StarletteHTTPException(413, too_large)  # FastAPI passes it on while reading the body
            return message

        await self.app(scope, counted_receive, send)


class _EngineStream(StreamingResponse):
    """A streamed response whose engine requests end with it, however it ends (even if never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(_one_write_at_a_time(content), media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _one_write_at_a_time(content: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chunks, the event loop run between two: where a client hung up, the write that fails schedules the
    connection's end, which then runs before the next write (and the stream ends). Chunks written back to back (n
    choices of one step) went on to the closed socket: asyncio logged 'socket.send() raised exception.' for each
    past the fifth."""
    async for chunk in content:
        yield chunk
        await asyncio.sleep(0)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable) -> tuple[bool, Any]:
    """(True, result) of `work`, or (False, None) as soon as the client hangs up (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return False, None
    return True, task.result()


def build_app(engine: AsyncEngine, served_model_name: str | Sequence[str], metrics: EngineMetrics,
              api_key: str | Sequence[str] | None = None,
              max_body_bytes: int = 1 << 20, max_n: int = 128, max_prompts_per_request: int = 256,
              on_shutdown: Callable[[], None] | None = None, chat_options: ChatOptions | None = None,
              log_requests: bool = False, cors: CorsOptions | None = None) -> FastAPI:
    served_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    served_model_name = served_names[0]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="torch_shift", version="0.1.0", lifespan=lifespan)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    cors = cors or CorsOptions()
    # outside the API key's guard: a browser's preflight request carries no key
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_credentials=cors.allow_credentials,
                       allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers)
    llm = engine.engine
    tokenizer = llm.tokenizer
    chat_options = chat_options or ChatOptions()
    if tokenizer is not None and chat_options.chat_template is not None:
        tokenizer.chat_template = chat_options.template()
    auto_tool_parser = TOOL_PARSERS[chat_options.auto_tool_parser] if chat_options.auto_tool_parser else None
    id_parser = TOOL_PARSERS[chat_options.tool_call_parser] if chat_options.tool_call_parser else None
    reasoning_parser = REASONING_PARSERS[chat_options.reasoning_parser] if chat_options.reasoning_parser else None
    # a sequence never outgrows the KV cache (it would preempt itself forever): where the cache holds less than
    # the model's context, what it holds is the context this server serves, advertised and checked as such
    max_model_len = llm.max_context_tokens
    bound = ("" if max_model_len == llm.scheduler_config.max_model_len else
             f" (this server's KV cache holds {max_model_len} tokens a request, fewer than max_model_len="
             f"{llm.scheduler_config.max_model_len})")
    vocab_size = llm.model_config.vocab_size

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _field_path(first.get("loc", ())[1:])
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        named = getattr(first.get("ctx", {}).get("error"), "param", None)  # a check of the whole body names it
        if param is None and named is not None:
            return APIError(400, msg, param=named, code=400).response()
        if first.get("type") == "missing" and param is None:
            msg = "the request body is missing: send a JSON object"
        elif first.get("type") == "extra_forbidden":
            msg = "unknown field: torch_shift does not support it (see docs/reliability.md, 'API differences')"
        elif first.get("type") == "json_invalid":
            param, msg = None, f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}"
        elif first.get("type") == "model_attributes_type" and isinstance(first.get("input"), bytes):
            # FastAPI left the body unparsed: its content type is not JSON's
            msg = (f"the body was sent as {request.headers.get('content-type') or 'no content type'}: send a JSON "
                   "object with Content-Type: application/json")
        return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=400).response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError):
        # a body whose JSON nests thousands of levels deep (a tool call's arguments, a tool's parameters) parses,
        # then overflows Python's stack where the request's parts are copied, read or rendered
        return APIError(400, "the request nests too deeply to be read", code=400).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # a defect, logged with its traceback by the server: the client gets OpenAI's error object, not plain text
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error", code=500).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and exc.__cause__ is not None and exc.detail == _UNPARSED_BODY:
            message = _unparsed_body_message(exc.__cause__)
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, _status_type(exc.status_code), code=exc.status_code,
                        headers=exc.headers).response()

    def check_model(name: str | None, path: bool = False) -> str:
        """A request's model, as its responses name it: a body's missing or empty name is the served model (vLLM's),
        a path's is not; any of the served names (vLLM's --served-model-name takes several, the first the main)."""
        if (name or path) and name not in served_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")
        return name or served_model_name

    def check_counts(num_prompts: int, n: int) -> None:
        if n > max_n:
            raise APIError(400, f"n: at most {max_n} samples per request on this server, got {n}", param="n")
        if num_prompts > max_prompts_per_request:
            raise APIError(400, f"prompt: at most {max_prompts_per_request} prompts per request on this server, "
                                f"got {num_prompts}", param="prompt")
        if num_prompts * n > engine.max_waiting_seqs:
            raise APIError(400, f"this request adds {num_prompts * n} sequences (prompts x n); the server queues at "
                                f"most {engine.max_waiting_seqs}", param="n")

    def need_tokenizer(what: str):
        if tokenizer is None:
            raise APIError(400, f"this model has no tokenizer: {what}")
        return tokenizer

    def prepare(prompt: str | list[int], max_tokens: int | None, what: str) -> TokenizedPrompt:
        """Tokenize (off the event loop) and check the prompt against the context, with vLLM's wording."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = need_tokenizer("give the prompt as token ids").encode(prompt) if text is not None else prompt
        if not token_ids:  # as the engine refuses it: "" is a prompt where the tokenizer adds a BOS token
            raise APIError(400, f"{what}: the {what} is empty", param=what)
        if len(token_ids) >= max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens{bound}. However, "
                                f"your request has {len(token_ids)} input tokens ({what}), which leaves no room for "
                                f"a completion. Please reduce the length of the {what}.", param=what)
        # vLLM 0.32's rule: more than the context is refused, more than the room the prompt leaves is clipped to it
        # (the engine stops the request at the context: finish_reason "length")
        if max_tokens is not None and max_tokens > max_model_len:
            raise APIError(400, f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}"
                                f"{bound}. Please request fewer output tokens.", param="max_tokens")
        try:
            return TokenizedPrompt(text, llm.tokenize_prompt(list(token_ids)).token_ids)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=what) from None

    def sampling(body, max_tokens, logprobs, prompt_logprobs, fields: dict[str, str], structured_outputs=None
                 ) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs, structured_outputs,
                                        llm.default_sampling_fields)
        except (ValueError, TypeError) as e:
            raise _parameter_error(e, fields) from None

    @asynccontextmanager
    async def submit(prefix: str, prompts: list[TokenizedPrompt], params: SamplingParams, priority: int,
                     fields: dict[str, str]) -> AsyncIterator[tuple[str, Submission]]:
        rid = engine.new_request_id(prefix)
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        try:
            async with engine.open(ids, prompts, [params] * len(prompts), priority) as submission:
                if log_requests:  # vLLM's --enable-log-requests: once admitted
                    lengths = ", ".join(str(len(p.token_ids)) for p in prompts)
                    logger.info("Received request %s: %s of %s tokens, priority %d, params: %s", rid,
                                "a prompt" if len(prompts) == 1 else f"{len(prompts)} prompts", lengths, priority,
                                params)
                yield rid, submission
        except (ValueError, TypeError) as e:
            raise _parameter_error(e, fields) from None
        except EngineFull as e:
            raise APIError(429, str(e), "rate_limit_error", code=429,
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_error", code=503) from None

    async def stream_response(prefix: str, prompts: list[TokenizedPrompt], params: SamplingParams, priority: int,
                              fields: dict[str, str], chunks: Callable[[str, Submission], AsyncIterator[str]]
                              ) -> Response:
        stack = AsyncExitStack()
        rid, submission = await stack.enter_async_context(submit(prefix, prompts, params, priority, fields))
        return _EngineStream(_sse_stream(chunks(rid, submission)), stack.aclose)  # errors before: HTTP errors

    async def collect(request: Request, prefix: str, prompts: list[TokenizedPrompt], params: SamplingParams,
                      priority: int, fields: dict[str, str]) -> tuple[str, list[RequestOutput]] | None:
        """The final output of every prompt; None when the client went away (its requests are aborted)."""
        async with submit(prefix, prompts, params, priority, fields) as (rid, submission):
            async def finals() -> list[RequestOutput]:
                last: list[RequestOutput | None] = [None] * len(prompts)
                async for index, out in submission:
                    last[index] = out
                return last

            connected, outputs = await _unless_disconnected(request, finals())
        return (rid, outputs) if connected else None

    # -- health, models, metrics, tokenizer ---------------------------------------------------------------
    @app.head("/health", include_in_schema=False)  # load balancers that probe without a body
    @app.get("/health")
    async def health():
        # each state read once: a step that passed its deadline between two reads of stall() read as shutting down
        if engine.error is not None:
            return APIError(503, "the engine failed; the server is restarting", "server_error", code=503).response()
        if engine.stall() is not None:
            return APIError(503, "the engine is not making progress", "server_error", code=503).response()
        if engine.stopping:
            return APIError(503, "the server is shutting down", "server_error", code=503).response()
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    @app.post("/ping")  # vLLM's (SageMaker's probe): /health's answer
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        from torch_shift import __version__

        return {"version": __version__}

    created = int(time.time())

    # the model as the server was given it (a hub id stays one, as vLLM's card shows it)
    given = llm.args.model
    root = given if isinstance(given, str) else str(llm.model_dir) if llm.model_dir is not None else served_model_name
    # OpenAI's legacy card fields, as vLLM fills them: what a client may do with the model
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                  "group": None, "is_blocking": False}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "torch_shift", "root": root,
                "parent": None, "max_model_len": max_model_len, "permission": [permission]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in served_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_card(check_model(model_id, path=True))

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        tok = need_tokenizer("nothing to tokenize with")

        def run() -> list[int]:
            if body.messages is None:
                return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            messages = template_messages([m.template_message() for m in body.messages], tok.reads_content_parts(tools))
            text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                                           continue_final_message=body.continue_final_message,
                                           **(body.chat_template_kwargs or {}))
            return tok.encode(text, add_special_tokens=bool(body.add_special_tokens))

        tools = body.template_tools()
        if tools is not None:
            try:
                check_tools(tools)
            except ValueError as e:
                raise _parameter_error(e) from None
        try:
            token_ids = await asyncio.to_thread(run)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None
        result = {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids}
        if body.return_token_strs:
            result["token_strs"] = tok.convert_ids_to_tokens(token_ids)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        tok = need_tokenizer("nothing to detokenize with")
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}  # vLLM's: special tokens kept

    # -- completions --------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model_name = check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt: the prompt is empty", param="prompt")
        check_counts(len(prompts), body.n)
        echo_only = bool(body.echo) and body.max_tokens == 0  # older lm-eval: prompt logprobs only
        if body.max_tokens is not None and body.max_tokens < 1 and not echo_only:
            raise APIError(400, f"max_tokens: must be >= 1 (or 0 with echo), got {body.max_tokens}",
                           param="max_tokens")
        max_tokens = 1 if echo_only else body.max_tokens
        # vLLM's prompt_logprobs, and echo's logprobs, which read the prompt's: the engine computes the most of them
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        prompt_logprobs = None if not wanted else -1 if -1 in wanted else max(wanted)
        grammar_field = body.grammar_field
        fields = {"prompt_logprobs": "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs",
                  "structured_outputs": grammar_field}
        params = sampling(body, max_tokens, body.logprobs, prompt_logprobs, fields)
        tokenized = await asyncio.to_thread(lambda: [prepare(p, max_tokens, "prompt") for p in prompts])
        if body.stream:
            return await stream_response(
                "cmpl", tokenized, params, body.priority, fields,
                lambda rid, submission: _completion_chunks(rid, submission, model_name, body, echo_only,
                                                           tokenizer))
        collected = await collect(request, "cmpl", tokenized, params, body.priority, fields)
        if collected is None:
            return Response(status_code=499)  # nobody listens
        rid, finals = collected

        def respond() -> Response:
            choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
            for i, final in enumerate(finals):
                prompt_tokens += len(final.prompt_token_ids)
                cached_tokens += final.num_cached_tokens
                for c in final.outputs:
                    if c.finish_reason == "error":
                        raise _generation_error(str(c.stop_reason), grammar_field)
                    completion_tokens += 0 if echo_only else len(c.token_ids)
                    choices.append(completion_choice(i * body.n + c.index, final, c, echo=bool(body.echo),
                                                       echo_only=echo_only, logprobs=body.logprobs,
                                                       skip_special_tokens=body.skip_special_tokens,
                                                       tokenizer=tokenizer, prompt_logprobs=body.prompt_logprobs))
            return _json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                 "model": model_name, "choices": choices,
                                 "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)})

        return await asyncio.to_thread(respond)  # built and encoded off the event loop (_json_response)

    # -- chat ---------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        model_name = check_model(body.model)
        check_counts(1, body.n)
        tok = need_tokenizer("chat needs a tokenizer with a chat template")
        if tok.chat_template is None:
            raise APIError(400, "this model has no chat template")
        try:
            tools = tool_choice(body.template_tools(), body.template_tool_choice(), body.parallel_tool_calls,
                                chat_options.auto_tool_parser)
            messages = template_messages([m.template_message() for m in body.messages],
                                         tok.reads_content_parts(tools.tools))
        except ValueError as e:
            raise _parameter_error(e) from None
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, f"max_tokens ({body.max_tokens}) and max_completion_tokens "
                                f"({body.max_completion_tokens}) differ: give one (max_tokens is the older name)",
                           param="max_completion_tokens")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{max_tokens_field}: must be >= 1, got {max_tokens}", param=max_tokens_field)
        held = ("response_format" if body.response_format is not None and body.response_format.type != "text"
                else "structured_outputs" if body.structured_outputs is not None else None)
        if tools.mode == "auto" and held is not None:
            raise APIError(400, f"{held}: held to the format, the output could never call a tool "
                                "(tool_choice 'auto'); send tool_choice 'none' to answer in the format, or "
                                "'required' or a named function for a call", param=held)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        grammar_field = "tools" if tools.forced or tools.grammar is not None else body.grammar_field
        fields = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs", "structured_outputs": grammar_field}
        params = sampling(body, max_tokens, logprobs, None, fields, tools.structured_outputs())
        if tools.mode == "auto" and auto_tool_parser.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)  # its markers may be special tokens

        def render() -> tuple[str, TokenizedPrompt]:
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                               tools=tools.tools, continue_final_message=body.continue_final_message,
                                               **body.template_kwargs())
            except (ValueError, TypeError) as e:
                raise APIError(400, f"messages: the chat template failed: {e}", param="messages") from None
            return text, prepare(tok.encode(text, add_special_tokens=False), max_tokens, "messages")

        prompt_text, prompt = await asyncio.to_thread(render)
        output = ChatOutputFormat(tools, auto_tool_parser, reasoning_parser, prompt_text, body.include_reasoning,
                                  id_parser, stop_strings=bool(body.stop),
                                  role="assistant" if body.add_generation_prompt else body.messages[-1].role)
        if params.structured_outputs is not None and output.reasoning_first:  # the model reasons, then answers
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after=reasoning_parser.end))
        if body.stream:
            return await stream_response(
                "chatcmpl", [prompt], params, body.priority, fields,
                lambda rid, submission: _chat_chunks(rid, submission, model_name, body, tokenizer, output,
                                                     grammar_field, len(prompt.token_ids)))
        collected = await collect(request, "chatcmpl", [prompt], params, body.priority, fields)
        if collected is None:
            return Response(status_code=499)
        rid, (final,) = collected

        def respond() -> Response:
            choices = []
            for c in final.outputs:
                if c.finish_reason == "error":
                    raise _generation_error(str(c.stop_reason), grammar_field)
                parser = output.parser()
                message = parser.parse(c.text, c.finish_reason)
                logprobs = (chat_logprobs(c.token_ids, c.logprobs or [], tokenizer, body.top_logprobs or 0)
                            if body.logprobs and not output.hides_reasoning else None)
                choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                                "finish_reason": output.finish_reason(c.finish_reason, parser.tools_called),
                                "stop_reason": c.stop_reason})
            completion_tokens = sum(len(c.token_ids) for c in final.outputs)
            return _json_response({"id": rid, "object": "chat.completion", "created": int(time.time()),
                                 "model": model_name, "choices": choices,
                                 "usage": _usage(len(final.prompt_token_ids), completion_tokens,
                                                 final.num_cached_tokens)})

        return await asyncio.to_thread(respond)

    return app


_UNPARSED_BODY = "There was an error parsing the body"  # FastAPI's, for what the JSON parser raised beside JSON errors


def _unparsed_body_message(cause: BaseException) -> str:
    """Why FastAPI could not read a body, from the error its JSON parser raised."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 text: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply to be read"
    if isinstance(cause, ValueError):  # Python's bound on an integer's digits
        return f"the body cannot be read: {cause}"
    return f"the body cannot be read: {type(cause).__name__}"


def _json_response(body: dict) -> Response:
    """`body` encoded as FastAPI encodes a dict an endpoint returns. Non-streamed completions call it off the event
    loop: 64 samples of 1,000 tokens with 20 logprobs each (a 36 MB response) built and encoded on the loop held
    every other client's stream and /health for 7.8 s (a helper's probe)."""
    return JSONResponse(jsonable_encoder(body))


async def _sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A streamed response's chunks, then `[DONE]`. After the first byte an error can only be reported in the stream:
    as one error event before `[DONE]`. Its end by the server (cancelled, or closed where the client went away) is
    no error: `chunks` is closed with it, and nothing more is sent."""
    async with aclosing(chunks):
        try:
            async for event in chunks:
                yield event
        except Exception as e:  # noqa: BLE001 - reported in the stream
            yield _stream_error(e)
    yield "data: [DONE]\n\n"


def _stream_error(e: Exception) -> str:
    if isinstance(e, EngineStopped):
        error = APIError(503, str(e), "server_error", code=503)
    elif isinstance(e, APIError):
        error = e
    else:
        logger.exception("torch_shift server: a stream failed", exc_info=e)
        error = APIError(500, "internal error while streaming", "server_error", code=500)
    return sse(error.body())


class _Usage:
    def __init__(self, stream_options):
        self.include = bool(stream_options and stream_options.include_usage)
        # vLLM's: usage in every chunk only where the stream reports usage at all
        self.continuous = self.include and bool(stream_options.continuous_usage_stats)
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def saw(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.cached_tokens[index] = out.num_cached_tokens

    def totals(self) -> dict:
        return _usage(sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values()))


async def _completion_chunks(rid: str, submission: Submission, model: str, body: CompletionRequest, echo_only: bool,
                             tokenizer) -> AsyncIterator[str]:
    created = int(time.time())
    trackers: dict[int, DeltaTracker] = {}
    offsets: dict[int, TextOffsets] = {}  # choice -> where its next token starts in its text
    usage = _Usage(body.stream_options)

    def chunk(choices: list[dict], totals: dict | None = None) -> str:
        payload = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if totals is not None:
            payload["usage"] = totals
        return sse(payload)

    async for index, out in submission:
        usage.saw(index, out)
        tracker = trackers.setdefault(index, DeltaTracker())
        for delta in tracker.deltas(out):
            c, (t0, t1) = delta.choice, delta.token_range
            if c.finish_reason == "error":
                raise _generation_error(str(c.stop_reason), body.grammar_field)
            if echo_only and c.finish_reason is None:
                continue  # the prompt is all that is sent, once the one scored token is there
            choice_index = index * body.n + c.index
            text, token_ids, entries = delta.text, c.token_ids[t0:t1], list((c.logprobs or [])[t0:t1])
            if echo_only:
                text, token_ids, entries = "", [], []
            else:
                usage.completion_tokens += t1 - t0
            prefix = EchoedPrompt()
            if body.echo and delta.first:
                prefix = EchoedPrompt.of(out, tokenizer, body.logprobs is not None)
            logprobs = None
            if body.logprobs is not None:
                if choice_index not in offsets:
                    offsets[choice_index] = TextOffsets(tokenizer, out.prompt_token_ids, len(prefix.text),
                                                          body.skip_special_tokens)
                logprobs = completion_logprobs(prefix.token_ids + token_ids, prefix.entries + entries,
                                                 prefix.offsets + offsets[choice_index].extend(token_ids),
                                                 tokenizer, body.logprobs)
            finish = ("length" if echo_only else c.finish_reason) if c.finish_reason else None
            choice = {"index": choice_index, "text": prefix.text + text, "logprobs": logprobs,
                      "finish_reason": finish,  # stop_reason in every chunk (null until the last), as vLLM's
                      "stop_reason": None if finish is None or echo_only else c.stop_reason}
            yield chunk([choice], usage.totals() if usage.continuous else None)
    if usage.include:
        yield chunk([], usage.totals())


async def _chat_chunks(rid: str, submission: Submission, model: str, body: ChatCompletionRequest, tokenizer,
                       output: ChatOutputFormat, grammar_field: str, num_prompt_tokens: int) -> AsyncIterator[str]:
    created = int(time.time())
    usage = _Usage(body.stream_options)

    def chunk(choices: list[dict], totals: dict | None = None) -> str:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
        if totals is not None:
            payload["usage"] = totals
        return sse(payload)

    # vLLM's role chunks carry continuous usage too: the prompt's tokens, none generated (whether the prefix
    # cache held some is known once the first token is, in the next chunk's prompt_tokens_details)
    role_usage = ({"prompt_tokens": num_prompt_tokens, "completion_tokens": 0, "total_tokens": num_prompt_tokens}
                  if usage.continuous else None)
    for i in range(body.n):
        yield chunk([{"index": i, "delta": {"role": output.role, "content": ""}, "logprobs": None,
                      "finish_reason": None}], role_usage)
    tracker = DeltaTracker()
    parsers = [output.parser() for _ in range(body.n)]
    async for _, out in submission:
        usage.saw(0, out)
        for delta in tracker.deltas(out):
            c, (t0, t1) = delta.choice, delta.token_range
            if c.finish_reason == "error":
                raise _generation_error(str(c.stop_reason), grammar_field)
            usage.completion_tokens += t1 - t0
            parser = parsers[c.index]
            fields = parser.feed(delta.text) if delta.text else {}
            finish = None
            if c.finish_reason is not None:
                for key, value in parser.finish(c.finish_reason).items():
                    fields[key] = fields.get(key, [] if key == "tool_calls" else "") + value
                finish = output.finish_reason(c.finish_reason, parser.tools_called)
            logprobs = (chat_logprobs(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], tokenizer,
                                      body.top_logprobs or 0) if body.logprobs and not output.hides_reasoning
                        else None)
            if fields or logprobs or finish:
                choice = {"index": c.index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice], usage.totals() if usage.continuous else None)
    if usage.include:
        yield chunk([], usage.totals())


def run_server(engine_args, args) -> int:
    """`torch-shift serve`: serve until SIGINT/SIGTERM or a fatal engine error; the process's exit code (1 after
    an engine failure or stall, so that a supervisor restarts it). `args` holds options.add_server_args'."""
    import gc
    import os

    import uvicorn

    from torch_shift.serve.options import API_KEY_ENV

    server: uvicorn.Server | None = None
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails in a second

    def exit_on_fatal() -> None:  # from the engine or watchdog thread; clients in flight have their errors
        def leave() -> None:
            if server is not None:
                server.should_exit = True

        # /health answers 503 for a moment before the port closes, for balancers that poll it
        threading.Timer(_FATAL_EXIT_DELAY_S, leave).start()

    try:
        app, async_engine = create_server(
            engine_args, served_model_name=args.served_model_name,
            api_key=args.api_key or os.environ.get(API_KEY_ENV), max_waiting_seqs=args.max_waiting_seqs,
            max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_prompts_per_request=args.max_prompts_per_request,
            step_deadline_s=args.step_deadline_s, on_fatal=exit_on_fatal, chat_options=ChatOptions.from_args(args),
            log_requests=args.enable_log_requests, cors=CorsOptions.from_args(args))
    except BaseException:
        sock.close()
        raise

    name = app.state.served_model_name

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # bound: say where (with --port 0, the port the system chose)
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
                print(f"[torch-shift] serving {name!r} on {url} (OpenAI API at {url}/v1; {url}/health, "
                      f"{url}/metrics); Ctrl+C stops", file=sys.stderr, flush=True)

        async def shutdown(self, sockets=None) -> None:
            async_engine.close()  # clients in flight get an explicit 503 now, not after a drain
            await super().shutdown(sockets)

    # this process is the library's own (the CLI) and what is built lives as long as it: keep it out of the
    # cyclic collector's full passes (~230 ms over torch's objects every few hundred steps, bench_engine.py)
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = Server(config)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again under the handler it found:
    # Python's SIGINT handler (a KeyboardInterrupt and its traceback) and SIGTERM's default (the process killed
    # before the engine's ranks are stopped below). Both end here as the stop they asked for.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_stop) if on_main_thread else None
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _StopSignal):
        pass
    finally:
        if on_main_thread:  # a supervisor's second SIGTERM does not cut the ranks' stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sock.close()
        app.state.stop()  # also after a forced exit, which skips the lifespan's shutdown
        gc.unfreeze()  # frozen objects outlive the interpreter's last collection (nanobind, under triton, lists them)
        if on_main_thread:  # None: a handler installed from C, which Python cannot put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)
    if server.started:  # also where uvicorn ended on the signal itself, raising nothing
        print("[torch-shift] stopped", file=sys.stderr, flush=True)
    return 0 if async_engine.error is None else 1


class _StopSignal(Exception):
    """SIGTERM, raised again by uvicorn after its graceful shutdown."""


def _raise_stop(signum, frame) -> None:
    raise _StopSignal


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) as uvicorn binds it; a taken port or an address this
    machine does not have is the user's mistake, said in terms of the flags."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); choose a free "
                             "port with --port, or --port 0 for any free one") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


def create_server(engine_args, served_model_name: str | Sequence[str] | None = None,
                  api_key: str | Sequence[str] | None = None,
                  max_waiting_seqs: int = 256, max_body_bytes: int = 1 << 20, max_n: int = 128,
                  max_prompts_per_request: int = 256, step_deadline_s: float = 30.0,
                  on_fatal: Callable[[], None] | None = None, chat_options: ChatOptions | None = None,
                  log_requests: bool = False, cors: CorsOptions | None = None) -> tuple[FastAPI, AsyncEngine]:
    """Build the engine (rank 0 of a parallel one starts its other ranks), its async wrapper and the app.
    `on_fatal` runs (from another thread) when the engine failed or stalled; every client in flight has been
    told by then. `chat_options`: tools and reasoning (vLLM's --enable-auto-tool-choice, --tool-call-parser,
    --reasoning-parser, --chat-template). `log_requests`: each admitted request logged at INFO on the
    "torch_shift.serve" logger (vLLM's --enable-log-requests). `cors`: which browser origins may call it (vLLM's
    --allowed-origins and its other CORS flags; by default any)."""
    from torch_shift.engine.llm_engine import LLMEngine

    chat_options = chat_options or ChatOptions()
    chat_options.template()  # a missing template file fails before the engine is built

    engine = LLMEngine(engine_args)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [engine_args.model]
    name = names[0]
    metrics = EngineMetrics(name)
    metrics.declare(engine)
    async_engine = AsyncEngine(engine, max_waiting_seqs=max_waiting_seqs, metrics=metrics,
                               step_deadline_s=step_deadline_s, on_fatal=on_fatal)

    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            async_engine.shutdown()  # requests still in flight end with an explicit 503 / stream error
            engine.shutdown()  # ends the ranks, even when the engine thread is stuck in a collective

    app = build_app(async_engine, names, metrics, api_key=api_key, max_body_bytes=max_body_bytes, max_n=max_n,
                    max_prompts_per_request=max_prompts_per_request, on_shutdown=stop, chat_options=chat_options,
                    log_requests=log_requests, cors=cors)
    app.state.stop = stop
    app.state.served_model_name = name
    return app, async_engine
