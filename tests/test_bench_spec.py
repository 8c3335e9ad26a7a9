"""bench_spec.py's widened target: the default model with MLPs widened by neurons the down projection multiplies by
zero computes the same function (the benchmark's premise for its weight-bound rows); the engines' order prompt by
prompt (spec_work.in_turn) balanced; a prompt's TPOT with its prefix cached alike in both timed runs; engines of
several ranks up together, each in a process of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torch_shift import LLM, SamplingParams
from torch_shift.models.default import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import spec_work  # noqa: E402
from bench_spec import widened  # noqa: E402
from spec_work import in_turn  # noqa: E402


def test_a_widened_model_gives_the_default_models_tokens(tmp_path):
    model_dir = widened(default_model_dir(), tmp_path / "widened", 1536)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["And God said", "In the beginning"]
    expected = [o.outputs[0].token_ids for o in LLM(compile=False).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(model_dir), compile=False)
    assert llm.engine.config.model.intermediate_size == 1536
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_engines_take_every_place_and_follow_every_other_engine_alike():
    """A Williams square: over n prompts (2n for an odd n) each engine runs once in each place and right after each
    other engine once (twice for an odd n)."""
    for num_engines in range(1, 7):
        names = [f"e{i}" for i in range(num_engines)]
        rows = num_engines if num_engines % 2 == 0 else 2 * num_engines
        orders = [in_turn(names, index) for index in range(rows)]
        assert all(sorted(order) == names for order in orders)
        assert orders == [in_turn(names, index + rows) for index in range(rows)]
        times = rows // num_engines
        for place in range(num_engines):
            assert sorted(order[place] for order in orders) == sorted(names * times)
        follows = [(a, b) for order in orders for a, b in zip(order, order[1:])]
        assert sorted(follows) == sorted([(a, b) for a in names for b in names if a != b] * times)


def test_a_prompts_tpot_counts_no_prefill_that_a_prefix_cache_saved(monkeypatch):
    """An engine that caches prefixes prefills a prompt once; `tpot` times its run of one token and its full run from
    the same cache, so that what is left is decode time alone (a clock moved by the engine's modelled work)."""
    prefill_s, cached_prefill_s, decode_s = 0.100, 0.008, 0.004
    clock = [0.0]

    class Caching:
        def __init__(self):
            self.cached = set()

        def generate(self, prompts, max_tokens, temperature, seed, ignore_eos):
            (prompt,) = prompts
            clock[0] += cached_prefill_s if tuple(prompt) in self.cached else prefill_s
            self.cached.add(tuple(prompt))
            clock[0] += decode_s * (max_tokens - 1)
            return [list(range(max_tokens))]

    monkeypatch.setattr(spec_work.time, "perf_counter", lambda: clock[0])
    seconds, tokens = spec_work.tpot(Caching(), [1, 2, 3], 96)
    assert tokens == list(range(96))
    assert seconds == pytest.approx(decode_s)


def test_several_ranks_run_every_methods_engine_together_each_in_a_process_of_its_own(monkeypatch):
    """A layout of several ranks (one parallel engine per process) starts each method's engine in a process of its
    own, and the work runs them all in turn prompt by prompt, as in one process; each engine's stats are read, then
    it is shut down. An engine that fails to start closes the ones started before it (their processes then shut their
    engines down)."""
    import bench_spec

    events = []

    class Hosted:
        def __init__(self, method, layout):
            if method == "broken":
                raise RuntimeError("the engine's process failed")
            self.method = method
            events.append(("start", method, tuple(sorted(layout))))

        def stats(self):
            events.append(("stats", self.method))
            return {"spec_decode": None}

        def shutdown(self):
            events.append(("shutdown", self.method))

        def close(self):
            events.append(("close", self.method))

    def run_work(engines, work):
        events.append(("work", tuple(engines)))
        return {name: {} for name in engines}

    monkeypatch.setattr(bench_spec, "EngineProcess", Hosted)
    monkeypatch.setattr(bench_spec, "run_work", run_work)
    methods = ["none", "ngram", "suffix"]
    rows = bench_spec.run_methods("shift", methods, {})
    layout = tuple(sorted(bench_spec.LAYOUTS["shift"]))
    assert events == ([("start", m, layout) for m in methods] + [("work", tuple(methods))]
                      + [event for m in methods for event in (("stats", m), ("shutdown", m))])
    assert list(rows) == methods and rows["none"]["acceptance_rate"] is None
    events.clear()
    with pytest.raises(RuntimeError, match="the engine's process failed"):
        bench_spec.run_methods("shift", ["none", "broken"], {})
    assert events == [("start", "none", layout), ("close", "none")]


def test_ratios_split_by_the_plain_engines_tpot_of_each_prompt():
    """Each prompt's TPOT is set against the plain engine's of the same prompt (timed a second apart: one spell of
    the machine's read rate), and the repeats split by whether the plain TPOT was below or above its own prompt's
    median over the repeats (a longer prompt is not a slower spell; a repeat at the median is in neither half)."""
    import bench_spec

    # prompt 0 plain 2.0 / 3.0 / 2.5 (median 2.5), prompt 1 plain 8.0 / 8.8 / None (median 8.4)
    plain = [{"agent_tpots_ms": [2.0, 8.0]}, {"agent_tpots_ms": [3.0, 8.8]}, {"agent_tpots_ms": [2.5, None]}]
    method = [{"agent_tpots_ms": [1.0, 4.0]}, {"agent_tpots_ms": [1.5, 4.0]}, {"agent_tpots_ms": [1.0, 4.0]}]
    fast, slow = bench_spec.ratios_below_and_above_median(plain, method, "agent")
    assert fast == pytest.approx((2.0 + 8.0) / (1.0 + 4.0)) and slow == pytest.approx((3.0 + 8.8) / (1.5 + 4.0))
    # a short and a long prompt at every repeat's same rate: no spell, so both halves read alike (splitting by rank
    # put the short prompt's median repeat in one half and the long one's in the other)
    plain = [{"agent_tpots_ms": [2.0 * f, 9.0 * f]} for f in (0.99, 1.0, 1.01)]
    method = [{"agent_tpots_ms": [1.0 * f, 7.5 * f]} for f in (0.99, 1.0, 1.01)]
    fast, slow = bench_spec.ratios_below_and_above_median(plain, method, "agent")
    assert fast == pytest.approx(slow) == pytest.approx(11.0 / 8.5)
    one_repeat = ([{"agent_tpots_ms": [2.0]}], [{"agent_tpots_ms": [1.0]}])
    assert bench_spec.ratios_below_and_above_median(*one_repeat, "agent") is None


def test_run_work_keeps_each_prompts_tpot_in_order(monkeypatch):
    """run_work's rows hold each prompt's TPOT in milliseconds, in the work's order, None for a single token, beside
    the means over the rest. (On a clock that each generated token moves by 1 ms: timed by the host, an instant
    engine's TPOT came out below zero.)"""
    clock = [0.0]

    class Fixed:
        def generate(self, prompts, max_tokens, temperature, seed, ignore_eos):
            outputs = [[5] * (1 if prompts[0][0] == 9 else max_tokens) for _ in prompts]
            clock[0] += 1e-3 * sum(map(len, outputs))
            return outputs

    monkeypatch.setattr(spec_work.time, "perf_counter", lambda: clock[0])
    work = {"agent_prompts": [[1]], "agent_observations": [[[2], [3]]], "edit_prompts": [[4], [9]],
            "free_prompts": [[6]], "throughput_prompts": [[7]]}
    row = spec_work.run_work({"plain": Fixed()}, work)["plain"]
    assert row["agent_tpots_ms"] == [pytest.approx(1.0)] * 2
    assert row["edit_tpots_ms"] == [pytest.approx(1.0), None] and row["edit_tpot_ms"] == pytest.approx(1.0)
    assert row["free_tpots_ms"] == [pytest.approx(1.0)] * len(spec_work.FREE_SEEDS)


def test_an_engine_process_generates_the_engines_tokens(monkeypatch):
    """EngineProcess: an engine of two ranks in a process of its own, driven through a pipe, gives the tokens of the
    same engine in this process, its stats and a clean shutdown; a method it cannot start is raised with the
    process's error."""
    import bench_spec

    monkeypatch.setattr(bench_spec, "MODEL_DIR", str(default_model_dir()))
    prompt = LLM(compile=False).tokenizer.encode("And God said")
    expected = bench_spec.TorchShiftEngine(LLM(compile=False)).generate([prompt], 16, 0.0, None, False)
    engine = bench_spec.EngineProcess("ngram", {"tp": 2})
    try:
        assert engine.generate([prompt], 16, 0.0, None, False) == expected
        assert engine.stats()["spec_decode"]["method"] == "ngram"
    finally:
        engine.shutdown()
    assert engine.process.exitcode == 0
    engine = bench_spec.EngineProcess("none", {"tp": 2})
    engine.close()  # the pipe closed: the process shuts its engine down and ends
    assert engine.process.exitcode == 0
    with pytest.raises(RuntimeError, match="':sync'"):
        bench_spec.EngineProcess("none:fast", {"tp": 2})
