"""Multi-step scheduling (SchedulerConfig.num_scheduler_steps, vLLM v0's): where every running request decodes
greedily and nothing waits, one step plan runs several decode steps on every rank, each drawing its tokens by argmax
and feeding them to the next. Tokens, finish reasons and KV blocks must be those of single steps: with stops inside a
run, lengths that cut a run short, requests that arrive, sample or return logprobs meanwhile, and every layout."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from torch_shift import LLM, SamplingParams
from torch_shift.config import SchedulerConfig
from torch_shift.engine.args import OFFLINE_SCHEDULER_STEPS, EngineArgs
from torch_shift.engine.policies import SingleGroupPolicy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.scheduler import Scheduler
from torch_shift.kv.block_manager import BlockManager

ENGINE = {"dtype": "float32", "max_num_seqs": 6, "num_kv_blocks": 64, "block_size": 4,
          "max_num_batched_tokens": 32, "max_model_len": 128, "seed": 0, "compile": False}


def _scheduler(num_blocks: int = 16, num_steps: int = 4, max_num_seqs: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, max_model_len=64,
                             num_scheduler_steps=num_steps)
    return Scheduler(config, BlockManager(num_blocks, 4), SingleGroupPolicy("single"))


def _greedy(request_id: str, prompt: list[int], max_tokens: int, **params) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   max_tokens=max_tokens)


def test_a_run_takes_blocks_for_every_step_and_receives_every_token():
    sched = _scheduler()
    request = _greedy("a", [5, 6, 7, 8, 9], 10)
    sched.add_request(request)
    prefill = sched.schedule()
    assert prefill.num_steps == 1  # a prompt's step is a single one
    sched.update_from_output(prefill, {"a": 11})
    run = sched.schedule()
    (entry,) = run.scheduled
    assert run.num_steps == 4 and (entry.num_computed_tokens, entry.num_tokens, entry.sample) == (5, 1, True)
    # positions 5-8 are written in the run: 9 tokens, 3 blocks of 4
    assert len(sched.block_manager.req_blocks["a"]) == 3
    assert sched.update_from_output(run, {"a": [12, 13, 14, 15]}) == [request]
    assert request.output_token_ids == [11, 12, 13, 14, 15] and request.num_computed_tokens == 9
    second = sched.schedule()
    assert second.num_steps == 4
    sched.update_from_output(second, {"a": [16, 17, 18, 19]})
    last = sched.schedule()
    assert last.num_steps == 1  # one token left before max_tokens: no step past the request's length
    sched.update_from_output(last, {"a": 20})
    assert request.status == RequestStatus.FINISHED_LENGTH and len(request.output_token_ids) == 10
    assert sched.block_manager.num_free_blocks == 16


def test_the_run_after_the_tokens_in_flight():
    """Scheduler.run_length(after_tokens_in_flight=True): with a step's token still on the device (asynchronous
    scheduling, one placeholder), the run a plan could take once it arrives, its token counted against max_tokens;
    a plan itself runs one step meanwhile."""
    sched = _scheduler()
    request = _greedy("a", [5, 6, 7, 8, 9], 6)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"a": 11})
    ahead = sched.schedule(max_run_steps=1)  # launched ahead: its token is a placeholder
    assert ahead.num_steps == 1 and request.num_output_placeholders == 1
    assert sched.run_length() == 1 and sched.run_length(after_tokens_in_flight=True) == 4
    sched.update_from_output(ahead, {"a": 12})
    assert sched.run_length() == 4
    sched.update_from_output(sched.schedule(max_run_steps=1), {"a": 13})
    sched.schedule(max_run_steps=1)  # the fourth token in flight: two left after it
    assert sched.run_length(after_tokens_in_flight=True) == 2


def test_a_stop_inside_a_run_ends_the_request_there_and_frees_its_blocks():
    sched = _scheduler()
    request = _greedy("a", [5, 6, 7, 8, 9], 20, stop_token_ids=[13])
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"a": 11})
    run = sched.schedule()
    assert run.num_steps == 4
    sched.update_from_output(run, {"a": [12, 13, 14, 15]})  # the tokens after the stop were drawn for nothing
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == [11, 12, 13]
    assert sched.block_manager.num_free_blocks == 16 and not sched.requests


@pytest.mark.parametrize("other", ["waiting", "sampled", "logprobs", "bias"])
def test_single_steps_while_a_request_waits_or_does_not_draw_its_argmax(other):
    sched = _scheduler(max_num_seqs=1 if other == "waiting" else 4)
    sched.add_request(_greedy("a", [5, 6, 7], 20))
    params = {"sampled": dict(temperature=0.8, seed=1), "logprobs": dict(temperature=0.0, logprobs=1),
              "bias": dict(temperature=0.0, logit_bias={3: 1.0}), "waiting": dict(temperature=0.0)}[other]
    sched.add_request(Request("b", [8, 9], SamplingParams(max_tokens=20, **params), max_tokens=20))
    for _ in range(3):
        output = sched.schedule()
        assert output.num_steps == 1
        sched.update_from_output(output, {e.request_id: 30 for e in output.scheduled})
    assert sched.requests["a"].num_computed_tokens > 3  # the first one decodes meanwhile


def test_a_run_takes_only_free_blocks_and_preempts_nobody():
    sched = _scheduler(num_blocks=4)
    for rid in "ab":
        sched.add_request(_greedy(rid, [5, 6, 7, 8, 9, 10, 11], 20))
    first = sched.schedule()
    sched.update_from_output(first, {"a": 12, "b": 12})
    # each holds 2 blocks (7 tokens, then its 8th position): no free block is left for a run's positions 8-10
    output = sched.schedule()
    assert output.num_steps == 1 and not output.preempted_request_ids and sched.num_preemptions == 0
    assert [len(sched.block_manager.req_blocks[rid]) for rid in "ab"] == [2, 2]


def test_num_scheduler_steps_is_checked():
    for bad in (0, -2, 1.5, True, 1 << 16):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineArgs("m", num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="synchronously"):
        EngineArgs("m", num_scheduler_steps=4, async_scheduling=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    EngineArgs("m", num_scheduler_steps=4, speculative_config=ngram)
    EngineArgs("m", num_scheduler_steps=4, async_scheduling=True, speculative_config=ngram)
    one = SimpleNamespace(world_size=1)
    # one rank on the CPU launches its single steps asynchronously by default, and a run is synchronous; beside
    # speculative decoding both (runs take the quiet steps)
    assert EngineArgs("m", device="cpu")._schedules_async(one, 1) is None
    assert EngineArgs("m", device="cpu")._schedules_async(one, 4) is False
    assert EngineArgs("m", device="cpu", speculative_config=ngram)._schedules_async(one, 4) is None
    with pytest.raises(ValueError, match="CPU only"):
        EngineArgs("m", device="cuda", async_scheduling=True, speculative_config=ngram)._schedules_async(one, 4)


def test_offline_generation_on_the_cpu_runs_eight_steps_by_default():
    """num_scheduler_steps=None: 8 where no request can arrive during a run (LLM's offline generation) on the CPU, at
    one rank and several; 1 for a server or LLMEngine, a GPU, and one rank given async_scheduling; with speculative
    decoding 8 too (runs take the steps after which nothing is proposed); a value given holds."""
    one, two = SimpleNamespace(world_size=1), SimpleNamespace(world_size=2)
    cpu = EngineArgs("m", device="cpu")
    assert cpu._scheduler_steps(two, offline=True) == cpu._scheduler_steps(one, offline=True) == 8
    assert OFFLINE_SCHEDULER_STEPS == 8
    assert cpu._scheduler_steps(two, offline=False) == cpu._scheduler_steps(one, offline=False) == 1
    assert EngineArgs("m", device="cuda")._scheduler_steps(two, offline=True) == 1
    for asked in (True, False):  # one rank steps as asked
        assert EngineArgs("m", device="cpu", async_scheduling=asked)._scheduler_steps(one, offline=True) == 1
    assert EngineArgs("m", device="cpu", async_scheduling=False)._scheduler_steps(two, offline=True) == 8
    spec = EngineArgs("m", device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert spec._scheduler_steps(two, offline=True) == 8
    assert spec._scheduler_steps(one, offline=True) == 8
    assert EngineArgs("m", device="cpu", num_scheduler_steps=1)._scheduler_steps(two, offline=True) == 1
    assert EngineArgs("m", device="cpu", num_scheduler_steps=3)._scheduler_steps(one, offline=False) == 3


def test_llm_runs_eight_steps_at_one_rank_and_two_and_an_engine_of_its_own_one(layers4):
    from torch_shift.engine.llm_engine import LLMEngine

    for ranks in ({}, {"tp": 2}):
        llm = LLM(str(layers4), **ranks, **ENGINE)
        try:
            scheduler = llm.engine.config.scheduler
            assert (scheduler.num_scheduler_steps, scheduler.async_scheduling) == (8, False)
        finally:
            llm.shutdown()
    engine = LLMEngine(EngineArgs(str(layers4), tp=2, **ENGINE))
    try:
        assert engine.config.scheduler.num_scheduler_steps == 1
    finally:
        engine.shutdown()


def _generate(model_dir, num_steps: int, prompts, params, calls=None, stats=None, cut=None, interrupted=False,
              **engine):
    llm = LLM(str(model_dir), num_scheduler_steps=num_steps, **{**ENGINE, **engine})
    if interrupted:  # as a request arriving at a server would, before every run: each ends after its first step
        llm.engine.interrupt_run()
    if calls is not None:  # rank 0's model: its multi-step runs in one call of its C++ decoder, or None
        model = llm.engine.worker.runner.model
        forward_steps = model.forward_steps

        def counted(*args):
            drawn = forward_steps(*args)
            calls.append(drawn is not None)
            return drawn

        model.forward_steps = counted
    runs = []  # the steps each plan ran
    executor = llm.engine.core.executor

    def spy(plan, *args, **options):
        result = executor(plan, *args, **options)
        planned = max(group.num_steps for group in plan.groups)
        runs.append(planned if planned == 1 else max(len(tokens) for tokens in result.logits))
        if cut is not None and planned > 1:  # some group's run ended early
            cut.append(min(len(tokens) for tokens in result.logits) < planned)
        return result

    llm.engine.core.executor = spy
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        engine_ = llm.engine
        for pool in engine_.scheduler.pools:
            assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
        if stats is not None:
            stats.update(llm.stats())
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], runs
    finally:
        llm.shutdown()


def _work():
    from conftest import random_prompts

    shared = random_prompts(1, [12], seed=5)[0]  # a prefix several prompts share: the prefix cache serves it
    prompts = [shared + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(6, [5, 17, 9, 30, 2, 11], seed=1))]
    return prompts, [SamplingParams(max_tokens=5 + 4 * i, temperature=0.0) for i in range(6)]


def _work_with_a_stop_token(model_dir):
    """_work's requests with a token they draw mid-output as a stop token (requests end inside runs), and their
    outputs and steps in single steps."""
    prompts, params = _work()
    reference, _ = _generate(model_dir, 1, prompts, params)
    drawn = [t for tokens, _ in reference for t in tokens[1:-1]]
    stop = max(set(drawn), key=drawn.count)
    for p in params:
        p.stop_token_ids = [stop]
    return prompts, params, *_generate(model_dir, 1, prompts, params)


@pytest.mark.parametrize("native_decode", [True, False], ids=["cpp", "python"])
def test_runs_give_the_tokens_of_single_steps(llama, native_decode):
    """A run's steps in one call of the C++ decoder, or one by one in Python, with the tokens of single steps; a run
    ends after the step in which a request drew a stop token."""
    _, model_dir = llama
    prompts, params, single, single_runs = _work_with_a_stop_token(model_dir)
    calls, stats, cut = [], {}, []
    outputs, runs = _generate(model_dir, 4, prompts, params, calls, stats, cut, native_decode=native_decode)
    assert outputs == single and set(single_runs) == {1}
    assert calls and set(calls) == {native_decode}
    assert True in cut and False in cut  # runs that a stop token ended early, and whole runs
    assert any(reason == "stop" for _, reason in outputs) and any(reason == "length" for _, reason in outputs)
    assert 4 in runs and 1 in runs  # runs of 4, and single steps for prompts and the ends of requests
    assert len(runs) < len(single_runs)
    assert stats["num_steps"] == sum(runs) and stats["num_decode_steps"] > 0  # a run counts as its steps


def test_a_request_that_samples_makes_the_steps_single_while_it_runs(llama):
    _, model_dir = llama
    prompts, params = _work()
    params[1] = SamplingParams(max_tokens=6, temperature=0.9, seed=3)  # ends before the others
    params[2] = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    single, _ = _generate(model_dir, 1, prompts, params)
    outputs, runs = _generate(model_dir, 4, prompts, params)
    assert outputs == single and 4 in runs


@pytest.mark.parametrize("layout", [dict(tp=2), dict(sp=2, shift_threshold=0), dict(sp=2, shift_threshold=8),
                                    dict(dp=2), dict(dp=2, policy="flying"), dict(pp=2, policy="seesaw"), dict(pp=2)],
                         ids=["tp2", "sp2", "shift", "dp2", "flying", "seesaw", "pp2"])
def test_every_layout_runs_them_with_the_tokens_of_one_device(layers4, layout):
    """Each rank that computes a run's steps draws the tokens from the logits it holds whole (a TP rank's gathered
    vocabulary, Flying's TP group's, SP rank 0 alone over the shared KV, a DP replica's own rank, which sends them to
    rank 0; Seesaw decodes in TP), in one call of its C++ decoder where that finds the argmax; a pipeline's steps
    stay single. Each ends its runs alike after a step that drew a stop token."""
    prompts, params, reference, _ = _work_with_a_stop_token(layers4)
    calls, cut = [], []
    outputs, runs = _generate(layers4, 4, prompts, params, calls, cut=cut, **layout)
    assert outputs == reference and any(reason == "stop" for _, reason in outputs)
    assert (4 in runs) == (True in cut) == (layout != dict(pp=2))
    # in one call of rank 0's C++ decoder; static SP's runs of one request too (SP rank 0 alone over the shared KV,
    # its own decoder with the whole LM head), its runs of several one by one (the ranks split the tokens)
    assert set(calls) == ({False, True} if layout == dict(sp=2, shift_threshold=0) else set() if layout == dict(pp=2)
                          else {True})


def test_four_ranks_run_them(layers4):
    prompts, params, reference, _ = _work_with_a_stop_token(layers4)
    cut = []
    outputs, runs = _generate(layers4, 4, prompts, params, cut=cut, dp=2, tp=2)
    assert outputs == reference and 4 in runs and True in cut


def test_a_stop_string_inside_a_run_cuts_the_tokens_after_it(llama):
    """A stop string completed by a token in the middle of a run ends the output there, its text and tokens those of
    single steps (the run's later tokens were drawn for nothing)."""
    _, model_dir = llama
    prompts, _ = _work()
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    llm = LLM(str(model_dir), **ENGINE)
    try:
        texts = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    stops = [text[len(text) // 2:len(text) // 2 + 2] for text in texts]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]) for stop in stops if stop]
    outputs = {}
    for num_steps in (1, 8):
        llm = LLM(str(model_dir), num_scheduler_steps=num_steps, **ENGINE)
        try:
            outs = llm.generate(prompts[:len(params)], params, use_tqdm=False)
            outputs[num_steps] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                  for o in outs]
            assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        finally:
            llm.shutdown()
    assert outputs[8] == outputs[1] and any(reason == "stop" for _, _, reason in outputs[1])


@pytest.mark.parametrize("native_decode", [True, False], ids=["native", "python"])
def test_a_run_of_one_request_ends_at_the_step_that_completes_its_stop_string(llama, native_decode):
    """A request running alone: its run ends after the step that drew a token that may complete one of its stop
    strings (Request.lone_stop_token_ids), so no step draws a token past the stop the host cuts the text at; the text
    and tokens those of single steps. (Without those tokens the first prompt's runs drew 17 tokens for an output of
    14.)"""
    _, model_dir = llama
    prompts, _ = _work()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), **ENGINE)
    try:
        texts = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    llm = LLM(str(model_dir), num_scheduler_steps=8, native_decode=native_decode, **ENGINE)
    drawn, execute = [], llm.engine.core.executor

    def counted(plan, *args, **kwargs):
        result = execute(plan, *args, **kwargs)
        drawn.extend(len(tokens) if group.num_steps > 1 else group.num_logits
                     for group, tokens in zip(plan.groups, result.logits))
        return result

    llm.engine.core.executor = counted
    try:
        num_stopped = 0
        for prompt, text in zip(prompts, texts):
            stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i:i + 3])
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
            drawn.clear()
            (output,) = llm.generate([prompt], [params], use_tqdm=False)
            num_stopped += output.outputs[0].finish_reason == "stop"
            assert sum(drawn) == len(output.outputs[0].token_ids), (stop, drawn, output.outputs[0].token_ids)
        assert num_stopped >= 4
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [dict(), dict(native_decode=False), dict(tp=2), dict(dp=2),
                                    dict(sp=2, shift_threshold=0)], ids=["one", "python", "tp2", "dp2", "sp2"])
def test_rank_0s_interrupt_ends_every_run_after_its_step_on_every_rank(layers4, layout):
    """Interrupted (a request arrived at the server, torch_shift.parallel.runs), each run's leader ends it after the
    step it is in, and every rank of the run stops there with it: in the C++ decoder's one call, a DP replica's rank,
    and static SP's steps of several requests in Python over both ranks."""
    prompts, params = _work()
    reference, _ = _generate(layers4, 1, prompts, params)
    cut = []
    outputs, runs = _generate(layers4, 4, prompts, params, cut=cut, interrupted=True, **layout)
    assert outputs == reference and set(runs) == {1} and cut and set(cut) == {True}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(sp=2, shift_threshold=0)], ids=["tp2", "sp2"])
def test_interrupts_at_any_moment_leave_the_tokens_alone(layers4, layout):
    """Rank 0's front end interrupts whenever a request arrives: set and cleared at random moments while two ranks run
    (the C++ decoder's runs of TP-2; static SP's steps of several requests in Python over both ranks), every rank
    still stops at the same step, and the tokens are single steps'."""
    from conftest import interrupted_at_random

    prompts, params = _work()
    reference, _ = _generate(layers4, 1, prompts, params)
    llm = LLM(str(layers4), num_scheduler_steps=4, **layout, **ENGINE)
    try:
        with interrupted_at_random(llm.engine):
            for _ in range(3):
                outputs = llm.generate(prompts, params, use_tqdm=False)
                assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs] == reference
    finally:
        llm.shutdown()


def test_a_request_that_arrives_at_the_server_during_a_run_ends_it_after_its_step(llama):
    """The server's engine loop (AsyncEngine) interrupts a run when a request arrives: the run in progress ends after
    the step it is in, the new request is scheduled next, and both get the tokens of single steps."""
    import asyncio
    import threading

    from torch_shift.engine.llm_engine import LLMEngine
    from torch_shift.serve.async_engine import AsyncEngine

    _, model_dir = llama
    first, second = _work()[0][:2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), **ENGINE)
    try:
        expected = [o.outputs[0].token_ids for o in reference.generate([first, second], params, use_tqdm=False)]
    finally:
        reference.shutdown()
    engine = LLMEngine(EngineArgs(str(model_dir), num_scheduler_steps=8, native_decode=False, **ENGINE))
    runner = engine.worker.runner
    steps_in_runs = []  # the steps each run ran
    run_steps, forward_step = runner._run_steps, runner.model.forward_step
    arrived = threading.Event()
    calls = []

    def counted_run(*args):
        calls.clear()
        drawn = run_steps(*args)
        steps_in_runs.append(len(drawn))
        return drawn

    def step(*args):
        calls.append(True)
        if len(calls) == 3 and not arrived.is_set():  # in the third step of the first run: the second request comes
            arrived.set()
            asyncio.run_coroutine_threadsafe(serve(second), running["loop"])
            deadline = time.monotonic() + 10
            while not runner.run_words[0]:
                assert time.monotonic() < deadline, "the request's arrival did not interrupt the run"
                time.sleep(1e-3)
        return forward_step(*args)

    runner._run_steps, runner.model.forward_step = counted_run, step
    async_engine = AsyncEngine(engine)
    tokens = {}

    async def serve(prompt):
        async with async_engine.open([f"r{len(tokens)}"], [prompt], [params]) as submission:
            key = len(tokens)
            tokens[key] = None
            async for _, output in submission:
                tokens[key] = output.outputs[0].token_ids

    running = {}

    async def main():
        running["loop"] = asyncio.get_running_loop()
        await serve(first)
        while len(tokens) < 2 or any(t is None or len(t) < 24 for t in tokens.values()):
            await asyncio.sleep(0.01)

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        async_engine.shutdown()
        engine.shutdown()
    assert arrived.is_set() and [tokens[0], tokens[1]] == expected
    assert steps_in_runs[0] == 4  # the interrupt came in step 3: the leader ended the run at the start of step 4


def _sampled_work_with_a_stop_token(model_dir):
    """_work's prompts, requests that sample (seeded, unseeded with top-k and top-p, greedy beside them) with a token
    they draw mid-output as a stop token, and their outputs in single steps, taken synchronously (a step launched
    ahead of its tokens draws for a request that has just stopped: the engine's generator then moves on further)."""
    prompts, params = _work()
    for i, p in enumerate(params):
        if i % 3 == 0:
            p.temperature, p.seed = 0.8, 100 + i
        elif i % 3 == 1:
            p.temperature, p.top_k, p.top_p = 1.0, 20, 0.9
    reference, _ = _generate(model_dir, 1, prompts, params, async_scheduling=False)
    drawn = [t for tokens, _ in reference for t in tokens[1:-1]]
    stop = max(set(drawn), key=drawn.count)
    for p in params:
        p.stop_token_ids = [stop]
    return prompts, params, *_generate(model_dir, 1, prompts, params, async_scheduling=False)


@pytest.mark.parametrize("layout", [dict(), dict(native_decode=False), dict(tp=2), dict(sp=2, shift_threshold=0),
                                    dict(dp=2)], ids=["one", "python", "tp2", "sp2", "dp2"])
def test_requests_that_sample_run_with_the_tokens_of_single_steps(layers4, layout):
    """Requests that sample (temperature, top-k, top-p; seeded or from the engine's generator) run in runs: every rank
    draws each step's tokens with the uniforms the sampler would have taken before that step (in the C++ decoder's
    call or in Python), and a run that a stop token ends early leaves the generators where single steps would. DP's
    two replicas, which would end their runs at different steps, run such requests in single steps. (The reference
    is the layout's own single steps: DP's groups order the engine's draws otherwise than one process.)"""
    prompts, params, _, _ = _sampled_work_with_a_stop_token(layers4)
    reference, _ = _generate(layers4, 1, prompts, params, async_scheduling=False, **layout)
    cut = []
    outputs, runs = _generate(layers4, 4, prompts, params, cut=cut, **layout)
    assert outputs == reference and any(reason == "stop" for _, reason in outputs)
    if layout == dict(dp=2):  # one replica with work: its requests run
        prompts, params = prompts[:1], [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5)]
        reference, _ = _generate(layers4, 1, prompts, params, async_scheduling=False, **layout)
        outputs, runs = _generate(layers4, 4, prompts, params, **layout)
        assert outputs == reference and 4 in runs
        return
    assert 4 in runs and True in cut
