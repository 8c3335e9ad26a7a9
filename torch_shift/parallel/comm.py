"""Collectives of the forward pass: functional collectives on explicit groups, with a ledger, and the
point-to-point transfers between pipeline stages.

A group whose ranks share one host runs its collectives through shared memory (torch_shift.parallel.shm,
registered by `use_shared_memory` when the deployment's groups are made): a gloo all-reduce of a decode
step's hidden states costs about 0.6 ms over TCP here, the same through shared memory 10 to 30 us. Inside
a compiled graph they are the custom ops `torch_shift::shm_*`, opaque to the compiler.

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

from torch_shift.custom_ops import custom_op
from torch_shift.parallel.shm import ShmCommunicator

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class CommLedger:
    """bytes[(layout, op)]: bytes this rank sent; calls[(layout, op)]: number of collectives."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, layout: str, op: str, nbytes: int, count: int = 1) -> None:
        """`count` collectives of `nbytes` sent each."""
        self.bytes[(layout, op)] += count * nbytes
        self.calls[(layout, op)] += count


_ledger: CommLedger | None = None
_layout = "base"
_link_bytes_per_s: float | None = None
_shared: dict[dist.ProcessGroup, int] = {}  # groups served through shared memory -> their communicator's index
_shared_by_id: list[ShmCommunicator] = []  # the communicators, by the index the custom ops name them with


def use_shared_memory(group: dist.ProcessGroup, communicator: ShmCommunicator) -> None:
    """Run the collectives of `group` through `communicator` (made over that group on every rank)."""
    _shared[group] = len(_shared_by_id)
    _shared_by_id.append(communicator)
    communicator.register_native(_shared[group])


def share_memory(group: dist.ProcessGroup, timeout_s: float) -> bool:
    """Collective over `group`: its collectives through a shared-memory communicator from now on, where its
    ranks can share one (ShmCommunicator.create); False where they keep the group's own backend."""
    communicator = ShmCommunicator.create(group, timeout_s)
    if communicator is not None:
        use_shared_memory(group, communicator)
    return communicator is not None


def release_shared_memory() -> None:
    """Back to the process groups' own collectives, closing the shared-memory communicators."""
    for communicator in _shared_by_id:
        communicator.close()
    _shared.clear()
    _shared_by_id.clear()


def _shared_id(group: dist.ProcessGroup) -> int | None:
    return _shared.get(group)


def shares_memory(group: dist.ProcessGroup) -> bool:
    """Whether a shared-memory communicator serves `group` (its ranks on one host)."""
    return group in _shared


def native_communicator(group: dist.ProcessGroup) -> int | None:
    """The id of the shared-memory communicator that serves `group`'s collectives in C++ (kernels/cpu_ops.cpp:
    UlyssesAttention's all-to-alls in compiled forwards, the C++ decoder's all-reduces on a tensor-parallel rank),
    or None: another backend, a communicator without the C++ operators, or an emulated link (whose delays, and the
    ledger's counts, only the Python collectives make)."""
    shared = _shared.get(group)
    if shared is None or _link_bytes_per_s is not None or _shared_by_id[shared].native_id is None:
        return None
    return shared


@custom_op("torch_shift::shm_all_reduce")
def _shm_all_reduce(x: torch.Tensor, communicator: int) -> torch.Tensor:
    return _shared_by_id[communicator].all_reduce(x)


@_shm_all_reduce.register_fake
def _(x: torch.Tensor, communicator: int) -> torch.Tensor:
    return torch.empty_like(x)


# On the CPU the operator's implementation is C++ (kernels/cpu_ops.cpp, registered with the first communicator), which
# calls these: the whole collective where it cannot run it, or the rest of one it published, to wait for the peers
custom_op("torch_shift::shm_all_reduce_python")(_shm_all_reduce.__wrapped__)


@custom_op("torch_shift::shm_all_reduce_resume")
def _shm_all_reduce_resume(x: torch.Tensor, communicator: int, step: int) -> torch.Tensor:
    return _shared_by_id[communicator].resume_all_reduce(x, step)


@custom_op("torch_shift::shm_all_to_all_resume")
def _shm_all_to_all_resume(x: torch.Tensor, communicator: int, step: int) -> torch.Tensor:
    return _shared_by_id[communicator].resume_all_to_all(x, step)


@custom_op("torch_shift::shm_all_gather_resume")
def _shm_all_gather_resume(x: torch.Tensor, communicator: int, step: int) -> torch.Tensor:
    return _shared_by_id[communicator].resume_all_gather(x, step)


@custom_op("torch_shift::shm_all_gather")
def _shm_all_gather(x: torch.Tensor, communicator: int, world: int) -> torch.Tensor:
    return _shared_by_id[communicator].all_gather(x)


@_shm_all_gather.register_fake
def _(x: torch.Tensor, communicator: int, world: int) -> torch.Tensor:
    return x.new_empty(world, *x.shape)


@custom_op("torch_shift::shm_all_to_all")
def _shm_all_to_all(x: torch.Tensor, communicator: int) -> torch.Tensor:
    return _shared_by_id[communicator].all_to_all(x)


@_shm_all_to_all.register_fake
def _(x: torch.Tensor, communicator: int) -> torch.Tensor:
    return torch.empty_like(x)


@contextmanager
def recording(ledger: CommLedger | None):
    """Count the collectives run inside the block into `ledger` (None: none counted)."""
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


def _all_reduce_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n  # ring all-reduce: each rank sends 2 (n - 1) / n of the tensor


def _all_to_all_bytes(nbytes: int, n: int) -> int:
    return (n - 1) * nbytes // n  # equal parts: each rank keeps its own 1 / n


def record_outside(op: str, count: int, nbytes: int, group: dist.ProcessGroup) -> None:
    """Count `count` collectives `op` ("all_reduce", "all_to_all" of equal parts, or "all_gather" of each rank's
    part) of tensors of `nbytes` (a rank's part, for "all_gather") over `group` that ran outside this module (inside
    the C++ decoder's call: torch_shift.parallel.layers' ShardDecoder and UlyssesDecoder), as the functions below
    count their own."""
    if _ledger is None or torch.compiler.is_compiling():
        return
    n = _size(group)
    if op == "all_reduce":
        sent = _all_reduce_bytes(nbytes, n)
    elif op == "all_to_all":
        sent = _all_to_all_bytes(nbytes, n)
    else:
        assert op == "all_gather", op
        sent = (n - 1) * nbytes  # as all_gather counts its own
    if n > 1:
        _ledger.record(_layout, op, sent, count)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    nbytes = _all_reduce_bytes(x.numel() * x.element_size(), n)
    _record("all_reduce", nbytes)
    shared = _shared_id(group)
    if shared is not None:
        out = _shm_all_reduce(x, shared) if torch.compiler.is_compiling() else _shared_by_id[shared].all_reduce(x)
    else:
        out = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    _link_delay(nbytes)
    return out


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, input_split_sizes: list[int] | None = None,
               output_split_sizes: list[int] | None = None) -> torch.Tensor:
    """dim 0 split in equal parts, or in `input_split_sizes` rows: part j goes to group rank j; the result
    stacks what each rank sent (`output_split_sizes[j]` rows from rank j). Unequal parts run eagerly only."""
    n = _size(group)
    if n == 1:
        return x
    row_bytes = x[:1].numel() * x.element_size()
    if input_split_sizes is None:
        nbytes = _all_to_all_bytes(x.numel() * x.element_size(), n)
    else:
        nbytes = (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)]) * row_bytes
    _record("all_to_all", nbytes)
    shared = _shared_id(group)
    if input_split_sizes is not None:
        assert not torch.compiler.is_compiling(), "unequal all-to-all parts inside a compiled graph"
        if shared is not None:
            out = _shared_by_id[shared].all_to_all(x, input_split_sizes, output_split_sizes)
        else:
            out = funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), output_split_sizes,
                                                              input_split_sizes, group))
    elif shared is not None:
        out = _shm_all_to_all(x, shared) if torch.compiler.is_compiling() else _shared_by_id[shared].all_to_all(x)
    else:
        out = funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))
    _link_delay(nbytes)
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    nbytes = (n - 1) * x.numel() * x.element_size()
    _record("all_gather", nbytes)
    shared = _shared_id(group)
    if shared is not None:  # stacked [n, *x.shape]: as the functional collective's [n * rows, ...] once flattened
        stacked = (_shm_all_gather(x, shared, n) if torch.compiler.is_compiling()
                   else _shared_by_id[shared].all_gather(x))
        out = stacked.reshape(n * x.shape[0], *x.shape[1:])
    else:
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
