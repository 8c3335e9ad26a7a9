"""Small steps on the GEMV kernel's decode pool (kernels/cpu_linear.cpp).

A batch-1 decode step on the CPU streams every weight once, and a third of its time is other work (the interpreter,
attention, small kernels, sampling) during which memory sits idle. The pool is threads of the GEMV kernel's own that
run the step's matmuls with the calling thread and, between them, prefetch the weights that come next. For a step
of at most `GEMV_MAX_ROWS` tokens (its matmuls all run the GEMV) the caller arms the pool with a worker for each of
its threads but one and runs everything else on torch's one thread: OpenMP's idle workers are ended first, and
torch stays on one thread between such steps (sampling, proposals), or OpenMP's workers would come back and spin
against the pool's on its cores for milliseconds. A larger step puts the pool to sleep and gives torch its threads
back, as `release_decode_pool` does when the engine runs out of work. Going from one to the other costs 0.1-0.2 ms
(OpenMP's workers ended and started again, the pool's woken), so the pool starts only after
`SMALL_STEPS_BEFORE_POOL` small steps in a row. Compiled forwards guard on the thread count: a runner compiles its
layouts for one thread too (ModelRunner._warm_up). The state is the process's: the target's and a draft model's
steps share the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from torch_shift.models.linear import GEMV_MAX_ROWS, gemv_reads_every_weight
from torch_shift.parallel.launch import release_openmp_threads

SMALL_STEPS_BEFORE_POOL = 8

_held_threads: int | None = None  # torch's threads before the pool took all but one (None: torch has them)


class DecodePool:
    """Whether and how a model's steps run on the pool; `enabled` False: never."""

    def __init__(self, model: nn.Module, device: torch.device, enabled: bool = True):
        self.enabled = enabled and device.type == "cpu" and gemv_reads_every_weight(model)
        self.small_steps = 0  # steps in a row that the pool could run

    def workers(self, num_tokens: int, threads: int) -> int:
        """The pool's workers for a step of `num_tokens` tokens on `threads` threads."""
        return threads - 1 if self.enabled and threads > 1 and 0 < num_tokens <= GEMV_MAX_ROWS else 0

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[int]:
        """Run a step of `num_tokens` tokens (on this rank) on the pool where it may, else on torch's threads;
        yields the pool's workers."""
        from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

        global _held_threads
        threads = torch.get_num_threads()
        if threads == 1 and _held_threads is not None:
            threads = _held_threads
        workers = self.workers(num_tokens, threads)
        self.small_steps = self.small_steps + 1 if workers else 0
        armed = gemv_pool_workers()
        if workers and self.small_steps < SMALL_STEPS_BEFORE_POOL and not armed:
            workers = 0
        if workers:
            if not armed or torch.get_num_threads() > 1:
                release_openmp_threads()  # 2 us where there are none, 120 us where there are
            torch.set_num_threads(1)
            _held_threads = threads
        elif _held_threads is not None:
            torch.set_num_threads(threads)
            _held_threads = None
        if workers != armed:
            arm_gemv_pool(workers)
        yield workers


def release_decode_pool() -> None:
    """Put the pool's threads to sleep and give torch its threads back (the engine out of work, or closing)."""
    from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

    global _held_threads
    if _held_threads is not None:
        torch.set_num_threads(_held_threads)
        _held_threads = None
    if gemv_pool_workers():
        arm_gemv_pool(0)
