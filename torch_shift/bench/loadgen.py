"""Send a request stream to an OpenAI-compatible server over HTTP and record what happened when.

Every request streams (`/v1/completions`, `stream: true`, `logprobs: 0` so that each chunk names
its tokens, `ignore_eos` so that outputs have the asked length); each generated token's arrival
time is recorded. Records follow `torch_shift.bench.report`'s input format.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx
from tqdm.auto import tqdm

from torch_shift.bench.traffic import RequestSpec


async def _one(http: httpx.AsyncClient, url: str, model: str | None, spec: RequestSpec, t0: float,
               config: str) -> dict:
    delay = t0 + spec.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    record = {"config": config, "id": spec.id, "arrival_s": spec.arrival_s, "start_s": time.monotonic() - t0,
              "first_token_s": None, "token_times_s": [], "end_s": None, "prompt_tokens": len(spec.prompt),
              "output_tokens": 0, "status": None, "error": None, "priority": spec.priority}
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True, "logprobs": 0,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    if spec.priority:
        body["priority"] = spec.priority
    if model is not None:
        body["model"] = model
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:300]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    now = time.monotonic() - t0
                    if "error" in chunk:
                        record["error"] = chunk["error"].get("message")
                        break
                    for choice in chunk.get("choices", []):
                        tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
                        record["token_times_s"].extend([now] * tokens)
                    if chunk.get("usage"):
                        record["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
    except httpx.HTTPError as e:
        record["error"] = f"{type(e).__name__}: {e}"
    record["end_s"] = time.monotonic() - t0
    record["output_tokens"] = len(record["token_times_s"])
    if record["token_times_s"]:
        record["first_token_s"] = record["token_times_s"][0]
    if record["error"] is not None and record["status"] == 200:
        record["status"] = 599  # failed inside the stream
    return record


async def run_load(url: str, specs: list[RequestSpec], model: str | None = None, config: str = "",
                   api_key: str | None = None, progress: bool = True, timeout_s: float = 600.0,
                   probes: list[tuple[float, Callable[[], Awaitable]]] = ()) -> list[dict]:
    """Send every request at its arrival time (all may be in flight at once); records by request.
    `probes`: (time from the start, coroutine function) pairs, each awaited at its time (e.g. scraping
    /metrics at phase boundaries)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as http:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_one(http, url.rstrip("/"), model, s, t0, config)) for s in specs]
        probe_tasks = [asyncio.create_task(_at(t0 + at, probe)) for at, probe in probes]
        records = []
        with tqdm(total=len(tasks), desc=f"bench {config}".strip(), disable=not progress) as bar:
            for done in asyncio.as_completed(tasks):
                records.append(await done)
                bar.update(1)
        for task in probe_tasks:
            await task
    return sorted(records, key=lambda r: r["arrival_s"])


async def _at(when: float, probe: Callable[[], Awaitable]) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await probe()
