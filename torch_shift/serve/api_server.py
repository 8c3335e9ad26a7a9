"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Bad input gets a 4xx with an OpenAI-style error body and the server keeps serving; a full waiting
queue is a 429, an engine that stopped a 503.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from torch_shift.engine.outputs import CompletionOutput, RequestOutput
from torch_shift.serve.async_engine import AsyncEngine, EngineFull, EngineStopped
from torch_shift.serve.metrics import EngineMetrics
from torch_shift.serve.protocol import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def build_app(engine: AsyncEngine, served_model_name: str, metrics: EngineMetrics, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="torch_shift", version="0.1.0", lifespan=lifespan)
    tokenizer = engine.engine.tokenizer

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(401, "invalid or missing API key", "authentication_error",
                                      code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return error_response(413, f"request body larger than {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           code="model_not_found")

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(503, f"engine failed: {engine.error}", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "torch_shift"}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def run(request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        try:
            async for out in engine.generate(request_id, prompt, params):
                yield out
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        except EngineFull as e:
            raise APIError(429, str(e), "rate_limit_error") from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_error") from None

    def sampling(body, max_tokens, logprobs, prompt_logprobs):
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    # -- completions --------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        if body.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt per request", param="prompt")
        echo_only = body.echo and body.max_tokens == 0  # lm-eval's loglikelihood: prompt logprobs only
        if body.max_tokens is not None and body.max_tokens < 1 and not echo_only:
            raise APIError(400, f"max_tokens must be >= 1, got {body.max_tokens}", param="max_tokens")
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = sampling(body, 1 if echo_only else body.max_tokens, body.logprobs, prompt_logprobs)
        rid = engine.new_request_id("cmpl")
        created = int(time.time())
        model = served_model_name
        if body.stream:
            stream = run(rid, prompts[0], params)
            first = await _first(stream)  # errors before the first byte are proper HTTP errors
            return StreamingResponse(_completion_chunks(first, stream, rid, created, model, body, tokenizer),
                                     media_type="text/event-stream")
        async def final_output(i: int, prompt) -> RequestOutput:
            final = None
            async for out in run(f"{rid}-{i}", prompt, params):
                final = out
            return final

        finals = await asyncio.gather(*(final_output(i, p) for i, p in enumerate(prompts)))  # all prompts batch
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, final in enumerate(finals):
            usage["prompt_tokens"] += len(final.prompt_token_ids)
            for c in final.outputs:
                usage["completion_tokens"] += 0 if echo_only else len(c.token_ids)
                choices.append(_completion_choice(i * body.n + c.index, final, c, body, echo_only, tokenizer))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage}

    # -- chat ---------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        if tokenizer is None or tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                   tokenize=True)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, max_tokens, logprobs, None)
        rid = engine.new_request_id("chatcmpl")
        created = int(time.time())
        if body.stream:
            stream = run(rid, prompt, params)
            first = await _first(stream)
            return StreamingResponse(_chat_chunks(first, stream, rid, created, served_model_name, body, tokenizer),
                                     media_type="text/event-stream")
        final = None
        async for out in run(rid, prompt, params):
            final = out
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": (_chat_logprobs(c.logprobs, c.token_ids, tokenizer, body.top_logprobs or 0)
                                 if body.logprobs else None),
                    "finish_reason": c.finish_reason} for c in final.outputs]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": served_model_name,
                "choices": choices, "usage": {"prompt_tokens": len(final.prompt_token_ids),
                                              "completion_tokens": completion_tokens,
                                              "total_tokens": len(final.prompt_token_ids) + completion_tokens}}

    return app


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()


def _hold_back(params_stop, finished: bool) -> int:
    """Characters to hold back while streaming: the start of a stop string may still be cut."""
    if finished or not params_stop:
        return 0
    stops = [params_stop] if isinstance(params_stop, str) else params_stop
    return max(len(s) for s in stops) - 1


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _deltas(first: RequestOutput, stream: AsyncIterator[RequestOutput], stop):
    """(choice, new text, new token range) per choice and step; text held back near stop strings."""
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    out = first
    while True:
        for c in out.outputs:
            end = len(c.text) - _hold_back(stop, c.finish_reason is not None)
            start = sent_chars.get(c.index, 0)
            t0, t1 = sent_tokens.get(c.index, 0), len(c.token_ids)
            if end > start or t1 > t0 or c.finish_reason is not None:
                if end > start:
                    sent_chars[c.index] = end
                sent_tokens[c.index] = t1
                yield c, c.text[start:max(start, end)], (t0, t1)
        if out.finished:
            return
        out = await stream.__anext__()


async def _completion_chunks(first, stream, rid, created, model, body: CompletionRequest, tokenizer):
    try:
        prompt_text = _prompt_text(first, tokenizer)
        echoed = set()
        completion_tokens = 0
        async for c, text, (t0, t1) in _deltas(first, stream, body.stop):
            if body.echo and c.index not in echoed:
                echoed.add(c.index)
                text = prompt_text + text
            completion_tokens += t1 - t0
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(c.logprobs[t0:t1], c.token_ids[t0:t1], tokenizer, body.logprobs)
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                     "finish_reason": c.finish_reason}]})
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = {"prompt_tokens": len(first.prompt_token_ids), "completion_tokens": completion_tokens,
                     "total_tokens": len(first.prompt_token_ids) + completion_tokens}
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                        "usage": usage})
    except APIError as e:  # after the first byte an error can only be reported in the stream
        yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    yield "data: [DONE]\n\n"


async def _chat_chunks(first, stream, rid, created, model, body: ChatCompletionRequest, tokenizer):
    def chunk(choices, usage=None):
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return _sse(payload)

    try:
        for i in range(len(first.outputs)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        completion_tokens = 0
        async for c, text, (t0, t1) in _deltas(first, stream, body.stop):
            completion_tokens += t1 - t0
            logprobs = (_chat_logprobs(c.logprobs[t0:t1], c.token_ids[t0:t1], tokenizer, body.top_logprobs or 0)
                        if body.logprobs else None)
            yield chunk([{"index": c.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], {"prompt_tokens": len(first.prompt_token_ids), "completion_tokens": completion_tokens,
                             "total_tokens": len(first.prompt_token_ids) + completion_tokens})
    except APIError as e:
        yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
    yield "data: [DONE]\n\n"


def _prompt_text(out: RequestOutput, tokenizer) -> str:
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.token_to_str(token_id) if tokenizer is not None else str(token_id)


def _top(entry, k: int, tokenizer) -> list[tuple[str, float]]:
    """The k most likely tokens of a position (the chosen token too, only if it is among them)."""
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(_token_text(tokenizer, t), logprob) for _, t, logprob in ranked]


def _completion_logprobs(position_logprobs, token_ids, tokenizer, k: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, position_logprobs):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(None if entry is None else entry[token_id].logprob)  # the first prompt token has none
        tops.append(None if entry is None else dict(_top(entry, k, tokenizer)))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _completion_choice(index: int, out: RequestOutput, c: CompletionOutput, body: CompletionRequest,
                       echo_only: bool, tokenizer) -> dict:
    text = "" if echo_only else c.text
    token_ids = [] if echo_only else c.token_ids
    position_logprobs = [] if echo_only else (c.logprobs or [])
    if body.echo:
        text = _prompt_text(out, tokenizer) + text
    logprobs = None
    if body.logprobs is not None:
        if body.echo:
            token_ids = out.prompt_token_ids + token_ids
            position_logprobs = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + position_logprobs
        logprobs = _completion_logprobs(position_logprobs, token_ids, tokenizer, body.logprobs)
    finish = "length" if echo_only else c.finish_reason
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _chat_logprobs(position_logprobs, token_ids, tokenizer, k: int) -> dict:
    content = []
    for token_id, entry in zip(token_ids, position_logprobs or []):
        text = _token_text(tokenizer, token_id)
        top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(entry, k, tokenizer)]
        content.append({"token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def create_server(engine_args, served_model_name: str | None = None, api_key: str | None = None,
                  max_waiting_requests: int = 256, max_body_bytes: int = 1 << 20) -> tuple[FastAPI, AsyncEngine]:
    """Build the engine (rank 0 of a parallel one starts its other ranks), its async wrapper and the app."""
    from torch_shift.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_args)
    name = served_model_name or engine_args.model
    metrics = EngineMetrics(name)
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, metrics=metrics)
    def stop() -> None:
        async_engine.shutdown()  # requests still in flight end with an explicit 503 / stream error
        engine.shutdown()

    app = build_app(async_engine, name, metrics, api_key=api_key, max_body_bytes=max_body_bytes, on_shutdown=stop)
    return app, async_engine
