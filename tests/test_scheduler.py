"""Scheduler driven by fake model outputs: token budget, chunked prefill, stops, aborts, preemption,
fairness, priority, prefix caching. No model and no tensors."""

from __future__ import annotations

import itertools
import random

import pytest
from test_block_manager import check_consistent

from torch_shift.config import SchedulerConfig
from torch_shift.engine.policies import SingleGroupPolicy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.engine.scheduler import Scheduler, SchedulerOutput
from torch_shift.kv.block_manager import BlockManager

BS = 4
EOS = 1
FAKE_TOKEN = 50
_fresh = itertools.count(1000)


# -- helpers --------------------------------------------------------------------------------------------

def make_scheduler(num_blocks: int = 256, budget: int = 64, max_seqs: int = 16, max_model_len: int = 4096,
                   policy: str = "fcfs", prefix: bool = True, block_size: int = BS) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len,
                             policy=policy)
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=prefix),
                     SingleGroupPolicy("single"))


def make_request(rid: str, prompt: int | list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None, eos: frozenset[int] = frozenset({EOS}), **params) -> Request:
    # an int asks for that many tokens never used before (no accidental prefix hits)
    tokens = [next(_fresh) for _ in range(prompt)] if isinstance(prompt, int) else list(prompt)
    return Request(rid, tokens, SamplingParams(**params), max_tokens, eos, arrival_time=arrival, priority=priority)


def add(sched: Scheduler, *requests: Request) -> list[Request]:
    for r in requests:
        sched.add_request(r)
    return list(requests)


def check_block_manager(bm: BlockManager) -> None:
    check_consistent(bm)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of every step plan."""
    cfg, bm = sched.config, sched.block_manager
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [e.request_id for e in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for e in out.scheduled:
        request = sched.requests[e.request_id]
        assert request.status == RequestStatus.RUNNING and request in sched.running
        assert e.num_tokens > 0
        assert e.num_computed_tokens + e.num_tokens == request.num_computed_tokens  # computed once scheduled
        assert e.token_ids == request.all_token_ids[e.num_computed_tokens:e.num_computed_tokens + e.num_tokens]
        assert e.sample == (request.num_computed_tokens == request.num_tokens)
        assert request.num_output_placeholders == e.sample
        assert len(e.block_table) * bm.block_size >= e.num_computed_tokens + e.num_tokens
        assert e.block_table == bm.block_table(e.request_id)
    for rid in out.preempted_request_ids:
        assert sched.requests[rid].status == RequestStatus.PREEMPTED
        assert bm.block_table(rid) == []
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
    check_block_manager(bm)


def constant_model(out: SchedulerOutput) -> dict[str, list[int]]:
    return {e.request_id: [FAKE_TOKEN] for e in out.scheduled if e.sample}


def step(sched: Scheduler, model=constant_model) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    check_step(sched, out)
    updated = sched.update_from_output(out, model(out))
    check_block_manager(sched.block_manager)
    return out, updated


def run_all(sched: Scheduler, model=constant_model, max_steps: int = 5000, on_step=None) -> list[str]:
    """Step until every request finishes; return the request ids in finish order."""
    finished: list[str] = []
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, updated = step(sched, model)
        assert not out.is_empty or out.preempted_request_ids, "no progress"
        finished += [r.request_id for r in updated if r.status.finished]
        if on_step is not None:
            on_step(n, out)
    else:
        raise AssertionError(f"unfinished after {max_steps} steps: {sorted(sched.requests)}")
    assert_no_leak(sched)
    return finished


def assert_no_leak(sched: Scheduler) -> None:
    bm = sched.block_manager
    check_block_manager(bm)
    assert bm.req_blocks == {}
    assert bm.num_free_blocks == bm.num_blocks


def entry(out: SchedulerOutput, rid: str):
    return next((e for e in out.scheduled if e.request_id == rid), None)


def _mix(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 7) % (2**61 - 1)


def reference_next(tokens: list[int]) -> int:
    state = 0
    for t in tokens:
        state = _mix(state, t)
    return 10 + state % 997  # never EOS


class PagedFakeModel:
    """A deterministic "model": next token = f(all previous tokens). It reads the previous state from
    and writes each position's state to a fake paged KV cache through the entry's block table, so a
    wrong block table, a stale prefix hit or a block reused while still owned changes the output."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        bs = self.sched.block_manager.block_size
        sampled = {}
        for e in out.scheduled:
            pos = e.num_computed_tokens
            state = self.kv[(e.block_table[(pos - 1) // bs], (pos - 1) % bs)] if pos else 0
            states = []
            for t in e.token_ids:
                state = _mix(state, t)
                self.kv[(e.block_table[pos // bs], pos % bs)] = state
                states.append(state)
                pos += 1
            if e.sample:
                sampled[e.request_id] = fake_draws(e, states)
        # the cache agrees with recomputing from the tokens
        for e in out.scheduled:
            request = self.sched.requests.get(e.request_id)
            if e.sample and request is not None:  # (None: aborted while the step ran)
                assert sampled[e.request_id][0] == reference_next(request.all_token_ids)
        return sampled


def fake_draws(entry, states: list[int]) -> list[int]:
    """A fake model's draws from the states at an entry's positions: the next token, or with proposed tokens
    the accepted ones and one more (the draw at each position, up to the first that differs)."""
    proposed = entry.spec_token_ids
    drawn = []
    for position, state in enumerate(states[len(states) - 1 - len(proposed):]):
        drawn.append(10 + state % 997)
        if position >= len(proposed) or drawn[-1] != proposed[position]:
            break
    return drawn


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(reference_next(tokens))
    return tokens[len(prompt):]


def run_with_paged_model(sched: Scheduler, requests: list[Request], **kwargs) -> dict[str, list[int]]:
    add(sched, *requests)
    run_all(sched, PagedFakeModel(sched), **kwargs)
    return {r.request_id: r.output_token_ids for r in requests}


# -- budget, chunking, progress -------------------------------------------------------------------------

def test_token_budget_and_max_num_seqs_respected_every_step():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=64, budget=24, max_seqs=5)
    add(sched, *[make_request(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 12)) for i in range(40)])
    full_steps = []

    def on_step(n, out):
        assert out.num_scheduled_tokens <= 24
        assert len(sched.running) <= 5 and len(out.scheduled) <= 5
        full_steps.append(out.num_scheduled_tokens == 24)

    run_all(sched, on_step=on_step)
    assert any(full_steps)  # the budget was actually binding


def test_long_prompt_is_chunked_and_samples_only_on_last_chunk():
    sched = make_scheduler(budget=16)
    (r,) = add(sched, make_request("a", 40, max_tokens=2))
    chunks = []
    for expected_start in (0, 16, 32):
        out, updated = step(sched)
        e = entry(out, "a")
        assert e.num_computed_tokens == expected_start
        assert r.num_computed_tokens == expected_start + e.num_tokens
        chunks.append((e.num_tokens, e.sample))
    assert chunks == [(16, False), (16, False), (8, True)]
    assert r.output_token_ids == [FAKE_TOKEN]
    out, _ = step(sched)  # decode: one token
    assert [(e.num_tokens, e.sample) for e in out.scheduled] == [(1, True)]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_computed_tokens == 41
    assert_no_leak(sched)


def test_chunk_of_exact_budget_then_one_token():
    sched = make_scheduler(budget=8)
    (r,) = add(sched, make_request("a", 9, max_tokens=1))
    out, _ = step(sched)
    assert entry(out, "a").num_tokens == 8 and not entry(out, "a").sample
    out, _ = step(sched)
    assert entry(out, "a").num_tokens == 1 and entry(out, "a").sample
    assert r.status.finished
    assert_no_leak(sched)


def test_decodes_and_a_prefill_chunk_mix_in_one_step():
    sched = make_scheduler(budget=10)
    a, b = add(sched, make_request("a", 3, max_tokens=10), make_request("b", 4, max_tokens=10))
    step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 1
    (c,) = add(sched, make_request("c", 30, max_tokens=2))
    out, _ = step(sched)
    assert [(e.request_id, e.num_tokens, e.sample) for e in out.scheduled] == [
        ("a", 1, True), ("b", 1, True), ("c", 8, False)]
    assert out.num_scheduled_tokens == 10
    out, _ = step(sched)
    assert [(e.request_id, e.num_tokens, e.sample) for e in out.scheduled] == [
        ("a", 1, True), ("b", 1, True), ("c", 8, False)]
    assert c.num_computed_tokens == 16 and a.num_computed_tokens == 5


def test_num_computed_tokens_advances_to_the_sequence_length():
    sched = make_scheduler(budget=7)
    (r,) = add(sched, make_request("a", 20, max_tokens=5))
    seen = []
    while sched.has_unfinished_requests():
        before = r.num_computed_tokens
        out, _ = step(sched)
        assert r.num_computed_tokens == before + entry(out, "a").num_tokens
        seen.append(r.num_computed_tokens)
    assert seen == [7, 14, 20, 21, 22, 23, 24]
    assert r.num_tokens == 25 and r.output_token_ids == [FAKE_TOKEN] * 5


def test_waiting_requests_beyond_max_num_seqs_wait():
    sched = make_scheduler(budget=100, max_seqs=2)
    add(sched, *[make_request(f"r{i}", 3, max_tokens=3) for i in range(4)])
    out, _ = step(sched)
    assert [e.request_id for e in out.scheduled] == ["r0", "r1"]
    assert len(sched.waiting) == 2
    run_all(sched)


# -- stopping -------------------------------------------------------------------------------------------

def scripted_model(script: dict[str, list[int]]):
    """Each request samples the next token of its script."""
    def model(out):
        return {e.request_id: [script[e.request_id].pop(0)] for e in out.scheduled if e.sample}
    return model


def test_finish_by_max_tokens():
    sched = make_scheduler()
    (r,) = add(sched, make_request("a", 5, max_tokens=3))
    run_all(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [FAKE_TOKEN] * 3


def test_finish_by_eos():
    sched = make_scheduler()
    r, s = add(sched, make_request("a", 5, max_tokens=10), make_request("b", 5, max_tokens=10))
    run_all(sched, scripted_model({"a": [7, 8, EOS, 9], "b": [7] * 10}))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7, 8, EOS]
    assert r.stop_reason is None
    assert s.status == RequestStatus.FINISHED_LENGTH and s.num_output_tokens == 10


def test_eos_ignored_with_ignore_eos():
    sched = make_scheduler()
    (r,) = add(sched, make_request("a", 5, max_tokens=3, ignore_eos=True))
    run_all(sched, scripted_model({"a": [EOS, EOS, EOS]}))
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [EOS] * 3


def test_finish_by_stop_token_ids():
    sched = make_scheduler()
    (r,) = add(sched, make_request("a", 5, max_tokens=10, stop_token_ids=[42, 43]))
    run_all(sched, scripted_model({"a": [7, 43, 9]}))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7, 43]
    assert r.stop_reason == 43


def test_min_tokens_defers_eos_and_stop_tokens():
    sched = make_scheduler()
    a, b = add(sched, make_request("a", 5, max_tokens=10, min_tokens=3),
               make_request("b", 5, max_tokens=10, min_tokens=2, stop_token_ids=[42]))
    run_all(sched, scripted_model({"a": [EOS, EOS, EOS, 9], "b": [42, 42, 9]}))
    assert a.output_token_ids == [EOS, EOS, EOS] and a.status == RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == [42, 42] and b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 42


def test_finish_at_max_model_len():
    sched = make_scheduler(max_model_len=8)
    (r,) = add(sched, make_request("a", 5, max_tokens=100))
    run_all(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_finished_requests_leave_the_scheduler():
    sched = make_scheduler()
    add(sched, make_request("a", 5, max_tokens=1), make_request("b", 5, max_tokens=3))
    step(sched)
    assert set(sched.requests) == {"b"} and [r.request_id for r in sched.running] == ["b"]
    assert sched.num_unfinished == 1


# -- aborts ---------------------------------------------------------------------------------------------

def test_abort_waiting_running_and_in_flight_requests():
    sched = make_scheduler(budget=8, max_seqs=2)
    a, b, c, d = add(sched, *[make_request(x, 6, max_tokens=20) for x in "abcd"])
    step(sched)  # a fully, b partly (budget 8)
    assert a.status == b.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    # a waiting request
    assert sched.finish_request("c", RequestStatus.FINISHED_ABORTED) is c
    assert c.status == RequestStatus.FINISHED_ABORTED and c not in list(sched.waiting)
    # a running request
    held = sched.block_manager.num_free_blocks
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a not in sched.running
    assert sched.block_manager.block_table("a") == []
    assert sched.block_manager.num_free_blocks == held + 2
    # a request aborted while its step runs: the update skips it
    out = sched.schedule()
    assert entry(out, "b") is not None
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    updated = sched.update_from_output(out, constant_model(out))
    assert b not in updated and b.num_output_tokens <= 1
    assert sched.block_manager.block_table("b") == []
    # unknown and already finished ids
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert sched.finish_request("zz", RequestStatus.FINISHED_ABORTED) is None
    run_all(sched)
    assert d.status == RequestStatus.FINISHED_LENGTH


def test_abort_everything_leaves_no_leak():
    sched = make_scheduler(num_blocks=32, budget=16, max_seqs=4)
    add(sched, *[make_request(f"r{i}", 9, max_tokens=30) for i in range(10)])
    for _ in range(3):
        step(sched)
    assert sched.running and len(sched.waiting)
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert not sched.running and len(sched.waiting) == 0 and not sched.has_unfinished_requests()
    assert_no_leak(sched)
    assert sched.schedule().is_empty


# -- preemption -----------------------------------------------------------------------------------------

def test_preemption_when_blocks_run_out_goes_to_the_front():
    # 4 blocks of 4 tokens: a and b each start with 2 blocks and both grow
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b, c = add(sched, make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8),
                  make_request("c", 2, max_tokens=1))
    out, _ = step(sched)
    assert [e.request_id for e in out.scheduled] == ["a", "b"]  # c does not fit
    out, _ = step(sched)  # a needs a third block: b, the latest admitted, is preempted
    assert out.preempted_request_ids == ["b"]
    assert [e.request_id for e in out.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]  # in front of the request that waited longer
    assert b.output_token_ids == [FAKE_TOKEN]  # what it generated is kept
    assert sched.num_preemptions == 1
    run_all(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8 and c.num_output_tokens == 1


def test_preempted_request_is_recomputed_from_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, budget=64, prefix=False)
    a, b = add(sched, make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8))
    for _ in range(2):
        out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    generated = list(b.output_token_ids)
    while b.status != RequestStatus.RUNNING:
        out, _ = step(sched)
    e = entry(out, "b")
    assert e.num_computed_tokens == 0
    assert e.token_ids == b.prompt_token_ids + generated
    assert e.sample  # the whole sequence fits in the budget: sample the next token
    assert b.output_token_ids[:len(generated)] == generated and b.num_output_tokens == len(generated) + 1


def test_several_preempted_requests_keep_their_order():
    # three one-block prompts fill the pool; when a grows, c is preempted for it, then b finds no
    # block and, being last, preempts itself
    sched = make_scheduler(num_blocks=3, budget=64)
    a, b, c = add(sched, *[make_request(x, 4, max_tokens=8) for x in "abc"])
    step(sched)
    out, _ = step(sched)
    assert out.preempted_request_ids == ["c", "b"]
    assert [e.request_id for e in out.scheduled] == ["a"]
    assert list(sched.waiting) == [b, c]  # back at the front in their admission order
    run_all(sched)
    assert all(r.num_output_tokens == 8 for r in (a, b, c))


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_keeps_outputs_identical(prefix):
    rng = random.Random(7)
    specs = [(rng.sample(range(10, 60), rng.randint(1, 14)), rng.randint(1, 20)) for _ in range(12)]
    specs += [(specs[0][0] + [3, 4], 6), (list(specs[1][0]), 9)]  # shared prefixes

    def requests():
        return [make_request(f"r{i}", p, max_tokens=n) for i, (p, n) in enumerate(specs)]

    big = make_scheduler(num_blocks=512, budget=16, max_seqs=8, prefix=prefix)
    small = make_scheduler(num_blocks=9, budget=16, max_seqs=8, prefix=prefix)
    expected = run_with_paged_model(big, requests())
    got = run_with_paged_model(small, requests())
    assert big.num_preemptions == 0 and small.num_preemptions > 0
    assert got == expected
    assert expected == {f"r{i}": reference_outputs(p, n) for i, (p, n) in enumerate(specs)}


def test_random_workload_with_aborts_leaves_no_leak():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=12, budget=12, max_seqs=6)
    model = PagedFakeModel(sched)
    n = 0
    for i in range(300):
        if n < 60 and rng.random() < 0.4:
            prompt = [rng.randint(10, 14) for _ in range(rng.randint(1, 12))]
            sched.add_request(make_request(f"r{n}", prompt, max_tokens=rng.randint(1, 12)))
            n += 1
        if sched.requests and rng.random() < 0.1:  # abort anyone: waiting, running or preempted
            sched.finish_request(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        check_step(sched, out)
        if sched.requests and rng.random() < 0.1:  # abort while the step runs
            sched.finish_request(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        sched.update_from_output(out, model(out))
        check_block_manager(sched.block_manager)
    assert sched.num_preemptions > 0
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert_no_leak(sched)


def test_abort_of_a_preempted_request_frees_everything():
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = add(sched, make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8))
    for _ in range(2):
        out, _ = step(sched)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and len(sched.waiting) == 0
    run_all(sched)
    assert a.num_output_tokens == 8


# -- fairness -------------------------------------------------------------------------------------------

def test_fcfs_long_queue_admits_in_arrival_order_and_everyone_finishes():
    sched = make_scheduler(num_blocks=64, budget=12, max_seqs=6)
    reqs = add(sched, *[make_request(f"r{i:03d}", 5, max_tokens=3) for i in range(200)])
    admitted: list[str] = []
    first_step: dict[str, int] = {}

    def on_step(n, out):
        for e in out.scheduled:
            if e.request_id not in first_step:
                first_step[e.request_id] = n
                admitted.append(e.request_id)

    finished = run_all(sched, on_step=on_step, max_steps=2000)
    ids = [r.request_id for r in reqs]
    # admitted in arrival order: nobody starts in an earlier step than a request before it (within a step a
    # batch lists one-token entries first)
    assert sorted(admitted) == ids and [first_step[rid] for rid in ids] == sorted(first_step[rid] for rid in ids)
    assert finished == ids
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    # the queue drains at a steady pace: request k starts within a bounded number of steps of k
    for k, rid in enumerate(ids):
        assert first_step[rid] <= k + 5


def test_head_of_queue_is_not_overtaken():
    # the head needs more blocks than are free; a small request behind it must not jump ahead
    sched = make_scheduler(num_blocks=6, budget=64)
    (a,) = add(sched, make_request("a", 16, max_tokens=4))
    step(sched)  # a holds 4 blocks and needs a fifth
    big, small = add(sched, make_request("big", 12, max_tokens=1), make_request("small", 1, max_tokens=1))
    out, _ = step(sched)
    assert [e.request_id for e in out.scheduled] == ["a"]
    first_step: dict[str, int] = {}
    run_all(sched, on_step=lambda n, out: [first_step.setdefault(e.request_id, n) for e in out.scheduled])
    assert first_step["big"] <= first_step["small"]


# -- priority -------------------------------------------------------------------------------------------

def test_priority_admits_lower_values_first_then_arrival():
    sched = make_scheduler(budget=64, max_seqs=1, policy="priority")
    add(sched, make_request("p5", 3, max_tokens=1, priority=5, arrival=1.0),
        make_request("p1_late", 3, max_tokens=1, priority=1, arrival=3.0),
        make_request("p1_early", 3, max_tokens=1, priority=1, arrival=2.0),
        make_request("p0", 3, max_tokens=1, priority=0, arrival=4.0))
    assert [r.request_id for r in sched.waiting] == ["p0", "p1_early", "p1_late", "p5"]
    order = []
    run_all(sched, on_step=lambda n, out: order.extend(e.request_id for e in out.scheduled))
    assert order == ["p0", "p1_early", "p1_late", "p5"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(budget=64, max_seqs=1)
    add(sched, make_request("a", 3, max_tokens=1, priority=9), make_request("b", 3, max_tokens=1, priority=0))
    out, _ = step(sched)
    assert [e.request_id for e in out.scheduled] == ["a"]


def grow_until_preemption(sched: Scheduler, max_steps: int = 50) -> SchedulerOutput:
    for _ in range(max_steps):
        out, _ = step(sched)
        if out.preempted_request_ids:
            return out
    raise AssertionError("no preemption")


def test_priority_preempts_the_worst_priority_running_request():
    # running order [good, bad]: good grows first and finds no block
    sched = make_scheduler(num_blocks=5, budget=64, policy="priority")
    good, mid, bad = add(sched, make_request("good", 4, max_tokens=20, priority=0, arrival=1.0),
                         make_request("mid", 4, max_tokens=20, priority=1, arrival=2.0),
                         make_request("bad", 2, max_tokens=20, priority=2, arrival=0.0))
    out = grow_until_preemption(sched)
    assert out.preempted_request_ids[0] == "bad"
    assert good.status == RequestStatus.RUNNING and good.num_preemptions == 0


def test_priority_preempts_the_worst_even_if_it_runs_ahead():
    # "bad" arrives first and runs alone; "good" arrives later, so it sits behind "bad" in the running
    # list. When good needs a block, the worst-priority running request (bad) must give way.
    sched = make_scheduler(num_blocks=3, budget=64, policy="priority")
    (bad,) = add(sched, make_request("bad", 4, max_tokens=20, priority=5, arrival=0.0))
    step(sched)  # bad: 5 tokens, 1 computed block
    (good,) = add(sched, make_request("good", 4, max_tokens=20, priority=0, arrival=1.0))
    step(sched)  # bad grows to 2 blocks, good takes the last one
    assert [r.request_id for r in sched.running] == ["bad", "good"]
    assert sched.block_manager.num_free_blocks == 0
    out, _ = step(sched)  # good needs a second block
    assert out.preempted_request_ids == ["bad"]
    assert entry(out, "good") is not None and entry(out, "bad") is None
    assert good.status == RequestStatus.RUNNING and good.num_preemptions == 0
    assert bad.status == RequestStatus.PREEMPTED


def test_priority_self_preemption_does_not_stall_better_requests():
    # running order [bad, good]; bad needs a block, none is free, and bad is the worst: it preempts
    # itself. Its block is free now, so good must still run this step (an empty plan with running
    # requests trips the engine's "running requests but nothing scheduled" assertion).
    sched = make_scheduler(num_blocks=3, budget=64, policy="priority")
    (bad,) = add(sched, make_request("bad", 3, max_tokens=20, priority=5, arrival=0.0))
    step(sched)  # bad: 4 tokens in 1 block
    (good,) = add(sched, make_request("good", 8, max_tokens=20, priority=0, arrival=1.0))
    step(sched)  # bad fills its block, good takes the other two
    assert [r.request_id for r in sched.running] == ["bad", "good"]
    assert sched.block_manager.num_free_blocks == 0
    out, _ = step(sched)  # bad needs a second block
    assert out.preempted_request_ids == ["bad"]
    assert [e.request_id for e in out.scheduled] == ["good"]
    assert not (out.is_empty and sched.running)


def test_priority_preempted_request_returns_by_priority():
    sched = make_scheduler(num_blocks=4, budget=64, policy="priority")
    a, b = add(sched, make_request("a", 6, max_tokens=8, priority=0, arrival=0.0),
               make_request("b", 6, max_tokens=8, priority=1, arrival=1.0))
    out = grow_until_preemption(sched)
    assert out.preempted_request_ids == ["b"]
    (c,) = add(sched, make_request("c", 2, max_tokens=1, priority=3, arrival=2.0))
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    readmitted = []

    def on_step(n, out):
        readmitted.extend(e.request_id for e in out.scheduled if e.num_computed_tokens == 0)

    run_all(sched, on_step=on_step)
    assert readmitted == ["b", "c"]


# -- prefix caching -------------------------------------------------------------------------------------

P10 = list(range(100, 110))

def test_prefix_cache_hit_reduces_scheduled_tokens():
    sched = make_scheduler(budget=64)
    (a,) = add(sched, make_request("a", P10, max_tokens=1))
    out, _ = step(sched)
    assert entry(out, "a").num_tokens == 10 and a.num_cached_tokens == 0
    (b,) = add(sched, make_request("b", P10, max_tokens=1))
    out, _ = step(sched)
    e = entry(out, "b")
    assert e.num_computed_tokens == 8 and e.num_tokens == 2 and e.sample
    assert e.token_ids == b.prompt_token_ids[8:]
    assert b.num_cached_tokens == 8
    assert sched.block_manager.num_prefix_hits == 8
    assert_no_leak(sched)


def test_prefix_hit_of_a_running_request_shares_its_blocks():
    sched = make_scheduler(budget=64)
    (a,) = add(sched, make_request("a", P10[:9], max_tokens=5))
    step(sched)
    (b,) = add(sched, make_request("b", P10[:9], max_tokens=5))
    out, _ = step(sched)
    assert entry(out, "b").num_tokens == 1
    bm = sched.block_manager
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    run_all(sched)


def test_identical_prompts_in_one_step_do_not_hit():
    sched = make_scheduler(budget=64)
    add(sched, make_request("a", P10, max_tokens=1), make_request("b", P10, max_tokens=1))
    out, _ = step(sched)
    assert [e.num_tokens for e in out.scheduled] == [10, 10]


def test_no_prefix_hit_when_disabled():
    sched = make_scheduler(budget=64, prefix=False)
    add(sched, make_request("a", P10, max_tokens=1))
    step(sched)
    (b,) = add(sched, make_request("b", P10, max_tokens=1))
    out, _ = step(sched)
    assert entry(out, "b").num_tokens == 10 and b.num_cached_tokens == 0


def test_prompt_logprobs_request_skips_prefix_hits():
    sched = make_scheduler(budget=64)
    add(sched, make_request("a", P10, max_tokens=1))
    step(sched)
    (b,) = add(sched, make_request("b", P10, max_tokens=1, prompt_logprobs=1))
    out, _ = step(sched)
    e = entry(out, "b")
    assert e.num_computed_tokens == 0 and e.num_tokens == 10 and e.prompt_logprobs
    assert b.num_cached_tokens == 0
    # a request without prompt logprobs does hit
    (c,) = add(sched, make_request("c", P10, max_tokens=1))
    out, _ = step(sched)
    assert entry(out, "c").num_tokens == 2 and not entry(out, "c").prompt_logprobs


def test_prefix_hit_of_partially_cached_chunked_prompt():
    # a long prompt computed in chunks registers its full blocks as they are computed
    sched = make_scheduler(budget=8)
    (a,) = add(sched, make_request("a", list(range(100, 120)), max_tokens=1))
    step(sched)  # 8 tokens computed: 2 blocks cached
    (b,) = add(sched, make_request("b", list(range(100, 110)), max_tokens=1))
    step(sched)  # a takes the whole budget
    assert b.status == RequestStatus.WAITING
    out, _ = step(sched)  # a: last 4 tokens; b: hits the first 2 blocks of a
    e = entry(out, "b")
    assert e.num_computed_tokens == 8 and e.num_tokens == 2 and b.num_cached_tokens == 8
    run_all(sched)


def test_prefix_cache_outputs_match_without_cache():
    shared = list(range(200, 213))
    specs = [(shared + [i], 5) for i in range(6)] + [(shared, 4), (shared[:5], 3)]

    def outputs(prefix):
        sched = make_scheduler(num_blocks=64, budget=10, max_seqs=3, prefix=prefix)
        reqs = [make_request(f"r{i}", p, max_tokens=n) for i, (p, n) in enumerate(specs)]
        return run_with_paged_model(sched, reqs), sched

    cached, sched = outputs(True)
    plain, _ = outputs(False)
    assert cached == plain
    assert sched.block_manager.num_prefix_hits > 0


def test_priority_ties_never_leave_a_step_empty():
    """Equal priority and equal arrival time (n > 1 children, or a caller's shared timestamp): the
    preempted request is the last running one, so the others keep running."""
    sched = make_scheduler(num_blocks=6, budget=64, policy="priority")
    requests = [make_request(f"r{i}", 7, max_tokens=12, priority=1) for i in range(3)]
    for r in requests:
        r.arrival_time = 1.0
    add(sched, *requests)
    for _ in range(60):
        out, _ = step(sched)
        if sched.running:
            assert out.scheduled, "running requests but an empty step"
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests() and sched.num_preemptions > 0
    assert_no_leak(sched)
