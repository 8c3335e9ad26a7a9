"""The engine behind the server: one thread steps the engine; clients await their outputs.

Only the engine thread touches the engine's requests. A client submits all the prompts of one HTTP
request at once (`open`): admission counts the sequences they add (n per prompt) against the waiting
limit, and the engine thread adds them together, so either every prompt runs or none does. Outputs come
back on the submission's asyncio queue; leaving `open` aborts whatever has not finished (a client that
went away, an error), which frees the KV blocks. Aborts and additions run between steps.

A watchdog thread checks that the engine makes progress: a step that runs past the step deadline (a
configured floor, or many times the longest recent step), or a rank that stopped answering, makes the
engine failed: every client in flight gets an explicit error, /health says 503, and `on_fatal` tells
the server to exit (non-zero) so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from torch_shift.engine.llm_engine import LLMEngine, Prompt, TokenizedPrompt
from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.sampling_params import SamplingParams

logger = logging.getLogger("torch_shift.serve")

_STEP_DEADLINE_FACTOR = 20  # a step this many times longer than the longest recent one is a stall
_RECENT_STEPS = 128


class EngineFull(RuntimeError):
    """The waiting queue is full: the client should retry later (HTTP 429 with Retry-After)."""

    retry_after_s = 1


class EngineStopped(RuntimeError):
    """The engine shut down, failed or stalled before the request finished (HTTP 503)."""


@dataclass
class Submission:
    """The engine requests of one client request; outputs arrive as (index, RequestOutput)."""

    request_ids: list[str]
    prompts: list[Prompt | TokenizedPrompt]
    params: list[SamplingParams]
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future  # set by the engine thread once the prompts are added (or refused)
    priority: int = 0  # lower is more urgent, as in vLLM
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set[int] = field(default_factory=set)

    @property
    def num_seqs(self) -> int:
        return sum(p.n for p in self.params)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each engine request's cumulative outputs, interleaved, until all have finished."""
        while len(self.finished) < len(self.request_ids):
            index, item = await self.outputs.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.finished.add(index)
            yield index, item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_seqs: int = 256, metrics=None, step_deadline_s: float = 30.0,
                 on_fatal: Callable[[], None] | None = None):
        self.engine = engine
        self.max_waiting_seqs = max_waiting_seqs
        self.metrics = metrics
        self.step_deadline_s = step_deadline_s
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _streams and _pending_seqs (engine thread, watchdog, clients)
        self._streams: dict[str, tuple[Submission, int]] = {}
        # requests of several samples (engine thread): their samples' outputs so far, merged (None before the first)
        self._samples: dict[str, RequestOutput | None] = {}
        self._pending_seqs = 0  # submitted, not yet added by the engine thread
        self._stopping = False
        self._step_started: float | None = None
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=_RECENT_STEPS)
        self._thread = threading.Thread(target=self._run, name="torch-shift-engine", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="torch-shift-watchdog", daemon=True)
        self._watchdog.start()

    # -- client side (event loop) -------------------------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        """A fresh id, as vLLM's: unique across the server's restarts too (clients log and compare them)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    @property
    def num_waiting_seqs(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_seqs

    @property
    def stopping(self) -> bool:
        """Whether the server closed it (it takes no requests)."""
        return self._stopping

    @asynccontextmanager
    async def open(self, request_ids: list[str], prompts: list[Prompt | TokenizedPrompt],
                   params: list[SamplingParams], priority: int = 0) -> AsyncIterator[Submission]:
        """Add the prompts as engine requests, all or none; abort the unfinished ones on leaving. Raises
        ValueError/TypeError for bad input, EngineFull when the waiting queue is full, EngineStopped when the
        engine does not run."""
        loop = asyncio.get_running_loop()
        submission = Submission(request_ids, prompts, params, loop, accepted=loop.create_future(), priority=priority)
        self._check_running()
        if any(p.structured_outputs is not None for p in params):
            # compiled here, off the engine's thread, whose step then copies them (a large schema took 0.3 s a
            # sequence there, every other client waiting)
            await asyncio.to_thread(self.engine.input_processor.compile_grammars, params)
        with self._lock:
            if self.num_waiting_seqs + submission.num_seqs > self.max_waiting_seqs:
                raise EngineFull(f"the server queues at most {self.max_waiting_seqs} waiting sequences and "
                                 f"{self.num_waiting_seqs} are waiting; this request adds {submission.num_seqs}")
            self._pending_seqs += submission.num_seqs
        self._commands.put(submission)
        self.engine.interrupt_run()  # a multi-step run in progress ends after its step
        self._wake.set()
        try:
            while not submission.accepted.done():
                await asyncio.wait({submission.accepted}, timeout=0.5)
                if not submission.accepted.done():
                    self._check_running()  # the engine ended, failed or stalled: nobody will answer
            submission.accepted.result()  # raises what the engine thread refused the prompts with
            yield submission
        finally:
            for index, request_id in enumerate(request_ids):
                if index not in submission.finished:
                    self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self.engine.interrupt_run()
        self._wake.set()

    def close(self) -> None:
        """Stop taking requests and fail those in flight explicitly (does not wait)."""
        self._stopping = True
        self._wake.set()
        self._fail_all(EngineStopped("the server is shutting down"))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """close(), then wait for the engine thread to leave its step: at most timeout_s, and not at all once
        the engine is stalled (a thread stuck in a collective is left to the engine's shutdown, which ends the
        ranks)."""
        self.close()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and self.stall() is None and time.monotonic() < deadline:
            self._thread.join(timeout=0.05)

    def stall(self) -> str | None:
        """Why the engine is not making progress, or None while it is."""
        started = self._step_started
        if started is not None:
            running_s = time.monotonic() - started
            deadline = max(self.step_deadline_s, _STEP_DEADLINE_FACTOR * max(self._recent_steps, default=0.0))
            if running_s > deadline:
                return f"step {self.engine.num_steps} has run for {running_s:.1f} s (deadline {deadline:.1f} s)"
        return self.engine.unresponsive_reason(self.step_deadline_s)  # heartbeats: also while idle

    def _check_running(self) -> None:
        if self.error is not None:
            raise EngineStopped("the engine failed; the server is restarting")
        if self._stopping or not self._thread.is_alive():
            raise EngineStopped("the server is shutting down")

    # -- engine thread ------------------------------------------------------------------------------------
    @staticmethod
    def _call_in_loop(submission: Submission, fn, *args) -> None:
        try:
            submission.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the client's event loop is closed: nobody listens any more
            pass

    def _deliver(self, submission: Submission, index: int, item) -> None:
        self._call_in_loop(submission, submission.outputs.put_nowait, (index, item))

    def _settle(self, submission: Submission, error: BaseException | None) -> None:
        def settle() -> None:
            if submission.accepted.done():
                return
            if error is None:
                submission.accepted.set_result(None)
            else:
                submission.accepted.set_exception(error)

        self._call_in_loop(submission, settle)

    def _add(self, submission: Submission) -> None:
        with self._lock:
            self._pending_seqs -= submission.num_seqs
        added: list[str] = []
        try:
            for request_id, prompt, params in zip(submission.request_ids, submission.prompts, submission.params):
                self.engine.add_request(request_id, prompt, params, priority=submission.priority)
                added.append(request_id)
                if params.n > 1:
                    self._samples[request_id] = None
        except (ValueError, TypeError) as e:
            for request_id in added:  # all of a client request's prompts run, or none
                self.engine.abort_request(request_id)
                self._samples.pop(request_id, None)
            self._settle(submission, e)
            return
        with self._lock:
            for index, request_id in enumerate(submission.request_ids):
                self._streams[request_id] = (submission, index)
        self._settle(submission, None)

    def _apply_commands(self) -> None:
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            changed = True
            if isinstance(command, Submission):
                if self._stopping or self.error is not None:
                    with self._lock:
                        self._pending_seqs -= command.num_seqs
                    self._settle(command, EngineStopped("the server is shutting down"))
                else:
                    self._add(command)
                continue
            _, request_id = command
            tracked = self.engine.output_processor.requests.get(request_id)
            # each of its sequences counts as vLLM's child requests do: by its own end, or as aborted here
            reasons = [child.status.value if child.status.finished else "abort"
                       for child in tracked.parent.children] if tracked is not None else []
            self.engine.abort_request(request_id)  # a no-op for a request that already finished
            self._samples.pop(request_id, None)
            with self._lock:
                known = self._streams.pop(request_id, None) is not None
            if known and self.metrics is not None:
                for reason in reasons or ["abort"]:
                    self.metrics.on_finished(reason, request_id)
        if changed and self.metrics is not None:
            self.metrics.update_gauges(self.engine)  # aborts free blocks now, not at the next step

    def _step(self) -> None:
        self._step_started = time.monotonic()
        outputs = self.engine.step()
        self._recent_steps.append(time.monotonic() - self._step_started)
        self._step_started = None
        if self.metrics is not None:
            self.metrics.on_step(self.engine)
        # a request of several samples advances by one output per sample that advanced (vLLM's engine): its client
        # gets them merged, all its samples in one output a step
        merged: dict[str, RequestOutput] = {}
        for out in outputs:
            if out.request_id in self._samples:
                whole = self._samples[out.request_id]
                if whole is None:
                    whole = self._samples[out.request_id] = replace(out, outputs=list(out.outputs))
                else:
                    whole.add(out, aggregate=False)
                    whole.metrics = out.metrics
                out = replace(whole, outputs=sorted(whole.outputs, key=lambda c: c.index))  # the client's own
                if out.finished:
                    del self._samples[out.request_id]
            merged[out.request_id] = out
        with self._lock:
            for out in merged.values():
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if self.metrics is not None:
                    self.metrics.on_output(out)
                if out.finished:
                    del self._streams[out.request_id]
                self._deliver(*stream, out)

    def _run(self) -> None:
        try:
            with self.engine.steps_in_a_row():  # this thread runs nothing but the engine
                while not self._stopping and self.error is None:
                    self.engine.clear_run_interrupt()  # before the commands: one that comes after interrupts
                    self._apply_commands()
                    if not self.engine.has_unfinished_requests():
                        self._wake.wait(timeout=0.5)
                        self._wake.clear()
                        continue
                    self._step()
        except BaseException as e:  # noqa: BLE001 - every waiting client is told, then the thread ends
            self._fatal(f"engine step failed: {type(e).__name__}: {e}", e)
        finally:
            with self._lock:
                in_flight = list(self._streams)
            for request_id in in_flight:
                self.engine.abort_request(request_id)
            self._fail_all(EngineStopped("the engine failed; the server is restarting" if self.error is not None
                                         else "the server is shutting down"))
            self._apply_commands()

    def _fail_all(self, error: EngineStopped) -> None:
        """Every client in flight gets `error` (from any thread; the engine's own state is left alone)."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, (submission, index) in streams.items():
            self._deliver(submission, index, error)
            if self.metrics is not None:
                self.metrics.on_finished("abort", request_id)

    def _fatal(self, reason: str, error: BaseException) -> None:
        if self.error is not None:
            return
        self.error = error
        logger.error("torch_shift engine: %s", reason)
        self._fail_all(EngineStopped("the engine failed; the server is restarting"))
        if self.on_fatal is not None:
            self.on_fatal()

    # -- watchdog thread ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = min(1.0, self.step_deadline_s / 4)
        while self._thread.is_alive() and self.error is None:
            reason = self.stall()
            if reason is not None:
                self._fatal(f"not making progress: {reason}", EngineStopped(reason))
                return
            time.sleep(interval)
