"""The paged FlexAttention path (the GPU path) against the gather + SDPA path, compiled on CPU."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from torch_shift import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_flex_paged_attention_matches_sdpa(checkpoints, family):
    _, model_dir = checkpoints(family)
    # one step with two fresh prefills, one with a chunk over cached context plus a decode, then decodes
    prompts = random_prompts(2, [9, 20], seed=6)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    args = dict(block_size=8, max_num_batched_tokens=16, device="cpu")  # the GPU's: tests/test_cuda.py
    ref = LLM(str(model_dir), **args).generate(prompts, params, use_tqdm=False)
    got = LLM(str(model_dir), attention_backend="flex", **args).generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert set(lr) == set(lg)
            assert all(abs(lr[t].logprob - lg[t].logprob) < 1e-4 for t in lr)
