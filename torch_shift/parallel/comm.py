"""Collectives of the forward pass: functional collectives on explicit groups, with a ledger, and the
point-to-point transfers between pipeline stages.

Every collective counts the bytes this rank sends, per layout and operation, while a ledger is
active (eager runs: the benchmark and the tests). A group of one rank moves nothing and calls
nothing (gloo cannot even self-send in a group of one).

An emulated interconnect (off by default; `emulated_link`) makes every transfer take bytes /
bandwidth longer, so that one machine can sweep link speeds (paper 003, Fig. 14): a collective
waits that long after it completed (every rank of the group sends that many bytes), a pipeline
send leaves that long after it was posted, from a thread, while the sender computes on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class CommLedger:
    """bytes[(layout, op)]: bytes this rank sent; calls[(layout, op)]: number of collectives."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, layout: str, op: str, nbytes: int) -> None:
        self.bytes[(layout, op)] += nbytes
        self.calls[(layout, op)] += 1


_ledger: CommLedger | None = None
_layout = "base"
_link_bytes_per_s: float | None = None


@contextmanager
def recording(ledger: CommLedger):
    """Count the collectives run inside the block into `ledger`."""
    global _ledger
    previous, _ledger = _ledger, ledger
    try:
        yield ledger
    finally:
        _ledger = previous


@contextmanager
def layout_scope(layout: str):
    """Name the layout whose forward runs inside the block (the ledger's key)."""
    global _layout
    previous, _layout = _layout, layout
    try:
        yield
    finally:
        _layout = previous


@contextmanager
def emulated_link(bandwidth_gb_per_s: float | None):
    """Inside the block every transfer takes bytes / bandwidth (GB/s, 1e9 bytes) longer; None: no delay."""
    global _link_bytes_per_s
    previous, _link_bytes_per_s = _link_bytes_per_s, None if bandwidth_gb_per_s is None else bandwidth_gb_per_s * 1e9
    try:
        yield
    finally:
        _link_bytes_per_s = previous


def _record(op: str, nbytes: int) -> None:
    if _ledger is not None and not torch.compiler.is_compiling():
        _ledger.record(_layout, op, nbytes)


def _link_delay(nbytes: int) -> None:
    if _link_bytes_per_s is not None and not torch.compiler.is_compiling():
        time.sleep(nbytes / _link_bytes_per_s)


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    # ring all-reduce: each rank sends 2 (n - 1) / n of the tensor
    nbytes = 2 * (n - 1) * x.numel() * x.element_size() // n
    _record("all_reduce", nbytes)
    out = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    _link_delay(nbytes)
    return out


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """dim 0 split in equal parts: part j goes to group rank j; the result stacks what each rank sent."""
    n = _size(group)
    if n == 1:
        return x
    nbytes = (n - 1) * x.numel() * x.element_size() // n
    _record("all_to_all", nbytes)
    out = funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))
    _link_delay(nbytes)
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    nbytes = (n - 1) * x.numel() * x.element_size()
    _record("all_gather", nbytes)
    out = funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))
    _link_delay(nbytes)
    if dim == 0:
        return out
    # [n * rows, ...] -> concatenated along `dim`
    return torch.cat(out.chunk(n, dim=0), dim=dim)


class _DelayedSend:
    """A send that leaves after the emulated link's transfer time, from a thread of its own."""

    def __init__(self, x: torch.Tensor, dst: int, tag: int, delay_s: float):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(x, dst, tag, delay_s), daemon=True)
        self._thread.start()

    def _run(self, x: torch.Tensor, dst: int, tag: int, delay_s: float) -> None:
        try:
            time.sleep(delay_s)
            dist.isend(x, dst=dst, tag=tag).wait()
        except BaseException as e:  # noqa: BLE001 - raised in the thread that waits
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def isend(x: torch.Tensor, dst: int, tag: int):
    """Send `x` to global rank `dst` (a pipeline stage's activations); `.wait()` before reusing `x`."""
    nbytes = x.numel() * x.element_size()
    _record("send", nbytes)
    if _link_bytes_per_s is None:
        return dist.isend(x, dst=dst, tag=tag)
    return _DelayedSend(x, dst, tag, nbytes / _link_bytes_per_s)


def irecv(x: torch.Tensor, src: int, tag: int):
    """Receive into `x` from global rank `src`; `.wait()` before reading it."""
    return dist.irecv(x, src=src, tag=tag)
