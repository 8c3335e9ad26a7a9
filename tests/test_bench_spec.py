"""bench_spec.py's widened target: the default model with MLPs widened by neurons the down projection multiplies by
zero computes the same function (the benchmark's premise for its weight-bound rows)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch_shift import LLM, SamplingParams
from torch_shift.models.default import default_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_spec import widened  # noqa: E402


def test_a_widened_model_gives_the_default_models_tokens(tmp_path):
    model_dir = widened(default_model_dir(), tmp_path / "widened", 1536)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = ["And God said", "In the beginning"]
    expected = [o.outputs[0].token_ids for o in LLM(compile=False).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(model_dir), compile=False)
    assert llm.engine.config.model.intermediate_size == 1536
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
