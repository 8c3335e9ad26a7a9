"""Compiled forwards: outputs equal to eager, and no recompilation as batch sizes change."""

from __future__ import annotations

import pytest
from conftest import random_prompts, refuse_python_ulysses

from torch_shift import LLM, SamplingParams
from torch_shift.parallel.launch import run_ranks

PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=2)
WARMUP = random_prompts(6, [3, 17, 40, 1, 9, 6])
# then other batch sizes, a chunked prefill next to decodes, and one-token steps
SERVING = [random_prompts(5, [7, 2, 30, 11, 4], seed=3), random_prompts(1, [5], seed=4),
           random_prompts(3, [60, 2, 8], seed=5)]


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _forwards(llm):
    from torch_shift.compilation import CompiledForward

    forwards = [f for f in llm.engine.model.forwards.values() if isinstance(f, CompiledForward)]
    assert forwards and all(f.sealed for f in forwards)  # the engine sealed them after its warm-up
    return forwards


def _run(llm):
    """Every prompt set through an engine compiled and warmed up at construction, first with its forwards
    unsealed: nothing compiles while it serves (no new graph, no recompile), so the sealed forwards, which skip
    dynamo's guards, never run a graph made for other inputs. Then sealed, as the engine runs them: outputs of
    both runs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    forwards = _forwards(llm)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the construction compiled
    for forward in forwards:
        forward.sealed = False
    torch._dynamo.config.error_on_recompile = True  # any recompile from here on raises
    try:
        unsealed = [llm.generate(p, PARAMS, use_tqdm=False) for p in [WARMUP] + SERVING]
    finally:
        torch._dynamo.config.error_on_recompile = False
        for forward in forwards:
            forward.seal()
    assert counters["stats"]["unique_graphs"] == graphs
    return unsealed, [llm.generate(p, PARAMS, use_tqdm=False) for p in [WARMUP] + SERVING]


def _compiled_rank(rank, world, model_dir, shift_threshold):
    llm = LLM(str(model_dir), sp=world, tp=1, shift_threshold=shift_threshold, compile=True, max_num_batched_tokens=32)
    return [[_token_ids(o) for o in run] for run in _run(llm)], dict(llm.engine.model.layout_counts)


@pytest.mark.slow
def test_compiled_single_device_matches_eager_without_recompiles(llama):
    """On the CPU to the last bit: RMSNorm, rotary and `silu(gate) * up` stay the eager forward's operators in the
    compiled graph (models/fused.py), and the steps of up to 64 tokens, which run the C++ decoder where it runs,
    round as the eager forward too (steps of up to 128 tokens: the prompt sets of 76 and 70 tokens take the compiled
    forward)."""
    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=128, compile=False)
    expected = [eager.generate(p, PARAMS, use_tqdm=False) for p in [WARMUP] + SERVING]
    for got in _run(LLM(str(model_dir), compile=True, max_num_batched_tokens=128)):
        for g, e in zip(got, expected):
            assert _token_ids(g) == _token_ids(e)
            for og, oe in zip(g, e):
                for lg, le in zip(og.outputs[0].logprobs, oe.outputs[0].logprobs):
                    assert {t: lp.logprob for t, lp in lg.items()} == {t: lp.logprob for t, lp in le.items()}


def test_compiled_cpu_forwards_attend_in_cpp(llama, monkeypatch):
    """On the CPU a compiled forward's attention calls run the paged kernel from C++ (kernels/cpu_ops.cpp), never
    CpuPagedAttention's Python; with that path declined, Python serves them: the same tokens and logprobs."""
    from torch_shift.attention.cpu import CpuPagedAttention
    from torch_shift.kernels import native_attention

    _, model_dir = llama
    # every step through the compiled forward (not the C++ decoder's, which needs the C++ attention installed)
    llm = LLM(str(model_dir), compile=True, max_num_batched_tokens=32, native_decode=False)
    if native_attention() is None:
        pytest.skip("the C++ operator library does not build here")
    calls = []
    python_call = CpuPagedAttention.__call__
    monkeypatch.setattr(CpuPagedAttention, "__call__", lambda self, *a, **k: calls.append(1) or python_call(self, *a,
                                                                                                               **k))
    prompts = WARMUP + SERVING[0]
    native = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert not calls
    monkeypatch.setattr(CpuPagedAttention, "install_native", lambda self: False)
    python = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert calls
    assert _token_ids(native) == _token_ids(python)
    for n, p in zip(native, python):
        assert [dict((t, lp.logprob) for t, lp in top.items()) for top in n.outputs[0].logprobs] == [
            dict((t, lp.logprob) for t, lp in top.items()) for top in p.outputs[0].logprobs]


@pytest.mark.slow
@pytest.mark.parametrize("world, shift_threshold", [(2, 16), (2, None), (4, None)])
def test_compiled_layouts_match_eager_without_recompiles(llama, world, shift_threshold):
    """SP-2 with Shift's TP-2 steps, and SP-2 or SP-4 alone, whose steps of fewer tokens than SP ranks leave the last
    SP ranks without rows (they only attend, or at one token only join the LM head): every rank's forwards were
    compiled and sealed at start-up all the same (the warm-up gives every SP rank a token)."""
    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=32)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in [WARMUP] + SERVING]
    for runs, counts in run_ranks(_compiled_rank, world, model_dir, shift_threshold, timeout_s=600):
        assert runs == [expected, expected]
        if shift_threshold is None:
            assert counts == {"base": counts["base"]} and counts["base"] >= 30
        else:
            assert counts["base"] >= 2 and counts["shift"] >= 10


def _compile_a_new_kernel(rank, world, constant):
    import torch

    return float(torch.compile(lambda x: torch.sin(x) * constant + 3.25)(torch.ones(4)).sum())


def test_ranks_forked_after_the_parent_compiled_can_compile():
    """The parent's inductor compile thread pool does not survive a fork: without the launcher's reset
    a rank that compiles a kernel missing from the on-disk cache waits forever (a cold cache, as in CI)."""
    import random

    import torch
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if get_compile_threads() <= 1:
        pytest.skip("inductor compiles in-line with one compile thread: no pool to inherit")
    constant = random.random()  # kernels no cache holds yet, in the parent and in the ranks
    torch.compile(lambda x: torch.cos(x) * constant)(torch.ones(4))
    assert AsyncCompile.pool.cache_info().currsize == 1, config.compile_threads  # the pool a fork inherits
    expected = float((torch.sin(torch.ones(4)) * (constant + 1) + 3.25).sum())
    assert run_ranks(_compile_a_new_kernel, 2, constant + 1, timeout_s=60) == [pytest.approx(expected)] * 2


def _compiled_pipeline_rank(rank, world, model_dir):
    llm = LLM(str(model_dir), pp=2, policy="seesaw", cpu_kv_gb=0.01, compile=True, max_num_batched_tokens=32)
    return [[_token_ids(o) for o in run] for run in _run(llm)], llm.stats()["steps_by_layout"]


@pytest.mark.slow
def test_compiled_pipeline_and_seesaw_layouts_match_eager(llama):
    """compile=True with pp > 1: each stage's forward and the TP layout's, compiled at start-up."""
    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=32)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in [WARMUP] + SERVING]
    for runs, layouts in run_ranks(_compiled_pipeline_rank, 2, model_dir, timeout_s=600):
        assert runs == [expected, expected]
        assert layouts["pp"] > 0 and layouts["tp"] > 0


def _compiled_flying_rank(rank, world, model_dir):
    llm = LLM(str(model_dir), dp=2, policy="flying", policy_config={"dp_above": 2.0, "tp_below": 1.0}, compile=True,
              max_num_batched_tokens=32)
    return [[_token_ids(o) for o in run] for run in _run(llm)], llm.stats()["steps_by_layout"]


@pytest.mark.slow
def test_compiled_flying_layouts_match_eager(llama):
    """compile=True under Flying: each replica's own forward and the merged TP group's (weights as views), one
    code compiled for modules of different shapes, which the sealed forwards tell apart."""
    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=32)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in [WARMUP] + SERVING]
    for runs, layouts in run_ranks(_compiled_flying_rank, 2, model_dir, timeout_s=600):
        assert runs == [expected, expected]
        assert layouts["tp2@0"] > 0 and layouts["dp@0"] > 0 and layouts["dp@1"] > 0


def test_a_forward_the_warm_up_never_ran_keeps_its_guards():
    import torch

    from torch_shift.compilation import CompiledForward

    class Double(torch.nn.Module):
        def forward(self, input_ids, positions, attention):
            return input_ids * 2 + positions

    forward = CompiledForward(Double())
    forward.seal()
    assert not forward.sealed  # never ran: sealed, it could run a graph made for another module of its code
    ids, positions = torch.arange(5), torch.ones(5, dtype=torch.long)
    assert torch.equal(forward(ids, positions, None), ids * 2 + 1)
    forward.seal()
    assert forward.sealed
    assert torch.equal(forward(ids[:3], positions[:3], None), ids[:3] * 2 + 1)


def test_compiled_forwards_of_one_module_class_keep_their_graphs_apart():
    """dynamo keeps a code object's graphs together and, once sealed, tells them apart only by the guards that failed
    when one compiled. Through the model class's shared `forward`, the first module's sealed call at the second's
    thread count ran the second module's graph (here: its constant). Each CompiledForward has a code object of its
    own: its sealed call at a count it never compiled for finds no graph and runs eagerly."""
    import torch

    from torch_shift.compilation import CompiledForward

    class Scale(torch.nn.Module):
        def __init__(self, factor: int):
            super().__init__()
            self.factor = factor

        def forward(self, input_ids, positions, attention):
            return input_ids * self.factor + positions

    ids, positions = torch.arange(5), torch.ones(5, dtype=torch.long)
    threads = torch.get_num_threads()
    forwards = {}
    try:
        for factor, count in ((2, threads), (3, threads + 1)):
            torch.set_num_threads(count)
            forwards[factor] = CompiledForward(Scale(factor))
            assert torch.equal(forwards[factor](ids, positions, None), ids * factor + 1)
            forwards[factor].seal()
        assert torch.equal(forwards[3](ids, positions, None), ids * 3 + 1)
        torch.set_num_threads(threads)
        assert torch.equal(forwards[2](ids[:3], positions[:3], None), ids[:3] * 2 + 1)
        torch.set_num_threads(threads + 1)
        assert torch.equal(forwards[2](ids, positions, None), ids * 2 + 1)  # eager: no graph of its own fits
        assert forwards[2].guarded
    finally:
        torch.set_num_threads(threads)


# prompt sets of over 64 tokens (a prefill the compiled forward runs, not the C++ decoder), none a prefix of another
CALLER_PROMPTS = [random_prompts(2, [50, 30], seed=11), random_prompts(2, [45, 40], seed=12),
                  random_prompts(3, [30, 30, 30], seed=13), random_prompts(2, [60, 20], seed=14)]


@pytest.mark.slow
def test_a_compiled_engine_steps_at_its_own_thread_count_whatever_its_callers(llama):
    """dynamo guards on the thread count: a compiled engine whose caller then called torch.set_num_threads(1), and a
    compiled one-process engine beside a compiled TP-2 engine (whose rank 0, this process, runs its own share of the
    cores), raised "Recompilation triggered" at their next prompt. An engine now steps at the count it was built with
    and gives the caller its own back."""
    import torch

    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=128)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in CALLER_PROMPTS]
    eager.shutdown()
    threads = torch.get_num_threads()
    one = LLM(str(model_dir), compile=True, max_num_batched_tokens=128)
    tp = None
    try:
        torch.set_num_threads(threads + 1)
        assert _token_ids(one.generate(CALLER_PROMPTS[0], PARAMS, use_tqdm=False)) == expected[0]
        assert torch.get_num_threads() == threads + 1
        torch.set_num_threads(threads)
        tp = LLM(str(model_dir), tp=2, compile=True, max_num_batched_tokens=128)
        caller = torch.get_num_threads()
        assert _token_ids(one.generate(CALLER_PROMPTS[1], PARAMS, use_tqdm=False)) == expected[1]
        assert _token_ids(tp.generate(CALLER_PROMPTS[2], PARAMS, use_tqdm=False)) == expected[2]
        assert _token_ids(one.generate(CALLER_PROMPTS[3], PARAMS, use_tqdm=False)) == expected[3]
        assert torch.get_num_threads() == caller
    finally:
        if tp is not None:
            tp.shutdown()
        one.shutdown()
        torch.set_num_threads(threads)


def _default_dtype(torch):
    torch.set_default_dtype(torch.float64)
    return lambda: torch.set_default_dtype(torch.float32)


def _deterministic(torch):
    torch.use_deterministic_algorithms(True)
    return lambda: torch.use_deterministic_algorithms(False)


def _matmul_precision(torch):
    torch.set_float32_matmul_precision("medium")
    return lambda: torch.set_float32_matmul_precision("highest")


def _autocast(torch):
    block = torch.autocast("cpu", dtype=torch.bfloat16)
    block.__enter__()
    return lambda: block.__exit__(None, None, None)


@pytest.mark.slow
def test_a_compiled_engine_steps_under_the_torch_settings_it_was_built_under(llama):
    """dynamo guards on torch's global settings: after the caller changed the default dtype, deterministic
    algorithms or the float32 matmul precision, or inside an autocast block, a compiled engine's next prompt raised
    "Recompilation triggered". Its steps now run under the settings of its construction, with the same tokens, and
    the caller's settings come back after each call."""
    import torch

    _, model_dir = llama
    settings = [_default_dtype, _deterministic, _matmul_precision, _autocast]
    prompts = [random_prompts(2, [50, 30], seed=21 + i) for i in range(len(settings))]
    eager = LLM(str(model_dir), max_num_batched_tokens=128)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in prompts]
    eager.shutdown()
    llm = LLM(str(model_dir), compile=True, max_num_batched_tokens=128)
    try:
        for setting, prompt, tokens in zip(settings, prompts, expected):
            undo = setting(torch)
            try:
                caller = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                          torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu"))
                assert _token_ids(llm.generate(prompt, PARAMS, use_tqdm=False)) == tokens, setting.__name__
                assert caller == (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                                  torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu"))
            finally:
                undo()
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_compiled_engine_runs_eagerly_after_the_user_resets_dynamo(llama, caplog):
    """torch.compiler.reset() drops every graph, and a default device is a torch function mode, which dynamo
    guards: a sealed forward's next call raised "Recompilation triggered". Such a call now falls back to dynamo's
    full guards and runs eagerly where no graph fits (never compiling while serving), with eager's tokens, and says
    so once."""
    import torch

    _, model_dir = llama
    prompts = [random_prompts(2, [50, 30], seed=31 + i) for i in range(3)]
    eager = LLM(str(model_dir), max_num_batched_tokens=128)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in prompts]
    eager.shutdown()
    llm = LLM(str(model_dir), compile=True, max_num_batched_tokens=128)
    try:
        torch.set_default_device("cpu")
        try:
            assert _token_ids(llm.generate(prompts[0], PARAMS, use_tqdm=False)) == expected[0]
        finally:
            torch.set_default_device(None)
        torch.compiler.reset()
        for prompt, tokens in zip(prompts[1:], expected[1:]):
            assert _token_ids(llm.generate(prompt, PARAMS, use_tqdm=False)) == tokens
        assert all(f.guarded and not f.sealed for f in llm.engine.model.forwards.values() if f is not None)
        assert sum("no longer fit" in r.getMessage() for r in caplog.records) == 1
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_process_builds_more_compiled_engines_than_dynamos_recompile_limit(llama):
    """dynamo compiles at most recompile_limit (8) graphs of a code object: when every compiled forward of a process
    added its own to the model class's `forward`, the ninth compiled engine of a process (a notebook, a sweep, a
    test suite) ran its warm-up eagerly, and its first sealed step raised "Recompilation triggered". Each
    CompiledForward now has a code object of its own, and the limit is lifted while one compiles. Here with the
    limit at 2."""
    import torch._dynamo

    _, model_dir = llama
    outputs = []
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            llm = LLM(str(model_dir), compile=True, max_num_batched_tokens=32)
            outputs.append(_token_ids(llm.generate(WARMUP, PARAMS, use_tqdm=False)))
            llm.shutdown()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


@pytest.mark.slow
def test_compiled_dp_replicas_that_borrow_cores_do_not_recompile(llama):
    """compile=True at DP-2, started from this process: a replica alone with work runs on the idle rank's core
    too, and dynamo guards on the thread count, so start-up compiles each replica's forward at both counts.
    Serving lone requests and batches over both replicas then compiles nothing and matches eager."""
    import torch

    from torch_shift.parallel.launch import local_cores

    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=128)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in [WARMUP] + SERVING]
    llm = LLM(str(model_dir), dp=2, compile=True, max_num_batched_tokens=128)
    try:
        for run in _run(llm):
            assert [_token_ids(o) for o in run] == expected
        caller_threads, threads, forward_step = torch.get_num_threads(), [], llm.engine.model.forward_step
        llm.engine.model.forward_step = lambda *a: threads.append(torch.get_num_threads()) or forward_step(*a)
        assert _token_ids(llm.generate(SERVING[1], PARAMS, use_tqdm=False)) == expected[2]  # a lone request
        assert threads and set(threads) == {local_cores()}  # its replica ran on the idle rank's core too
        assert torch.get_num_threads() == caller_threads  # given back when the call returned
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_compiled_sp_steps_run_ulysses_in_cpp_and_lend_idle_cores_without_recompiling(llama, monkeypatch):
    """compile=True at SP-2, started from this process: a compiled step's all-to-alls and the paged attention between
    them run in C++ on both ranks (kernels/cpu_ops.cpp), never UlyssesAttention's Python. A step of one token leaves
    SP rank 1 without rows (with the SP ranks' KV shared, rank 0 attends its heads too and rank 1 joins only the LM
    head), and rank 0 runs on both cores (step_threads), a thread count the start-up compiled. Lone requests and
    batches then compile nothing and match eager."""
    import torch

    from torch_shift.kernels import cpu_ops, gemv_pool_workers
    from torch_shift.parallel.launch import local_cores

    if not cpu_ops():
        pytest.skip("the C++ operator library does not build here")
    if local_cores() < 2:
        pytest.skip("one core: nothing to lend")
    _, model_dir = llama
    eager = LLM(str(model_dir), max_num_batched_tokens=32)
    expected = [_token_ids(eager.generate(p, PARAMS, use_tqdm=False)) for p in [WARMUP] + SERVING]
    refuse_python_ulysses(monkeypatch)
    llm = LLM(str(model_dir), sp=2, shift_threshold=None, compile=True, max_num_batched_tokens=32)
    try:
        for run in _run(llm):
            assert [_token_ids(o) for o in run] == expected
        assert _token_ids(llm.generate(SERVING[1], PARAMS, use_tqdm=False)) == expected[2]  # one-token steps
        assert set(llm.engine.model.layout_counts) == {"base"}
        # rank 0 ran the one-token steps on every core, the others on its own share (the decode pool's worker on the
        # lent core counts, where the pool runs them: not for this small a model)
        threads, forward_step = {}, llm.engine.model.forward_step

        def recording(layout, micro_batches):
            threads[len(micro_batches[0].input_ids)] = torch.get_num_threads() + gemv_pool_workers()
            return forward_step(layout, micro_batches)

        llm.engine.model.forward_step = recording
        llm.generate(SERVING[1] + WARMUP[:2], PARAMS, use_tqdm=False)  # steps of three tokens and more
        llm.generate(SERVING[1], PARAMS, use_tqdm=False)  # of one
        assert threads.pop(1) == local_cores() and threads
        assert set(threads.values()) == {local_cores() // 2}
    finally:
        llm.shutdown()


def _late_rank(rank, world, model_dir, prompts):
    import time

    import torch.distributed as dist

    from torch_shift.parallel.shm import ShmCommunicator
    from torch_shift.parallel.ulysses import UlyssesAttention

    if rank == 1:  # Ulysses in Python, 3 ms late to every all-to-all
        python_call = UlyssesAttention.__call__
        UlyssesAttention.install_native = lambda self: False
        UlyssesAttention.__call__ = lambda self, *a, **k: time.sleep(3e-3) or python_call(self, *a, **k)
    resumed = []
    resume = ShmCommunicator.resume_all_to_all
    ShmCommunicator.resume_all_to_all = lambda self, x, step: resumed.append(step) or resume(self, x, step)
    llm = LLM(str(model_dir), sp=2, shift_threshold=None, compile=True, max_num_batched_tokens=32)
    outputs = _token_ids(llm.generate(prompts, PARAMS, use_tqdm=False))
    dist.barrier()
    return outputs, len(resumed)


@pytest.mark.slow
def test_a_late_peer_hands_the_cpp_all_to_all_to_pythons_wait(llama):
    """SP rank 0 runs Ulysses in C++, rank 1 in Python and 3 ms late to each all-to-all: rank 0 spins 1 ms for its
    peer, then hands the collective it published to the communicator's Python wait (resume_all_to_all, with its
    deadline and liveness checks); the two paths share the protocol. The tokens of eager one-rank runs."""
    from torch_shift.kernels import cpu_ops

    if not cpu_ops():
        pytest.skip("the C++ operator library does not build here")
    _, model_dir = llama
    prompts = WARMUP[:3]
    expected = _token_ids(LLM(str(model_dir), max_num_batched_tokens=32).generate(prompts, PARAMS, use_tqdm=False))
    (outputs0, resumed0), (outputs1, resumed1) = run_ranks(_late_rank, 2, model_dir, prompts, timeout_s=600)
    assert outputs0 == outputs1 == expected
    assert resumed0 > 0 and resumed1 == 0
