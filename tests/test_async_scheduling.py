"""Asynchronous scheduling (torch_shift.engine.core): the next step scheduled and launched before this one's tokens
reach the host, its decodes' input ids taken from the device. The tokens, finish reasons and KV blocks must be
those of the synchronous engine: with stops that end requests while their next step is in flight, preemption,
chunked prompts, prefix caching, seeded sampling, aborts, and requests that sample on the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torch_shift import LLM, SamplingParams
from torch_shift.config import SchedulerConfig
from torch_shift.engine.args import EngineArgs
from torch_shift.engine.policies import SingleGroupPolicy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.scheduler import Scheduler
from torch_shift.kv.block_manager import BlockManager

ENGINE = {"dtype": "float32", "max_num_seqs": 6, "num_kv_blocks": 36, "block_size": 4,
          "max_num_batched_tokens": 32, "max_model_len": 128, "seed": 0}


def _prompts():
    from conftest import random_prompts

    shared = random_prompts(1, [12], seed=5)[0]  # a prefix several prompts share: the prefix cache serves it
    return [shared + p if i % 3 == 0 else p
            for i, p in enumerate(random_prompts(10, [5, 17, 9, 30, 2, 11, 23, 7, 14, 40], seed=1))]


def _params(stop_token_ids=()):
    return [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i,
                           stop_token_ids=list(stop_token_ids)) for i in range(10)]


def _generate(model_dir, async_scheduling: bool, prompts, params, **engine):
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, **{**ENGINE, **engine})
    placeholders = []
    executor = llm.engine.core.executor

    def spy(plan, *tokens, **options):
        placeholders.append(sum(0 if g.placeholders is None else len(g.placeholders) for g in plan.groups))
        return executor(plan, *tokens, **options)

    llm.engine.core.executor = spy
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        engine_ = llm.engine
        assert engine_.block_manager.num_free_blocks == engine_.block_manager.num_blocks  # nothing leaked
        assert not engine_.scheduler.requests and engine_.scheduler.num_host_sampled == 0
        return ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs],
                engine_.stats()["num_preemptions"], sum(placeholders))
    finally:
        llm.shutdown()


def test_asynchronous_steps_give_the_synchronous_engines_tokens(llama):
    _, model_dir = llama
    prompts = _prompts()
    reference, _, _ = _generate(model_dir, False, prompts, _params())
    # a token the requests draw mid-output, as a stop token: requests end while their next step is in flight
    drawn = [t for tokens, _ in reference for t in tokens[1:-1]]
    stop = max(set(drawn), key=drawn.count)
    sync, sync_preemptions, none = _generate(model_dir, False, prompts, _params([stop]))
    outputs, preemptions, placeholders = _generate(model_dir, True, prompts, _params([stop]))
    assert outputs == sync
    assert any(reason == "stop" for _, reason in outputs) and any(reason == "length" for _, reason in outputs)
    assert preemptions > 0 and sync_preemptions > 0  # requests were preempted with their last token on the device
    assert none == 0 and placeholders > 50  # decodes took their input ids from the device


def test_a_request_that_samples_on_the_host_makes_the_steps_synchronous(llama):
    _, model_dir = llama
    prompts = _prompts()[:6]
    params = _params()[:6]
    params[2] = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)
    params[4] = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
    sync, _, _ = _generate(model_dir, False, prompts, params)
    outputs, _, placeholders = _generate(model_dir, True, prompts, params)
    assert outputs == sync
    assert placeholders > 0  # once those two finished, steps ran ahead again


def test_an_abort_while_the_next_step_is_in_flight(llama):
    _, model_dir = llama
    prompts, params = _prompts()[:4], _params()[:4]
    sync, _, _ = _generate(model_dir, False, prompts, params)
    llm = LLM(str(model_dir), async_scheduling=True, **ENGINE)
    try:
        engine = llm.engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        finished = {}
        aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            in_flight = engine.core.in_flight
            if not aborted and in_flight is not None and any(r.request_id == "r1" for r in in_flight.requests):
                engine.abort_request("r1")  # its token of the step in flight is dropped
                aborted = True
        assert aborted and "r1" not in finished
        assert [finished[f"r{i}"] for i in (0, 2, 3)] == [sync[i][0] for i in (0, 2, 3)]
        engine.step()  # the step in flight (its requests all finished) completes
        assert engine.core.in_flight is None
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.shutdown()


def _scheduler(num_blocks: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, async_scheduling=True)
    return Scheduler(config, BlockManager(num_blocks, 4), SingleGroupPolicy("single"))


def test_a_decode_is_scheduled_while_its_input_token_is_on_the_device():
    sched = _scheduler()
    request = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3), max_tokens=3)
    sched.add_request(request)
    prefill = sched.schedule()
    assert request.num_computed_tokens == 5 and request.num_output_placeholders == 1
    decode = sched.schedule()  # before the prompt's token arrived
    (entry,) = decode.scheduled
    assert (entry.num_computed_tokens, entry.num_tokens, entry.sample) == (5, 1, True)
    assert request.num_output_placeholders == 2 and request.num_tokens == 5
    assert sched.update_from_output(prefill, {"a": 11}) == [request]
    assert request.output_token_ids == [11] and request.num_output_placeholders == 1
    third = sched.schedule()
    (entry,) = third.scheduled
    assert entry.num_computed_tokens == 6 and request.num_output_placeholders == 2
    sched.update_from_output(decode, {"a": 12})
    # its third token, on the way, is its last (max_tokens 3): nothing more is scheduled for it
    assert sched.schedule().is_empty
    sched.update_from_output(third, {"a": 13})
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [11, 12, 13]
    assert sched.block_manager.num_free_blocks == 16


def test_a_request_preempted_with_its_token_on_the_device_waits_for_it():
    sched = _scheduler()
    request = Request("a", list(range(5, 12)), SamplingParams(max_tokens=8), max_tokens=8)
    sched.add_request(request)
    prefill = sched.schedule()
    sched._preempt(request, prefill)
    assert request.status == RequestStatus.PREEMPTED and request.num_output_placeholders == 1
    assert sched.schedule().is_empty  # not admitted again before its token arrives
    assert sched.update_from_output(prefill, {"a": 20}) == [request]
    assert request.all_token_ids[-1] == 20 and request.num_output_placeholders == 0
    (entry,) = sched.schedule().scheduled  # recomputed from its prompt and the token
    assert (entry.num_computed_tokens, entry.num_tokens, entry.sample) == (0, 8, True)


def test_asynchronous_scheduling_is_on_for_one_rank_on_a_gpu():
    """Decided after num_scheduler_steps (its second argument: steps one at a time here)."""
    one, two = SimpleNamespace(world_size=1), SimpleNamespace(world_size=2)
    assert EngineArgs("m", device="cuda")._schedules_async(one, 1)  # no GPU needed to decide: the device is only named
    assert not EngineArgs("m", device="cuda")._schedules_async(two, 1)
    assert EngineArgs("m", device="cpu")._schedules_async(one, 1) is None  # where the runner launches its steps
    assert EngineArgs("m", device="cpu")._schedules_async(two, 1) is False
    # with speculative decoding: the quiet steps run ahead, measured on the CPU only
    assert not EngineArgs("m", device="cuda", speculative_config={"method": "suffix"})._schedules_async(one, 1)
    assert EngineArgs("m", device="cpu", speculative_config={"method": "suffix"})._schedules_async(one, 1) is None
    assert EngineArgs("m", async_scheduling=True, speculative_config={"method": "suffix"})._schedules_async(one, 1)
    assert EngineArgs("m", device="cpu", async_scheduling=True)._schedules_async(one, 1)
    with pytest.raises(ValueError, match="async_scheduling=True needs one rank"):
        EngineArgs("m", async_scheduling=True)._schedules_async(two, 1)
    with pytest.raises(TypeError, match="async_scheduling must be True or False"):
        EngineArgs("m", async_scheduling="yes")


def _parallelized_rank(rank, world, model_dir):
    import torch.distributed as dist
    from conftest import build_hf_model, random_prompts
    from torch.distributed.device_mesh import init_device_mesh

    import torch_shift

    dist.init_process_group("gloo")  # as under torchrun --nproc-per-node 1
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    module = torch_shift.parallelize(build_hf_model("llama"), mesh)
    prompts, params = random_prompts(3, [5, 9, 14]), SamplingParams(max_tokens=6, temperature=0.0)
    outputs = {}
    for mode in (False, True):
        llm = LLM(module, tokenizer=model_dir, num_kv_blocks=64, async_scheduling=mode)
        assert llm.engine.worker.runtime is not None and llm.engine.config.scheduler.async_scheduling == mode
        outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    dist.destroy_process_group()
    return outputs


def test_a_module_parallelized_over_one_rank_schedules_asynchronously(llama):
    from torch_shift.parallel.launch import run_ranks

    _, model_dir = llama
    (outputs,) = run_ranks(_parallelized_rank, 1, str(model_dir))
    assert outputs[True] == outputs[False]


def test_a_module_on_the_cpu_is_served_there_beside_a_gpu(llama, monkeypatch):
    """A module's parameters place the engine: where a GPU exists, a module on the CPU runs on the CPU, with no
    CUDA graphs and the CPU's choice of asynchronous scheduling (on where the C++ decoder runs its steps), not
    CUDA's (on an H100 the engine took CUDA's defaults for such a module and failed at start-up)."""
    import torch
    from conftest import random_prompts

    _, model_dir = llama
    cpu = LLM(str(model_dir), device="cpu", num_kv_blocks=64)
    prompts, params = random_prompts(2, [5, 9]), SamplingParams(max_tokens=4, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    llm = LLM(cpu.engine.model.model, tokenizer=model_dir, num_kv_blocks=64)
    config = llm.engine.config
    assert torch.device(config.runner.device).type == "cpu"
    assert not config.runner.cuda_graphs
    assert config.scheduler.async_scheduling is cpu.engine.config.scheduler.async_scheduling
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_the_engine_keeps_no_step_once_its_requests_finished(llama):
    """A step launched for requests that all stop meanwhile (a stop token, an abort) is dropped, not left for the
    next run to complete."""
    _, model_dir = llama
    llm = LLM(str(model_dir), async_scheduling=True, **ENGINE)
    try:
        prompt = _prompts()[:1]
        reference, _, _ = _generate(model_dir, False, prompt, [SamplingParams(max_tokens=8, temperature=0.0)])
        stop = reference[0][0][2]  # its third token: it stops while its next step is in flight
        params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
        (output,) = llm.generate(prompt, params, use_tqdm=False)
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids == reference[0][0][:3]
        assert llm.engine.core.in_flight is None
        llm.engine.add_request("late", prompt[0], SamplingParams(max_tokens=40, ignore_eos=True))
        assert llm.engine.step() == [] and llm.engine.core.in_flight is not None  # its prompt launched
        llm.engine.abort_request("late")
        assert llm.engine.core.in_flight is None
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.shutdown()
