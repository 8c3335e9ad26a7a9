"""The ranks of a parallel engine and the messages rank 0 sends them.

(a) Under torchrun every rank runs the user's program; (b) from an ordinary process, this
process becomes rank 0 and starts the other local ranks itself, which run the worker loop.
Rank 0 schedules; every step it broadcasts the step plan on a CPU (gloo) group, then all ranks
run the forward together. A rank that fails ends the others: a dead peer breaks the gloo
connections at once, and every collective has the process group's timeout as a bound.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_shift.parallel.groups import DeploymentGroups
from torch_shift.parallel.launch import LocalRanks, default_start_method, free_port, rank_environment


class ParallelRuntime:
    def __init__(self, deployment, worker_main, worker_args: tuple, timeout_s: float):
        world = deployment.world_size
        self.launched: LocalRanks | None = None
        if not dist.is_initialized():
            if "RANK" not in os.environ:  # (b): start ranks 1..P-1 here
                port = free_port()
                method = default_start_method()
                # forked ranks run one intra-op thread: a forked child of a process that used several
                # OpenMP threads hangs in its first parallel region (measured here)
                self.launched = LocalRanks(worker_main, world, list(range(1, world)), *worker_args, port=port,
                                           threads=1 if method == "fork" else max(1, os.cpu_count() // world),
                                           start_method=method)
                os.environ.update(rank_environment(0, world, port))
                torch.set_num_threads(max(1, os.cpu_count() // world))
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            kwargs: dict[str, Any] = {}
            if backend == "nccl":
                local_rank = int(os.environ.get("LOCAL_RANK", 0))
                torch.cuda.set_device(local_rank)
                kwargs["device_id"] = torch.device("cuda", local_rank)
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        self.groups = DeploymentGroups.build(deployment)
        self.rank = dist.get_rank()

    @classmethod
    def over(cls, deployment, replica_groups) -> ParallelRuntime:
        """The runtime of ranks that already hold their groups (a module from `torch_shift.parallelize`,
        every rank running the user's program): nothing is started or initialised."""
        runtime = cls.__new__(cls)
        runtime.launched = None
        runtime.groups = DeploymentGroups.build(deployment, replica_groups)
        runtime.rank = dist.get_rank()
        return runtime

    @property
    def device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 sends `message`; every rank returns it."""
        box = [message]
        try:
            dist.broadcast_object_list(box, src=0, group=self.groups.control_group)
        except Exception as e:
            raise self.failure(e) from e
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.groups.control_group)
        return int(t.item())

    def failure(self, error: Exception, wait_s: float = 2.0) -> RuntimeError:
        """The error to raise when a collective failed: a started rank's own report when there is one
        (it may reach us a moment after its sockets closed), else the collective's error."""
        deadline = time.monotonic() + wait_s
        while self.launched is not None:
            report = self.launched.failed()
            if report is not None:
                return RuntimeError(report)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return RuntimeError(f"a rank failed or stopped answering: {error}")

    def shutdown(self) -> None:
        """Rank 0 of (b): tell the workers to exit, wait for them, and leave the process group."""
        if self.launched is not None:
            try:
                self.broadcast(("shutdown", None))
            except RuntimeError:
                pass  # a worker already died: nothing to tell
            self.launched.stop()
            self.launched = None
            if dist.is_initialized():
                dist.destroy_process_group()
