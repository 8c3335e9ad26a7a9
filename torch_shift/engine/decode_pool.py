"""Small steps on the GEMV kernel's decode pool (kernels/cpu_linear.cpp).

A batch-1 decode step on the CPU streams every weight once, and a third of its time is other work (the interpreter,
attention, small kernels) during which memory sits idle. The pool is threads of the GEMV kernel's own that run the
step's matmuls with the calling thread and, between them, prefetch the weights that come next. For a step of at most
`GEMV_MAX_ROWS` tokens (its matmuls all run the GEMV) the caller arms the pool with a worker for each of its threads
but one and runs the rest of the step on torch's one thread; OpenMP's idle workers are ended first, or they would
spin against the pool's on its cores for milliseconds. A larger step puts the pool to sleep and runs on torch's
threads. Compiled forwards guard on the thread count: a runner compiles its layouts for one thread too
(ModelRunner._warm_up).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from torch_shift.models.linear import GEMV_MAX_ROWS, gemv_reads_every_weight
from torch_shift.parallel.launch import release_openmp_threads


class DecodePool:
    """Whether and how a model's steps run on the pool; `enabled` False: never."""

    def __init__(self, model: nn.Module, device: torch.device, enabled: bool = True):
        self.enabled = enabled and device.type == "cpu" and gemv_reads_every_weight(model)

    def workers(self, num_tokens: int, threads: int | None = None) -> int:
        """The pool's workers for a step of `num_tokens` tokens on `threads` threads (default: torch's now)."""
        threads = torch.get_num_threads() if threads is None else threads
        return threads - 1 if self.enabled and threads > 1 and 0 < num_tokens <= GEMV_MAX_ROWS else 0

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[int]:
        """Run a step of `num_tokens` tokens (on this rank) on the pool where it may, else with the pool asleep;
        yields the pool's workers."""
        from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

        threads = torch.get_num_threads()
        workers = self.workers(num_tokens, threads)
        if workers:
            release_openmp_threads()  # 2 us where there are none (the usual case: the last step was the pool's too)
            torch.set_num_threads(1)
        if workers != gemv_pool_workers():
            arm_gemv_pool(workers)
        try:
            yield workers
        finally:
            if workers:
                torch.set_num_threads(threads)


def release_decode_pool() -> None:
    """Put the pool's threads to sleep (they take no core until armed again)."""
    from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers

    if gemv_pool_workers():
        arm_gemv_pool(0)
