"""The paged FlexAttention path (the GPU path) against the gather + SDPA path, compiled on CPU."""

from __future__ import annotations

import logging

import pytest
from conftest import random_prompts

from torch_shift import LLM, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.args import EngineArgs


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


def test_flex_on_the_cpu_says_it_is_for_tests(caplog):
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256})
    for backend, warned in (("FLEX_ATTENTION", True), ("auto", False), ("sdpa", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch_shift"):
            EngineArgs("unused", attention_backend=backend, device="cpu").create_engine_config(config)
        assert ("attention_backend 'flex' on the CPU compiles FlexAttention again" in caplog.text) == warned, backend
