"""Small steps on the GEMV kernel's decode pool (kernels/cpu_linear.cpp).

A batch-1 decode step on the CPU streams every weight once, and a third of its time is other work (the interpreter,
attention, small kernels, sampling) during which memory sits idle. The pool is threads of the GEMV kernel's own that run
the step's matmuls with the calling thread and, between them, prefetch the weights that come next. For a step whose
matmuls all run the GEMV (at most `GEMV_MAX_ROWS` tokens: models/linear.py) and, where its attention runs on one
thread (outside the C++ decoder, whose attention and SiLU run on the pool's threads too), whose context is small
beside the weights, the runner arms the pool with a worker for each of its threads but one and the calling thread
runs everything else on one OpenMP thread: OpenMP's idle workers are ended first, and the thread
stays at one between such steps (sampling, proposals) until the engine's step returns, or OpenMP's workers would come
back and spin against the pool's on its cores for milliseconds. Only the calling thread's OpenMP thread count changes
(`omp_set_num_threads`, which torch reads as its own: `torch.get_num_threads()`); other threads and torch's default for
new ones keep theirs. A larger step puts the pool to sleep and runs on the thread's own count, as `idle` does when the
engine runs out of work. Going from one to the other costs 0.1-0.2 ms (OpenMP's workers ended and started again, the
pool's woken), so the pool starts only after `SMALL_STEPS_BEFORE_POOL` small steps in a row (each step of a
multi-step run one). Compiled forwards guard on the thread count: a runner compiles its layouts for one thread too
(ModelRunner._warm_up).

A step launched on the C++ decoder's own thread (asynchronous scheduling: torch_shift.models.native_decoder) takes the
pool's place: the pool's workers sleep, the decoder's thread runs the GEMVs as the pool's caller, and the calling
thread, on one OpenMP thread as for a pooled step, helps once it has prepared the next step and waits.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch
from torch import nn

from torch_shift.models.linear import gemv_rows, weight_bytes
from torch_shift.parallel.launch import openmp_function, release_openmp_threads

SMALL_STEPS_BEFORE_POOL = 8
MAX_WORKERS = 63  # the kernel's bound
# a step whose KV cache reads exceed this share of the weights' bytes keeps its threads for attention, where its
# attention runs outside the C++ decoder (on the step's one thread; the decoder's runs on the pool's threads)
KV_SHARE_OF_WEIGHTS = 0.05

_state = threading.local()  # .held: the calling thread's OpenMP threads before the pool took all but one


def _forget_in_child() -> None:
    global _state
    _state = threading.local()


os.register_at_fork(after_in_child=_forget_in_child)


def _set_threads(threads: int) -> None:
    """The calling thread's OpenMP threads (libgomp's per-thread setting where torch runs on libgomp, else torch's)."""
    set_threads = openmp_function("omp_set_num_threads", [ctypes.c_int], None)
    if set_threads is None:
        torch.set_num_threads(threads)
    else:
        set_threads(threads)


class DecodePool:
    """Whether and how a model's steps run on the pool; `enabled` False: never."""

    def __init__(self, model: nn.Module, device: torch.device, enabled: bool = True, kv_bytes_per_token: int = 0):
        # steps of up to this many tokens run every matmul on the GEMV kernel, which the pool runs
        self.max_tokens = gemv_rows(model) if enabled and device.type == "cpu" else 0
        self.enabled = self.max_tokens > 0
        self.kv_budget_tokens = (int(KV_SHARE_OF_WEIGHTS * weight_bytes(model) / kv_bytes_per_token)
                                 if kv_bytes_per_token else None)
        self.small_steps = 0  # steps in a row that the pool could run

    def workers(self, num_tokens: int, threads: int, kv_tokens: int = 0) -> int:
        """The pool's workers for a step of `num_tokens` tokens over `kv_tokens` cached ones, on `threads` threads."""
        if not (self.enabled and threads > 1 and 0 < num_tokens <= self.max_tokens):
            return 0
        if self.kv_budget_tokens is not None and kv_tokens > self.kv_budget_tokens:
            return 0
        return min(threads - 1, MAX_WORKERS)

    def step(self, num_tokens: int, kv_tokens: int = 0, threads: int | None = None,
             asynchronous: bool = False, num_steps: int = 1) -> int:
        """Set up a step of `num_tokens` tokens over `kv_tokens` cached ones (on this rank) to run on the pool where
        it may, else on `threads` threads (None: the calling thread's own); returns the pool's workers (with
        `asynchronous`, a step launched on the C++ decoder's thread: those it would have had, none armed;
        `num_steps`: a multi-step run's, each a small step). The thread stays at one OpenMP thread after a pooled
        step: `end_step` (the engine's step returns) or `idle` gives them back. (A plain call: a context manager,
        with nothing to undo, cost 5% of the Python of a batch-1 step.)"""
        from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

        held = getattr(_state, "held", None)
        if threads is None:
            threads = held if held is not None else torch.get_num_threads()
        workers = self.workers(num_tokens, threads, kv_tokens)
        self.small_steps = self.small_steps + num_steps if workers else 0
        armed = gemv_pool_workers()
        if workers and self.small_steps < SMALL_STEPS_BEFORE_POOL and not armed:
            workers = 0
        if workers:
            # not on one thread: not held yet, or the runner raised its count since (a DP replica alone with work
            # is given the idle rank's core each step); a step on the pool beside two OpenMP threads took 3x
            if held is None or torch.get_num_threads() > 1:
                if not armed or torch.get_num_threads() > 1:
                    release_openmp_threads(cached=True)  # 2 us where there are none, 120 us where there are
                hold_one_thread(threads)
            elif held != threads:  # given back when the engine's step returns
                _state.held = threads
        elif held is not None or torch.get_num_threads() != threads:
            _set_threads(threads)
            _state.held = None
        if asynchronous:
            if armed:
                arm_gemv_pool(0)
        elif workers != armed:
            workers = arm_gemv_pool(workers)
            if not workers and _state.held is not None:  # the system refused the pool's threads
                _set_threads(threads)
                _state.held = None
        return workers


def hold_one_thread(threads: int) -> None:
    """The calling thread on one OpenMP thread until `end_step` gives it `threads` back."""
    _set_threads(1)
    _state.held = threads


def end_step() -> None:
    """The calling thread gets its OpenMP threads back; the pool stays armed (the engine's step returned to its
    caller, who may run torch between steps)."""
    held = getattr(_state, "held", None)
    if held is not None:
        _set_threads(held)
        _state.held = None


def idle() -> None:
    """Out of work: the calling thread gets its threads back and the pool's threads sleep."""
    from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

    end_step()
    if gemv_pool_workers():
        arm_gemv_pool(0)


def stop() -> None:
    """An engine closing: as `idle`, and the pool's threads end (arming starts new ones)."""
    from torch_shift.kernels import stop_gemv_pool

    idle()
    stop_gemv_pool()
