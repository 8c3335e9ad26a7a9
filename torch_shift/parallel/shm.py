"""Collectives among the ranks of one host through a shared-memory segment; gloo only sets it up.

A gloo all-reduce between two local ranks goes through TCP and costs 0.5 to 1 ms here even for 4 KiB, and a
tensor-parallel decode step runs 16 or more of them. `ShmCommunicator` serves the same collectives through one segment in
/dev/shm that every rank of a process group maps (vLLM's CPU build does the same).

The segment: a header of one row of int64 words per rank, then two slots of `slot_bytes` per rank (one per
parity of the step number), then a page of int64 words the ranks share for their own use (`words`: the engine's
multi-step runs, torch_shift.parallel.runs). Group rank 0 creates the file, sends its name through the group, every
rank maps it and rank 0 removes it as soon as all have, so nothing is left behind when a process is killed.

The protocol. Every rank numbers the steps it takes, 1, 2, 3, ... in the same order on every rank (a
collective is one step, or one per chunk when its message is larger than a slot). In step s a rank copies its
message into its slot of parity s % 2, writes the step's fields (signature, size, ...) into its header row,
then its sequence counter seq = s; it waits until every peer's counter is >= s, then reads the peers' slots and
fields of parity s % 2 and returns. One synchronisation point per step.

Invariant: a rank writes its slot (and fields) of parity s % 2 only when no peer can still read what it wrote
there in step s - 2. A peer reads step s - 2's slots before it publishes s - 1; the rank starts step s only
after step s - 1 ended, when it had seen every peer's counter >= s - 1. A peer at most one step ahead
(s + 1) writes the other parity, and cannot reach s + 2 before this rank published s + 1, i.e. finished
reading step s. Counters only grow, so a peer found at >= s has published step s.

Memory ordering: the data is written, then the counter, by plain stores from Python (separate C calls, the
copy complete before the counter store starts, also where intra-op threads made it: the calling thread joined
them), and read after the counter by plain loads. This is correct
under x86-64's TSO (stores are not reordered with stores, loads not with loads; the non-temporal stores of a
large memcpy are fenced by glibc before it returns), and not on weaker memory models (ARM, POWER), where
`create` returns None and the caller keeps gloo. An aligned int64 read or written through a memoryview is one
load or store.

The all-reduce of compiled forwards (`torch_shift::shm_all_reduce`) and the all-to-alls of their Ulysses attention
(torch_shift.parallel.ulysses) run this protocol in C++ on the same words (kernels/cpu_ops.cpp, `register_native`),
sharing the step and collective counters with this class: they spin for their peers for up to 1 ms (an SP rank
without tokens, which waits a whole layer for the others' q/k/v, spins 50 us and then sleeps as below for up to
50 ms), then hand the rest to `resume_all_reduce` / `resume_all_to_all`, so deadlines and errors are this module's.

Waiting and failure: a rank waits by spinning on the counters with sched_yield between checks (so that more
ranks than cores make progress) for 1 ms, then asleep on the counter of the first peer it still waits for (a futex
on the counter's low 32 bits) until that peer publishes, at most 10 ms at a time; every 50 ms it checks that the
ranks it waits for are alive (their pid and start time are in the header; a zombie counts as dead) and have not
closed the communicator, and gives up at the deadline. A failed communicator refuses every later call.

Waking: a rank about to sleep sets the sleeping word of its header row, then checks the counter again, then sleeps
while the counter holds the value it read (the kernel compares it); a rank that publishes a step wakes the sleepers
on its counter when a peer's sleeping word is set (no system call otherwise). An idle rank that slept in steps of at
most 1 ms instead woke 1,000 times a second, each time taking the core from a working rank's thread for tens of
microseconds: a DP-2 replica's lone 512-token prefill on both cores took 471-487 ms against 468-469 now
(docs/performance.md). A publisher's counter store may still wait in its store buffer while it reads the sleeping
word (x86-64 lets a load pass an earlier store; the C++ publisher fences, the Python one cannot), as may a
sleeper's store of its sleeping word while it reads the counter: the kernel compares the counter again after a full
barrier, so a sleeper misses a wake only where the publisher's counter store came late as well, and then wakes at
its 10 ms bound.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import pickle
import platform
import socket
import time
import uuid
import zlib
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "torch_shift_shm_"

# A header row: these words, then one block per parity (see _PARITY_*). Rows are padded to 128 bytes so that no
# two ranks' counters share a cache line or an adjacent-line prefetch pair.
_SEQ, _PID, _START_TIME, _CLOSED, _SLEEPING, _FIRST_PARITY_WORD = 0, 1, 2, 3, 4, 5
# a parity block: the step's signature (operation and dtype), this rank's message size in bytes, an operation's
# own value (broadcast: the source; all_to_all: 1 when its parts are equal), then world_size split sizes (bytes)
_PARITY_SIGNATURE, _PARITY_NBYTES, _PARITY_AUX, _PARITY_SPLITS = 0, 1, 2, 3
_ROW_ALIGN_WORDS = 16
_SLOT_ALIGN = 64

# Spin (yielding the core) this long before sleeping until the peer publishes, at most _MAX_SLEEP_S at a time
_SPIN_S = 1e-3
_NAPS_FOR_S = 0.1  # a wait in naps (broadcast_object's nap_s) sleeps until woken after this long: a server out of work
_MAX_SLEEP_S = 1e-2
_LIVENESS_INTERVAL_S = 0.05
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64's system call number (the only machine served)

_SUPPORTED_MACHINES = ("x86_64", "AMD64")
_MAX_CACHED_VIEWS = 256
_SHARED_WORDS = 512  # ShmCommunicator.words


class _ProcessIdentity(NamedTuple):
    hostname: str
    boot_id: str | None
    pid_namespace: str | None
    machine: str
    pid: int
    start_time: int | None


def _proc_stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat from its third field (the state) on; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses


def _start_time(pid: int) -> int | None:
    fields = _proc_stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22: start time in clock ticks since boot


def _is_alive(pid: int, start_time: int) -> bool:
    """The process that recorded (pid, start_time) still runs: not gone, not a zombie, pid not reused."""
    fields = _proc_stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X", b"x") and int(fields[19]) == start_time


def _process_identity() -> _ProcessIdentity:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = None
    try:
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = None
    return _ProcessIdentity(socket.gethostname(), boot_id, pid_namespace, platform.machine(), os.getpid(),
                            _start_time(os.getpid()))


def _can_share_memory(identities: list[_ProcessIdentity]) -> bool:
    """One host (same name and boot), one pid namespace (peers' pids are checked in /proc), x86-64 memory model."""
    first = identities[0]
    return (first.boot_id is not None and first.pid_namespace is not None
            and all(i.start_time is not None and i.machine in _SUPPORTED_MACHINES for i in identities)
            and all((i.hostname, i.boot_id, i.pid_namespace) == (first.hostname, first.boot_id, first.pid_namespace)
                    for i in identities))


def _create_segment_file(nbytes: int) -> str | None:
    """A new file of `nbytes` in /dev/shm with its memory reserved (a sparse file that /dev/shm cannot hold maps
    fine and dies of SIGBUS at the first touch), or None where that fails."""
    path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _map_segment(path: str, nbytes: int) -> torch.Tensor | None:
    try:
        # torch owns the mapping: it is released when the last view of it dies, so no view can outlive it
        with torch.inference_mode(False):
            return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except RuntimeError:
        return None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: ctypes.CDLL | None = None


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> int:
    """FUTEX_WAIT (sleep while the 32-bit word at `address` holds `value`, at most `timeout_s`; the GIL released)
    or FUTEX_WAKE (wake up to `value` sleepers on it). 0 where it worked (a wait woken or the word already changed:
    EAGAIN; out of time: ETIMEDOUT; a signal: EINTR), else the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    timeout = None
    if timeout_s is not None:
        seconds = int(timeout_s)
        timeout = ctypes.byref(_Timespec(seconds, int((timeout_s - seconds) * 1e9)))
    result = _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(op),
                           ctypes.c_uint32(value), timeout, None, ctypes.c_int(0))
    if result >= 0:
        return 0
    error = ctypes.get_errno()
    return 0 if error in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR) else error


_signatures: dict[tuple[str, torch.dtype | None], int] = {}


def _signature(op: str, dtype: torch.dtype | None = None) -> int:
    """A number naming the operation and dtype, the same in every process (unlike hash())."""
    key = (op, dtype)
    signature = _signatures.get(key)
    if signature is None:
        signature = _signatures[key] = zlib.crc32(f"{op} {dtype}".encode())
    return signature


_summable: set[torch.dtype] = set()


def _check_summable(dtype: torch.dtype) -> None:
    """Refuse, before any rank publishes, a dtype torch cannot add on CPU (uint16, float8, ...)."""
    if dtype not in _summable:
        try:
            torch.add(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype))
        except (RuntimeError, NotImplementedError) as e:
            raise TypeError(f"all_reduce cannot sum {dtype} on CPU: {e}") from None
        _summable.add(dtype)


class ShmCommunicator:
    """Collectives over the ranks of one process group on one host, through shared memory (see the module's
    docstring for the protocol). Make one with `create`, on every rank of the group.

    Every rank must call the same collectives in the same order, from one thread at a time. Errors name
    ranks by their rank in the group and collectives by their number on this communicator (1, 2, ...)."""

    def __init__(self, segment: torch.Tensor, rank: int, world_size: int, slot_bytes: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._row_words = _header_row_words(world_size)
        header_bytes = _header_bytes(world_size)
        self._segment = segment
        self._bytes = memoryview(segment.numpy())
        self._header = self._bytes[:header_bytes].cast("q")
        self._my_row = rank * self._row_words
        self._peers = [p for p in range(world_size) if p != rank]
        self._peer_seq_words = [p * self._row_words + _SEQ for p in self._peers]
        self._peer_sleeping_words = [p * self._row_words + _SLEEPING for p in self._peers]
        self._segment_address = segment.data_ptr()
        self.sleeps = 0  # sleeps on a peer's counter (FUTEX_WAIT) so far
        parity_words = _PARITY_SPLITS + world_size
        # [parity][rank]: the first word of that rank's parity block
        self._parity_word = [[p * self._row_words + _FIRST_PARITY_WORD + parity * parity_words
                              for p in range(world_size)] for parity in (0, 1)]
        self._peer_parity_word = [[block[p] for p in self._peers] for block in self._parity_word]
        # [parity]: every rank's slot of that parity, [world_size, slot_bytes]; and its byte offset per rank
        self._slot_offset = [[header_bytes + (parity * world_size + p) * slot_bytes for p in range(world_size)]
                             for parity in (0, 1)]
        with torch.inference_mode(False):
            self._slots = [segment[offsets[0]:offsets[0] + world_size * slot_bytes].view(world_size, slot_bytes)
                           for offsets in self._slot_offset]
        self._views: dict[tuple, tuple] = {}
        words_offset = header_bytes + 2 * world_size * slot_bytes
        with torch.inference_mode(False):
            # int64 words every rank of the group reads and writes as it pleases, outside the protocol (zeros at
            # first; None once closed: a holder of them keeps the mapping)
            self.words: np.ndarray | None = segment[words_offset:words_offset + 8 * _SHARED_WORDS].numpy().view(
                np.int64)
        # the last step this rank published, and its collectives so far: in an array that the C++ all-reduce of
        # compiled forwards (register_native) counts in too
        self._counters = np.zeros(2, dtype=np.int64)
        self._native_id: int | None = None
        self._unusable: str | None = None
        self._header[self._my_row + _PID] = os.getpid()
        self._header[self._my_row + _START_TIME] = _start_time(os.getpid())

    @classmethod
    def create(cls, group: dist.ProcessGroup, timeout_s: float, slot_bytes: int = 8 << 20) -> ShmCommunicator | None:
        """Collective over `group` (every member calls it, with the same arguments). Returns None, on every rank,
        where shared memory cannot serve this group and the caller keeps gloo: a group of one rank, ranks on
        different hosts (or in different pid namespaces), a machine other than x86-64 (the protocol relies on
        its memory model), or a segment that /dev/shm cannot hold or a rank cannot map.

        `timeout_s` bounds every wait of a collective; `slot_bytes` (a multiple of 64) is the largest message
        sent in one step: larger ones go in chunks. The segment takes 2 * world_size * slot_bytes of /dev/shm."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if slot_bytes <= 0 or slot_bytes % _SLOT_ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {_SLOT_ALIGN}, got {slot_bytes}")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of the group")
        if world_size == 1:
            return None
        identities: list = [None] * world_size
        dist.all_gather_object(identities, _process_identity(), group=group)
        if not _can_share_memory(identities):
            return None
        nbytes = _header_bytes(world_size) + 2 * world_size * slot_bytes + 8 * _SHARED_WORDS
        path = _create_segment_file(nbytes) if rank == 0 else None
        communicator = None
        try:
            paths: list = [None] * world_size
            dist.all_gather_object(paths, path, group=group)
            if paths[0] is None:
                return None
            segment = _map_segment(paths[0], nbytes)
            if segment is not None:
                communicator = cls(segment, rank, world_size, slot_bytes, timeout_s)
            mapped: list = [None] * world_size
            # after this every rank has mapped the file (or failed to) and written its pid into the header
            dist.all_gather_object(mapped, communicator is not None, group=group)
        finally:
            if path is not None:
                os.unlink(path)
        if not all(mapped):
            if communicator is not None:
                communicator.close()
            return None
        for peer in communicator._peers:
            row = peer * communicator._row_words
            assert communicator._header[row + _PID] == identities[peer].pid
            assert communicator._header[row + _START_TIME] == identities[peer].start_time
        return communicator

    @property
    def _step(self) -> int:
        return int(self._counters[0])

    @_step.setter
    def _step(self, step: int) -> None:
        self._counters[0] = step

    @property
    def _collectives(self) -> int:
        return int(self._counters[1])

    @_collectives.setter
    def _collectives(self, count: int) -> None:
        self._counters[1] = count

    @property
    def native_id(self) -> int | None:
        """The id the C++ operators serve this communicator under (register_native), None where they do not."""
        return self._native_id

    def register_native(self, communicator_id: int) -> bool:
        """Serve `torch_shift::shm_all_reduce(x, communicator_id)`, Ulysses' all-to-alls of compiled forwards and the
        C++ decoder's collectives in C++ where it can (kernels/cpu_ops.cpp); False where the operator library does not
        build."""
        from torch_shift.kernels import register_native_all_reduce

        registered = register_native_all_reduce(
            communicator_id, self._segment.data_ptr(), self.rank, self.world_size, self.slot_bytes,
            _header_bytes(self.world_size), self._row_words, _FIRST_PARITY_WORD, _PARITY_SPLITS + self.world_size,
            self._counters.ctypes.data, (_signature("all_reduce", torch.float32),
                                         _signature("all_reduce", torch.bfloat16),
                                         _signature("all_to_all", torch.float32),
                                         _signature("all_to_all", torch.bfloat16),
                                         _signature("all_gather", torch.float32),
                                         _signature("all_gather", torch.bfloat16)))
        self._native_id = communicator_id if registered else None
        return registered

    def _unregister_native(self) -> None:
        if self._native_id is not None:
            from torch_shift.kernels import unregister_native_all_reduce

            unregister_native_all_reduce(self._native_id)
            self._native_id = None

    # -- collectives ------------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (same shape and dtype on every rank), as a new tensor, bit-identical on
        every rank: each rank adds the contributions in group-rank order."""
        x = self._checked(x)
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            return self._all_reduce_chunks(x, nbytes)
        key = ("all_reduce", x.shape, x.dtype)
        views = self._views.get(key) or self._make_views(key, nbytes)
        self._collectives += 1
        step = self._step + 1
        parity = step & 1
        mine, rows = views[parity]
        signature = _signature("all_reduce", x.dtype)
        try:
            mine.copy_(x)
            self._publish(step, signature, nbytes)
        except BaseException as e:
            self._interrupted("all_reduce", e)
            raise
        return self._finish_all_reduce(rows, step, signature, nbytes)

    def resume_all_reduce(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The rest of an all-reduce of `x` that the C++ operator published as `step` and handed over to wait
        for its peers (longer than it spins, or a peer's fields differ)."""
        assert step == self._step, (step, self._step)
        nbytes = x.numel() * x.element_size()
        key = ("all_reduce", x.shape, x.dtype)
        views = self._views.get(key) or self._make_views(key, nbytes)
        return self._finish_all_reduce(views[step & 1][1], step, _signature("all_reduce", x.dtype), nbytes)

    def _finish_all_reduce(self, rows: tuple, step: int, signature: int, nbytes: int) -> torch.Tensor:
        try:
            self._await(step, "all_reduce")
            self._check_peers(step & 1, signature, nbytes, "all_reduce")
            out = torch.add(rows[0], rows[1])
            for row in rows[2:]:
                out += row
        except BaseException as e:
            self._interrupted("all_reduce", e)
            raise
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape and dtype on every rank) stacked along a new dim 0 in group-rank order."""
        x = self._checked(x)
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            return self._all_gather_chunks(x, nbytes)
        key = ("all_gather", x.shape, x.dtype)
        views = self._views.get(key) or self._make_views(key, nbytes)
        self._collectives += 1
        step = self._step + 1
        mine, gathered = views[step & 1]
        signature = _signature("all_gather", x.dtype)
        try:
            mine.copy_(x)
            self._publish(step, signature, nbytes)
        except BaseException as e:
            self._interrupted("all_gather", e)
            raise
        return self._finish_all_gather(gathered, step, signature, nbytes)

    def resume_all_gather(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The rest of an all-gather of `x` that the C++ decoder published as `step` and handed over to wait for its
        peers (longer than it spins, or a peer's fields differ)."""
        assert step == self._step, (step, self._step)
        nbytes = x.numel() * x.element_size()
        key = ("all_gather", x.shape, x.dtype)
        views = self._views.get(key) or self._make_views(key, nbytes)
        return self._finish_all_gather(views[step & 1][1], step, _signature("all_gather", x.dtype), nbytes)

    def _finish_all_gather(self, gathered: torch.Tensor, step: int, signature: int, nbytes: int) -> torch.Tensor:
        try:
            self._await(step, "all_gather")
            self._check_peers(step & 1, signature, nbytes, "all_gather")
            out = gathered.clone(memory_format=torch.contiguous_format)
        except BaseException as e:
            self._interrupted("all_gather", e)
            raise
        return out

    def all_to_all(self, x: torch.Tensor, input_split_sizes: list[int] | None = None,
                   output_split_sizes: list[int] | None = None) -> torch.Tensor:
        """As `torch.distributed.all_to_all_single` on dim 0: part j of `x` (input_split_sizes[j] rows) goes to
        group rank j; the result stacks the parts received, output_split_sizes[j] rows from rank j, in rank
        order. A split of None means equal parts of x.shape[0] / world_size rows. A rank whose output_split_sizes
        do not match what the others send raises ValueError (and the communicator is unusable after)."""
        x = self._checked(x)
        if x.dim() == 0:
            raise ValueError("all_to_all needs a tensor with a dim 0 to split")
        in_rows = self._split_sizes(input_split_sizes, x.shape[0], "input_split_sizes", total=x.shape[0])
        out_rows = self._split_sizes(output_split_sizes, x.shape[0], "output_split_sizes")
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        in_bytes = [rows * row_bytes for rows in in_rows]
        out_bytes = [rows * row_bytes for rows in out_rows]
        equal = in_rows == out_rows and in_rows.count(in_rows[0]) == self.world_size
        nbytes = x.shape[0] * row_bytes
        signature = _signature("all_to_all", x.dtype)
        self._collectives += 1
        try:
            if not equal or nbytes > self.slot_bytes:
                out = self._all_to_all_steps(x.reshape(-1).view(torch.uint8), in_bytes, out_bytes, equal, signature)
                return out.view(x.dtype).view(sum(out_rows), *x.shape[1:])
            key = ("all_to_all", x.shape, x.dtype)
            views = self._views.get(key) or self._make_views(key, nbytes)
            step = self._step + 1
            views[step & 1][0].copy_(x)
            self._publish_splits(step, in_bytes)
            self._publish(step, signature, nbytes, aux=1)
            return self._finish_all_to_all(x, views, step, signature)
        except BaseException as e:
            self._interrupted("all_to_all", e)
            raise

    def resume_all_to_all(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The rest of an all-to-all of equal parts of `x` (its message, in this rank's slot) that the C++ operator
        published as `step` and handed over to wait for its peers (longer than it spins, or a peer's fields differ)."""
        assert step == self._step, (step, self._step)
        key = ("all_to_all", x.shape, x.dtype)
        views = self._views.get(key) or self._make_views(key, x.numel() * x.element_size())
        try:
            return self._finish_all_to_all(x, views, step, _signature("all_to_all", x.dtype))
        except BaseException as e:
            self._interrupted("all_to_all", e)
            raise

    def _finish_all_to_all(self, x: torch.Tensor, views: tuple, step: int, signature: int) -> torch.Tensor:
        parity = step & 1
        nbytes = x.numel() * x.element_size()
        self._await(step, "all_to_all")
        self._check_peers(parity, signature, None, "all_to_all")
        header = self._header
        if all(header[word + _PARITY_AUX] == 1 and header[word + _PARITY_NBYTES] == nbytes
               for word in self._peer_parity_word[parity]):
            return views[parity][1].clone(memory_format=torch.contiguous_format).view(x.shape)
        # a peer sends other parts (or more than a slot): its split sizes say where this rank's part is
        part = nbytes // self.world_size
        out = self._all_to_all_steps(x.reshape(-1).view(torch.uint8), [part] * self.world_size,
                                     [part] * self.world_size, True, signature, first_step_taken=True)
        return out.view(x.dtype).view(x.shape)

    def broadcast_object(self, obj: object = None, src: int = 0, timeout_s: float | None = ...,
                         nap_s: float | None = None) -> object:
        """Group rank `src`'s `obj` (pickled; any size) on every rank. `timeout_s` bounds each wait: `...` (the
        default) is the communicator's timeout, None waits without a deadline (a worker idling for its next
        message; sleeping, it costs little CPU) but still ends when a rank it waits for dies. `nap_s`: this rank
        waits in naps of that long, unannounced, instead of spinning and then sleeping until a peer wakes it: the
        peers publish without a wake-up call (a futex wake that schedules the sleeper is a system call of 60-1,240
        us on a busy host), and this rank sees the message up to `nap_s` late; after 0.1 s it sleeps until woken."""
        self._check_usable()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be a group rank in [0, {self.world_size}), got {src}")
        timeout_s = self.timeout_s if timeout_s is ... else timeout_s
        self._collectives += 1
        signature = _signature("broadcast_object")
        payload = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) if self.rank == src else None
        received: bytearray | None = None
        total = rounds = None
        chunk = 0
        try:
            while rounds is None or chunk < rounds:
                step = self._step + 1
                parity = step & 1
                low = chunk * self.slot_bytes
                slot = self._slot_offset[parity][src]
                if payload is not None:
                    high = min(len(payload), low + self.slot_bytes)
                    self._bytes[slot:slot + high - low] = payload[low:high]
                self._publish(step, signature, len(payload) if payload is not None else 0, aux=src)
                self._await(step, "broadcast_object", timeout_s, nap_s)
                self._check_peers(parity, signature, None, "broadcast_object", aux=src)
                if rounds is None:
                    total = self._header[self._parity_word[parity][src] + _PARITY_NBYTES]
                    rounds = max(1, -(-total // self.slot_bytes))
                    received = bytearray(total) if payload is None else None
                if received is not None:
                    high = min(total, low + self.slot_bytes)
                    received[low:high] = self._bytes[slot:slot + high - low]
                chunk += 1
        except BaseException as e:
            self._interrupted("broadcast_object", e)
            raise
        return obj if received is None else pickle.loads(received)

    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""
        self._check_usable()
        self._collectives += 1
        step = self._step + 1
        try:
            self._publish(step, _signature("barrier"), 0)
            self._await(step, "barrier")
            self._check_peers(step & 1, _signature("barrier"), 0, "barrier")
        except BaseException as e:
            self._interrupted("barrier", e)
            raise

    def close(self) -> None:
        """Tell the peers this rank left (a peer waiting for it gets an error) and release the mapping.
        Idempotent; every later call raises."""
        if self._segment is None:
            return
        self._unregister_native()  # before the mapping goes
        self._header[self._my_row + _CLOSED] = 1
        self._unusable = "the shared-memory communicator is closed"
        self._views.clear()
        self._header.release()
        self._bytes.release()
        self._slots = []
        self.words = None
        self._segment = None  # the mapping goes with its last view

    # -- chunks: messages larger than a slot -----------------------------------------------------------------

    def _all_reduce_chunks(self, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        _check_summable(x.dtype)
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        self._collectives += 1
        try:
            for parity, low, high in self._equal_chunks("all_reduce", x.dtype, flat.view(torch.uint8), nbytes):
                rows = self._slots[parity][:, :high - low].view(x.dtype)
                piece = out[low // x.element_size():high // x.element_size()]
                torch.add(rows[0], rows[1], out=piece)
                for row in rows[2:]:
                    piece += row
        except BaseException as e:
            self._interrupted("all_reduce", e)
            raise
        return out.view(x.shape)

    def _all_gather_chunks(self, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        out = torch.empty((self.world_size, nbytes), dtype=torch.uint8)
        self._collectives += 1
        try:
            for parity, low, high in self._equal_chunks("all_gather", x.dtype, x.reshape(-1).view(torch.uint8),
                                                        nbytes):
                out[:, low:high].copy_(self._slots[parity][:, :high - low])
        except BaseException as e:
            self._interrupted("all_gather", e)
            raise
        return out.view(x.dtype).view(self.world_size, *x.shape)

    def _equal_chunks(self, op: str, dtype: torch.dtype, source: torch.Tensor, nbytes: int):
        """The steps of a collective whose message has `nbytes` on every rank: for each slot-sized chunk, copies
        this rank's chunk of `source` into its slot, publishes and waits; yields (parity, low, high), the
        chunk's bytes in the message, to read the peers' slots of that parity."""
        signature = _signature(op, dtype)
        for low in range(0, nbytes, self.slot_bytes):
            high = min(nbytes, low + self.slot_bytes)
            step = self._step + 1
            parity = step & 1
            self._slots[parity][self.rank, :high - low].copy_(source[low:high])
            self._publish(step, signature, nbytes)
            self._await(step, op)
            self._check_peers(parity, signature, nbytes, op)
            yield parity, low, high

    def _all_to_all_steps(self, source: torch.Tensor, in_bytes: list[int], out_bytes: list[int], equal: bool,
                          signature: int, first_step_taken: bool = False) -> torch.Tensor:
        """all_to_all in general (unequal parts, messages larger than a slot): each rank sends its whole message
        (`source`, bytes), a slot per step, for as many steps as the largest message needs (every rank learns
        the sizes and split sizes in the first step); each rank copies its part out of each peer's chunks.
        Returns the parts received, in rank order, as bytes. `first_step_taken`: the first chunk is published
        and awaited already."""
        nbytes = source.numel()
        out = torch.empty(sum(out_bytes), dtype=torch.uint8)
        offsets: list[int] = []
        steps = None
        chunk = 0
        while steps is None or chunk < steps:
            low = chunk * self.slot_bytes
            if not (first_step_taken and chunk == 0):
                step = self._step + 1
                high = min(nbytes, low + self.slot_bytes)
                if high > low:
                    self._slots[step & 1][self.rank, :high - low].copy_(source[low:high])
                self._publish_splits(step, in_bytes)
                self._publish(step, signature, nbytes, aux=int(equal))
                self._await(step, "all_to_all")
                self._check_peers(step & 1, signature, None, "all_to_all")
            parity = self._step & 1
            if steps is None:
                offsets = self._peer_offsets(parity, out_bytes)
                largest = max(self._header[block + _PARITY_NBYTES] for block in self._parity_word[parity])
                steps = max(1, -(-largest // self.slot_bytes))
            self._receive_parts(parity, out, offsets, out_bytes, low)
            chunk += 1
        return out

    def _peer_offsets(self, parity: int, out_bytes: list[int]) -> list[int]:
        """Where this rank's part starts in each rank's message (from their split sizes in the header), after
        checking that each part has the size this rank expects."""
        offsets = []
        for p in range(self.world_size):
            splits = self._parity_word[parity][p] + _PARITY_SPLITS
            if self._header[splits + self.rank] != out_bytes[p]:
                self._fail(ValueError, f"all_to_all #{self._collectives}: rank {p} sends "
                                       f"{self._header[splits + self.rank]} bytes to rank {self.rank}, which "
                                       f"expects {out_bytes[p]} (output_split_sizes does not match that rank's "
                                       f"input_split_sizes)")
            offsets.append(sum(self._header[splits + j] for j in range(self.rank)))
        return offsets

    def _receive_parts(self, parity: int, out: torch.Tensor, offsets: list[int], out_bytes: list[int],
                       low: int) -> None:
        """Copy what the peers' slots of `parity` (bytes low .. low + slot_bytes of each message) hold of this
        rank's parts into `out` (the parts in rank order)."""
        start = 0
        for p in range(self.world_size):
            first, last = max(offsets[p], low), min(offsets[p] + out_bytes[p], low + self.slot_bytes)
            if first < last:
                out[start + first - offsets[p]:start + last - offsets[p]].copy_(
                    self._slots[parity][p, first - low:last - low])
            start += out_bytes[p]

    # -- the protocol ----------------------------------------------------------------------------------------

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        self._check_usable()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_cpu or x.layout != torch.strided:
            raise ValueError(f"the shared-memory communicator takes dense CPU tensors, got one on {x.device} "
                             f"({x.layout})")
        if x.requires_grad:
            x = x.detach()
        return x

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(self._unusable)

    def _split_sizes(self, sizes: list[int] | None, rows: int, name: str, total: int | None = None) -> list[int]:
        """`sizes` checked (world_size counts >= 0, summing to `total` where given); None: equal parts of `rows`."""
        if sizes is None:
            if rows % self.world_size:
                raise ValueError(f"x.shape[0] = {rows} does not split in {self.world_size} equal parts; "
                                 f"give {name}")
            return [rows // self.world_size] * self.world_size
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.world_size or min(sizes) < 0:
            raise ValueError(f"{name} must hold {self.world_size} sizes >= 0, got {sizes}")
        if total is not None and sum(sizes) != total:
            raise ValueError(f"{name} must sum to x.shape[0] = {total}, got {sizes}")
        return sizes

    def _make_views(self, key: tuple, nbytes: int) -> tuple:
        """[parity]: (this rank's slot as a tensor of the message's shape and dtype, what the operation reads:
        all_reduce: every rank's slot so; all_gather: the slots stacked; all_to_all: this rank's part of each
        slot, stacked). Cached: a decode step sends the same shapes every time. Made outside inference mode, so
        that they can be written in place both in and outside it."""
        op, shape, dtype = key
        if op == "all_reduce":
            _check_summable(dtype)
        world = self.world_size
        views = []
        with torch.inference_mode(False):
            for slots in self._slots:
                mine = slots[self.rank, :nbytes].view(dtype).view(shape)
                if op == "all_reduce":
                    views.append((mine, tuple(slots[p, :nbytes].view(dtype).view(shape) for p in range(world))))
                elif op == "all_gather":
                    views.append((mine, slots[:, :nbytes].view(dtype).view(world, *shape)))
                else:
                    assert op == "all_to_all"
                    part = nbytes // world
                    views.append((mine, slots[:, self.rank * part:(self.rank + 1) * part].view(dtype).view(
                        world, shape[0] // world, *shape[1:])))
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[key] = views = tuple(views)
        return views

    def _publish_splits(self, step: int, in_bytes: list[int]) -> None:
        splits = self._parity_word[step & 1][self.rank] + _PARITY_SPLITS
        for j, n in enumerate(in_bytes):
            self._header[splits + j] = n

    def _publish(self, step: int, signature: int, nbytes: int, aux: int = 0) -> None:
        """The step's fields, then the counter: after the slot's data (see the module's docstring)."""
        header = self._header
        block = self._parity_word[step & 1][self.rank]
        header[block + _PARITY_SIGNATURE] = signature
        header[block + _PARITY_NBYTES] = nbytes
        header[block + _PARITY_AUX] = aux
        header[self._my_row + _SEQ] = step
        self._step = step
        for word in self._peer_sleeping_words:
            if header[word]:  # a peer sleeps (on some rank's counter: this one's may be it)
                _futex(self._segment_address + 8 * (self._my_row + _SEQ), _FUTEX_WAKE, self.world_size)
                break

    def _await(self, step: int, op: str, timeout_s: float | None = ..., nap_s: float | None = None) -> None:
        header = self._header
        for word in self._peer_seq_words:
            if header[word] < step:
                self._wait_slowly(step, op, self.timeout_s if timeout_s is ... else timeout_s, nap_s)
                return

    def _wait_slowly(self, step: int, op: str, timeout_s: float | None, nap_s: float | None = None) -> None:
        header = self._header
        start = time.monotonic()
        next_check = start + _LIVENESS_INTERVAL_S
        while True:
            waiting = [(p, word) for p, word in zip(self._peers, self._peer_seq_words, strict=True)
                       if header[word] < step]
            if not waiting:
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_INTERVAL_S
                ranks = [p for p, _ in waiting]
                self._check_alive(ranks, op)
                if timeout_s is not None and now - start >= timeout_s:
                    names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
                    self._fail(RuntimeError, f"{names} did not reach {op} #{self._collectives} within {timeout_s:g} s")
            if nap_s is not None and now - start < _NAPS_FOR_S:
                time.sleep(nap_s)
            elif now - start < _SPIN_S:
                os.sched_yield()
            else:
                self._sleep_on(waiting[0][1], step, min(_MAX_SLEEP_S, next_check - now))

    def _sleep_on(self, seq_word: int, step: int, timeout_s: float) -> None:
        """Sleep until the peer of counter `seq_word` publishes (it wakes this rank: _publish), at most
        `timeout_s`; at once if it published `step` meanwhile."""
        header = self._header
        timeout_s = max(timeout_s, 0.0)
        header[self._my_row + _SLEEPING] = 1
        try:
            seen = header[seq_word]  # the kernel compares the counter again, after a full barrier
            if seen < step:
                if _futex(self._segment_address + 8 * seq_word, _FUTEX_WAIT, seen & 0xFFFFFFFF, timeout_s):
                    time.sleep(min(timeout_s, 1e-3))  # futexes refused (a sandbox): sleeps of 1 ms, as before them
                else:
                    self.sleeps += 1
        finally:
            header[self._my_row + _SLEEPING] = 0

    def _check_alive(self, ranks: list[int], op: str) -> None:
        header = self._header
        for p in ranks:
            row = p * self._row_words
            if header[row + _CLOSED]:
                self._fail(RuntimeError, f"rank {p} closed the communicator before {op} #{self._collectives}")
            pid = header[row + _PID]
            if not _is_alive(pid, header[row + _START_TIME]):
                self._fail(RuntimeError, f"rank {p} (pid {pid}) died during {op} #{self._collectives}")

    def _check_peers(self, parity: int, signature: int, nbytes: int | None, op: str, aux: int | None = None) -> None:
        """The peers ran the same collective as this rank in this step (and, where given, with as many bytes
        and the same `aux`)."""
        header = self._header
        for word in self._peer_parity_word[parity]:
            if (header[word + _PARITY_SIGNATURE] != signature
                    or (nbytes is not None and header[word + _PARITY_NBYTES] != nbytes)
                    or (aux is not None and header[word + _PARITY_AUX] != aux)):
                self._mismatch(parity, signature, nbytes, op, aux)

    def _mismatch(self, parity: int, signature: int, nbytes: int | None, op: str, aux: int | None) -> None:
        names = {_signature(name, dtype): f"{name} of {dtype}" if dtype else name
                 for name in ("all_reduce", "all_gather", "all_to_all")
                 for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool)}
        names.update({_signature(name): name for name in ("broadcast_object", "barrier")})
        ranks = []
        for p in range(self.world_size):
            block = self._parity_word[parity][p]
            got = self._header[block + _PARITY_SIGNATURE]
            ranks.append(f"rank {p}: {names.get(got, f'operation {got}')}, {self._header[block + _PARITY_NBYTES]} "
                         f"bytes, {self._header[block + _PARITY_AUX]}")
        self._fail(ValueError, f"the ranks called different collectives, or with different sizes or sources, at "
                               f"{op} #{self._collectives} ({'; '.join(ranks)})")

    def _fail(self, error: type[Exception], message: str):
        self._unusable = f"the shared-memory communicator failed earlier: {message}"
        self._unregister_native()  # its calls come to Python, which refuses them
        raise error(message)

    def _interrupted(self, op: str, error: BaseException) -> None:
        """A collective that did not end leaves the ranks at different steps: no later call may run."""
        self._unregister_native()
        if self._unusable is None:
            self._unusable = (f"the shared-memory communicator failed earlier: {op} #{self._collectives} was "
                              f"interrupted by {type(error).__name__}: {error}")


def _header_row_words(world_size: int) -> int:
    words = _FIRST_PARITY_WORD + 2 * (_PARITY_SPLITS + world_size)
    return -(-words // _ROW_ALIGN_WORDS) * _ROW_ALIGN_WORDS


def _header_bytes(world_size: int) -> int:
    return -(-world_size * _header_row_words(world_size) * 8 // 4096) * 4096
