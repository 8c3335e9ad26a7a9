"""The life of a parallel engine's local ranks inside the user's process: start, heartbeat, shutdown.

These tests start `LLM(..., sp/tp=2)` in the test process itself (launch path (b)), as a user does.
"""

from __future__ import annotations

import gc
import ipaddress
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from torch_shift import LLM, SamplingParams
from torch_shift.engine import worker as worker_module
from torch_shift.parallel.launch import local_cores, run_ranks

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = ["the quick brown fox", "x"]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def listening_sockets() -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, inode
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((ipaddress.ip_address(raw), int(port, 16)))
    return found


def _continue_and_shutdown(llm: LLM, pids: list[int]) -> None:
    for pid in pids:  # a test that failed half-way must not leave a stopped process behind
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    llm.shutdown(timeout_s=5)


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_reported_and_a_shutdown_from_another_thread_ends_it(llama):
    """The server's watchdog: the heartbeat shows a SIGSTOPped rank within a fraction of a second, and
    `shutdown` from another thread, while the engine thread is blocked in the step's collectives, kills
    the rank and returns within its bound; the blocked step ends with an error."""
    _, model_dir = llama
    llm = LLM(str(model_dir), sp=2, tp=1, shift_threshold=4)
    worker = llm.engine.parallel.launched.procs[1]
    try:
        assert llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert llm.engine.unresponsive_ranks(max_silence_s=1.0) == []
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while llm.engine.unresponsive_ranks(max_silence_s=0.5) != [1]:
            assert time.monotonic() < deadline, "the stopped rank was not reported"
            time.sleep(0.05)
        assert llm.engine.unresponsive_reason(max_silence_s=0.5) == "rank 1 gave no sign of life for 0.5 s"

        errors: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - the result of this test
                errors.append(e)

        engine_thread = threading.Thread(target=generate)
        engine_thread.start()
        time.sleep(1.0)
        assert engine_thread.is_alive()  # blocked: its peer is stopped
        start = time.monotonic()
        llm.engine.shutdown(timeout_s=5.0)
        assert time.monotonic() - start < 5.0 + 3.0  # the bound, with room for a loaded machine
        engine_thread.join(timeout=10)
        assert not engine_thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "shut down" in str(errors[0])
        assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
        assert llm.engine.unresponsive_ranks(max_silence_s=0.5) == []
    finally:
        _continue_and_shutdown(llm, [worker.pid])


def test_parallel_llms_one_after_another_match_single_device_and_leave_the_process_as_it_was(llama):
    """Issue 9 item 4 and issue 10 items 6-7: two tp=2 engines then an sp=2 one in one process, each started
    after the previous one's shutdown (that object still referenced); each gives the single-device tokens;
    the rendezvous listens on the loopback only; nothing of the user's process changes; the ports close."""
    _, model_dir = llama
    expected = tokens(LLM(str(model_dir)))  # (its import of torch._dynamo sets TORCHINDUCTOR_CACHE_DIR: torch's)
    env, threads, frozen, hook = dict(os.environ), torch.get_num_threads(), gc.get_freeze_count(), sys.excepthook
    listening = listening_sockets()
    previous = None
    for args in ({"tp": 2}, {"tp": 2}, {"sp": 2, "shift_threshold": 4}):
        llm = LLM(str(model_dir), **args)
        ranks = list(llm.engine.parallel.launched.procs.values())
        try:
            opened = listening_sockets() - listening
            assert opened  # the rendezvous store and gloo's sockets
            assert not [(a, port) for a, port in opened if a.is_unspecified], opened  # none on every interface
            assert tokens(llm) == expected
            assert torch.get_num_threads() == threads  # while the engine lives too
        finally:
            llm.shutdown()
        assert not any(p.is_alive() for p in ranks)
        assert dict(os.environ) == env
        assert torch.get_num_threads() == threads and gc.get_freeze_count() == frozen
        assert sys.excepthook is hook  # init_process_group's wrapper (a rank prefix) is taken off again
        previous = llm
    del llm, previous
    assert listening_sockets() <= listening  # none of theirs is left (an earlier test's may have closed since)


def _parallel_matmul_threads(rank, world):
    a = torch.randn(256, 256)
    for _ in range(4):
        a = torch.tanh(a @ a)  # parallel regions of several threads
    return torch.get_num_threads()


@pytest.mark.timeout(120)
def test_forked_ranks_run_several_threads_after_the_parent_did():
    """libgomp does not survive a fork: a forked child of a process whose parallel regions used several threads
    hung in its first region of several threads, so forked ranks ran one thread whatever the host had. The
    launcher now releases the forking thread's OpenMP workers first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _parallel_matmul_threads(0, 1)  # the parent's worker threads exist now
        assert run_ranks(_parallel_matmul_threads, 2, threads=2, timeout_s=60) == [2, 2]
        assert _parallel_matmul_threads(0, 1) == 2  # the parent starts new workers
    finally:
        torch.set_num_threads(threads)


def test_a_dp_replica_alone_with_work_borrows_the_idle_ranks_core(llama):
    """A DP-2 engine: a lone request's replica runs on the host's cores (rank 0 here, this process), a batch
    over both replicas on each rank's own share; the tokens are the single device's; between its calls the user's
    process keeps the user's thread count (it is built on its share, then gives the count back)."""
    _, model_dir = llama
    expected = tokens(LLM(str(model_dir)))
    lone = LLM(str(model_dir)).generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    threads, cores = torch.get_num_threads(), local_cores()
    llm = LLM(str(model_dir), dp=2)
    try:
        assert llm.engine.worker.runner.host_cores == cores
        step_threads, forward_step = [], llm.engine.model.forward_step
        llm.engine.model.forward_step = lambda *a: step_threads.append(torch.get_num_threads()) or forward_step(*a)
        assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == lone
        assert llm.stats()["steps_by_layout"]["dp@0"] > 0
        assert step_threads and set(step_threads) == {cores}
        assert torch.get_num_threads() == threads  # the user's count, given back after the steps
        step_threads.clear()
        assert tokens(llm) == expected
        assert max(1, cores // 2) in step_threads  # batches over both replicas: each rank on its own share
        assert torch.get_num_threads() == threads
        torch.set_num_threads(threads + 1)  # the user's to change while the engine lives
        assert tokens(llm) == expected
        assert torch.get_num_threads() == threads + 1
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_an_interrupted_step_ends_the_ranks_and_the_next_call_says_why(llama):
    """Ctrl+C in a notebook lands inside a step: the other rank stays in the step's collectives, which rank 0 can
    never meet again. The ranks are ended at once, and the next call fails at once naming the interruption (it
    waited out the 120 s timeout, then every later call failed with a rank's exit code)."""
    _, model_dir = llama
    llm = LLM(str(model_dir), tp=2)
    worker = llm.engine.parallel.launched.procs[1]
    runner = llm.engine.worker.runner
    real = runner.execute

    def interrupted(*args, **kwargs):
        runner.execute = real
        raise KeyboardInterrupt

    runner.execute = interrupted
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 10 and not worker.is_alive()
        with pytest.raises(RuntimeError, match="a step was interrupted \\(KeyboardInterrupt\\).*create a new"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        llm.shutdown(timeout_s=5)


@pytest.mark.timeout(120)
def test_a_second_interrupt_during_the_shutdown_still_ends_the_ranks(llama):
    """Ctrl+C again while the interrupted step's shutdown waits for the ranks to leave: the ranks are ended at once
    and the process group released (the ranks were left running, waiting for rank 0's next message, for as long as
    the notebook's kernel lived, and no later engine could start)."""
    _, model_dir = llama
    llm = LLM(str(model_dir), tp=2)
    launched = llm.engine.parallel.launched
    worker = launched.procs[1]
    real_stop = launched.stop
    graceful = []

    def stop(grace_s, kill_after_s):
        graceful.append(grace_s)
        if len(graceful) == 1:
            raise KeyboardInterrupt  # during the graceful wait
        real_stop(grace_s=grace_s, kill_after_s=kill_after_s)

    launched.stop = stop
    with pytest.raises(KeyboardInterrupt):
        llm.shutdown(timeout_s=5)
    assert graceful[1:] == [0.0] and not worker.is_alive()
    llm = LLM(str(model_dir), tp=2)  # the process group was released: a new engine starts
    llm.shutdown()


def test_del_ends_the_ranks(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir), sp=2, tp=1)
    rank = llm.engine.parallel.launched.procs[1]
    assert rank.is_alive()
    del llm
    assert not rank.is_alive()
    llm = LLM(str(model_dir), sp=2, tp=1)  # the process group was released: a new engine starts
    llm.shutdown()


@pytest.mark.timeout(120)
def test_construction_ends_within_the_timeout_when_a_rank_stops_answering(llama, monkeypatch):
    """A rank stopped while the engines are built: rank 0 gives up after distributed_timeout_s (not the
    control group's idle timeout of a year) and the stopped rank is killed."""
    _, model_dir = llama
    parent = os.getpid()
    num_kv_blocks = worker_module._num_kv_blocks

    def stop_in_started_ranks(*args):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGSTOP)
        return num_kv_blocks(*args)

    monkeypatch.setattr(worker_module, "_num_kv_blocks", stop_in_started_ranks)
    children_before = {p.pid for p in multiprocessing.active_children()}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank"):
        LLM(str(model_dir), sp=2, tp=1, distributed_timeout_s=5)
    assert time.monotonic() - start < 5 + 30  # the bound plus start-up on a loaded machine
    assert {p.pid for p in multiprocessing.active_children()} <= children_before


@pytest.mark.timeout(120)
def test_a_rank_that_dies_before_the_control_group_ends_the_construction_with_its_exit(llama, monkeypatch):
    """The control group, which has no timeout once made, was made without one: a rank that died before it joined
    left rank 0 waiting for it for good (a helper's probe: no timeout, no Ctrl+C). Now made under the bound, and the
    error names the rank, not the store's key."""
    from torch_shift.parallel import groups

    _, model_dir = llama
    parent = os.getpid()
    build = groups.DeploymentGroups.build.__func__

    def die_in_started_ranks(cls, *args, **kwargs):
        if os.getpid() != parent:
            os._exit(7)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(groups.DeploymentGroups, "build", classmethod(die_in_started_ranks))
    children_before = {p.pid for p in multiprocessing.active_children()}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the parallel engine could not start: rank 1 exited with code 7"):
        LLM(str(model_dir), sp=2, tp=1, distributed_timeout_s=5)
    assert time.monotonic() - start < 5 + 30
    assert {p.pid for p in multiprocessing.active_children()} <= children_before
    assert tokens(LLM(str(model_dir)))  # the process is still whole


def _wait_on_the_control_group(rank: int, world_size: int) -> float:
    from datetime import timedelta

    import torch.distributed as dist

    from torch_shift.config import ModelConfig
    from torch_shift.parallel.groups import DeploymentGroups
    from torch_shift.parallel.layouts import build_deployment

    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64})
    bound = timedelta(seconds=2)
    dist.init_process_group("gloo", timeout=bound)
    control = DeploymentGroups.build(build_deployment(config, tp=2), bound).control_group
    if rank == 1:
        time.sleep(4)  # an idle server: past the forward's bound
    start = time.monotonic()
    dist.broadcast_object_list([None] if rank == 0 else ["plan"], src=1, group=control)
    return time.monotonic() - start


def test_the_control_group_is_made_under_the_bound_then_waits_without_one():
    """Made under the forward's bound (a rank that died before it joined ends the construction), the control group
    then waits as long as a server idles."""
    waited = run_ranks(_wait_on_the_control_group, 2, timeout_s=60)
    assert waited[0] > 2


@pytest.mark.timeout(120)
def test_after_a_failed_step_the_next_call_fails_at_once(llama):
    """A stopped rank: the step fails after distributed_timeout_s, and each later call waited that long again (a
    helper's probe). The failed step now ends the ranks, and the next call says why at once."""
    _, model_dir = llama
    llm = LLM(str(model_dir), sp=2, tp=1, distributed_timeout_s=5)
    worker = llm.engine.parallel.launched.procs[1]
    try:
        assert tokens(llm)
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match="rank 1"):
            tokens(llm)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="the parallel engine was shut down: a step failed .*rank 1.*; "
                                               "create a new engine"):
            tokens(llm)
        assert time.monotonic() - start < 2.5  # at once, not after the 5 s timeout again
        assert not worker.is_alive()
    finally:
        _continue_and_shutdown(llm, [worker.pid])


EXIT_WITH_A_STOPPED_RANK = """
import os, signal, sys
from torch_shift import LLM
llm = LLM(sys.argv[1], sp=2, tp=1)
pid = llm.engine.parallel.launched.procs[1].pid
os.kill(pid, signal.SIGSTOP)
print(pid, flush=True)
"""


def _run_script(path, text: str, model_dir) -> subprocess.CompletedProcess:
    """`text` run as a script of its own, given the model directory."""
    path.write_text(text)
    return subprocess.run([sys.executable, str(path), str(model_dir)], capture_output=True, text=True, timeout=120)


def test_the_process_exits_and_ends_a_stopped_rank(llama, tmp_path):
    """Issue 10 item 3, offline: a process that exits without shutdown() while its rank is stopped exits
    (multiprocessing's own exit handler would wait for that rank forever) and the rank ends."""
    _, model_dir = llama
    result = _run_script(tmp_path / "exit.py", EXIT_WITH_A_STOPPED_RANK, model_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"rank {pid} outlived its process"
        time.sleep(0.1)


FORK_A_CHILD_THAT_EXITS = """
import os, sys, time
from torch_shift import LLM, SamplingParams
llm = LLM(sys.argv[1], sp=2, tp=1)
params = SamplingParams(max_tokens=6, temperature=0.0)
before = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0].token_ids
pid = os.fork()
if pid == 0:
    sys.exit(0)  # its exit handlers run in the child
deadline = time.monotonic() + 30
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    assert time.monotonic() < deadline, "the forked child hung at its exit"
    time.sleep(0.05)
after = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0].token_ids
assert after == before, (before, after)
llm.shutdown()
print("ok")
"""


def test_a_forked_child_that_exits_leaves_the_parents_ranks_alone(llama, tmp_path):
    """A helper's probe: the child's copy of the runtime's exit handler (and multiprocessing's, which took the ranks
    for its daemonic children) terminated the parent's rank, then the child hung at its exit in gloo's destructors."""
    _, model_dir = llama
    result = _run_script(tmp_path / "fork.py", FORK_A_CHILD_THAT_EXITS, model_dir)
    assert result.returncode == 0 and result.stdout.split()[-1:] == ["ok"], result.stderr[-2000:]


IN_A_POOL_WORKER = """
import multiprocessing, sys
from torch_shift import LLM

def build(model_dir):
    try:
        LLM(model_dir, tp=2)
    except RuntimeError as e:
        return str(e)
    return "built"

if __name__ == "__main__":
    with multiprocessing.get_context("fork").Pool(1) as pool:
        print(pool.apply(build, (sys.argv[1],)))
"""


def test_an_engine_of_several_ranks_in_a_pool_worker_is_refused_by_name(llama, tmp_path):
    """A Pool worker is daemonic, and multiprocessing refuses it children with a bare AssertionError."""
    _, model_dir = llama
    result = _run_script(tmp_path / "pool.py", IN_A_POOL_WORKER, model_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cannot start in a daemonic process" in result.stdout, result.stdout


@pytest.mark.timeout(120)
def test_a_rank_that_died_while_idle_is_reported_by_its_exit_code(llama):
    """The server's watchdog logged a killed rank as one that "gave no sign of life"."""
    _, model_dir = llama
    llm = LLM(str(model_dir), tp=2)
    worker = llm.engine.parallel.launched.procs[1]
    try:
        assert llm.engine.unresponsive_reason(max_silence_s=1.0) is None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        assert llm.engine.unresponsive_reason(max_silence_s=1.0) == f"rank 1 exited with code {-signal.SIGKILL}"
    finally:
        llm.shutdown(timeout_s=5)
