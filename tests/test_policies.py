"""Policies as plain objects: decisions on real schedulers with fake model outputs, and through the
SchedulerView protocol alone; no processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from test_scheduler import make_request
from test_step_plan import CONFIG

from torch_shift.config import ModelConfig, SchedulerConfig
from torch_shift.engine.policies import (
    FlyingOptions,
    FlyingPolicy,
    RandomOptions,
    RandomPolicy,
    SeesawOptions,
    SeesawPolicy,
    ShiftOptions,
    ShiftPolicy,
    StaticPolicy,
    StepDecision,
    build_policy,
    policy_options,
)
from torch_shift.engine.request import RequestStatus
from torch_shift.engine.scheduler import Scheduler
from torch_shift.kv.block_manager import BlockManager
from torch_shift.parallel.layouts import build_deployment

BS = 4


def flying(num_replicas=2, num_blocks=64, config=CONFIG, budget=64, **options):
    deployment = build_deployment(config, dp=num_replicas, flying=True)
    policy = FlyingPolicy(deployment, FlyingOptions(**options))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256,
                                      policy="priority"),
                      [BlockManager(num_blocks, BS) for _ in range(num_replicas)], policy)
    return sched, policy


def step(sched):
    out = sched.schedule()
    sched.update_from_output(out, {e.request_id: [50] for e in out.scheduled if e.sample})
    return out


def layouts(out):
    return sorted(g.layout for g in out.groups if g.entries)


def test_flying_runs_tp_under_light_load_and_dp_under_a_burst_with_hysteresis():
    sched, policy = flying(num_replicas=2, dp_above=3, tp_below=1)
    sched.add_request(make_request("a", 5, max_tokens=40))
    assert layouts(step(sched)) == ["tp2@0"] and policy.mode == "tp"
    for i in range(6):  # 7 requests on 2 replicas: 3.5 per replica >= 3
        sched.add_request(make_request(f"b{i}", 5, max_tokens=3))
    out = step(sched)
    assert policy.mode == "dp" and layouts(out) == ["dp@0", "dp@1"]
    assert "a" in out.preempted_request_ids  # moved from width 2 to width 1: recomputed
    # the burst drains; at 2 per replica (between the thresholds) the mode holds
    while sched.num_unfinished > 2:
        step(sched)
        assert policy.mode == "dp"
    while sched.num_unfinished > 1 and sched.num_unfinished > 0:
        step(sched)
    step(sched)
    assert policy.mode == "tp" and policy.num_mode_switches == 2
    assert sched.requests["a"].replicas == (0, 1)  # back in TP


def test_flying_without_dp_above_keeps_its_tp_group_under_any_load_but_binds_priority_groups():
    """dp_above=None: load never splits the TP groups (where they out-serve their replicas at every load); a
    priority request still gets its group."""
    sched, policy = flying(num_replicas=4, dp_above=None, priority_width=2, priority_below=0)
    for i in range(12):  # 3 per replica, then more: a split at any finite dp_above up to 3
        sched.add_request(make_request(f"b{i}", 5, max_tokens=4))
    out = step(sched)
    assert policy.mode == "tp" and layouts(out) == ["tp4@0"]
    sched.add_request(make_request("urgent", 5, max_tokens=2, priority=-1))
    urgent_layouts = set()
    while sched.num_unfinished:
        out = step(sched)
        urgent_layouts |= {g.layout for g in out.groups for e in g.entries if e.request_id == "urgent"}
    assert urgent_layouts == {"tp2@0"} and policy.num_binds == 1
    assert policy.num_mode_switches == 0 and all(p.num_free_blocks == 64 for p in sched.pools)
    assert policy_options("flying", {"dp_above": None}) == FlyingOptions(dp_above=None)
    with pytest.raises(ValueError, match="tp_below <= dp_above"):
        FlyingOptions(dp_above=None, tp_below=-1)


def test_hard_preemption_pauses_dp_requests_with_their_kv():
    sched, policy = flying(num_replicas=4, dp_above=1, tp_below=0, priority_width=2)
    for i in range(8):
        sched.add_request(make_request(f"n{i}", 6, max_tokens=30))
    step(sched)
    assert policy.mode == "dp"
    on_first_pair = [r for r in sched.running if set(r.replicas) & {0, 1}]
    computed = {r.request_id: r.num_computed_tokens for r in on_first_pair}
    blocks = {r.request_id: [list(p.req_blocks[r.request_id]) for p in sched.pools if r.request_id in p.req_blocks]
              for r in on_first_pair}
    sched.add_request(make_request("urgent", 6, max_tokens=4, priority=-1))
    while "urgent" in sched.requests:
        out = step(sched)
        assert "tp2@0" in layouts(out) and not out.preempted_request_ids
        for r in on_first_pair:  # paused: not scheduled, blocks and progress kept
            assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == computed[r.request_id]
            assert [list(p.req_blocks[r.request_id]) for p in sched.pools
                    if r.request_id in p.req_blocks] == blocks[r.request_id]
    out = step(sched)  # released: the paused requests resume where they were
    assert "tp2@0" not in layouts(out)
    assert all(r.num_computed_tokens == computed[r.request_id] + 1 for r in on_first_pair)
    assert all(r.num_preemptions == 0 for r in on_first_pair)


def test_a_stream_of_priority_requests_never_starves_the_others():
    """With 2 replicas a priority group covers every replica: new requests share it, and requests it
    paused move into it after max_pause_steps (recomputed) instead of waiting for the stream to end."""
    sched, policy = flying(num_replicas=2, dp_above=1, tp_below=0, max_pause_steps=4)
    for i in range(2):
        sched.add_request(make_request(f"n{i}", 6, max_tokens=40))
    step(sched)
    assert policy.mode == "dp" and all(r.replicas in ((0,), (1,)) for r in sched.running)
    moved_at = None
    for k in range(30):  # a priority request in the system at every step
        if not any(r.priority < 0 for r in sched.requests.values()):
            sched.add_request(make_request(f"u{k}", 4, max_tokens=6, priority=-1))
        if k == 2:
            sched.add_request(make_request("late", 5, max_tokens=3))
        out = step(sched)
        assert layouts(out) == ["tp2@0"]  # the priority group, every step
        if moved_at is None and {"n0", "n1"} <= set(out.preempted_request_ids):
            moved_at = k
    assert moved_at is not None and moved_at <= 5  # paused for at most max_pause_steps, then moved
    assert sched.requests["n0"].replicas == (0, 1) and sched.requests["n0"].num_output_tokens > 10
    assert "late" not in sched.requests  # a new request shared the priority group and finished


def test_a_priority_request_takes_the_blocks_of_paused_ones_only_when_it_must():
    sched, _ = flying(num_replicas=2, num_blocks=8, dp_above=1, tp_below=0)
    for i in range(2):
        sched.add_request(make_request(f"n{i}", 28, max_tokens=4))  # 7 blocks of 8 on each replica
    step(sched)
    sched.add_request(make_request("urgent", 20, max_tokens=2, priority=-1))  # 3 blocks of 8 tokens per pool
    out = step(sched)
    assert layouts(out) == ["tp2@0"] and sorted(out.preempted_request_ids) == ["n0", "n1"]
    assert sched.requests["urgent"].replicas == (0, 1)


def test_soft_preemption_starts_in_dp_then_moves_to_tp_once_the_group_drained():
    sched, policy = flying(num_replicas=2, dp_above=1, tp_below=0, preemption="soft")
    for i in range(2):
        sched.add_request(make_request(f"n{i}", 6, max_tokens=3 + 2 * i))
    step(sched)
    assert policy.mode == "dp"
    sched.add_request(make_request("urgent", 6, max_tokens=10, priority=-1))
    out = step(sched)
    urgent = sched.requests["urgent"]
    assert urgent.replicas in ((0,), (1,)) and "tp2@0" not in layouts(out)  # started at once, in DP
    while "n0" in sched.requests or "n1" in sched.requests:
        assert "tp2@0" not in layouts(step(sched))  # the group's replicas drain
    out = step(sched)
    assert "urgent" in out.preempted_request_ids  # recomputed in TP at bind
    assert layouts(out) == ["tp2@0"] and urgent.replicas == (0, 1)


def test_a_request_too_long_for_one_pool_goes_to_the_smallest_group_that_holds_it():
    sched, _ = flying(num_replicas=4, num_blocks=16, dp_above=1, tp_below=0)  # 64 tokens per pool
    sched.add_request(make_request("short", 10, max_tokens=10))
    sched.add_request(make_request("long", 100, max_tokens=20))  # 120 tokens: two pools
    step(sched)
    assert sched.requests["long"].replicas in ((0, 1), (2, 3))
    while sched.has_unfinished_requests():
        step(sched)
    for pool in sched.pools:
        assert pool.num_free_blocks == pool.num_blocks


def test_widths_the_model_cannot_use_are_never_offered_and_asking_for_one_names_the_numbers():
    three_kv = ModelConfig.from_hf_dict({**CONFIG_DICT, "num_key_value_heads": 2})
    deployment = build_deployment(three_kv, dp=4, flying=True)
    assert sorted(layout.name for layout in deployment.layouts) == ["dp@0", "dp@1", "dp@2", "dp@3",
                                                                      "tp2@0", "tp2@2"]
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_width=4"):
        FlyingPolicy(deployment, FlyingOptions(tp_width=4))
    with pytest.raises(ValueError, match="power-of-two width up to the 4 replicas"):
        FlyingPolicy(deployment, FlyingOptions(priority_width=3))
    with pytest.raises(ValueError, match="tp_below <= dp_above"):
        FlyingOptions(dp_above=1, tp_below=2)


def test_policy_names_and_options_are_checked():
    deployment = build_deployment(CONFIG, sp=2, tp=2)
    assert isinstance(build_policy(None, deployment, ShiftOptions(16)), ShiftPolicy)
    with pytest.raises(ValueError, match="policy 'shift' has no option 'dp_above'"):
        policy_options("shift", {"dp_above": 2})
    with pytest.raises(ValueError, match="policy 'static' takes no options"):
        policy_options("static", {"dp_above": 2})
    with pytest.raises(ValueError, match="needs sp > 1"):
        build_policy("shift", build_deployment(CONFIG, dp=2), ShiftOptions(16))
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("fast", deployment)
    with pytest.raises(ValueError, match="unknown policy"):
        policy_options("fast", {})
    with pytest.raises(TypeError, match="dp_above must be a number"):
        policy_options("flying", {"dp_above": "4"})
    assert policy_options("flying", {"dp_above": 2}) == FlyingOptions(dp_above=2)
    assert isinstance(build_policy(None, build_deployment(CONFIG, dp=2)), StaticPolicy)


def test_shift_policy_is_paper_000_algorithm_3():
    policy = ShiftPolicy(build_deployment(CONFIG, sp=2, tp=2), ShiftOptions(threshold=16))
    assert [policy.finalize("base", n) for n in (1, 16, 17, 500)] == ["shift", "shift", "base", "base"]
    assert ShiftPolicy(build_deployment(CONFIG, sp=2, tp=2), ShiftOptions(threshold=None)).finalize("base", 1) \
        == "base"


def test_random_bindings_cover_the_replicas_without_overlap():
    policy = RandomPolicy(build_deployment(CONFIG, dp=4, flying=True))
    assert len(policy.bindings) == 5  # dp + dp or tp2 on each half (2 x 2), or tp4
    for binding in policy.bindings:
        replicas = [r for name in binding for r in policy.deployment[name].replicas]
        assert sorted(replicas) == [0, 1, 2, 3]


CONFIG_DICT = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
               "max_position_embeddings": 512}


# -- the policies through the SchedulerView protocol alone: no scheduler, no block manager ---------------

@dataclass
class FakeView:
    """A SchedulerView with every field set by the test (torch_shift.engine.policies.base)."""

    num_replicas: int = 2
    waiting_requests: list = field(default_factory=list)
    running: tuple = ()
    swapped_requests: list = field(default_factory=list)
    num_steps: int = 0
    tier_free_blocks: int = 0
    tier_num_blocks: int = 0
    free_blocks: tuple | None = None
    blocks_per_replica: int = 16
    block_size: int = BS
    config: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_batched_tokens=64,
                                                                               max_num_seqs=8, max_model_len=256))
    last_decision: StepDecision | None = None

    @property
    def waiting(self):
        return iter(self.waiting_requests)

    @property
    def num_waiting(self):
        return len(self.waiting_requests)

    def peek_waiting(self):
        return self.waiting_requests[0] if self.waiting_requests else None

    @property
    def num_running(self):
        return len(self.running)

    @property
    def swapped(self):
        return iter(self.swapped_requests)

    @property
    def num_swapped(self):
        return len(self.swapped_requests)

    @property
    def tier_usage(self):
        return 1 - self.tier_free_blocks / self.tier_num_blocks if self.tier_num_blocks else 0.0

    @property
    def num_seqs(self):
        seqs = [0] * self.num_replicas
        for request in self.running:
            for replica in request.replicas:
                seqs[replica] += 1
        return tuple(seqs)

    @property
    def remaining_tokens(self):
        remaining = [0] * self.num_replicas
        for request in self.running:
            for replica in request.replicas:
                remaining[replica] += request.num_prompt_tokens + request.max_tokens - request.num_computed_tokens
        return tuple(remaining)

    @property
    def num_free_blocks(self):
        return self.free_blocks or (self.blocks_per_replica,) * self.num_replicas

    @property
    def num_blocks(self):
        return (self.blocks_per_replica,) * self.num_replicas


def placed(rid, prompt, layout, replicas, kv_view="heads", computed=None, max_tokens=8, priority=0):
    request = make_request(rid, prompt, max_tokens=max_tokens, priority=priority)
    request.status = RequestStatus.RUNNING
    request.replicas, request.kv_layout, request.kv_view = tuple(replicas), layout, kv_view
    request.num_computed_tokens = request.num_tokens if computed is None else computed
    return request


def test_protocol_flying_switches_on_load_with_hysteresis_and_moves_the_other_width():
    policy = FlyingPolicy(build_deployment(CONFIG, dp=2, flying=True), FlyingOptions(dp_above=2, tp_below=1))
    view = FakeView(waiting_requests=[make_request("w", 4)])
    assert policy.decide(view) == StepDecision(("tp2@0",))
    a = placed("a", 4, "tp2@0", (0, 1))
    view = FakeView(running=(a,), waiting_requests=[make_request(f"w{i}", 4) for i in range(3)])
    decision = policy.decide(view)  # 4 requests on 2 replicas: 2 per replica >= dp_above
    assert policy.mode == "dp" and decision == StepDecision(("dp@0", "dp@1"), recompute=("a",))
    assert policy.route(make_request("x", 4), decision, view) == ["dp@0", "dp@1"]
    b, c = placed("b", 4, "dp@0", (0,)), placed("c", 4, "dp@1", (1,))
    view = FakeView(running=(b, c, placed("d", 4, "dp@1", (1,))))
    assert policy.route(make_request("y", 4), policy.decide(view), view) == ["dp@0", "dp@1"]  # fewer on replica 0
    assert policy.mode == "dp"  # 1.5 per replica: between the thresholds
    decision = policy.decide(FakeView(running=(b, c)))  # 1 per replica: back to TP, both recomputed there
    assert policy.mode == "tp" and decision == StepDecision(("tp2@0",), recompute=("b", "c"))
    assert policy.stats()["num_mode_switches"] == 2


def test_protocol_flying_counts_proposed_tokens_averaged_and_never_splits_for_a_lone_request():
    """Proposed tokens count in Flying's load, averaged over steps: requests proposing every step reach DP where
    the same requests without proposals stay in TP; a lone request whose proposals come and go never switches (it
    swung the load across both thresholds, and each switch recomputed it)."""
    options = FlyingOptions(dp_above=4, tp_below=1)
    lone = FlyingPolicy(build_deployment(CONFIG, dp=2, flying=True), options)
    a = placed("a", 4, "tp2@0", (0, 1))
    for i in range(64):
        a.spec_token_ids = [7] * 24 if i % 2 else []
        assert lone.decide(FakeView(running=(a,))) == StepDecision(("tp2@0",))
    assert lone.mode == "tp" and lone.stats()["num_mode_switches"] == 0
    for k, mode in ((0, "tp"), (3, "dp")):  # 4 requests on 2 replicas: 2 per replica, 8 with 3 proposed each
        policy = FlyingPolicy(build_deployment(CONFIG, dp=2, flying=True), options)
        running = tuple(placed(f"r{i}", 4, "tp2@0", (0, 1)) for i in range(4))
        for r in running:
            r.spec_token_ids = [7] * k
        for _ in range(32):
            policy.decide(FakeView(running=running))
        assert policy.mode == mode and policy.stats()["num_mode_switches"] == (mode == "dp")


def test_protocol_flying_binds_a_group_for_a_priority_or_a_too_long_request_and_pauses_then_moves():
    policy = FlyingPolicy(build_deployment(CONFIG, dp=4, flying=True),
                          FlyingOptions(tp_width=1, priority_width=2, max_pause_steps=3))
    urgent = make_request("urgent", 4, priority=-1)
    policy.on_add(urgent, FakeView(num_replicas=4))
    dp = [placed(f"r{i}", 4, f"dp@{i}", (i,)) for i in range(4)]
    view = FakeView(num_replicas=4, running=tuple(dp), waiting_requests=[urgent])
    decision = policy.decide(view)
    group = policy.pinned["urgent"]
    members = policy.deployment[group].replicas
    assert group in decision.layouts and decision.recompute == ()  # the DP requests there pause with their KV
    assert policy.route(urgent, decision, view) == [group]
    assert not set(members) & {r for n in policy.route(make_request("n", 4), decision, view)
                               for r in policy.deployment[n].replicas}  # new work goes elsewhere
    for step in range(1, 4):
        view.num_steps = step
        decision = policy.decide(view)
    assert sorted(decision.recompute) == sorted(f"r{m}" for m in members)  # paused too long: moved
    policy.on_finish(urgent)
    assert policy.decide(view).layouts == ("dp@0", "dp@1", "dp@2", "dp@3")

    policy = FlyingPolicy(build_deployment(CONFIG, dp=4, flying=True), FlyingOptions(tp_width=1))
    long_request = make_request("long", 16 * BS + 1, max_tokens=BS)  # two pools of 16 blocks hold it
    policy.on_add(long_request, FakeView(num_replicas=4))
    assert policy.needs == {"long": 2}


def seesaw(**options):
    return SeesawPolicy(build_deployment(CONFIG, pp=2, seesaw=True), SeesawOptions(**options))


def test_protocol_seesaw_prefills_until_the_tier_is_full_then_decodes_then_refills():
    policy = seesaw()
    tier = {"tier_num_blocks": 8, "num_replicas": 1}
    queue = [make_request("a", 2 * BS), make_request("b", 2 * BS)]
    decision = policy.decide(FakeView(waiting_requests=queue, tier_free_blocks=8, **tier))
    assert decision == StepDecision(("pp",), phase="prefill")
    view = FakeView(waiting_requests=queue, tier_free_blocks=8, **tier)
    assert policy.route(queue[0], decision, view) == ["pp"]
    # a prefilled under PP leaves for the tier; b would need 3 blocks once a's 2 are reserved: 3 <= 8 - 2
    done = placed("a", 2 * BS, "pp", (0,), kv_view="layers", computed=2 * BS)
    done.append_output_token(7)
    view = FakeView(running=(done,), waiting_requests=queue[1:], tier_free_blocks=8, **tier)
    decision = policy.decide(view)
    assert decision == StepDecision(("pp",), swap_out=("a",), phase="prefill")
    # the tier cannot take the next prompt: decode
    big = make_request("big", 9 * BS)
    view = FakeView(waiting_requests=[big], swapped_requests=[done], tier_free_blocks=6, **tier)
    assert policy.route(big, decision, view) == []
    assert policy.decide(view) == StepDecision(("tp",), phase="decode")
    # decoding from the tier: no refill while it holds KV (tiered); prefill_first refills at once
    view = FakeView(waiting_requests=[make_request("c", BS)], swapped_requests=[done], tier_free_blocks=6, **tier)
    assert policy.decide(view).phase == "decode"
    eager = seesaw(scheduling="prefill_first")
    eager.phase = "decode"
    assert eager.decide(view).phase == "prefill"
    # the tier drained: back to prefill
    view = FakeView(waiting_requests=[make_request("c", BS)], tier_free_blocks=8, **tier)
    assert policy.decide(view).phase == "prefill"
    assert policy.stats()["num_transitions"] == 2


def test_protocol_dp_routes_to_the_replica_with_the_fewest_tokens_left():
    """A new request goes where the least work is left (prompt tokens to compute, outputs up to max_tokens), not where
    the fewest requests are; equal work left: the fewest requests, then the most free blocks."""
    policy = StaticPolicy(build_deployment(CONFIG, dp=2))
    decision = policy.decide(FakeView())
    long_prompt = placed("long", 96, "dp@0", (0,), computed=16)  # 80 prompt tokens and 8 outputs left
    short = [placed(f"s{i}", 8, "dp@1", (1,), max_tokens=8) for i in range(3)]  # 8 outputs left each
    view = FakeView(running=(long_prompt, *short))
    assert view.num_seqs == (1, 3) and view.remaining_tokens == (88, 24)
    assert policy.route(make_request("x", 4), decision, view) == ["dp@1", "dp@0"]
    even = FakeView(running=(placed("a", 8, "dp@0", (0,), max_tokens=16), *short[:2]))
    assert even.remaining_tokens == (16, 16)
    assert policy.route(make_request("y", 4), decision, even) == ["dp@0", "dp@1"]  # one request against two
    assert policy.route(make_request("z", 4), decision, FakeView(free_blocks=(3, 9))) == ["dp@1", "dp@0"]


def test_dp_scheduler_places_requests_by_tokens_left():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256),
                      [BlockManager(64, BS) for _ in range(2)], StaticPolicy(build_deployment(CONFIG, dp=2)))
    sched.add_request(make_request("big", 40, max_tokens=4))
    for i in range(3):
        sched.add_request(make_request(f"s{i}", 4, max_tokens=4))
    assert sched.view.remaining_tokens == (0, 0)
    step(sched)
    # by request counts s2 would have joined "big" (one request against two)
    assert {rid: sched.requests[rid].replicas for rid in ("big", "s0", "s1", "s2")} == {
        "big": (0,), "s0": (1,), "s1": (1,), "s2": (1,)}
    assert sched.view.remaining_tokens == (44 - 40, 3 * (8 - 4))


def test_tokens_left_kept_through_admissions_and_preemptions():
    """While a step admits, the scheduler keeps the tokens left per replica by each placement and release instead of
    summing the running requests at every routing: both agree at every route, preemptions of victims included."""
    seen = []

    class Checking(StaticPolicy):
        def route(self, request, decision, view):
            fresh = [0, 0]
            for r in view.running:
                for replica in r.replicas:
                    fresh[replica] += r.num_prompt_tokens + r.max_tokens - r.num_computed_tokens
            assert view.remaining_tokens == tuple(fresh)
            seen.append(sched._remaining is not None)
            return super().route(request, decision, view)

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=256),
                      [BlockManager(12, BS) for _ in range(2)], Checking(build_deployment(CONFIG, dp=2)))
    for i in range(16):
        sched.add_request(make_request(f"r{i}", 3 + (7 * i) % 13, max_tokens=4 + i % 5))
    while sched.num_unfinished:
        step(sched)
    assert sched.num_preemptions > 0 and any(seen) and sched._remaining is None


def test_protocol_static_and_shift_decisions_need_no_view():
    deployment = build_deployment(CONFIG, dp=2)
    assert StaticPolicy(deployment).decide(FakeView()) == StepDecision(("dp@0", "dp@1"))
    shift = ShiftPolicy(build_deployment(CONFIG, sp=2, tp=2), ShiftOptions(threshold=8))
    assert shift.decide(FakeView(num_replicas=1)) == StepDecision(("base",))
    assert shift.route(make_request("a", 4), StepDecision(("base",)), FakeView(num_replicas=1)) == ["base"]


def test_protocol_random_binds_legal_layouts_and_moves_only_unbound_requests():
    policy = RandomPolicy(build_deployment(CONFIG, dp=4, flying=True), RandomOptions(seed=3, move_probability=1.0))
    running = (placed("a", 4, "dp@0", (0,)), placed("b", 4, "tp2@2", (2, 3)))
    for _ in range(20):
        view = FakeView(num_replicas=4, running=running)
        decision = policy.decide(view)
        assert decision.layouts in policy.bindings
        bound = {policy.deployment[name].replicas for name in decision.layouts}
        assert set(decision.recompute) == {r.request_id for r in running if r.replicas not in bound}
        assert sorted(policy.route(make_request("x", 4), decision, view)) == sorted(decision.layouts)


def test_a_layout_alone_with_work_borrows_the_idle_ranks_cores():
    """step_threads: a rank's share of the host's cores, all of them split over its layout's ranks when its
    layout is the step's only one (a DP replica or Flying's TP group beside idle ranks), None when idle."""
    from torch_shift.engine.model_runner import step_threads

    dp4 = build_deployment(ModelConfig.from_hf_dict({**CONFIG_DICT, "num_key_value_heads": 4}), dp=4, flying=True)
    replicas = [layout.name for layout in dp4.replica_layouts()]
    tp2 = next(layout for layout in dp4.layouts if len(layout.ranks) == 2 and 0 in layout.ranks)
    tp4 = next(layout for layout in dp4.layouts if len(layout.ranks) == 4)

    def alone(*names):  # a step of one token in each
        return [(name, 1) for name in names]

    assert step_threads(dp4, alone(*replicas[:1]), 0, 16) == 16
    assert step_threads(dp4, alone(*replicas[:1]), 1, 16) is None
    assert step_threads(dp4, alone(*replicas[:2]), 1, 16) == 4  # two replicas with work: each rank's own share
    assert step_threads(dp4, alone(tp2.name), 1, 16) == 8
    assert step_threads(dp4, alone(tp2.name, replicas[2]), 0, 16) == 4
    assert step_threads(dp4, alone(tp4.name), 3, 16) == 4
    assert step_threads(dp4, alone(*replicas[:1]), 0, 2) == 2  # more ranks than cores: at least one thread each
    assert step_threads(dp4, alone(*replicas), 3, 2) == 1


def test_sp_ranks_with_a_step_of_fewer_tokens_than_sp_ranks_borrow_the_others_cores():
    """Ulysses SP rank s holds n // SP tokens or one more: in a step of fewer tokens than SP ranks the ranks with
    rows (global rank = sp * TP + tp) take the host's cores split over them; the others attend on one thread. The
    warm-up compiles each such count (borrowed_thread_counts, the same list on every rank). Not with experts split
    over the SP ranks."""
    from torch_shift.engine.model_runner import borrowed_thread_counts, step_threads

    config = ModelConfig.from_hf_dict({**CONFIG_DICT, "num_key_value_heads": 4})
    sp2tp2 = build_deployment(config, sp=2, tp=2)
    base = sp2tp2["base"]
    assert base.working_ranks(1) == (0, 1) and base.working_ranks(2) == base.working_ranks(9) == (0, 1, 2, 3)
    assert [step_threads(sp2tp2, [("base", 1)], rank, 8) for rank in range(4)] == [4, 4, 1, 1]
    assert [step_threads(sp2tp2, [("base", 2)], rank, 8) for rank in range(4)] == [2, 2, 2, 2]
    assert [step_threads(sp2tp2, [("shift", 1)], rank, 8) for rank in range(4)] == [2, 2, 2, 2]  # full TP
    assert borrowed_thread_counts(sp2tp2, base, 8) == [{0: 4, 1: 4, 2: 1, 3: 1}]
    assert borrowed_thread_counts(sp2tp2, sp2tp2["shift"], 8) == []
    sp4 = build_deployment(config, sp=4)
    assert [step_threads(sp4, [("base", n)], 0, 4) for n in (1, 2, 3, 4)] == [4, 2, 1, 1]
    assert borrowed_thread_counts(sp4, sp4["base"], 4) == [{0: 4, 1: 1, 2: 1, 3: 1}, {0: 2, 1: 2, 2: 1, 3: 1}]
    assert borrowed_thread_counts(sp4, sp4["base"], 2) == [{0: 2, 1: 1, 2: 1, 3: 1}]  # more ranks than cores
    # experts split over the SP ranks: every rank runs every step's layers (their all-to-alls), nothing is lent
    moe = ModelConfig.from_hf_dict({**CONFIG_DICT, "num_key_value_heads": 4, "architectures": ["Qwen3MoeForCausalLM"],
                                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    ep = build_deployment(moe, sp=2, expert_parallel=True)
    assert ep["base"].working_ranks(1) == (0, 1) and borrowed_thread_counts(ep, ep["base"], 4) == []
