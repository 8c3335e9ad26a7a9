"""Phi-3 (`Phi3ForCausalLM`: Phi-3, Phi-3.5, Phi-4) against Hugging Face `transformers` on random checkpoints:
q/k/v and gate/up fused in the checkpoint (read part by part, and only a rank's rows), a sliding window, and
LongRoPE's short and long factors with its attention factor, the long ones where the engine's context exceeds the
original length (vLLM's rule; transformers switches per forward by its longest position, so each comparison stays
on one side of it). The plain family also runs in conftest's FAMILIES (logits, convert, the SP-2 x TP-2 mesh)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    assert_outputs_match_transformers,
    checkpoint_cache,
    engine_logits,
    hf_greedy_logprobs,
    random_prompts,
)
from test_moe import DENSE_SHARDED, assert_layout_matches_one_rank

from torch_shift import LLM, LLMEngine, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.handoff import handoff
from torch_shift.models import load_model
from torch_shift.models.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4
ORIGINAL = 32  # LongRoPE's original context: prompts of up to 32 tokens run on the short factors
HEAD_DIM = 16


def longrope(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(HEAD_DIM // 2, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(HEAD_DIM // 2, generator=g)).tolist()}


def build_phi3(name: str = "phi3_longrope", seed: int = 0):
    """Four layers, a window of 8, LongRoPE with an original context of 32 in a model of 256 positions."""
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB_SIZE, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        rope_parameters=longrope(), sliding_window=8, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=0, eos_token_id=1, pad_token_id=3)
    config.architectures = ["Phi3ForCausalLM"]
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, build_phi3)("phi3_longrope")


def test_config_reads_longrope_and_refuses_what_it_cannot_run(phi3):
    hf_model, model_dir = phi3
    config = ModelConfig.from_dir(model_dir)
    assert config.family == "phi3" and config.sliding_window == 8
    rope = config.rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == ORIGINAL and rope.long
    assert rope.factor == 256 / ORIGINAL
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(ORIGINAL)))
    assert hf_model.model.rotary_emb.attention_scaling == pytest.approx(rope.attention_factor)
    assert not config.for_context(ORIGINAL).rope.long and config.for_context(ORIGINAL + 1).rope.long
    assert config.num_parameters == sum(p.numel() for p in hf_model.parameters())

    hf = json.loads((model_dir / "config.json").read_text())
    for old_name in ("su", "yarn"):  # Phi-3's earlier names for LongRoPE, as transformers' Phi3Config reads them
        assert ModelConfig.from_hf_dict({**hf, "rope_parameters": {**hf["rope_parameters"], "rope_type": old_name}}
                                        ).rope.rope_type == "longrope"
    with pytest.raises(ValueError, match="short_factor must be a list of head_dim / 2 = 8 numbers"):
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {**hf["rope_parameters"], "short_factor": [1.0] * 4}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75 is not supported"):  # Phi-4-mini's
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": 0.75}})


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_tables_match_transformers(phi3, long):
    hf_model, model_dir = phi3
    config = ModelConfig.from_dir(model_dir).for_context(256 if long else ORIGINAL)
    length = 100 if long else ORIGINAL  # transformers' choice follows the longest position of its forward
    positions = torch.arange(length)[None]
    cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    torch.testing.assert_close(ours.cos_sin[0, :length], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(ours.cos_sin[1, :length], sin[0], atol=0, rtol=0)


@pytest.mark.parametrize("engine_args", [
    {"max_model_len": ORIGINAL, "max_num_batched_tokens": 8},  # the short factors; prompts in chunks
    {"max_num_batched_tokens": 16},  # the long factors (context 256)
    {"max_num_batched_tokens": 16, "compile": True},
], ids=["short_chunked", "long", "long_compiled"])
def test_greedy_tokens_and_logprobs_match_transformers(phi3, engine_args):
    hf_model, model_dir = phi3
    short = engine_args.get("max_model_len") == ORIGINAL
    lengths, max_tokens = ([3, 17, 9, 1, 20], 10) if short else ([40, 33, 60, 35], 12)
    prompts = random_prompts(len(lengths), lengths, seed=3)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, max_tokens)
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, logprobs=3)
    assert_outputs_match_transformers(llm.generate(prompts, params, use_tqdm=False), refs, ref_logprobs, FP32_ATOL)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_short_and_long_factors_both_matter(phi3):
    """The comparisons above would notice the wrong set: a prompt's logits under the other set move far beyond the
    tolerance."""
    hf_model, model_dir = phi3
    prompt = random_prompts(1, [30], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]  # 30 positions: transformers' short factors
    short = engine_logits(LLMEngine(EngineArgs(str(model_dir), max_model_len=ORIGINAL)), prompt)
    long = engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt)
    torch.testing.assert_close(short, ref, atol=FP32_ATOL, rtol=1e-5)
    assert (long - ref).abs().max() > 100 * FP32_ATOL


def test_in_memory_model_handed_off_gives_the_checkpoints_outputs(phi3):
    """The fused tensors of transformers' own module read as the checkpoint's; the handed-off model's rotary tables
    follow the engine's context (the short factors at max_model_len 32)."""
    hf_model, model_dir = phi3
    prompts = random_prompts(3, [4, 19, 1], seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    for engine_args in ({}, {"max_model_len": ORIGINAL}):
        expected = LLM(str(model_dir), **engine_args).generate(prompts, greedy, use_tqdm=False)
        got = handoff(hf_model, None, tokenizer=model_dir, **engine_args).generate(prompts, greedy, use_tqdm=False)
        assert [_tokens_and_logprobs(o) for o in got] == [_tokens_and_logprobs(o) for o in expected]


def _tokens_and_logprobs(output) -> tuple:
    completion = output.outputs[0]
    return completion.token_ids, [{t: lp.logprob for t, lp in top.items()} for top in completion.logprobs]


def test_draft_model_follows_the_engines_context(phi3):
    """A draft is loaded for the engine's context as the target is: the target itself as its own draft at
    max_model_len 32 proposes with the short factors, so the check keeps every proposal."""
    _, model_dir = phi3
    prompts = random_prompts(3, [4, 12, 9], seed=8)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    plain = LLM(str(model_dir), max_model_len=ORIGINAL).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(str(model_dir), max_model_len=ORIGINAL, speculative_config={
        "method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "goodput_budget": False})
    draft = llm.engine.core.speculator.proposer.model
    assert not draft.rotary.rope.long and not llm.engine.config.model.rope.long
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["spec_decode"]["acceptance_rate"] > 0.95


def test_one_model_handed_to_engines_of_both_contexts(phi3):
    """Each engine serves the model with its own context's tables (a copy of the module's where they differ); the
    user's module and the first engine's outputs stay as they were."""
    _, model_dir = phi3
    model = load_model(model_dir)
    assert model.rotary.rope.long
    prompts = random_prompts(2, [4, 19], seed=7)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    short = LLM(model=model, tokenizer=str(model_dir), max_model_len=ORIGINAL)
    first = short.generate(prompts, params, use_tqdm=False)
    long = LLM(model=model, tokenizer=str(model_dir))
    assert model.rotary.rope.long and model.config.rope.long
    expected = {ORIGINAL: LLM(str(model_dir), max_model_len=ORIGINAL), 256: LLM(str(model_dir))}
    for llm, context in ((short, ORIGINAL), (long, 256)):
        got = [_tokens_and_logprobs(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == [_tokens_and_logprobs(o) for o in expected[context].generate(prompts, params, use_tqdm=False)]
    assert [_tokens_and_logprobs(o) for o in first] == [
        _tokens_and_logprobs(o) for o in short.generate(prompts, params, use_tqdm=False)]


# the layouts that slice q/k/v and gate/up (a rank's rows of each part of the fused tensors), and Flying and Seesaw
LAYOUTS = DENSE_SHARDED


@pytest.mark.slow
@pytest.mark.parametrize("context", [256, ORIGINAL], ids=["long", "short"])
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_every_layout_matches_one_rank(phi3, family, context):
    assert_layout_matches_one_rank(phi3[1], *LAYOUTS[family], lengths=(3, 17, 14, 9), max_model_len=context)
