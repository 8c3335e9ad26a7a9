"""bench_spec.py's widened target: the default model with MLPs widened by neurons the down projection multiplies by
zero computes the same function (the benchmark's premise for its weight-bound rows); the engines' order prompt by
prompt (spec_work.in_turn) balanced."""

from __future__ import annotations

import sys
from pathlib import Path

from torch_shift import LLM, SamplingParams
from torch_shift.models.default import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

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


def test_several_ranks_run_their_methods_in_the_squares_order(monkeypatch):
    """A layout of several ranks runs one engine at a time: repeat r takes row r of the Williams square, so that no
    method always runs first (the machine drifts between the engines' runs); rows come back in the given order."""
    import bench_spec

    started = []

    class Engine:
        def __init__(self, model, speculative_config=None, **kwargs):
            started.append(next(name for name, config in bench_spec.METHODS.items() if config is speculative_config))

        def generate(self, *args, **kwargs):
            return []

        def stats(self):
            return {"spec_decode": None}

        def shutdown(self):
            pass

    monkeypatch.setattr(bench_spec, "LLM", Engine)
    monkeypatch.setattr(bench_spec, "TorchShiftEngine", lambda llm: llm)
    monkeypatch.setattr(bench_spec, "run_work", lambda engines, work: {name: {} for name in engines})
    methods = ["none", "ngram", "suffix"]
    for repeat in range(6):
        started.clear()
        rows = bench_spec.run_methods("shift", methods, {}, repeat)
        assert started == in_turn(methods, repeat) and list(rows) == methods
