"""Start local ranks from one ordinary process (the torchrun-free path and the tests).

On CPU ranks are forked (DESIGN.md section 3: a 4-rank start costs ~1 s instead of ~10 s
spawned) and use one intra-op thread each unless told otherwise; with CUDA they are spawned,
since CUDA cannot be used in a forked child. Before forking, this thread's OpenMP workers are
released (`release_openmp_threads`), so that a forked rank can run several threads. Each rank
finds its place in the environment variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def local_cores() -> int:
    """The cores this process may run on (its CPU affinity, which `taskset` and containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def own_threads(host_cores: int, world_size: int) -> int:
    """A local rank's own share of the host's cores: its intra-op threads when other ranks have work too."""
    return max(1, host_cores // world_size)


def release_openmp_threads(cached: bool = False) -> bool:
    """End this thread's OpenMP worker threads (OpenMP 5.0's `omp_pause_resource_all`; the next parallel region
    starts new ones), so that a child forked next can run parallel regions of several threads: libgomp, torch's
    OpenMP on Linux, does not handle fork, and a forked child of a process whose parallel regions used several
    threads hangs in its first such region of its own (measured here). Also before steps that run on other threads
    (the GEMV kernel's decode pool, `cached`: the libgomp found the last time), which OpenMP's idle workers would spin
    against for milliseconds: 2 us where there are none, 120 us where there are. False where libgomp is loaded and
    the release failed, or where this process's libraries cannot be listed (no /proc); LLVM's and Intel's runtimes
    reset themselves in a forked child."""
    pauses = _libgomp_functions("omp_pause_resource_all", [ctypes.c_int], ctypes.c_int, cached)
    return pauses is not None and all(pause(2) == 0 for pause in pauses)  # omp_pause_hard; fails in a region


def openmp_function(name: str, argtypes: list, restype) -> Callable | None:
    """libgomp's function `name` where this process runs one libgomp (torch's), else None."""
    functions = _libgomp_functions(name, argtypes, restype, cached=True)
    return functions[0] if functions is not None and len(functions) == 1 else None


_libgomp_found: dict[str, tuple | None] = {}


def _libgomp_functions(name: str, argtypes: list, restype, cached: bool) -> tuple | None:
    """`name` from every libgomp this process loaded; None where one lacks it or the libraries cannot be listed.
    With `cached`, what an earlier look found once torch (which loads libgomp) was imported."""
    if cached and name in _libgomp_found:
        return _libgomp_found[name]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    functions = []
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            return None
        function.argtypes, function.restype = argtypes, restype
        functions.append(function)
    if "torch" in sys.modules:
        _libgomp_found[name] = tuple(functions)
    return tuple(functions)


def default_start_method(device_type: str = "cpu") -> str:
    """Fork (fast, shares what rank 0 built) unless the ranks use CUDA or this process already did: a forked
    child of a process with a CUDA context cannot use CUDA."""
    import torch

    return "spawn" if device_type == "cuda" or torch.cuda.is_initialized() else "fork"


def _reset_inherited_compile_pool() -> None:
    """A forked rank must not use the inductor compile thread pool of its parent.

    torch's own fork handler (torch/_inductor/async_compile.py, `after_fork`) resets the process
    pool but not `AsyncCompile.pool()`, a cached ThreadPoolExecutor: the child inherits the object
    without its threads, so the first C++ kernel it compiles is queued to no thread and its
    `future.result()` waits forever. That happens whenever the parent compiled before the fork and
    the child compiles a kernel that is not in the on-disk cache (a cold cache, as in CI)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


HEARTBEAT_INTERVAL_S = 0.1


def _beat(heartbeats, rank: int, parent: int) -> None:
    """A started rank's heartbeat: its last sign of life in shared memory, every 100 ms. A thread of
    its own, so a rank busy in a long step keeps beating; a stopped (SIGSTOP) or dead one does not.
    A rank whose parent is gone (killed, so that nothing stopped the rank) ends itself."""
    while os.getppid() == parent:
        heartbeats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        time.sleep(HEARTBEAT_INTERVAL_S)
    os._exit(1)


_started_rank_cores: int | None = None


def started_rank_cores() -> int | None:
    """In a rank that LocalRanks started: the cores its world's ranks share, where the rank may use more threads
    than its own share while others idle; None elsewhere."""
    return _started_rank_cores


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, threads: int | None, host_cores: int | None,
               results, heartbeats, parent: int, args) -> None:
    global _started_rank_cores
    _started_rank_cores = host_cores
    # A forked rank never collects what it inherited: the parent's garbage may hold objects whose destructors
    # join threads that a fork does not copy (a previous engine's process group: gc.collect() hung here).
    gc.freeze()
    os.environ.update(rank_environment(rank, world_size, port))
    _reset_inherited_compile_pool()
    threading.Thread(target=_beat, args=(heartbeats, rank, parent), name="torch-shift-heartbeat", daemon=True).start()
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        # plain pickle copies tensors into the message; the queue's own reducers would share their
        # memory through file descriptors that die with this process
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


class RankFailed(RuntimeError):
    pass


class LocalRanks:
    """Processes running `fn(rank, world_size, *args)` for some ranks of a local world.

    `threads`: each rank's intra-op threads (None: as inherited); `host_cores`: the cores the world's ranks
    share, which a rank may borrow while others idle (`started_rank_cores()` in the rank; None: it may not)."""

    def __init__(self, fn: Callable[..., Any], world_size: int, ranks: list[int], *args: Any, port: int,
                 threads: int | None = 1, start_method: str | None = None, host_cores: int | None = None):
        if mp.current_process().daemon:  # multiprocessing's own check is a bare assert in Process.start
            raise RuntimeError(
                f"an engine of {world_size} local ranks cannot start in a daemonic process (such as a "
                f"multiprocessing.Pool worker), whose children multiprocessing forbids: start it from a "
                f"non-daemonic process (multiprocessing.Process(daemon=False), or a concurrent.futures "
                f"ProcessPoolExecutor), or run one rank")
        method = start_method or default_start_method()
        ctx = mp.get_context(method)
        if method == "fork" and (threads != 1 or host_cores is not None) and not release_openmp_threads():
            threads, host_cores = 1, None  # a forked rank's parallel regions of several threads would hang
        self.host_cores = host_cores
        self.world_size = world_size
        self.results = ctx.Queue()
        # shared memory written by each rank's heartbeat thread (created before the processes start)
        self.heartbeats = ctx.Array("d", [time.monotonic()] * world_size, lock=False)
        self.procs = {r: ctx.Process(target=_rank_main, daemon=True,
                                     args=(fn, r, world_size, port, threads, host_cores, self.results,
                                           self.heartbeats, os.getpid(), args))
                      for r in ranks}
        for p in self.procs.values():
            p.start()

    def failed(self) -> str | None:
        """What went wrong with a rank, if anything did (a reported error or a non-zero exit)."""
        try:
            rank, status, value = self.results.get_nowait()
        except queue.Empty:
            dead = [r for r, p in self.procs.items() if p.exitcode not in (None, 0)]
            return f"rank {dead[0]} exited with code {self.procs[dead[0]].exitcode}" if dead else None
        if status == "error":
            return f"rank {rank} failed: {value}"
        self.results.put((rank, status, value))
        return None

    def silent_ranks(self, max_silence_s: float) -> list[int]:
        """Ranks that have not beaten for `max_silence_s` (stopped, hung outside Python's reach, or dead)."""
        now = time.monotonic()
        return [r for r, p in self.procs.items()
                if not p.is_alive() or now - self.heartbeats[r] > max_silence_s]

    def describe(self, rank: int, max_silence_s: float) -> str:
        """What a silent rank (`silent_ranks`) is: its exit, or its silence."""
        code = self.procs[rank].exitcode
        if code is not None:
            return f"rank {rank} exited with code {code}"
        return f"rank {rank} gave no sign of life for {max_silence_s:.1f} s"

    def stop(self, grace_s: float = 5.0, kill_after_s: float = 1.0) -> None:
        """Wait up to `grace_s` for the ranks to exit, then terminate them, and kill those still there
        `kill_after_s` later (a stopped process does not act on SIGTERM). Returns within about
        grace_s + kill_after_s."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [p for p in self.procs.values() if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + kill_after_s
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = 1,
              timeout_s: float = 300.0, start_method: str | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` local processes; return their results by
    rank. When one rank fails, dies or the time runs out, every rank is stopped and RankFailed
    names what happened."""
    ranks = LocalRanks(fn, world_size, list(range(world_size)), *args, port=free_port(), threads=threads,
                       start_method=start_method)
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            try:
                rank, status, value = ranks.results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in ranks.procs.items() if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {ranks.procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(outputs))} did not finish "
                                     f"within {timeout_s:.0f} s") from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed: {value}")
            outputs[rank] = pickle.loads(value)
    finally:
        ranks.stop(grace_s=5.0 if len(outputs) == world_size else 0.5)
    return [outputs[r] for r in range(world_size)]
