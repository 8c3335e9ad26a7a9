"""Collectives of the forward pass: functional collectives on explicit groups, with a ledger.

Every collective counts the bytes this rank sends, per layout and operation, while a ledger is
active (eager runs: the benchmark and the tests). A group of one rank moves nothing and calls
nothing (gloo cannot even self-send in a group of one).
"""

from __future__ import annotations

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


def _record(op: str, nbytes: int) -> None:
    if _ledger is not None and not torch.compiler.is_compiling():
        _ledger.record(_layout, op, nbytes)


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    # ring all-reduce: each rank sends 2 (n - 1) / n of the tensor
    _record("all_reduce", 2 * (n - 1) * x.numel() * x.element_size() // n)
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """dim 0 split in equal parts: part j goes to group rank j; the result stacks what each rank sent."""
    n = _size(group)
    if n == 1:
        return x
    _record("all_to_all", (n - 1) * x.numel() * x.element_size() // n)
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    _record("all_gather", (n - 1) * x.numel() * x.element_size())
    out = funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))
    if dim == 0:
        return out
    # [n * rows, ...] -> concatenated along `dim`
    return torch.cat(out.chunk(n, dim=0), dim=dim)
