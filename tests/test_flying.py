"""Data parallelism and Flying Serving (paper 004) on CPU with gloo, against the single-device engine:
DP replicas, DP x TP, TP groups bound from DP replicas (weights as views, KV blocks reinterpreted),
width changes, hard preemption, long-context routing, and random bindings for hundreds of steps."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, random_prompts, save_checkpoint
from test_shift import assert_same_outputs

from torch_shift import LLM, SamplingParams
from torch_shift.parallel.launch import run_ranks

PROMPT_LENGTHS = [3, 17, 40, 1, 9, 6]
PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=3)


@pytest.fixture(scope="module")
def kv4(tmp_path_factory):
    """A Llama with 8 query and 4 KV heads: TP-2 and TP-4 groups are both possible."""
    model = build_hf_model("llama", num_key_value_heads=4)
    return model, save_checkpoint(model, tmp_path_factory.mktemp("kv4"))


def reference(model_dir, prompts, params=PARAMS):
    return LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)


def _generate_rank(rank, world, model_dir, engine_args, prompts, params):
    llm = LLM(str(model_dir), **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    stats = None
    if rank == 0:
        stats = engine.stats()
        stats["leaked_blocks"] = sum(p.num_blocks - p.num_free_blocks for p in engine.pools)
        stats["layout_counts"] = dict(engine.model.layout_counts)
    return outputs, stats


DP_CASES = [(2, {"dp": 2}), (4, {"dp": 4}), (4, {"dp": 2, "tp": 2})]


@pytest.mark.parametrize("world,engine_args", DP_CASES, ids=["dp2", "dp4", "dp2tp2"])
def test_data_parallel_matches_single_device(llama, world, engine_args):
    _, model_dir = llama
    prompts = random_prompts(6, PROMPT_LENGTHS)
    ref = reference(model_dir, prompts)
    results = run_ranks(_generate_rank, world, model_dir, engine_args, prompts, PARAMS)
    for outputs, _ in results:
        assert_same_outputs(outputs, ref)
    stats = results[0][1]
    assert set(stats["steps_by_layout"]) == {f"dp@{i}" for i in range(engine_args["dp"])}  # every replica worked
    assert stats["leaked_blocks"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_random_bindings_every_step_for_hundreds_of_steps(kv4, world):
    """Every step a random legal binding (DP replicas, TP-2 groups, TP-4) and random moves between
    widths (a moved request's KV is dropped and recomputed in its new width): greedy tokens and
    logprobs as on one device, no hang, no leaked block."""
    _, model_dir = kv4
    prompts = random_prompts(10, [3, 17, 40, 1, 9, 6, 25, 12, 2, 33], seed=5)
    params = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0, logprobs=3)
    ref = reference(model_dir, prompts, params)
    args = {"dp": world, "policy": "random", "max_num_batched_tokens": 16, "max_num_seqs": 2}
    results = run_ranks(_generate_rank, world, model_dir, args, prompts, params, timeout_s=600)
    for outputs, _ in results:
        assert_same_outputs(outputs, ref)
    stats = results[0][1]
    assert stats["num_steps"] >= 200 and stats["num_preemptions"] > 0 and stats["leaked_blocks"] == 0
    expected = {"dp@0", "dp@1", "tp2@0"} | ({"tp2@2", "tp4@0"} if world == 4 else set())
    assert expected <= set(stats["steps_by_layout"])


def _tp_logprobs_rank(rank, world, model_dir, engine_args, prompt, params):
    llm = LLM(str(model_dir), **engine_args)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out, (llm.engine.stats()["steps_by_layout"] if rank == 0 else None)


@pytest.mark.parametrize("width", [2, 4])
def test_a_tp_group_request_has_the_logits_of_static_tp(kv4, width):
    """A request served by a TP-d group bound from d replicas (weights as views of each replica's full
    weights, each pool's blocks holding d x block_size tokens of 1/d of the KV heads) has the prompt
    and output logprobs of static TP-d: a wrong block stride would not survive this comparison."""
    _, model_dir = kv4
    prompt = random_prompts(1, [37], seed=9)[0]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=20, prompt_logprobs=20)
    small_blocks = {"block_size": 4, "max_num_batched_tokens": 16}  # a chunked prompt, many blocks
    flying_args = {"dp": width, "policy": "flying", **small_blocks}
    (flying_out, layouts), *_ = run_ranks(_tp_logprobs_rank, width, model_dir, flying_args, prompt, params)
    (static_out, _), *_ = run_ranks(_tp_logprobs_rank, width, model_dir, {"tp": width, **small_blocks}, prompt,
                                    params)
    assert layouts == {f"tp{width}@0": layouts[f"tp{width}@0"]}  # light load: TP all along
    assert flying_out.outputs[0].token_ids == static_out.outputs[0].token_ids
    for got, want in zip(flying_out.prompt_logprobs[1:] + flying_out.outputs[0].logprobs,
                         static_out.prompt_logprobs[1:] + static_out.outputs[0].logprobs, strict=True):
        assert set(got) == set(want)
        assert max(abs(got[t].logprob - want[t].logprob) for t in want) < 1e-4  # fp32 rounding only


def _hard_preemption_rank(rank, world, model_dir, normal, urgent, params):
    llm = LLM(str(model_dir), dp=2, policy="flying", scheduling_policy="priority",
              policy_config={"dp_above": 1.0, "tp_below": 0.0})
    engine = llm.engine
    if rank != 0:
        return engine.follow()
    for i, prompt in enumerate(normal):
        engine.add_request(f"n{i}", prompt, params)
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("urgent", urgent, params, priority=-1)
    layouts_while_urgent = set()
    while engine.has_unfinished_requests():
        urgent_running = "urgent" in engine.scheduler.requests
        outs = engine.step()
        if urgent_running:
            layouts_while_urgent.add(engine.last_step_layout)
        finished.update({o.request_id: o for o in outs if o.finished})
    result = ([finished[f"n{i}"] for i in range(len(normal))], finished["urgent"], layouts_while_urgent,
              engine.stats())
    engine.send_result("result", result)
    return result


def test_hard_preemption_pauses_dp_requests_which_resume_without_recomputing(llama):
    _, model_dir = llama
    normal = random_prompts(4, [9, 14, 5, 11], seed=2)
    urgent = random_prompts(1, [7], seed=3)[0]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=3)
    ref = reference(model_dir, normal + [urgent], params)
    for outs, urgent_out, layouts, stats in run_ranks(_hard_preemption_rank, 2, model_dir, normal, urgent, params):
        assert_same_outputs(outs + [urgent_out], ref)
        assert layouts == {"tp2@0"}  # the priority request's group ran alone: the DP requests paused
        assert stats["num_preemptions"] == 0
        # every token computed once: prompts and outputs, less each request's last sampled token
        assert stats["num_scheduled_tokens"] == sum(len(p) + 8 - 1 for p in normal + [urgent])


def _long_rank(rank, world, model_dir, engine_args, prompt, params):
    llm = LLM(str(model_dir), **engine_args)
    if rank == 0:
        try:
            llm.engine.tokenize_prompt(prompt)
        except ValueError as e:
            llm.engine.send_result("result", str(e))
            return str(e)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_a_request_that_fits_no_replica_runs_in_a_tp_group_and_static_dp_refuses_it(llama):
    _, model_dir = llama
    prompt = random_prompts(1, [40], seed=6)[0]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=3)
    ref = reference(model_dir, [prompt], params)
    pools = {"num_kv_blocks": 8, "block_size": 4}  # 32 tokens per replica's pool
    out, _ = run_ranks(_long_rank, 2, model_dir, {"dp": 2, "policy": "flying", **pools}, prompt, params)
    assert_same_outputs([out], ref)
    message, _ = run_ranks(_long_rank, 2, model_dir, {"dp": 2, **pools}, prompt, params)
    assert "the prompt has 40 tokens; the KV pool holds only 32 tokens" in message
    assert "policy 'flying'" in message


def test_the_command_line_and_stats(llama):
    """`torch-shift generate --dp 2 --policy flying` gives the single-device tokens; `LLM.stats()` says which
    layouts ran."""
    import json
    import subprocess
    import sys

    _, model_dir = llama
    prompt = random_prompts(1, [11], seed=4)[0]
    params = SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0)
    expected = reference(model_dir, [prompt], params)[0].outputs[0].token_ids
    proc = subprocess.run([sys.executable, "-m", "torch_shift", "generate", "--model", str(model_dir), "--dp", "2",
                           "--policy", "flying", "--policy-config", '{"dp_above": null}', "--token-ids",
                           " ".join(map(str, prompt)), "--max-tokens", "5", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["token_ids"] == expected
    llm = LLM(str(model_dir))
    llm.generate([prompt], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["steps_by_layout"] == {"single": 5} and stats["num_switches"] == 0 and stats["policy"] == "static"
