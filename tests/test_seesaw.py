"""Seesaw (paper 003) and what it stands on: pipeline-parallel layouts, two views of one KV pool, the
host tier of the KV cache and the tiered-buffering policy.

Plain-Python tests drive the real scheduler and policies with a fake model that keeps a fake paged
KV cache per view and executes the plan's swap operations (before the forward, or beside it for
asynchronous copies); multi-rank tests compare static PP and Seesaw at world 2 and 4 with the
single-device engine.
"""

from __future__ import annotations

import gc
import os
import random
import weakref

import numpy as np
import pytest
import torch
from conftest import random_prompts
from test_scheduler import _mix, fake_draws, make_request, reference_next, reference_outputs
from test_shift import assert_same_outputs
from test_step_plan import CONFIG

from torch_shift import LLM, SamplingParams
from torch_shift.config import ModelConfig, SchedulerConfig
from torch_shift.engine.input_batch import InputBatch
from torch_shift.engine.policies import SeesawOptions, SeesawPolicy, StaticPolicy, StepDecision, build_policy
from torch_shift.engine.request import RequestStatus
from torch_shift.engine.scheduler import Scheduler
from torch_shift.engine.step_plan import GroupStep, NewRow, ReplicaDelta, split_micro_batches
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.cache import KVCache
from torch_shift.kv.host_tier import KVRegion, map_host_tier, swap_in, swap_out, tier_shape
from torch_shift.kv.tier import TierAllocator
from torch_shift.parallel.launch import run_ranks
from torch_shift.parallel.layouts import build_deployment, stage_layers

BS = 4


# -- layouts --------------------------------------------------------------------------------------------

def test_pipeline_deployments_and_what_they_refuse():
    static = build_deployment(CONFIG, pp=2)
    assert [(lay.name, lay.kind, lay.ranks, lay.kv_view, lay.logits_rank) for lay in static.layouts] == [
        ("pp", "pp", (0, 1), "layers", 1)]
    seesaw = build_deployment(CONFIG, dp=2, pp=2, seesaw=True)
    assert seesaw.replicas == ((0, 1), (2, 3)) and seesaw.family == "seesaw"
    assert {lay.name: (lay.kind, lay.ranks, lay.kv_view) for lay in seesaw.layouts} == {
        "pp@0": ("pp", (0, 1), "layers"), "tp@0": ("tp", (0, 1), "heads"),
        "pp@1": ("pp", (2, 3), "layers"), "tp@1": ("tp", (2, 3), "heads")}
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="needs pp >= 2"):
        build_deployment(CONFIG, seesaw=True)
    with pytest.raises(ValueError, match="combines only with dp"):
        build_deployment(CONFIG, pp=2, tp=2)
    with pytest.raises(ValueError, match="seesaw.* decodes in TP=8 over a replica.s pp=8 ranks, which must split "
                                         "the heads and the MLP evenly .no KV heads replicated, as plain TP may.*"
                                         "num_key_value_heads=4 is not divisible by TP=8"):
        build_deployment(ModelConfig.from_hf_dict({**_CONFIG_DICT, "num_hidden_layers": 8}), pp=8, seesaw=True)
    with pytest.raises(ValueError, match="num_hidden_layers=3 divisible by pp=2"):
        build_deployment(ModelConfig.from_hf_dict({**_CONFIG_DICT, "num_hidden_layers": 3}), pp=2, seesaw=True)
    with pytest.raises(ValueError, match="need at least 4 layers"):
        build_deployment(CONFIG, pp=4)
    with pytest.raises(ValueError, match="build it with pp >= 2 and policy='seesaw'"):
        build_policy("seesaw", static)


_CONFIG_DICT = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
                "max_position_embeddings": 512}


# -- one pool, two views; the tier re-shards --------------------------------------------------------------

L, H, D, NB = 4, 4, 8, 6


def _pool(pp: int) -> KVCache:
    """A rank's pool as allocated (TP geometry: every layer, H / pp heads)."""
    return KVCache(L, NB, BS, H // pp, D, torch.float32)


def _regions(pp: int, rank: int) -> tuple[KVRegion, KVRegion]:
    layers = stage_layers(L, pp, rank)
    return KVRegion(layers.start, len(layers), 0, H), KVRegion(0, L, rank * H // pp, H // pp)


def test_a_block_written_in_one_view_leaves_every_other_block_alone():
    """The pool is block-major: a pipeline stage's view of block b (its layers, every head) and a TP
    rank's view of it (every layer, its heads) cover the same bytes, and no other block's."""
    pool = _pool(2)
    stage_view = pool.regroup(L // 2, H)
    stage_view.write(1, torch.tensor([2 * BS + 1]), torch.ones(1, H, D), torch.ones(1, H, D))
    touched = (pool.k_all != 0).flatten(1).any(dim=1)
    assert touched.tolist() == [b == 2 for b in range(NB)]
    assert torch.equal(stage_view.read_slots(1, torch.tensor([2 * BS + 1]))[0], torch.ones(1, H, D))


@pytest.mark.parametrize("pp", [2, 4])
def test_the_tier_round_trip_is_byte_exact_for_every_layer_and_head_range(pp):
    """KV written by every stage (its layers, all heads) and swapped out comes back to every TP rank as
    exactly its heads of every layer, and from there back to the stages: bit for bit."""
    g = torch.Generator().manual_seed(pp)
    full_k = torch.randn(L, 3 * BS, H, D, generator=g)  # the whole cache of one 12-token request
    full_v = torch.randn(L, 3 * BS, H, D, generator=g)
    tier = torch.zeros(tier_shape(L, H, D, 5, BS))
    tier_blocks = torch.tensor([4, 0, 2])
    pools = [_pool(pp) for _ in range(pp)]
    for rank, pool in enumerate(pools):  # prefill under PP: each stage writes its layers
        stage_region, _ = _regions(pp, rank)
        view = pool.regroup(stage_region.num_layers, H)
        blocks = torch.tensor([5, 1, 3])
        slots = (blocks[:, None] * BS + torch.arange(BS)).flatten()
        for i, layer in enumerate(range(stage_region.layer_start, stage_region.layer_start + stage_region.num_layers)):
            view.write(i, slots, full_k[layer], full_v[layer])
        swap_out(tier, view, stage_region, blocks, tier_blocks)
    for rank, pool in enumerate(pools):  # decode under TP: each rank reads its heads of every layer
        stage_region, tp_region = _regions(pp, rank)
        swap_in(tier, pool, tp_region, torch.tensor([0, 2, 4]), tier_blocks)
        slots = (torch.tensor([0, 2, 4])[:, None] * BS + torch.arange(BS)).flatten()
        heads = slice(tp_region.head_start, tp_region.head_start + tp_region.num_heads)
        for layer in range(L):
            k, v = pool.read_slots(layer, slots)
            assert torch.equal(k, full_k[layer][:, heads]) and torch.equal(v, full_v[layer][:, heads])
        swap_out(tier, pool, tp_region, torch.tensor([0, 2, 4]), torch.tensor([1, 3, 0]))  # and back
    for rank, pool in enumerate(pools):
        stage_region, _ = _regions(pp, rank)
        view = pool.regroup(stage_region.num_layers, H)
        swap_in(tier, view, stage_region, torch.tensor([1, 3, 5]), torch.tensor([1, 3, 0]))
        slots = (torch.tensor([1, 3, 5])[:, None] * BS + torch.arange(BS)).flatten()
        for i, layer in enumerate(range(stage_region.layer_start, stage_region.layer_start + stage_region.num_layers)):
            k, v = view.read_slots(i, slots)
            assert torch.equal(k, full_k[layer]) and torch.equal(v, full_v[layer])


def test_tier_allocator_is_all_or_nothing_and_frees_read_blocks_one_step_later():
    tier = TierAllocator(5, BS)
    assert tier.allocate("a", 9) == [0, 1, 2] and tier.allocate("b", 9) is None
    assert tier.allocate("b", 8) == [3, 4] and tier.num_free_blocks == 0
    tier.release("a")  # read by a swap-in planned this step
    assert tier.num_free_blocks == 0 and tier.usage == 0.4
    tier.advance()
    assert tier.num_free_blocks == 3
    tier.free("b")
    assert tier.num_free_blocks == 5 and tier.req_blocks == {}


# -- micro-batches ----------------------------------------------------------------------------------------

def test_micro_batches_cut_prompt_chunks_and_rebuild_the_whole_steps_inputs():
    """Every piece continues where the one before ended, only a chunk's last piece samples, and the
    pieces' inputs put together are the whole group's."""
    batch = InputBatch(4, 64, BS, torch.device("cpu"))
    prompts = {0: list(range(10, 13)), 1: list(range(20, 47)), 2: list(range(50, 61)), 3: list(range(70, 79))}
    for row, tokens in prompts.items():
        batch.apply(ReplicaDelta(new_rows=[NewRow(row, np.array(tokens, dtype=np.int32),
                                                  np.arange(row * 8, row * 8 + 8, dtype=np.int32), 1)]))
    # a decode (row 0 at position 2), a chunk of 20 with prompt logprobs, a chunk of 11, a chunk of 9
    group = GroupStep("pp", (np.array([0, 1, 2, 3], dtype=np.int32),), np.array([1, 20, 11, 9], dtype=np.int32),
                      np.array([2, 7, 0, 0], dtype=np.int32), 1, np.array([1, 20, 1, 0], dtype=np.int32), 4)
    micro = split_micro_batches(group)
    assert [int(m.num_scheduled.sum()) for m in micro] == [10, 10, 10, 11]
    whole = batch.to_device(batch.prepare(GroupStep(*[getattr(group, f) for f in (
        "layout", "rows", "num_scheduled", "num_computed", "num_decodes", "logits_counts")]), 0, 1))
    parts = [batch.to_device(batch.prepare(m, 0, 1)) for m in micro]
    for name in ("input_ids", "positions"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))
    assert torch.equal(torch.cat([p.attention.slot_mapping for p in parts]), whole.attention.slot_mapping)
    assert sum(m.num_logits for m in micro) == group.num_logits == 22
    offsets = np.cumsum([0] + [int(m.num_scheduled.sum()) for m in micro])
    rows = torch.cat([p.logits_indices + int(o) for p, o in zip(parts, offsets)])
    assert torch.equal(rows, whole.logits_indices)


# -- the scheduler with a tier, and Seesaw, on a fake model -------------------------------------------------

class TieredFakeModel:
    """next token = f(all tokens before), each position's state kept in a fake paged KV cache per
    replica, tagged with the KV view it was written in; swap operations copy states between the device
    and a fake tier, before the forward (sync) or after it (async: beside the forward, done by the next
    step). Reading a state that is missing, stale or of another view changes or breaks the output."""

    def __init__(self, sched: Scheduler, async_copies: bool = False):
        self.sched = sched
        self.async_copies = async_copies
        self.device: dict[tuple[int, int, int], tuple[str, int]] = {}  # (replica, block, offset) -> (view, state)
        self.tier: dict[tuple[int, int], int] = {}
        self.layouts = sched.policy.deployment

    def _swap(self, out) -> None:
        """Copy whole blocks; a state written in another view than the copy's (a block's slots past its
        request's tokens may hold an earlier owner's) arrives as junk that no read may find."""
        for op in out.swap_outs:
            view = self.layouts[op.layout].kv_view
            for db, tb in zip(op.device_blocks, op.tier_blocks):
                for o in range(BS):
                    state = self.device.get((op.replica, db, o))
                    self.tier[(tb, o)] = state[1] if state is not None and state[0] == view else None
        for op in out.swap_ins:
            view = self.layouts[op.layout].kv_view
            for db, tb in zip(op.device_blocks, op.tier_blocks):
                for o in range(BS):
                    state = self.tier.get((tb, o))
                    self.device[(op.replica, db, o)] = (view, state) if state is not None else ("junk", 0)

    def __call__(self, out) -> dict[str, list[int]]:
        if not self.async_copies:
            self._swap(out)
        sampled = {}
        for group in out.groups:
            view = self.layouts[group.layout].kv_view
            replica = group.replicas[0]
            for e in group.entries:
                table, pos = e.block_table, e.num_computed_tokens
                state = 0
                if pos:
                    written_view, state = self.device[(replica, table[(pos - 1) // BS], (pos - 1) % BS)]
                    assert written_view == view, f"{e.request_id}: KV read in another view than written"
                states = []
                for t in e.token_ids:
                    state = _mix(state, t)
                    self.device[(replica, table[pos // BS], pos % BS)] = (view, state)
                    states.append(state)
                    pos += 1
                if e.sample:
                    sampled[e.request_id] = fake_draws(e, states)
                    assert sampled[e.request_id][0] == reference_next(e.request.all_token_ids)
        if self.async_copies:
            self._swap(out)
        return sampled


def _scheduler(deployment, policy, num_blocks: int, tier_blocks: int, budget: int = 32, max_seqs: int = 8,
               async_copies: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256)
    pools = [BlockManager(num_blocks, BS) for _ in deployment.replicas]
    tier = TierAllocator(tier_blocks, BS, async_copies) if tier_blocks else None
    return Scheduler(config, pools, policy, tier)


def _drive(sched: Scheduler, model, requests=(), arrivals=None, abort_rate: float = 0.0, seed: int = 0,
           max_steps: int = 3000) -> dict:
    """Steps until every request finished; `arrivals`: step -> requests added before it."""
    rng = random.Random(seed)
    for r in requests:
        sched.add_request(r)
    arrivals = dict(arrivals or {})
    outputs, aborted, phases = {}, set(), []
    for n in range(max_steps):
        for r in arrivals.pop(n, []):
            sched.add_request(r)
        if not sched.has_unfinished_requests() and not arrivals:
            break
        if abort_rate and sched.requests and rng.random() < abort_rate:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        out = sched.schedule()
        phases.append(out.groups[0].layout.split("@")[0] if out.groups else None)
        for r in sched.update_from_output(out, model(out)):
            if r.status.finished:
                outputs[r.request_id] = r.output_token_ids
    else:
        raise AssertionError(f"unfinished after {max_steps} steps: {sorted(sched.requests)}")
    for pool in sched.pools:  # nothing leaked: device blocks, tier blocks, rows
        assert pool.num_free_blocks == pool.num_blocks and not pool.req_blocks
    if sched.tier is not None:
        sched.tier.advance()
        assert sched.tier.num_free_blocks == sched.tier.num_blocks and not sched.tier.req_blocks
    assert not sched.swapped and not sched.running
    return {"outputs": outputs, "aborted": aborted, "phases": phases}


def _random_requests(n: int, seed: int, max_prompt: int = 24, max_out: int = 12):
    rng = random.Random(seed)
    return [make_request(f"r{i}", rng.randint(1, max_prompt), max_tokens=rng.randint(1, max_out)) for i in range(n)]


@pytest.mark.parametrize("async_copies", [False, True], ids=["sync", "async"])
def test_preempted_requests_swap_to_the_tier_when_it_has_room_and_come_back_unchanged(async_copies):
    """Static DP over two replicas whose pools are too small for the load: a generating request that
    loses its blocks goes to the tier (recomputed only when the tier is full); with aborts on the way,
    outputs are the reference's and no device block, tier block or request is left behind."""
    deployment = build_deployment(CONFIG, dp=2)
    sched = _scheduler(deployment, StaticPolicy(deployment), num_blocks=12, tier_blocks=10,
                       async_copies=async_copies)
    requests = _random_requests(40, seed=3)
    result = _drive(sched, TieredFakeModel(sched, async_copies), requests, abort_rate=0.05, seed=4)
    for r in requests:
        if r.request_id not in result["aborted"]:
            assert result["outputs"][r.request_id] == reference_outputs(r.prompt_token_ids, r.max_tokens)
    assert sched.num_swap_outs > 5 and sched.num_swap_ins > 5 and result["aborted"]
    assert sched.num_preemptions > sched.num_swap_outs // 2  # the tier was full at times: some recomputed


@pytest.mark.parametrize("async_copies", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dp", [1, 2])
def test_seesaw_prefills_under_pp_decodes_under_tp_and_loses_nothing(dp, async_copies):
    """Seesaw on real schedulers: prompts prefill under the pipeline layouts, their KV goes to the tier
    and comes back under TP (a KV read in the other view would break the fake model); decode-time
    preemptions swap out; arrivals and aborts on the way; nothing leaks."""
    deployment = build_deployment(CONFIG, dp=dp, pp=2, seesaw=True)
    policy = SeesawPolicy(deployment)
    sched = _scheduler(deployment, policy, num_blocks=14, tier_blocks=16, async_copies=async_copies)
    requests = _random_requests(30, seed=dp)
    arrivals = {5 * i: requests[10 + i:11 + i] for i in range(20)}
    result = _drive(sched, TieredFakeModel(sched, async_copies), requests[:10], arrivals, abort_rate=0.03, seed=dp)
    for r in requests:
        if r.request_id not in result["aborted"]:
            assert result["outputs"][r.request_id] == reference_outputs(r.prompt_token_ids, r.max_tokens)
    assert policy.num_transitions >= 6 and sched.num_preemptions > 0
    assert set(result["phases"]) >= {"pp", "tp"}


class _Alternating(StaticPolicy):
    """PP one step, TP the next, no phase: requests admitted under either layout."""

    def decide(self, view):
        return StepDecision(("pp",) if view.num_steps % 2 == 0 else ("tp",))


def test_kv_is_only_ever_read_in_the_view_it_was_written_in():
    """Two layouts over one pool with different KV views: a request runs only when a layout of its own
    view is bound, and pauses (its KV kept) otherwise; the fake model fails on any read across views."""
    deployment = build_deployment(CONFIG, pp=2, seesaw=True)
    sched = _scheduler(deployment, _Alternating(deployment), num_blocks=40, tier_blocks=0)
    requests = _random_requests(12, seed=7)
    ran_in: dict[str, set[str]] = {}
    model = TieredFakeModel(sched)

    def recording(out):
        for group in out.groups:
            for e in group.entries:
                ran_in.setdefault(e.request_id, set()).add(group.layout)
        return model(out)

    result = _drive(sched, recording, requests)
    assert result["outputs"] == {r.request_id: reference_outputs(r.prompt_token_ids, r.max_tokens) for r in requests}
    assert all(len(layouts) == 1 for layouts in ran_in.values())
    assert {next(iter(layouts)) for layouts in ran_in.values()} == {"pp", "tp"}


def test_a_full_tier_makes_prefill_wait():
    """The tier holds two prompts' KV: with a device pool that could take them all, only two prompts
    start; the rest wait (no crash, no loss) and start once the tier has emptied."""
    deployment = build_deployment(CONFIG, pp=2, seesaw=True)
    sched = _scheduler(deployment, SeesawPolicy(deployment), num_blocks=64, tier_blocks=4, budget=64)
    requests = [make_request(f"r{i}", 8, max_tokens=3) for i in range(6)]
    for r in requests:
        sched.add_request(r)
    model = TieredFakeModel(sched)
    out = sched.schedule()
    assert [e.request_id for e in out.scheduled] == ["r0", "r1"] and sched.view.num_waiting == 4
    sched.update_from_output(out, model(out))
    result = _drive(sched, model)
    assert {rid: toks for rid, toks in result["outputs"].items()} == {
        r.request_id: reference_outputs(r.prompt_token_ids, 3) for r in requests}


def _transitions(scheduling: str, refill_below: float = 0.0) -> SeesawPolicy:
    """A scripted workload: 12 prompts of 8 tokens (2 blocks each); the tier holds 6 of them (12 blocks,
    as the paper's host tier, larger than the device's), the device about 4 requests' KV; outputs of 2
    to 9 tokens, so that requests finish apart."""
    deployment = build_deployment(CONFIG, pp=2, seesaw=True)
    policy = SeesawPolicy(deployment, SeesawOptions(scheduling=scheduling, refill_below=refill_below))
    sched = _scheduler(deployment, policy, num_blocks=13, tier_blocks=12, budget=64)
    requests = [make_request(f"r{i}", 8, max_tokens=2 + i % 8) for i in range(12)]
    result = _drive(sched, TieredFakeModel(sched), requests)
    assert result["outputs"] == {r.request_id: reference_outputs(r.prompt_token_ids, r.max_tokens) for r in requests}
    return policy


def test_tiered_buffering_makes_the_transitions_its_rule_predicts_and_fewer_than_prefill_first():
    """Tiered: a prefill phase lasts until the tier is full (6 prompts), a decode phase until the tier is
    empty, so 12 requests take ceil(12 / 6) = 2 prefill phases: 2 * 2 - 1 transitions. Prefill-first
    goes back to prefill whenever a prompt fits, decode-first only when nothing is left to decode."""
    tiered = _transitions("tiered")
    assert tiered.num_transitions == 2 * 2 - 1
    assert _transitions("prefill_first").num_transitions > tiered.num_transitions
    assert _transitions("decode_first").num_transitions <= tiered.num_transitions
    with pytest.raises(ValueError, match="scheduling must be one of"):
        SeesawOptions(scheduling="eager")


def test_refilling_below_a_fraction_of_the_tier_prefills_again_before_it_is_empty():
    """The artifact's rule: back to prefill once the tier holds less than half of what it can (2 of 6 prompts
    left after the device took 4), not only when it is empty: more, shorter phases, the same outputs."""
    assert _transitions("tiered", refill_below=0.5).num_transitions > _transitions("tiered").num_transitions
    with pytest.raises(ValueError, match="refill_below"):
        SeesawOptions(refill_below=1.0)


# -- every layout exact against the single-device engine, at world 2 and 4 -------------------------------------

PARAMS = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=3)
PROMPT_LENGTHS = [3, 17, 40, 1, 9, 6, 25, 12]


@pytest.fixture(scope="module")
def reference(layers4):
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11)
    return prompts, LLM(str(layers4)).generate(prompts, PARAMS, use_tqdm=False)


def _generate_rank(rank, world, model_dir, engine_args, prompts):
    llm = LLM(str(model_dir), **engine_args)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    if rank != 0:
        return outputs, None
    engine = llm.engine
    stats = engine.stats()
    stats["leaked_blocks"] = sum(p.num_blocks - p.num_free_blocks for p in engine.pools)
    stats["leaked_tier_blocks"] = engine.tier.num_used_blocks if engine.tier is not None else 0
    return outputs, stats


# a device pool of 14 blocks of 4 tokens and a tier of 16: the 48-token request fits either, not much more
SMALL = {"block_size": 4, "num_kv_blocks": 14, "num_cpu_kv_blocks": 16, "max_num_batched_tokens": 32}
CASES = [
    (2, {"pipeline_parallel_size": 2}),
    (4, {"pp": 4, "max_num_batched_tokens": 24}),
    (2, {"pp": 2, "policy": "seesaw", **SMALL}),
    (2, {"pp": 2, "policy": "seesaw", "kv_swap": "async", "seesaw_weights": "host", **SMALL}),
    (4, {"pp": 4, "policy": "seesaw", **SMALL}),
    (4, {"dp": 2, "pp": 2, "policy": "seesaw", **SMALL}),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,engine_args", CASES, ids=["pp2", "pp4", "p2t2", "p2t2-async-host", "p4t4", "d2p2t2"])
def test_pipeline_and_seesaw_match_the_single_device_engine(layers4, reference, world, engine_args):
    prompts, ref = reference
    results = run_ranks(_generate_rank, world, layers4, engine_args, prompts, timeout_s=300)
    for outputs, _ in results:
        assert_same_outputs(outputs, ref)
    stats = results[0][1]
    assert stats["leaked_blocks"] == 0 and stats["leaked_tier_blocks"] == 0
    if engine_args.get("policy") != "seesaw":  # static PP
        assert set(stats["steps_by_layout"]) == {"pp"}
        return
    # several prefill / decode rounds, and decode-time preemptions that went to the tier
    assert stats["num_transitions"] >= 3 and stats["num_swap_outs"] > len(prompts)
    assert {name.split("@")[0] for name in stats["steps_by_layout"]} == {"pp", "tp"}


def test_a_single_device_engine_swaps_preempted_requests_through_the_tier(layers4, reference):
    """The host tier is not Seesaw's alone: with a small pool, generating requests that must give up
    their blocks go to the tier and come back; no token is computed twice."""
    prompts, ref = reference
    llm = LLM(str(layers4), block_size=4, num_kv_blocks=14, num_cpu_kv_blocks=16)
    assert_same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), ref)
    stats = llm.stats()
    assert stats["num_swap_outs"] > 0 and stats["num_swap_outs"] == stats["num_preemptions"]
    assert stats["num_scheduled_tokens"] == sum(len(p) + PARAMS.max_tokens - 1 for p in prompts)


def test_an_engine_with_a_tier_is_freed_when_dropped_without_waiting_for_the_collector(layers4):
    """Nothing of an engine with a host tier holds itself in a cycle: its weights, KV and tier go when the
    last reference does (its swapper held the runner back until Python's next full collection)."""
    llm = LLM(str(layers4), block_size=4, num_kv_blocks=14, num_cpu_kv_blocks=16)
    llm.generate(random_prompts(1, [8], seed=3), PARAMS, use_tqdm=False)
    runner = weakref.ref(llm.engine.worker.runner)
    assert runner().swapper is not None
    gc.disable()
    try:
        del llm
        assert runner() is None
    finally:
        gc.enable()


def _map_rank(rank, world):
    """As under torchrun: ranks of an initialised process group, none started by another."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        def broadcast(obj=None):
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        tier = map_host_tier((2, 3, 4), torch.float32, rank, broadcast, dist.barrier)
        tier[rank].fill_(rank + 1)  # each rank writes its half, reads the other's
        dist.barrier()
        return tier.clone(), sorted(os.listdir("/dev/shm"))
    finally:
        dist.destroy_process_group()


def test_under_torchrun_every_rank_maps_one_shared_memory_file():
    before = set(os.listdir("/dev/shm"))
    for tier, files in run_ranks(_map_rank, 2, timeout_s=60):
        assert torch.equal(tier[0], torch.ones(3, 4)) and torch.equal(tier[1], torch.full((3, 4), 2.0))
        assert not [f for f in set(files) - before if f.startswith("torch_shift_kv_tier")]  # removed once mapped


def test_engine_arguments_of_seesaw(layers4):
    from torch_shift.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["generate", "--pipeline-parallel-size", "2", "--policy", "seesaw",
                                      "--cpu-kv-gb", "0.5", "hello"])
    assert {k: v for k, v in _engine_kwargs(args).items() if k in ("pp", "policy", "cpu_kv_gb")} == {
        "pp": 2, "policy": "seesaw", "cpu_kv_gb": 0.5}
    with pytest.raises(ValueError, match="give it a size"):
        LLM(str(layers4), pp=2, policy="seesaw", cpu_kv_gb=0)
    with pytest.raises(ValueError, match="kv_swap must be"):
        LLM(str(layers4), kv_swap="later")


def test_tier_and_link_arguments_are_checked():
    from torch_shift.engine.llm_engine import EngineArgs

    for bad, error in (({"cpu_kv_gb": "4"}, TypeError), ({"cpu_kv_gb": -1}, ValueError),
                       ({"num_cpu_kv_blocks": True}, TypeError), ({"num_cpu_kv_blocks": 1.5}, TypeError),
                       ({"num_cpu_kv_blocks": -2}, ValueError), ({"interconnect_gbps": 0}, ValueError),
                       ({"interconnect_gbps": float("inf")}, ValueError),
                       ({"interconnect_gbps": 10, "device": "cuda"}, ValueError)):
        with pytest.raises(error):
            EngineArgs("model", **bad)
    for timeout in (0, -3, float("nan"), float("inf")):  # one message, whichever way the timeout is wrong
        with pytest.raises(ValueError, match="distributed_timeout_s must be a finite number > 0"):
            EngineArgs("model", distributed_timeout_s=timeout)


def test_a_tier_larger_than_dev_shm_is_refused_before_any_rank_starts(layers4, monkeypatch):
    """Were torch's "unable to allocate shared memory" (a 64 MB /dev/shm, Docker's default) after a file the size of
    the tier was left in /dev/shm, on every try."""
    import multiprocessing

    from torch_shift.kv import host_tier

    monkeypatch.setattr(host_tier, "_shm_free_bytes", lambda: 64 << 20)
    left_before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError, match=r"the host KV tier needs .* GiB of /dev/shm, which has 0.06 GiB free: "
                                         r"lower cpu_kv_gb"):
        LLM(str(layers4), pp=2, policy="seesaw", cpu_kv_gb=1.0)
    assert not multiprocessing.active_children() and set(os.listdir("/dev/shm")) <= left_before


def test_a_shared_host_tier_is_made_in_shared_memory_without_a_private_copy():
    """The tier ranks share: zero-filled, shared, and never held twice (a copy into shared memory made the README's
    cpu_kv_gb=8 take 16 GiB at its peak, and an engine built after another ran out of memory)."""
    import subprocess
    import sys

    from torch_shift.kv.host_tier import create_host_tier

    tier = create_host_tier((2, 3, 4, 16), torch.bfloat16, shared=True)
    assert tier.shape == (2, 3, 4, 16) and tier.is_contiguous() and tier.is_shared()
    assert not tier.any()
    pid = os.fork()
    if pid == 0:  # a forked rank writes, this process reads
        tier[1, 2, 3, 4] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert tier[1, 2, 3, 4].item() == 7.0 and tier.count_nonzero().item() == 1
    # peak memory of this process while a 512 MiB tier is made: its pages are touched only when written
    script = ("import resource, torch; from torch_shift.kv.host_tier import create_host_tier; "
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
              "tier = create_host_tier((256 << 20,), torch.bfloat16, shared=True); "
              "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)")
    grown_mib = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                   check=True).stdout.split()[-1])
    assert grown_mib < 64, grown_mib


def _emulated_link_rank(rank, world):
    import types

    import torch.distributed as dist

    from torch_shift.parallel import comm

    dist.init_process_group("gloo")
    delays, real_time = [], comm.time
    comm.time = types.SimpleNamespace(sleep=delays.append)  # the delays comm asks for, in this forked rank
    try:
        x = torch.ones(1000)
        with comm.emulated_link(0.001):  # 1 MB/s
            comm.all_reduce(x, dist.group.WORLD)
            comm.all_gather(x, dist.group.WORLD)
        comm.all_reduce(x, dist.group.WORLD)  # outside the block: no delay
    finally:
        comm.time = real_time
        dist.destroy_process_group()
    return delays


def test_the_emulated_link_delays_each_transfer_by_its_bytes_over_the_bandwidth():
    """paper 003 Fig. 14's sweep on one machine: a ring all-reduce of 4000 bytes at 2 ranks sends 4000 bytes,
    an all-gather 4000: 4 ms each at 1 MB/s; none outside the emulated link."""
    for delays in run_ranks(_emulated_link_rank, 2):
        assert delays == [pytest.approx(0.004), pytest.approx(0.004)]


@pytest.mark.parametrize("tier, option", [({"num_cpu_kv_blocks": 4}, "raise num_cpu_kv_blocks"),
                                          ({"cpu_kv_gb": 1e-5}, "raise cpu_kv_gb")])
def test_a_prompt_beyond_seesaws_tier_names_the_option_that_sized_it(layers4, tier, option):
    llm = LLM(str(layers4), pp=2, policy="seesaw", block_size=4, num_kv_blocks=14, **tier)
    try:
        with pytest.raises(ValueError, match=f"host KV tier.*{option}"):
            llm.generate([list(range(5, 45))], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
