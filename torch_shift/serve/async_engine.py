"""The engine behind the server: one thread steps the engine; clients await their outputs.

Only the engine thread touches the engine. Clients hand it additions and aborts through a queue;
it runs them between steps, so new requests join the running batch at the next step. Each
request's outputs (cumulative `RequestOutput`s) come back on its own asyncio queue. A client that
stops listening aborts its request, which frees its KV blocks. A full waiting queue refuses new
requests (`EngineFull`); shutdown ends every request still in flight with `EngineStopped`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from torch_shift.engine.llm_engine import LLMEngine, Prompt
from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.sampling_params import SamplingParams


class EngineFull(RuntimeError):
    """The waiting queue is full: the client should retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine shut down or failed before the request finished (HTTP 503)."""


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, metrics=None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Add] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._ids = 0
        self._id_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="torch-shift-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) -------------------------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        with self._id_lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. Raises ValueError/TypeError for bad
        input, EngineFull when the waiting queue is full, EngineStopped on shutdown."""
        if self._stopping or self.error is not None:
            raise EngineStopped("the engine is shutting down" if self.error is None else f"engine failed: {self.error}")
        if self.num_waiting + self._commands.qsize() >= self.max_waiting_requests:
            raise EngineFull(f"{self.max_waiting_requests} requests are already waiting")
        outputs: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request_id, prompt, params, outputs, asyncio.get_running_loop()))
        self._wake.set()
        if not self._thread.is_alive():  # it ended after the check above: nobody would answer
            raise EngineStopped("the engine is shutting down")
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away (or an error): free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, fail those in flight explicitly, stop the engine thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    # -- engine thread ------------------------------------------------------------------------------------
    def _deliver(self, stream: _Add, item) -> None:
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params,
                                            arrival_time=time.monotonic())
                except (ValueError, TypeError) as e:
                    self._deliver(command, e)
                    continue
                self._streams[command.request_id] = command
            else:
                _, request_id = command
                if request_id in self._streams:
                    self.engine.abort_request(request_id)
                    del self._streams[request_id]
                    if self.metrics is not None:
                        self.metrics.on_finished("abort", request_id)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if self.metrics is not None:
                    self.metrics.on_step(self.engine)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue  # aborted meanwhile
                    if self.metrics is not None:
                        self.metrics.on_output(out)
                    if out.finished:
                        del self._streams[out.request_id]
                    self._deliver(stream, out)
        except BaseException as e:  # noqa: BLE001 - every waiting client is told, then the thread ends
            self.error = e
        finally:
            reason = EngineStopped("the engine shut down" if self.error is None else f"engine failed: {self.error}")
            self._apply_commands()
            for request_id, stream in list(self._streams.items()):
                self.engine.abort_request(request_id)
                self._deliver(stream, reason)
                if self.metrics is not None:
                    self.metrics.on_finished("abort", request_id)
            self._streams.clear()
