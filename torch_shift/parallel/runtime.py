"""The ranks of a parallel engine and the messages rank 0 sends them.

(a) Under torchrun every rank runs the user's program; (b) from an ordinary process, this
process becomes rank 0 and starts the other local ranks itself, which run the worker loop.
Rank 0 schedules; every step it broadcasts the step plan on a CPU (gloo) group, then all ranks
run the forward together. A rank that fails ends the others: a dead peer breaks the gloo
connections at once, and every collective has the process group's timeout as a bound.

In (b) the user's process is left as it was: the rendezvous store is this process's own (on
127.0.0.1), no environment variable is written, the intra-op thread count is restored and the
process group destroyed at shutdown, which ends the started ranks within a bound from any thread.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_shift.parallel import comm
from torch_shift.parallel.agreement import check_ranks_agree
from torch_shift.parallel.groups import DeploymentGroups
from torch_shift.parallel.launch import LocalRanks, default_start_method, local_cores, own_threads, started_rank_cores
from torch_shift.parallel.shm import ShmCommunicator

# the runtime whose started ranks hold this process's default process group, if any
_holder: ParallelRuntime | None = None


_kept_in_child: list = []


def _forget_ranks_in_child() -> None:
    """In a child forked from a process that holds ranks (the user's `os.fork()`): the ranks stay the parent's.
    multiprocessing's exit handler would terminate them from the child as its own daemonic children, and the
    process groups' destructors, run as the child exits, wait for gloo's threads, which a fork does not copy
    (measured: the child hung at its exit): they are kept alive until the child ends."""
    global _holder
    if _holder is None:
        return
    if _holder.launched is not None:
        for process in _holder.launched.procs.values():
            multiprocessing.process._children.discard(process)
    if dist.is_initialized():
        groups = list(dist.distributed_c10d._world.pg_map)
        _kept_in_child.extend(groups)
        for group in groups:  # past the interpreter's own teardown of modules, which would drop the list
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _holder = None


os.register_at_fork(after_in_child=_forget_ranks_in_child)


class ParallelRuntime:
    def __init__(self, deployment, worker_main, worker_args: tuple, timeout_s: float, device_type: str = "cpu",
                 fingerprint: Mapping[str, Any] | None = None):
        """`device_type`: where the ranks run their models ("cuda": NCCL for the layouts' collectives, one GPU
        per local rank; "cpu": gloo and shared memory). `fingerprint`: what every rank's engine agrees on, where
        every rank runs the user's program (see `every_rank_joins`)."""
        world = deployment.world_size
        self._init_state(timeout_s)
        self.device_type = device_type
        if _holder is not None:
            raise ValueError("another parallel engine of this process still holds the ranks it started; "
                             "call its shutdown() first (one parallel engine per process at a time)")
        try:
            if not dist.is_initialized():
                # torch.distributed.nn.functional takes `group.WORLD` as default arguments when it is imported
                # (torch._dynamo imports it): imported while our group exists, it would keep that group, its
                # sockets and the store's port for the life of the process
                import torch.distributed.nn.functional  # noqa: F401

                dist.init_process_group(**self._process_group_args(world, worker_main, worker_args))
            else:  # the user's group (torchrun): every rank of it must be building the same engine
                assert fingerprint is not None, "ranks of the user's program compare their engines' fingerprints"
                every_rank_joins(timeout_s, fingerprint)
            self.groups = DeploymentGroups.build(deployment, self.timeout)
            self.rank = dist.get_rank()
            self._share_memory(timeout_s)
        except BaseException as e:
            # (a user's mistake is said as it is: no rank to wait for)
            failed = (self._rank_that_failed(0.0 if isinstance(e, (ValueError, TypeError)) else 1.0)
                      if isinstance(e, Exception) else None)
            self.shutdown(timeout_s=2.0)  # started ranks must not outlive a failed construction
            if failed is not None:  # what gloo or the store says of it names no rank
                raise RuntimeError(f"the parallel engine could not start: {failed}") from e
            raise

    def _rank_that_failed(self, wait_s: float) -> str | None:
        """What went wrong with a rank this process started, waiting up to `wait_s` for its report or its exit (they
        may come a moment after its sockets closed); None where none failed (or none was started)."""
        if self.launched is None:
            return None
        deadline = time.monotonic() + wait_s
        while (failed := self.launched.failed()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return failed

    def _init_state(self, timeout_s: float) -> None:
        self._pid = os.getpid()
        self.timeout = timedelta(seconds=timeout_s)
        self.launched: LocalRanks | None = None
        self._user_threads: int | None = None  # the user's thread count, given back once the engine is built
        self._user_excepthook = sys.excepthook  # init_process_group wraps it (a rank prefix): restored at shutdown
        self._closed = False
        self._closed_reason: str | None = None  # why it was shut down, when not by its owner
        self._close_lock = threading.Lock()
        # held while this process is inside a collective of the engine, so that a shutdown from another
        # thread destroys the process group only once that collective has ended
        self._in_collective = threading.RLock()
        self.groups: DeploymentGroups | None = None
        # the cores of the local ranks this library started, which a rank with work may borrow while others idle
        # (ModelRunner); None under torchrun, where the user placed the ranks
        self.host_cores: int | None = started_rank_cores()
        self.control: ShmCommunicator | None = None  # the control channel through shared memory, where it can be

    @classmethod
    def over(cls, deployment, replica_groups, timeout_s: float, fingerprint: Mapping[str, Any]) -> ParallelRuntime:
        """The runtime of ranks that already hold their groups (a module from `torch_shift.parallelize`,
        every rank running the user's program): nothing is started or initialised."""
        runtime = cls.__new__(cls)
        runtime._init_state(timeout_s)
        every_rank_joins(timeout_s, fingerprint)
        runtime.groups = DeploymentGroups.build(deployment, runtime.timeout, replica_groups)
        runtime.rank = dist.get_rank()
        runtime._share_memory(timeout_s)
        return runtime

    def _share_memory(self, timeout_s: float) -> None:
        """Ranks of one host (on the CPU) exchange step plans and run their layouts' collectives through
        shared memory (torch_shift.parallel.shm); gloo stays for set-up and wherever that cannot be."""
        if dist.get_backend() != "gloo":
            return
        self.control = ShmCommunicator.create(self.groups.control_group, timeout_s)
        for group in self.groups.forward_groups():
            comm.share_memory(group, timeout_s)

    def _process_group_args(self, world: int, worker_main, worker_args: tuple) -> dict[str, Any]:
        """How this process joins a new default process group: torchrun's environment (a), or (b) as
        rank 0 of local ranks it starts here, with a rendezvous store of its own on the loopback (the
        listening socket exists before the ranks start, so no other process can take the port)."""
        global _holder
        args: dict[str, Any] = {"backend": "nccl" if self.device_type == "cuda" else "gloo", "timeout": self.timeout}
        if args["backend"] == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            args["device_id"] = torch.device("cuda", local_rank)
        if "RANK" in os.environ:  # (a)
            return args
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        cores = local_cores()
        threads = own_threads(cores, world)
        try:
            self.launched = LocalRanks(worker_main, world, list(range(1, world)), *worker_args, port=port,
                                       threads=threads, start_method=default_start_method(self.device_type),
                                       host_cores=cores if self.device_type == "cpu" else None)
        except BaseException:
            listener.close()
            raise
        self.host_cores = self.launched.host_cores
        _holder = self
        # at exit this runs before multiprocessing's own handler, which would wait forever for a stopped rank
        atexit.register(self.shutdown)
        # the engine is built on this rank's share of the cores (its compiled forwards' count), then the user's
        # count comes back (give_threads_back); the runner takes the share for each step (ModelRunner)
        self._user_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=self.timeout,
                              master_listen_fd=listener.detach(), wait_for_workers=False)
        # the started ranks join through torchrun's environment (env://), whose keys init_process_group
        # puts under this prefix
        return {**args, "store": dist.PrefixStore("default_pg", store), "rank": 0, "world_size": world}

    def give_threads_back(self) -> None:
        """Rank 0 in the user's process, its engine built: the user's intra-op thread count as it was before."""
        threads, self._user_threads = self._user_threads, None
        if threads is not None:
            torch.set_num_threads(threads)

    @property
    def device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the parallel engine was shut down" + (f": {self._closed_reason}"
                                                                       if self._closed_reason else ""))

    def broadcast(self, message: Any = None, nap_s: float | None = None) -> Any:
        """Rank 0 sends `message`; every rank returns it. The other ranks wait for it without a deadline (they
        idle there for as long as a server does), rank 0 for them within the timeout. `nap_s`: a rank that waits
        looks for the message every `nap_s` seconds instead of being woken (shared memory only)."""
        box = [message]
        with self._in_collective:
            self._check_open()
            try:
                if self.control is not None:
                    timeout = self.timeout.total_seconds() if self.rank == 0 else None
                    return self.control.broadcast_object(message, src=0, timeout_s=timeout, nap_s=nap_s)
                dist.broadcast_object_list(box, src=0, group=self.groups.control_group)
            except Exception as e:
                raise self.failure(e) from e
        return box[0]

    def run_step(self, plan: Any, execute) -> Any:
        """Rank 0: send the step plan to every rank and run `execute(plan)` here with them. Interrupted inside
        (KeyboardInterrupt in a notebook), or failed (a rank died or stopped answering), the started ranks are
        left in collectives that rank 0 no longer meets: they are ended at once, and the engine's next call says
        why instead of waiting out the timeout again (a stopped rank cost every later call the whole timeout)."""
        try:
            with self._in_collective:
                self.broadcast(("step", plan))
                try:
                    return execute(plan)
                except Exception as e:
                    raise self.failure(e) from e
        except BaseException as e:
            if self.launched is not None and not self._closed:
                what = (f"a step was interrupted ({type(e).__name__}) while the ranks were in it"
                        if not isinstance(e, Exception) else f"a step failed ({_first_line(e)})")
                self._closed_reason = f"{what}; create a new engine"
                self.shutdown(timeout_s=4.0)
            raise

    def min_over_ranks(self, value: int) -> int:
        """Every rank's minimum of `value`, within the process group's timeout."""
        t = torch.tensor([value], dtype=torch.long)
        with self._in_collective:
            self._check_open()
            try:
                # the control group has no timeout of its own (ranks idle on it): bound this wait
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.groups.control_group,
                                async_op=True).wait(timeout=self.timeout)
            except Exception as e:
                raise self.failure(e) from e
        return int(t.item())

    def barrier(self) -> None:
        """Every rank waits for the others on the control group (CPU, whatever the layouts' backend), within the
        process group's timeout."""
        self.min_over_ranks(0)

    def failure(self, error: Exception, wait_s: float = 2.0) -> RuntimeError:
        """The error to raise when a collective failed: a started rank's own report when there is one
        (it may reach us a moment after its sockets closed), else the collective's error."""
        if self._closed:
            return RuntimeError(f"the parallel engine was shut down ({_first_line(error)})")
        report = self._rank_that_failed(wait_s)
        if report is not None:
            return RuntimeError(report)
        # the first line: an error raised through the C++ kernels carries the Python stack after it ("At: ..."),
        # which the chained error keeps
        return RuntimeError(f"a rank failed or stopped answering: {_first_line(error)}")

    def _release_shared_memory(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        comm.release_shared_memory()

    def close_local(self) -> None:
        """A rank other than 0 leaving: its shared-memory channels first, then the process group."""
        with self._in_collective:
            self._release_shared_memory()
            if dist.is_initialized():
                dist.destroy_process_group()

    def unresponsive_ranks(self, max_silence_s: float) -> list[int]:
        """The ranks this process started whose heartbeat (every 100 ms, from a thread of their own) is
        older than `max_silence_s`, or that are no longer alive. Cheap: reads shared memory. Under
        torchrun (no started ranks) and after shutdown: []."""
        launched = self.launched
        return [] if launched is None else launched.silent_ranks(max_silence_s)

    def unresponsive_reason(self, max_silence_s: float) -> str | None:
        """`unresponsive_ranks` in words ("rank 1 exited with code -9"), or None where every rank answers."""
        launched = self.launched
        if launched is None:
            return None
        ranks = launched.silent_ranks(max_silence_s)
        return "; ".join(launched.describe(r, max_silence_s) for r in ranks) or None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Rank 0 of (b): end the started ranks and leave the process group, within about `timeout_s`.

        Safe from any thread, also while another thread of this process is blocked in a collective: the
        ranks are asked to exit only when no collective is in flight and every rank's heartbeat is
        fresh; those still there are terminated, then killed (a stopped process ignores SIGTERM). The
        process group is destroyed once no collective of this process is in flight any more (the ended
        ranks end it). Idempotent; a no-op under torchrun."""
        global _holder
        check_timeout(timeout_s)
        if os.getpid() != self._pid:  # a forked child's copy (its exit runs this): the ranks are the parent's
            return
        with self._close_lock:
            if self._closed or self.launched is None:
                return
            self._closed = True
        deadline = time.monotonic() + timeout_s
        launched = self.launched
        sender = None
        interrupted: BaseException | None = None
        try:
            if self.groups is not None and not launched.silent_ranks(1.0) and self._in_collective.acquire(
                    blocking=False):
                try:  # the ranks wait on the control channel for the next message: tell them to exit
                    thread = threading.Thread(target=_broadcast_quietly, args=([("shutdown", None)],
                                              self.groups.control_group, self.control, timeout_s / 4), daemon=True)
                    thread.start()
                    sender = thread  # only once started: an interruption before leaves none to join
                    sender.join(timeout_s / 4)
                finally:
                    self._in_collective.release()
            grace = (deadline - time.monotonic()) / 2 if sender is not None else 0.0
            launched.stop(grace_s=max(0.0, grace), kill_after_s=1.0)
        except BaseException as e:  # a second Ctrl+C during the wait: the ranks are ended at once, the group
            interrupted = e         # released below (a later engine can start), and the interruption raised
            launched.stop(grace_s=0.0, kill_after_s=1.0)
        if sender is not None:  # it ends with the ranks at the latest: a moment even with no time left
            sender.join(max(0.5, deadline - time.monotonic()))
        released = False
        if (sender is None or not sender.is_alive()) and self._in_collective.acquire(
                timeout=max(0.1, deadline - time.monotonic())):
            try:
                self._release_shared_memory()
                if dist.is_initialized():
                    dist.destroy_process_group()
                released = True
            finally:
                self._in_collective.release()
        self.launched = None
        if released and _holder is self:  # else the next engine is refused rather than joining a stale group
            _holder = None
        atexit.unregister(self.shutdown)
        self.give_threads_back()  # a construction that failed
        if released and getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
            sys.excepthook = self._user_excepthook  # unless someone set one of their own since
        if interrupted is not None:
            raise interrupted


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def check_timeout(timeout_s: float) -> None:
    """A shutdown's timeout, checked before anything closes: a bad call leaves the engine as it was."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not 0 <= timeout_s <= threading.TIMEOUT_MAX:  # NaN and infinity too (a thread's join overflows on them)
        raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s}")


def every_rank_joins(timeout_s: float, fingerprint: Mapping[str, Any]) -> None:
    """Every rank of the user's default group is building the same engine, within `timeout_s`: the groups the engine
    makes next wait for every rank with the group's own timeout (gloo's connect; 30 minutes by default), so a rank
    that never calls LLM(...) or handoff(...) hung the others, and ranks that built different deployments failed
    inside a collective. `fingerprint`: what every rank's engine must agree on (a ValueError naming what differs)."""
    try:
        check_ranks_agree(fingerprint, "LLM(...) under torchrun", timeout_s=timeout_s)
    except TimeoutError as e:
        raise RuntimeError(f"not every one of the {dist.get_world_size()} ranks built the engine within "
                           f"{timeout_s:.0f} s (distributed_timeout_s): under torchrun every rank calls LLM(...) "
                           f"or handoff(...) together ({e})") from None


def _broadcast_quietly(box: list, group: dist.ProcessGroup, control: ShmCommunicator | None,
                       timeout_s: float) -> None:
    try:
        if control is not None:
            control.broadcast_object(box[0], src=0, timeout_s=timeout_s)
        else:
            dist.broadcast_object_list(box, src=0, group=group)
    except Exception:  # noqa: BLE001 - a rank already gone has nothing to be told
        pass
