"""Gemma 3 (`Gemma3ForCausalLM`: the text models, 270M and 1B; and the language model of
`Gemma3ForConditionalGeneration`, 4B-27B, its vision tower left out) against Hugging Face `transformers` on random
checkpoints: norms before and after attention and the MLP, each scaling by 1 + weight in float32, q/k norms, the
embedding times sqrt(hidden_size), GeGLU (GELU's tanh approximation), windowed and full layers alternating with a
rotary table each (the windowed layers' of their own base), the tied LM head; greedy tokens and logprobs chunked,
preempted, eager, compiled and on the SDPA reference, bf16 as close as transformers' own, and every layout against
one rank. What Gemma 3 computes and torch_shift does not (logit soft-capping, bidirectional attention, attention
biases) is refused."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    assert_converted_and_handed_off_alike,
    assert_lm_head_rows_alone,
    assert_outputs_match_transformers,
    checkpoint_cache,
    engine_logits,
    hf_greedy_logprobs,
    random_prompts,
    save_checkpoint,
)
from test_moe import DENSE_SHARDED, assert_layout_matches_one_rank

from torch_shift import LLM, LLMEngine, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.handoff import handoff
from torch_shift.models import load_model
from torch_shift.models.batch import CausalAttention
from torch_shift.models.native_decoder import _supported
from torch_shift.models.rope import RotaryEmbedding
from torch_shift.models.toy import build_tokenizer

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4
WINDOW = 8


def build_gemma3(name: str = "gemma3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Four layers (windowed, full, windowed, full), random norm weights (transformers starts them at zero: 1 + 0)."""
    config = transformers.Gemma3TextConfig(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 256, "sliding_window": WINDOW, "sliding_window_pattern": 2, "rope_theta": 1e6,
        "rope_local_base_freq": 100.0, "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 3, **overrides})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.3)
    return model.to(dtype)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, build_gemma3)("gemma3")


def test_config_reads_gemma3_and_refuses_what_it_cannot_run(gemma3):
    hf_model, model_dir = gemma3
    config = ModelConfig.from_dir(model_dir)
    assert config.family == "gemma3_text" and config.gemma_norms and config.qk_norm and config.tie_word_embeddings
    assert config.hidden_act == "gelu_pytorch_tanh" and config.embed_scale == 8.0
    assert config.layer_windows == (WINDOW, None) * 2 and config.sliding_window is None
    assert config.rope.theta == 1e6 and config.local_rope.theta == 100.0
    assert config.num_parameters == sum(p.numel() for p in hf_model.parameters())
    hf = json.loads((model_dir / "config.json").read_text())
    for change, message in [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
                            ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
                            ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
                            ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be > 0"),
                            ({"attention_bias": True}, "attention_bias=true is not supported"),
                            ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported")]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**hf, **change})


def test_linear_scaling_of_the_full_layers_and_a_transformers_4_config(tmp_path):
    """The larger Gemma 3 models scale their full layers' rotary table linearly (factor 8); config.json as
    transformers 4 wrote it (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern) reads alike."""
    hf_model = build_gemma3(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e4)
    model_dir = save_checkpoint(hf_model, tmp_path / "gemma3")
    config = ModelConfig.from_dir(model_dir)
    assert (config.rope.rope_type, config.rope.factor, config.rope.theta) == ("linear", 8.0, 1e4)
    prompt = random_prompts(1, [40], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt), ref, atol=FP32_ATOL,
                               rtol=1e-5)
    written = json.loads((model_dir / "config.json").read_text())
    del written["rope_parameters"], written["layer_types"]
    written |= {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e4,
                "rope_local_base_freq": 100.0, "sliding_window_pattern": 2}
    (model_dir / "config.json").write_text(json.dumps(written))
    assert ModelConfig.from_dir(model_dir) == config
    with torch.no_grad():
        reloaded = transformers.Gemma3ForCausalLM.from_pretrained(model_dir).eval()
        torch.testing.assert_close(reloaded(torch.tensor([prompt])).logits[0], ref, atol=0, rtol=0)


def test_rotary_tables_match_transformers(gemma3):
    hf_model, model_dir = gemma3
    config = ModelConfig.from_dir(model_dir)
    ours = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, config.local_rope)
    positions = torch.arange(200)[None]
    for layer_type, table in (("full_attention", ours.cos_sin), ("sliding_attention", ours.local_cos_sin)):
        cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions, layer_type)
        torch.testing.assert_close(table[0, :200], cos[0], atol=0, rtol=0)
        torch.testing.assert_close(table[1, :200], sin[0], atol=0, rtol=0)


PROMPT_LENGTHS = [3, 17, 40, 1, 9, 64, 33, 5]
MAX_TOKENS = 10


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 16},  # prompts split into chunks, mixed with decodes
    {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},  # a pool small enough to preempt
    {"max_num_batched_tokens": 16, "compile": False},
    {"max_num_batched_tokens": 16, "compile": True},
    {"max_num_batched_tokens": 16, "attention_backend": "sdpa"},
], ids=["chunked", "preempted", "eager", "compiled", "sdpa"])
def test_greedy_tokens_and_logprobs_match_transformers(gemma3, engine_args):
    hf_model, model_dir = gemma3
    prompts = random_prompts(8, PROMPT_LENGTHS)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    assert_outputs_match_transformers(llm.generate(prompts, params, use_tqdm=False), refs, ref_logprobs, FP32_ATOL)
    engine = llm.engine
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_lm_heads_rows_alone_leave_the_last_layer(gemma3):
    assert_lm_head_rows_alone(gemma3[1])  # Gemma's norms after attention and the MLP


def test_bf16_as_close_to_fp32_as_transformers(gemma3):
    hf_model, model_dir = gemma3
    prompt = random_prompts(1, [40], seed=2)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        hf_bf16 = build_gemma3(dtype=torch.bfloat16)
        hf_err = (hf_bf16(torch.tensor([prompt])).logits[0].float() - ref).abs().mean()
    got = engine_logits(LLMEngine(EngineArgs(str(model_dir), dtype="bfloat16")), prompt)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().mean() < 1.5 * hf_err
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_each_of_gemmas_differences_matters(gemma3):
    """The comparisons above would notice a difference dropped: the windowed layers' own rotary table, the norms
    after attention and the MLP, and the embedding's scale each move the logits far beyond the tolerance."""
    hf_model, model_dir = gemma3
    prompt = random_prompts(1, [40], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        got = engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt)
        torch.testing.assert_close(got, ref, atol=FP32_ATOL, rtol=1e-5)
        model = load_model(model_dir)
        assert not _supported(model)  # the C++ decoder runs none of it: the forward does
        positions, ids = torch.arange(len(prompt)), torch.tensor(prompt)

        def logits(model) -> torch.Tensor:
            return model.compute_logits(model(ids, positions, CausalAttention([len(prompt)], None)))

        torch.testing.assert_close(logits(model), ref, atol=FP32_ATOL, rtol=1e-5)
        for change in ("local_rope", "post_norms", "embed_scale"):
            changed = load_model(model_dir)
            if change == "local_rope":
                changed.rotary.local_cos_sin = changed.rotary.cos_sin
            elif change == "post_norms":
                for layer in changed.layers:
                    layer.post_feedforward_norm.weight.zero_()
            else:
                changed.config = dataclasses.replace(changed.config, embed_scale=None)
            assert (logits(changed) - ref).abs().max() > 100 * FP32_ATOL, change


def test_in_memory_model_and_converted_checkpoint_give_the_same_outputs(gemma3, tmp_path):
    assert_converted_and_handed_off_alike(*gemma3, tmp_path / "converted")


def build_gemma3_vision_language(seed: int = 0):
    """Gemma3ForConditionalGeneration (the 4B-27B models' class) with a small vision tower, its language model
    scaling attention by query_pre_attn_scalar ** -0.5 = 24 ** -0.5 (27B's kind: not head_dim's)."""
    text = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24, "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 256, "sliding_window": WINDOW, "sliding_window_pattern": 2,
            "rope_theta": 1e6, "rope_local_base_freq": 100.0, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB_SIZE - 1, boi_token_index=VOCAB_SIZE - 3,
                                       eoi_token_index=VOCAB_SIZE - 2)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and "language_model" in param_name:
                param.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    hf_model = build_gemma3_vision_language()
    model_dir = save_checkpoint(hf_model, tmp_path_factory.mktemp("gemma3_vl") / "model", with_tokenizer=False)
    build_tokenizer(model_dir, vocab_size=VOCAB_SIZE)
    return hf_model, model_dir


def test_vision_language_checkpoint_serves_its_language_model(gemma3_vl, tmp_path):
    """The 4B-27B checkpoints: config.json's text_config, the language model's tensors (`language_model.model.`),
    the vision tower's left out; text prompts give transformers' tokens and logprobs, converted too."""
    from torch_shift.models.convert import convert_checkpoint

    hf_model, model_dir = gemma3_vl
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.family == "gemma3_text"
    assert config.query_scale == pytest.approx(math.sqrt(16 / 24)) and config.layer_windows == (WINDOW, None) * 2
    prompts = random_prompts(4, [3, 17, 40, 9], seed=2, vocab=VOCAB_SIZE - 3)  # no image tokens
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, MAX_TOKENS)
    assert min(row.max() - row.min() for row in ref_logprobs).item() > 5  # not flat: the comparison means something
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    assert_outputs_match_transformers(llm.generate(prompts, params, use_tqdm=False), refs, ref_logprobs, FP32_ATOL)
    greedy = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    handed = handoff(hf_model, None, tokenizer=model_dir).generate(prompts, greedy, use_tqdm=False)  # its modules
    assert [o.outputs[0].token_ids for o in handed] == [r[:6] for r in refs]
    prompt = prompts[2]
    ref = engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt)
    converted = convert_checkpoint(model_dir, tmp_path / "converted", progress=False)
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(converted), tokenizer=str(model_dir))), prompt),
                               ref, atol=0, rtol=0)


LAYOUTS = DENSE_SHARDED


@pytest.mark.slow
@pytest.mark.parametrize("family", list(LAYOUTS) + ["tp2_vision_language"])
def test_every_layout_matches_one_rank(gemma3, gemma3_vl, family):
    """The extra norms replicated, the local rotary table on every rank and stage, the tied head sharded by
    vocabulary: greedy tokens and logprobs of one rank."""
    model_dir = (gemma3_vl if family.endswith("_vision_language") else gemma3)[1]
    assert_layout_matches_one_rank(model_dir, *LAYOUTS[family.removesuffix("_vision_language")])
