"""The GEMV kernel's decode pool (kernels/cpu_linear.cpp, torch_shift.engine.decode_pool): its threads compute
the same bits as torch's, whatever they prefetched, in a forked child too, and an engine's steps of a few tokens
give the same tokens and logprobs with it as without."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import random_prompts

from torch_shift import LLM, SamplingParams, kernels
from torch_shift.engine import decode_pool
from torch_shift.engine.decode_pool import MAX_WORKERS, SMALL_STEPS_BEFORE_POOL
from torch_shift.kernels import arm_gemv_pool, gemv_pool_workers, stop_gemv_pool
from torch_shift.models.linear import GEMV_MAX_ROWS, PackedWeight, packing_supported
from torch_shift.parallel.launch import local_cores, release_openmp_threads

DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if packing_supported(torch.device("cpu"), dt)]


def _pool_dtype() -> torch.dtype:
    """float32 where the GEMV kernel runs it (AVX-512), else bfloat16 (the AVX2 kernel's blocks run on the pool)."""
    return next((dt for dt in DTYPES if PackedWeight(torch.zeros(64, 64, dtype=dt)).gemv is not None), torch.float32)


POOL_DTYPE = str(_pool_dtype()).removeprefix("torch.")


def _weights(dtype):
    """A decode step's shapes in small: qkv, o, gate/up, down, LM head."""
    torch.manual_seed(0)
    shapes = [(384, 256), (256, 256), (1024, 256), (256, 512), (1024, 256)]
    weights = [PackedWeight(torch.randn(shape).to(dtype)) for shape in shapes]
    if any(w.gemv is None for w in weights):
        pytest.skip("the GEMV kernel does not run here (no compiler or no AVX-512)")
    return weights


def _step(weights, xs, bias):
    return [w(x, bias if w.out_features == bias.numel() else None) for w, x in zip(weights, xs)]


@pytest.fixture
def disarmed():
    yield
    decode_pool.stop()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_pool_computes_torchs_bits_whatever_it_prefetched(dtype, disarmed):
    """Every row count the GEMV takes, the weights run in a fixed order again and again (the pool learns it and
    prefetches the next ones), with one worker and with more workers than cores: each result equals the one
    computed on torch's threads bit for bit. A weight freed while the pool still expects it is harmless."""
    weights = _weights(dtype)
    bias = torch.randn(256).to(dtype)
    for rows in [1, 2, 5, 7, 12, 16, 33, GEMV_MAX_ROWS]:
        xs = [torch.randn(rows, w.in_features).to(dtype) for w in weights]
        expected = _step(weights, xs, bias)
        for workers in (1, 3):
            assert arm_gemv_pool(workers) == workers == gemv_pool_workers()
            for _ in range(4):
                assert all(torch.equal(g, e) for g, e in zip(_step(weights, xs, bias), expected, strict=True))
            arm_gemv_pool(0)
    for workers in (3, 1, 2, 0, 2):  # fewer workers than the last job's, and more
        assert arm_gemv_pool(workers) == workers
        assert all(torch.equal(g, e) for g, e in zip(_step(weights, xs, bias), expected, strict=True))
    time.sleep(0.02)  # the workers sleep after 5 ms without work; the next job wakes them
    assert all(torch.equal(g, e) for g, e in zip(_step(weights, xs, bias), expected, strict=True))
    stop_gemv_pool()  # ends them; arming starts new ones
    assert gemv_pool_workers() == 0 and arm_gemv_pool(1) == 1
    arm_gemv_pool(1)
    _step(weights, xs, bias)
    del weights[2]  # the pool's order still names it next after the second
    xs = [torch.randn(GEMV_MAX_ROWS, w.in_features).to(dtype) for w in weights]
    armed = _step(weights, xs, bias)
    arm_gemv_pool(0)
    assert all(torch.equal(a, e) for a, e in zip(armed, _step(weights, xs, bias), strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_threads_calling_at_once_both_get_torchs_bits(dtype, disarmed):
    """One caller at a time runs on the pool; another runs its matmul on torch's threads meanwhile."""
    weights = _weights(dtype)
    bias = torch.randn(256).to(dtype)
    xs = [torch.randn(4, w.in_features).to(dtype) for w in weights]
    expected = _step(weights, xs, bias)
    arm_gemv_pool(1)
    failures = []

    def caller():
        for _ in range(50):
            if not all(torch.equal(g, e) for g, e in zip(_step(weights, xs, bias), expected)):
                failures.append(1)

    callers = [threading.Thread(target=caller) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert not failures


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_of_a_pooled_step_runs_on_the_pool_with_one_threads_bits(dtype, disarmed):
    """A pooled step's SiLU (torch's threads at one) runs in pieces on the pool's threads: every element as one thread
    computes it, in rows whose length leaves a remainder after the vectorised runs (std::exp) too. The pool's pieces
    (ts_pool_run_pieces) each run once; where the pool is not armed none runs there and the caller runs them."""
    if not kernels.cpu_ops():
        pytest.skip("the operator library does not build here")
    import torch_shift.models.fused  # noqa: F401 - defines torch_shift::cpu_silu_mul

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for tokens, intermediate in ((1, 24576), (17, 24576), (64, 2816), (5, 5000), (3, 4097), (2, 8191)):
            gate_up = (torch.randn(tokens, 2 * intermediate) * 4).to(dtype)
            expected = torch.ops.torch_shift.cpu_silu_mul(gate_up)
            assert arm_gemv_pool(1) == 1
            assert torch.equal(torch.ops.torch_shift.cpu_silu_mul(gate_up), expected), (tokens, intermediate)
            arm_gemv_pool(0)
    finally:
        torch.set_num_threads(threads)
    piece_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
    run_pieces = kernels._ops_library.ts_pool_run_pieces
    run_pieces.argtypes, run_pieces.restype = [ctypes.c_int64, piece_type, ctypes.c_void_p], ctypes.c_int
    ran = []
    piece = piece_type(lambda ctx, b: ran.append(b))
    assert run_pieces(100, piece, None) == 1 and not ran  # not armed: the caller's own way
    assert arm_gemv_pool(1) == 1
    assert run_pieces(100, piece, None) == 0 and sorted(ran) == list(range(100))


def test_a_child_forked_from_an_armed_process_computes_without_the_parents_threads(disarmed):
    """fork copies only the forking thread: the child's pool starts disarmed (pthread_atfork) and its matmuls run
    on torch's threads; arming it there starts threads of its own."""
    (weight, *_) = _weights(_pool_dtype())
    x = torch.randn(3, weight.in_features).to(weight.dtype)
    expected = weight(x, None)
    arm_gemv_pool(1)
    weight(x, None)
    release_openmp_threads()  # as the launcher does before it forks (libgomp does not survive a fork)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            results = [gemv_pool_workers(), torch.equal(weight(x, None), expected)]
            arm_gemv_pool(1)
            results.append(torch.equal(weight(x, None), expected))
            os.write(write, pickle.dumps(results))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        results = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    assert results == [0, True, True]



PARAMS = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=2)
PROMPTS = [random_prompts(1, [37]), random_prompts(3, [5, 40, 9], seed=1), random_prompts(6, None, seed=2)]


def _outputs(llm):
    runs = [llm.generate(prompts, PARAMS, use_tqdm=False) for prompts in PROMPTS]
    return [[(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in top.items()} for top in o.outputs[0].logprobs])
             for o in run] for run in runs]


def _threads_of_this_process() -> set[str] | None:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _armed_in_decodes(llm) -> int:
    """The pool's workers seen in the decode steps of a generation."""
    seen = []
    step = llm.engine.worker.runner._run_groups

    def spy(*args):
        seen.append(gemv_pool_workers())
        return step(*args)

    llm.engine.worker.runner._run_groups = spy
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2 * SMALL_STEPS_BEFORE_POOL, ignore_eos=True), use_tqdm=False)
    del llm.engine.worker.runner._run_groups
    return max(seen)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="the pool needs two threads or more")
def test_a_multi_step_runs_steps_count_toward_the_pools_start(layers4, disarmed):
    """The pool starts after SMALL_STEPS_BEFORE_POOL small steps in a row, each step of a multi-step run one of them:
    `LLM` at one rank (8 decode steps a plan by default) runs its first run after a prompt on the pool, where counting
    plans kept it off for 7 runs (56 tokens: 0.93-0.94x the TPOT with it in fast spells, docs/performance.md)."""
    llm = LLM(str(layers4), dtype=POOL_DTYPE, compile=False)
    runner = llm.engine.worker.runner
    if not runner.decode_pool.enabled:
        pytest.skip("the GEMV kernel does not run here")
    assert llm.engine.config.scheduler.num_scheduler_steps >= SMALL_STEPS_BEFORE_POOL
    runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 0.3 MB here)
    seen, run_groups = [], runner._run_groups

    def spy(plan, *args):
        seen.append((plan.groups[0].num_steps, gemv_pool_workers()))
        return run_groups(plan, *args)

    runner._run_groups = spy
    llm.generate({"prompt_token_ids": random_prompts(1, [100], seed=3)[0]},
                 SamplingParams(max_tokens=1 + 2 * SMALL_STEPS_BEFORE_POOL, ignore_eos=True), use_tqdm=False)
    assert [steps for steps, _ in seen] == [1, SMALL_STEPS_BEFORE_POOL, SMALL_STEPS_BEFORE_POOL]  # the prompt, 2 runs
    assert seen[0][1] == 0 and seen[1][1] > 0 and seen[2][1] > 0
    llm.shutdown()


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_engine_gives_the_same_outputs_with_and_without_the_pool(layers4, compile, disarmed, monkeypatch):
    """Steps whose matmuls all run the GEMV run on the pool (torch on one thread, compiled for it at start-up:
    nothing recompiles), the others on torch's threads: the same tokens and logprobs as an engine without it."""
    import torch._dynamo

    # steps of up to 128 tokens: the six prompts' 134 take two, the first above what the pool takes
    without = LLM(str(layers4), decode_pool=False, compile=compile, max_num_batched_tokens=128, dtype=POOL_DTYPE)
    expected = _outputs(without)
    assert not without.engine.worker.runner.decode_pool.enabled
    # synchronous steps: the pool's own workers run them (launched steps: tests/test_native_decoder.py)
    llm = LLM(str(layers4), compile=compile, max_num_batched_tokens=128, async_scheduling=False, dtype=POOL_DTYPE)
    if not llm.engine.worker.runner.decode_pool.enabled:
        pytest.skip("the GEMV kernel does not run here")
    threads = torch.get_num_threads()
    monkeypatch.setattr(decode_pool, "SMALL_STEPS_BEFORE_POOL", 1)  # every small step on the pool
    llm.engine.worker.runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 0.3 MB here)
    pooled, other_threads = [], []
    run_groups = llm.engine.worker.runner._run_groups

    def spy(*args):
        pooled.append(gemv_pool_workers() > 0)
        if not pooled[-1]:
            return run_groups(*args)
        # this thread runs on one OpenMP thread; a thread started now has torch's default
        other = threading.Thread(target=lambda: other_threads.append(torch.get_num_threads()))
        other.start()
        other.join()
        assert torch.get_num_threads() == 1
        threads_before = _threads_of_this_process()
        out = run_groups(*args)
        # no OpenMP worker started: the forward ran code made for one thread (a graph compiled for more opens
        # regions of that many threads whatever torch's count)
        after = _threads_of_this_process()
        assert after is None or after <= threads_before  # (the joined thread above may still be listed before)
        return out

    llm.engine.worker.runner._run_groups = spy
    torch._dynamo.config.error_on_recompile = True
    try:
        assert _outputs(llm) == expected
    finally:
        torch._dynamo.config.error_on_recompile = False
        del llm.engine.worker.runner._run_groups
    if threads > 1:
        assert sum(pooled) >= 3 * (PARAMS.max_tokens - 1)  # the decodes of the three prompt sets
        assert not all(pooled)  # the 128-token step on torch's threads
        assert set(other_threads) == {threads}
    assert torch.get_num_threads() == threads  # the caller's threads, after every step
    if threads > 1:
        assert _armed_in_decodes(llm) == min(threads - 1, MAX_WORKERS)
    llm.shutdown()
    assert gemv_pool_workers() == 0


def test_which_steps_the_pool_takes(layers4):
    """Steps of 1 to GEMV_MAX_ROWS tokens (those whose matmuls all run the GEMV) on a rank of several threads,
    whose KV reads stay below a share of the weights' bytes (attention runs on one thread in a pooled step); at most
    the kernel's 63 workers."""
    engine = LLM(str(layers4), dtype=POOL_DTYPE).engine
    pool = engine.worker.runner.decode_pool
    if not pool.enabled:
        pytest.skip("the GEMV kernel does not run here")
    budget = pool.kv_budget_tokens
    assert budget is not None and budget > 0
    limit = pool.max_tokens
    packed = next(m.packed for m in engine.model.modules() if getattr(m, "packed", None) is not None)
    assert limit == packed.gemv_max_rows  # GEMV_MAX_ROWS; the blocks' ts_blocked_gemv_rows
    assert [pool.workers(tokens, 2) for tokens in (0, 1, limit, limit + 1)] == [0, 1, 1, 0]
    assert pool.workers(1, 1) == 0 and pool.workers(4, 200) == MAX_WORKERS
    assert pool.workers(1, 2, kv_tokens=budget) == 1 and pool.workers(1, 2, kv_tokens=budget + 1) == 0
    assert not decode_pool.DecodePool(LLM(str(layers4), decode_pool=False).engine.model, torch.device("cpu"),
                                      False).workers(1, 2)


def test_a_gpu_engines_steps_build_no_cpu_kernels(tmp_path):
    """A GPU engine's runner calls the pool's step, idle and stop like a CPU one's; in a process that never loaded
    the CPU kernels, they ask nothing of them, so a GPU machine builds no C++ (it did at the first warm-up step: an
    H200 engine's start-up 49 s with the build, 37 s without) and needs no compiler."""
    script = """
import torch
from torch_shift import kernels
from torch_shift.engine import decode_pool
pool = decode_pool.DecodePool(torch.nn.Linear(4, 4), torch.device("cuda"))
assert not pool.enabled and pool.step(1) == 0 and pool.step(1, asynchronous=True) == 0
decode_pool.end_step(); decode_pool.idle(); decode_pool.stop()
assert kernels._libraries.cache_info().currsize == 0, "the CPU kernels were looked for"
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # nothing built here, whatever the user's cache holds
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "torch_shift").exists()


def test_dp_replicas_run_their_lone_steps_on_the_pool(layers4, disarmed, monkeypatch):
    """DP-2 started from this process: a replica alone with work borrows the idle rank's core, for the pool's
    worker in its small steps; outputs as one process's."""
    expected = _outputs(LLM(str(layers4), decode_pool=False, max_num_batched_tokens=32, dtype=POOL_DTYPE))
    llm = LLM(str(layers4), dp=2, max_num_batched_tokens=32, dtype=POOL_DTYPE)
    runner = llm.engine.worker.runner
    runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 0.3 MB here)
    # the runner gives the lone replica both cores at every step (torch.set_num_threads); on the pool, its thread
    # must still run on one OpenMP thread beside the pool's worker
    monkeypatch.setattr(decode_pool, "SMALL_STEPS_BEFORE_POOL", 1)
    threads_in_pooled_steps, run_groups = [], runner._run_groups

    def spy(*args):
        if gemv_pool_workers() > 0:
            threads_in_pooled_steps.append(torch.get_num_threads())
        return run_groups(*args)

    runner._run_groups = spy
    try:
        outputs = _outputs(llm)
        del runner._run_groups
        assert outputs == expected
        if local_cores() > 1 and runner.decode_pool.enabled:
            assert _armed_in_decodes(llm) == min(local_cores() - 1, MAX_WORKERS)  # rank 0's replica, alone
            assert len(threads_in_pooled_steps) >= 5 and set(threads_in_pooled_steps) == {1}
    finally:
        llm.shutdown()


def test_a_pooled_step_holds_one_thread_after_its_count_was_raised(layers4, disarmed, monkeypatch):
    """Between two pooled steps the caller may raise the thread's OpenMP count (the runner does, for a DP replica
    alone with work): the next pooled step takes it back to one, and the step's end gives the raised count back."""
    pool = LLM(str(layers4), dtype=POOL_DTYPE).engine.worker.runner.decode_pool
    if not pool.enabled:
        pytest.skip("the GEMV kernel does not run here")
    monkeypatch.setattr(decode_pool, "SMALL_STEPS_BEFORE_POOL", 1)
    threads = torch.get_num_threads()
    try:
        assert pool.step(1, 0, threads=2) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert pool.step(1, 0, threads=2) == 1 and torch.get_num_threads() == 1
        decode_pool.end_step()
        assert torch.get_num_threads() == 2
    finally:
        decode_pool.idle()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("asynchronous", [False, None])
def test_a_generation_interrupted_while_pooled_gives_the_threads_back(layers4, disarmed, asynchronous):
    """Synchronous steps on the pool's workers, or (the default for single steps) launched on the C++ decoder's
    thread, the engine's thread helping: interrupted mid-generation, the thread has its OpenMP threads back, the pool
    sleeps and no launched step is left running."""
    llm = LLM(str(layers4), max_num_batched_tokens=32, async_scheduling=asynchronous, dtype=POOL_DTYPE,
              num_scheduler_steps=1)
    runner = llm.engine.worker.runner
    runner.decode_pool.kv_budget_tokens = None
    launched, launch_step = [], runner.model.launch_step

    def launch(*args):
        launched.append(len(launched))
        return launch_step(*args)

    runner.model.launch_step = launch
    threads = torch.get_num_threads()
    steps = []
    step = llm.engine.step

    def interrupted(*args, **kwargs):
        steps.append(gemv_pool_workers())
        if len(steps) > 2 * SMALL_STEPS_BEFORE_POOL:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    llm.engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    if threads > 1 and runner.decode_pool.enabled and not runner.launch_steps:
        assert max(steps) == min(threads - 1, MAX_WORKERS)  # it was pooled when interrupted
    assert torch.get_num_threads() == threads and gemv_pool_workers() == 0
    if runner.launch_steps:
        assert launched and not runner.model.native_decoder.launched
    llm.shutdown()


STOP_WHILE_A_WORKER_LOOKS = """
import ctypes, sys, time
import torch  # the library links libtorch's own libraries
pool = ctypes.CDLL(sys.argv[1])
assert pool.ts_gemv_pool_arm(1) == 1
time.sleep(0.05)  # the worker pauses 20 ms after each look at `stopping`: stop() comes inside such a pause
pool.ts_gemv_pool_stop()
print("stopped")
"""


@pytest.mark.slow
def test_stop_ends_a_worker_that_looked_at_stopping_just_before(tmp_path):
    """A worker that found `stopping` false just before stop() set it: it must not sleep for ever on the arming
    word that stop() already changed (stop() joins it). The kernel built with a pause after that look, so that stop()
    always comes inside it (the window is a few instructions otherwise)."""
    import platform
    import subprocess
    import sys
    from pathlib import Path

    import torch_shift.kernels as kernels_module
    from torch_shift.kernels import compiler

    if platform.machine() != "x86_64" or compiler() is None or not kernels_module.cpu_kernels():
        pytest.skip("the pool's threads run on x86-64 (and need a C++ compiler)")
    source = Path(kernels_module.__file__).parent / "cpu_linear.cpp"
    error = kernels_module._compile_and_link(compiler(), [source], tmp_path / "libpool.so", native=False,
                                             extra_flags=("-DTS_TEST_WORKER_PAUSE_US=20000",))
    assert error is None, error
    try:
        run = subprocess.run([sys.executable, "-c", STOP_WHILE_A_WORKER_LOOKS, str(tmp_path / "libpool.so")],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("stop() did not return within 30 s: the worker slept on the arming word")
    assert run.returncode == 0 and run.stdout.strip() == "stopped", run.stderr


@pytest.mark.parametrize("native", [True, False])
def test_a_long_context_keeps_the_pool_where_the_cpp_decoder_attends(layers4, native, disarmed, monkeypatch):
    """The C++ decoder runs attention's work items on the pool's threads, so its small steps take the pool whatever
    their context; where attention runs outside it (native_decode=False, on the step's one thread) a context past the
    KV budget keeps the step's threads."""
    llm = LLM(str(layers4), dtype=POOL_DTYPE, native_decode=native, async_scheduling=False)
    try:
        runner = llm.engine.worker.runner
        pool = runner.decode_pool
        if not pool.enabled or torch.get_num_threads() < 2:
            pytest.skip("the GEMV kernel's pool does not run here")
        assert runner.native_decode is native
        budget = pool.kv_budget_tokens
        prompt = random_prompts(1, [budget + 20], seed=5)[0]
        assert len(prompt) + 16 <= llm.engine.config.scheduler.max_model_len, budget
        seen, step = [], pool.step

        def spy(tokens, kv_tokens=0, threads=None, asynchronous=False, num_steps=1):
            workers = step(tokens, kv_tokens, threads, asynchronous, num_steps)
            seen.append((tokens, kv_tokens, workers))
            return workers

        monkeypatch.setattr(pool, "step", spy)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        decodes = [(kv_tokens, workers) for tokens, kv_tokens, workers in seen if tokens == 1]
        assert len(decodes) == 15
        if native:
            assert all(kv_tokens == 0 for kv_tokens, _ in decodes) and decodes[-1][1] > 0
        else:
            assert all(kv_tokens > budget and workers == 0 for kv_tokens, workers in decodes)
    finally:
        llm.shutdown()
