"""The planner's simulator against the real engine: the same trace, the same step times, the same plans.

The simulator is the engine's own rank-0 half (`LLMEngine.driver_only`) with a modelled forward; the real
engine runs the model on forked gloo ranks. Both are driven by `simulate`'s event loop on one virtual
clock, so their step plans (layouts, rows, tokens per request, blocks, tier copies) must agree exactly;
only the sampled token values differ (the simulator's filler token against the model's)."""

from __future__ import annotations

import logging
import random

import pytest

from torch_shift.bench.traffic import RequestSpec
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.planner import ModelShape, get_profile
from torch_shift.planner.simulate import ClockedEngine, CostModelTimer, FixedStepTimer, SimulatedEngine, simulate


def trace(num: int = 14, seed: int = 0, vocab: int = 512) -> list[RequestSpec]:
    """Bursts and gaps: the load (and Flying's bindings, Seesaw's phases) changes during the run."""
    rng = random.Random(seed)
    specs, t = [], 0.0
    for i in range(num):
        t += rng.choice([0.0, 0.0, 0.01, 0.2])
        specs.append(RequestSpec(f"r{i}", t, [rng.randrange(8, vocab) for _ in range(rng.randrange(1, 40))],
                                 rng.randrange(2, 9)))
    return specs


def signature(plan) -> tuple:
    """Everything in a step plan except the sampled tokens' values."""
    groups = tuple((g.layout, tuple(tuple(r.tolist()) for r in g.rows), tuple(g.num_scheduled.tolist()),
                    tuple(g.num_computed.tolist()), g.num_decodes, tuple(g.logits_counts.tolist()),
                    g.num_micro_batches) for g in plan.groups)
    deltas = tuple(sorted(
        (replica, tuple((n.row, len(n.token_ids), tuple(n.block_ids.tolist()), n.width) for n in d.new_rows),
         tuple(d.token_rows), len(d.tokens), tuple(d.block_rows), tuple(map(tuple, d.block_ids)))
        for replica, d in plan.deltas.items()))
    swaps = tuple((op.replica, op.layout, tuple(op.device_blocks), tuple(op.tier_blocks))
                  for op in (*plan.swap_outs, *plan.swap_ins))
    return groups, deltas, swaps


TIMES = {"dp@0": 0.010, "dp@1": 0.010, "tp2@0": 0.006, "pp": 0.012, "tp": 0.005, "single": 0.01}


def run_real(model_dir, engine_args: dict, specs):
    engine = ClockedEngine(EngineArgs(str(model_dir), **engine_args))
    try:
        engine.step_timer, engine.plan_log = FixedStepTimer(TIMES), []
        result = simulate(engine, specs)
        leaked = sum(p.num_blocks - p.num_free_blocks for p in engine.pools)
        return [signature(p) for p in engine.plan_log], result, leaked, engine.model_config, engine.pools[0].num_blocks
    finally:
        engine.shutdown()


def run_simulated(config: ModelConfig, engine_args: dict, specs, num_kv_blocks: int):
    engine = SimulatedEngine.simulated(EngineArgs("config-only", **engine_args), config, num_kv_blocks,
                                       FixedStepTimer(TIMES))
    engine.plan_log = []
    result = simulate(engine, specs)
    assert all(p.num_free_blocks == p.num_blocks for p in engine.pools)
    return [signature(p) for p in engine.plan_log], result


CASES = {
    "flying": {"dp": 2, "policy": "flying", "policy_config": {"dp_above": 2.0}, "block_size": 4,
               "num_kv_blocks": 40, "max_num_batched_tokens": 32},
    "seesaw": {"pp": 2, "policy": "seesaw", "block_size": 4, "num_kv_blocks": 24, "num_cpu_kv_blocks": 30,
               "max_num_batched_tokens": 32},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_simulator_makes_the_real_engines_step_plans(layers4, case):
    engine_args = CASES[case]
    specs = trace()
    real_plans, real, leaked, config, num_blocks = run_real(layers4, engine_args, specs)
    sim_plans, sim = run_simulated(config, engine_args, specs, num_blocks)
    assert leaked == 0
    assert len(real_plans) == len(sim_plans) and real_plans == sim_plans
    # the same clock: every request's arrival, first token and finish at the same virtual time
    assert [(r.request_id, r.first_token_s, r.finish_s, r.num_output_tokens) for r in real.requests] == \
        [(r.request_id, r.first_token_s, r.finish_s, r.num_output_tokens) for r in sim.requests]
    stats = sim.engine_stats
    if case == "flying":  # the load changed the bindings during the run
        assert {"dp@0", "tp2@0"} <= set(stats["steps_by_layout"]) and stats["num_switches"] > 0
    else:  # several prefill / decode rounds through the tier
        assert stats["num_transitions"] >= 2 and stats["num_swap_ins"] > 0


def test_a_change_to_the_scheduler_changes_the_engine_and_the_simulator_alike(llama):
    """Single device, in this process: a smaller token budget per step chunks prefills differently in both."""
    _, model_dir = llama
    specs = trace(8, seed=1)
    plans = {}
    for budget in (32, 12):
        # asynchronous scheduling asked for (a GPU's default): a clocked engine's steps run one after the other
        args = {"max_num_batched_tokens": budget, "block_size": 4, "num_kv_blocks": 64, "async_scheduling": True}
        real_plans, _, _, config, num_blocks = run_real(model_dir, args, specs)
        sim_plans, _ = run_simulated(config, args, specs, num_blocks)
        assert real_plans == sim_plans
        plans[budget] = sim_plans
    assert plans[32] != plans[12]


def test_data_parallel_replicas_that_idle_do_not_count_as_switches():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                                       "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512})
    specs = trace(10, seed=2)
    _, static = run_simulated(config, {"dp": 2}, specs, 64)
    layouts = {step.layouts for step in static.steps}
    assert {"dp@0", "dp@0+dp@1"} <= layouts and static.num_switches == 0
    _, flying = run_simulated(config, {"dp": 2, "policy": "flying", "policy_config": {"dp_above": 2.0}}, specs, 64)
    assert flying.num_switches > 0


def test_cost_model_steps_drive_the_clock():
    """With the cost model, a step's time is its priced plan: TTFT of a lone request is its prefill step."""
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                       "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                                       "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 4096})
    shape, hw = ModelShape.from_config(config, dtype="bf16"), get_profile("a10x2")
    from torch_shift.parallel.layouts import micro_batch_count
    from torch_shift.planner.cost import Layout, step_cost
    from torch_shift.planner.shape import Seq

    spec = RequestSpec("r0", 0.5, list(range(8, 8 + 300)), 3)
    for engine_args, layout in (({"tp": 2}, Layout("tp", tp=2)), ({"pp": 2}, Layout("pp", pp=2))):
        engine = SimulatedEngine.simulated(EngineArgs("config-only", **engine_args), config, 256,
                                           CostModelTimer(shape, hw, 16))
        result = simulate(engine, [spec])
        (record,) = result.requests
        if layout.kind == "pp":  # the engine cuts the prompt into micro-batches of near-equal tokens
            n = micro_batch_count(2, 300)
            cuts = [300 * m // n for m in range(n + 1)]
            pieces = [[Seq(hi - lo, lo, int(hi == 300))] for lo, hi in zip(cuts, cuts[1:])]
            prefill = step_cost(shape, hw, layout, [Seq(300, 0, 1)], micro_batches=pieces).total_s
            assert n >= 2
        else:
            prefill = step_cost(shape, hw, layout, [Seq(300, 0, 1)]).total_s
        decodes = [step_cost(shape, hw, layout, [Seq(1, context, 1)]).total_s for context in (300, 301)]
        assert record.first_token_s == pytest.approx(0.5 + prefill, rel=1e-9)
        assert record.finish_s == pytest.approx(0.5 + prefill + sum(decodes), rel=1e-9)
        assert record.tpot_s == pytest.approx(sum(decodes) / 2, rel=1e-9)


def test_a_replica_alone_with_work_is_priced_on_the_idle_replicas_cores():
    """DP-2: a lone request's steps borrow the idle rank's cores (model_runner.step_threads), so the simulator prices
    them on the profile's rates at twice a rank's threads; steps with work on both replicas at a rank's own."""
    from dataclasses import replace

    from test_planner import scaled_rates

    from torch_shift.planner.cost import Layout, step_cost
    from torch_shift.planner.shape import Seq

    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                       "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                                       "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 4096})
    shape, plain = ModelShape.from_config(config, dtype="bf16"), get_profile("a10x2")
    hw = replace(plain, borrowed={2: scaled_rates(plain, 2)})
    alone = RequestSpec("r0", 0.5, list(range(8, 8 + 300)), 3)
    pair = [RequestSpec(f"p{i}", 10.0, list(range(8, 8 + 300)), 3) for i in range(2)]
    engine = SimulatedEngine.simulated(EngineArgs("config-only", dp=2), config, 256, CostModelTimer(shape, hw, 16))
    records = {r.request_id: r for r in simulate(engine, [alone, *pair]).requests}
    borrowed, own = (step_cost(shape, profile, Layout("tp"), [Seq(300, 0, 1)]).total_s
                     for profile in (hw.borrowing(2), plain))
    assert borrowed < own
    assert records["r0"].first_token_s == pytest.approx(0.5 + borrowed, rel=1e-9)
    both = step_cost(shape, plain, Layout.dp_groups(1, 1), [Seq(300, 0, 1)] * 2, groups=[0, 1]).total_s
    assert records["p0"].first_token_s == pytest.approx(10.0 + both, rel=1e-9)


def test_a_simulated_engine_with_a_short_context_does_not_warn_as_a_server_would(caplog, monkeypatch):
    """The engine warns at start when its KV cache holds less than max_model_len (`serve` takes that as its
    context); the planner's simulated engines refuse such a candidate in the plan's own terms instead."""
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256})
    monkeypatch.setattr(logging.getLogger("torch_shift"), "propagate", True)  # the CLI's tests stop it
    with caplog.at_level(logging.WARNING, logger="torch_shift"):
        engine = SimulatedEngine.simulated(EngineArgs("config-only", block_size=4, max_model_len=256), config, 8,
                                           FixedStepTimer(TIMES))
    assert engine.max_context_tokens == 32 and "KV cache holds" not in caplog.text


def _speculative_work() -> tuple:
    """The speculative simulations' model (the 106M peer model's shape, its config only), its cost shape on two A10s,
    and four requests of 200 prompt tokens and 64 new ones."""
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                       "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                                       "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 4096})
    shape, hw = ModelShape.from_config(config, dtype="bf16"), get_profile("a10x2")
    specs = [RequestSpec(f"r{i}", 0.0, list(range(8 + i, 208 + i)), 64) for i in range(4)]
    return config, shape, hw, specs


def test_the_simulator_prices_speculative_steps():
    """With speculation, a decode step is priced with every proposed token (the weights are read once for all of
    them) and adds the accepted ones: fewer, slightly dearer steps. Each proposed token is accepted with probability
    0.7 until the first rejection: of 4 proposed, 0.7 + 0.7^2 + 0.7^3 + 0.7^4 = 1.77 accepted on average."""
    config, shape, hw, specs = _speculative_work()
    results = {}
    for name, extra, acceptance in (("plain", {}, 0.0), ("suffix", {"speculative_config": {
            "method": "suffix", "num_speculative_tokens": 4}}, 0.7)):
        engine = SimulatedEngine.simulated(EngineArgs("config-only", tp=2, **extra), config, 256,
                                           CostModelTimer(shape, hw, 16), spec_acceptance=acceptance, seed=1)
        results[name] = simulate(engine, specs)
        assert all(p.num_free_blocks == p.num_blocks for p in engine.pools)
    plain, spec = results["plain"], results["suffix"]
    assert [r.num_output_tokens for r in spec.requests] == [r.num_output_tokens for r in plain.requests]
    stats = spec.engine_stats["spec_decode"]
    assert 1.2 < stats["mean_accepted_length"] - 1 < 2.0  # fewer: proposals shorten near max_tokens
    assert len(spec.steps) < 0.6 * len(plain.steps)
    assert max(r.finish_s for r in spec.requests) < 0.7 * max(r.finish_s for r in plain.requests)


def test_a_speculative_simulation_does_not_depend_on_the_proposers_wall_time(monkeypatch):
    """The speculator prices a proposal with the proposer's time per ask, measured on the host's clock; a simulated
    engine's does not advance, so a slow (or loaded) machine makes the same plan. (Timed by the host, 0.1 ms more per
    ask took a third more simulated steps: the budget's bar rose with it.)"""
    import time

    from torch_shift.engine.spec_decode.suffix import SuffixProposer

    config, shape, hw, specs = _speculative_work()

    def run():
        engine = SimulatedEngine.simulated(EngineArgs("config-only", tp=2, speculative_config={
            "method": "suffix", "num_speculative_tokens": 4}), config, 256, CostModelTimer(shape, hw, 16),
            spec_acceptance=0.7, seed=1)
        result = simulate(engine, specs)
        return len(result.steps), [r.finish_s for r in result.requests]

    fast = run()
    propose = SuffixProposer.propose
    monkeypatch.setattr(SuffixProposer, "propose", lambda self, requests, max_tokens: time.sleep(0.002) or propose(
        self, requests, max_tokens))
    assert run() == fast
