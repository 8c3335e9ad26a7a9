"""Step plans as deltas: workers that receive only deltas build the same step inputs as a full plan.

The scheduler runs with a fake model (no tensors in the model, no processes) under policies that
admit, chunk, preempt, move requests between KV widths and abort; every step each replica's
persistent batch applies the plan's deltas, and its inputs are compared with the ones built from
the full scheduler output (every token id and block table, as the plan carried before deltas).
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from test_scheduler import EOS, assert_no_leak, make_request, reference_next

from torch_shift.attention.sdpa import build_sdpa_metadata, key_mask
from torch_shift.config import ModelConfig, SchedulerConfig
from torch_shift.engine import input_batch
from torch_shift.engine.input_batch import InputBatch
from torch_shift.engine.policies import RandomOptions, RandomPolicy, StaticPolicy
from torch_shift.engine.scheduler import Scheduler
from torch_shift.engine.step_plan import PlanBuilder
from torch_shift.kv.block_manager import BlockManager
from torch_shift.parallel.layouts import build_deployment

BS = 4
CONFIG = ModelConfig.from_hf_dict({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512})


def reference_inputs(entries, member: int, width: int, sliding_window=None) -> dict:
    """Inputs from the full plan: every scheduled request's token ids and block table."""
    tpb = BS * width
    input_ids, positions, slots, logits_indices = [], [], [], []
    decode_tables, prefill_tables = [], []
    row = 0
    for e in entries:
        table = e.block_tables[member]
        for j, token in enumerate(e.token_ids):
            pos = e.num_computed_tokens + j
            input_ids.append(token)
            positions.append(pos)
            slots.append(table[pos // tpb] * tpb + pos % tpb)
        if e.prompt_logprobs or e.spec_token_ids:
            logits_indices.extend(range(row, row + e.num_tokens))
        elif e.sample:
            logits_indices.append(row + e.num_tokens - 1)
        ctx = e.num_computed_tokens + e.num_tokens
        (decode_tables if e.num_tokens == 1 else prefill_tables).append((row, e.num_tokens, e.num_computed_tokens,
                                                                        table[: -(-ctx // tpb)]))
        row += e.num_tokens
    return dict(input_ids=input_ids, positions=positions, slots=slots, logits_indices=logits_indices,
                decode_tables=decode_tables, prefill_tables=prefill_tables)


def check_inputs(inputs, ref, width: int, sliding_window=None) -> None:
    assert inputs.input_ids.tolist() == ref["input_ids"]
    assert inputs.positions.tolist() == ref["positions"]
    batch = inputs.attention
    assert batch.slot_mapping.tolist() == ref["slots"]
    assert inputs.logits_indices.tolist() == ref["logits_indices"]
    assert batch.num_decodes == len(ref["decode_tables"])
    runs = ref["decode_tables"] + ref["prefill_tables"]
    assert batch.num_runs == len(runs)
    for i, (start, n, done, table) in enumerate(runs):
        assert (batch.query_start[i], batch.query_len[i], batch.num_computed[i]) == (start, n, done)
        assert batch.blocks_of(i).tolist() == table
    # the reference backend's metadata built from it
    md = build_sdpa_metadata(batch)
    tpb = BS * width
    for i, (_, _, done, table) in enumerate(ref["decode_tables"]):
        assert md.decode_block_table[i, : len(table)].tolist() == table  # columns past them are masked out
        expected = key_mask(torch.tensor([done]), md.decode_block_table.shape[1] * tpb, sliding_window)
        assert torch.equal(md.decode_attention_mask(None)[i, 0], expected)
    assert len(md.prefills) == len(ref["prefill_tables"])
    for chunk, (start, n, done, table) in zip(md.prefills, ref["prefill_tables"]):
        assert (chunk.start, chunk.num_tokens, chunk.num_computed_tokens) == (start, n, done)
        assert chunk.block_table[0].tolist() == table


def run(policy_name: str, num_replicas: int, seed: int, steps: int = 400, num_blocks: int = 18,
        budget: int = 24, speculate: bool = False) -> dict:
    """`num_blocks` per replica: 72 tokens, enough for any one request (at most 62), not for many. With
    `speculate`, requests propose the reference's next tokens, some corrupted: checks accept some, reject the
    rest, and blocks of rejected proposals go back and are taken again by others."""
    rng = random.Random(seed)
    deployment = build_deployment(CONFIG, dp=num_replicas, flying=policy_name == "random") if num_replicas > 1 \
        else build_deployment(CONFIG)
    policy = RandomPolicy(deployment, RandomOptions(seed=seed)) if policy_name == "random" else StaticPolicy(deployment)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=96)
    sched = Scheduler(config, [BlockManager(num_blocks, BS) for _ in range(num_replicas)], policy)
    builder = PlanBuilder(deployment, config.max_num_seqs)
    batches = [InputBatch(config.max_num_seqs, config.max_model_len, BS, torch.device("cpu"))
               for _ in range(num_replicas)]
    shared_prefix = [rng.randrange(10, 500) for _ in range(12)]
    counts = {"steps": 0, "preempted": 0, "aborted": 0, "prefix_hits": 0, "widths": set(), "decode_plan_bytes": [],
              "accepted": 0, "rejected": 0, "one_request_checks": 0, "one_request_chunks": 0}
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.5 and sched.num_unfinished < 6 * num_replicas:
            n = rng.randint(1, 30)
            prompt = (shared_prefix if rng.random() < 0.4 else []) + [rng.randrange(10, 500) for _ in range(n)]
            sched.add_request(make_request(f"r{next_id}", prompt, max_tokens=rng.randint(1, 20),
                                           prompt_logprobs=0 if rng.random() < 0.15 else None))
            next_id += 1
        if sched.running and rng.random() < 0.03:
            victim = rng.choice(sched.running)
            sched.finish_request(victim.request_id, victim.status.FINISHED_ABORTED)
            counts["aborted"] += 1
        out = sched.schedule()
        counts["preempted"] += len(out.preempted_request_ids)
        plan = builder.build(out)  # every output, as the engine's core: the rows it removed come free
        if out.is_empty:
            continue
        entries = [g.entries for g in out.groups if g.entries]
        plan = pickle.loads(pickle.dumps(plan))  # as the workers receive it
        for replica, delta in plan.deltas.items():
            batches[replica].apply(delta)
        for group, group_entries in zip(plan.groups, entries):
            layout = deployment[group.layout]
            counts["widths"].add(layout.kv_width)
            if len(group.num_scheduled) == 1 and group.num_decodes == 0:  # InputBatch._prepare_one's
                counts["one_request_checks" if group.num_spec is not None else "one_request_chunks"] += 1
            for member, replica in enumerate(layout.replicas):
                batches[replica].write_spec_tokens(group, member)
                inputs = batches[replica].to_device(batches[replica].prepare(group, member, layout.kv_width))
                check_inputs(inputs, reference_inputs(group_entries, member, layout.kv_width), layout.kv_width)
        if all(g.num_decodes == len(g.num_scheduled) for g in plan.groups):
            counts["decode_plan_bytes"].append((sum(len(g.num_scheduled) for g in plan.groups),
                                                len(pickle.dumps(plan))))
        counts["steps"] += 1
        sampled = {}
        for e in out.scheduled:
            if e.sample:
                tokens = list(e.request.all_token_ids)
                for proposed in e.spec_token_ids:  # accepted while it is the reference's token
                    if proposed != reference_next(tokens):
                        break
                    tokens.append(proposed)
                tokens.append(reference_next(tokens))
                sampled[e.request_id] = tokens[e.request.num_tokens:]
                counts["accepted"] += len(sampled[e.request_id]) - 1
                counts["rejected"] += len(e.spec_token_ids) + 1 - len(sampled[e.request_id])
        for request in sched.update_from_output(out, sampled):
            if speculate and not request.status.finished:
                tokens = list(request.all_token_ids)
                for _ in range(rng.randint(0, 5)):
                    tokens.append(reference_next(tokens) + (rng.random() < 0.3))
                request.spec_token_ids = tokens[request.num_tokens:]
    counts["prefix_hits"] = sum(p.num_prefix_hits for p in sched.pools)
    for request in list(sched.requests.values()):
        sched.finish_request(request.request_id, request.status.FINISHED_ABORTED)
    for pool in sched.pools:
        assert pool.num_free_blocks == pool.num_blocks and not pool.req_blocks
    return counts


@pytest.mark.parametrize("policy,num_replicas", [("static", 1), ("static", 2), ("random", 2), ("random", 4)])
def test_deltas_reproduce_the_full_plan_inputs(policy, num_replicas):
    counts = run(policy, num_replicas, seed=num_replicas)
    # the run went through what the deltas must survive
    assert counts["steps"] > 150 and counts["preempted"] > 0 and counts["aborted"] > 0
    assert counts["prefix_hits"] > 0
    if policy == "random":
        assert counts["widths"] >= {1, 2}


@pytest.mark.parametrize("policy,num_replicas", [("static", 1), ("random", 2)])
@pytest.mark.parametrize("few_tokens", [0, 1000])
def test_deltas_reproduce_the_full_plan_inputs_with_speculation(policy, num_replicas, few_tokens, monkeypatch):
    """Blocks that held rejected proposals go back and are taken again, by the request itself or another: the
    replicas' batches must follow (a stale block id there writes into another request's KV). Each delta's tokens
    (several for a request after accepted proposals) written all at once with numpy, then one at a time."""
    monkeypatch.setattr(input_batch, "_FEW_TOKENS", few_tokens)
    counts = run(policy, num_replicas, seed=num_replicas + 10, speculate=True)
    assert counts["steps"] > 150 and counts["preempted"] > 0 and counts["accepted"] > 50 and counts["rejected"] > 50
    assert counts["one_request_checks"] > 0 and counts["one_request_chunks"] > 0


def test_decode_plan_size_does_not_grow_with_context():
    """A decode step sends per request its row, one token and (at block boundaries) one block id:
    the pickled plan's size depends on the batch, not on how long the contexts are."""
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=2048)
    sizes = {}
    for prompt_len in (16, 1500):
        deployment = build_deployment(CONFIG)
        sched = Scheduler(config, [BlockManager(4096, BS)], StaticPolicy(deployment))
        builder = PlanBuilder(deployment, config.max_num_seqs)
        for i in range(8):
            sched.add_request(make_request(f"r{i}", prompt_len, max_tokens=40))
        measured = []
        for _ in range(30):
            out = sched.schedule()
            plan = builder.build(out)
            (group,) = plan.groups
            if group.num_decodes == len(group.num_scheduled) == 8:
                measured.append(len(pickle.dumps(plan)))
            sched.update_from_output(out, {e.request_id: [7] for e in out.scheduled if e.sample})
        assert len(measured) >= 20
        sizes[prompt_len] = max(measured)
    # the same up to the width of pickled ints (block ids past 255 take more bytes); a full plan
    # would carry 8 x 1500 token ids and 8 x 375 block ids at 1500
    assert sizes[1500] <= 1.1 * sizes[16] and sizes[1500] < 1024, sizes


def test_the_rank0_half_of_an_engine_runs_without_a_model():
    """What a simulator drives: the engine's own requests, scheduler, policy and plans, with the executor
    replaced (here by zero logits); every request finishes with its length and every block comes back."""
    from torch_shift.engine.llm_engine import EngineArgs, LLMEngine
    from torch_shift.engine.model_runner import StepResult
    from torch_shift.engine.sampling_params import SamplingParams

    engine = LLMEngine.driver_only(EngineArgs("config-only", dp=2, policy="flying", max_num_batched_tokens=32),
                                   CONFIG, num_kv_blocks=64)
    plans = []

    def run_plan(plan):
        plans.append(plan)
        return StepResult([torch.zeros(g.num_logits, CONFIG.vocab_size) for g in plan.groups])

    engine.core.executor = run_plan
    for i in range(6):
        engine.add_request(f"r{i}", list(range(10, 20 + 5 * i)), SamplingParams(max_tokens=8, ignore_eos=True,
                                                                               temperature=0.0))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == [f"r{i}" for i in range(6)]
    assert all(len(o.outputs[0].token_ids) == 8 for o in finished.values())
    assert len(plans) == engine.num_steps and {"tp2@0", "dp@0", "dp@1"} >= set(engine.stats()["steps_by_layout"])
    assert all(p.num_free_blocks == p.num_blocks for p in engine.pools)
