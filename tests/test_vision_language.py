"""Vision-language checkpoints served by their language model, text in and text out (Qwen2-VL and Qwen2.5-VL here;
Gemma 3's in tests/test_gemma3.py): the text config (nested as transformers 5 writes it, or flat as the hub's
configs), M-RoPE (a text token's three position ids are one: the plain rotation), the language model's tensors
under every naming, the vision tower left out; greedy tokens and logprobs of text prompts against transformers'
model of the whole checkpoint, a handoff of its modules, and TP-2 against one rank."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    assert_outputs_match_transformers,
    hf_greedy_logprobs,
    random_prompts,
    save_checkpoint,
)
from safetensors.torch import load_file, save_file
from test_moe import assert_layout_matches_one_rank

from torch_shift import LLM, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.handoff import handoff
from torch_shift.models.toy import build_tokenizer

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4
MODELS = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {"embed_dim": 32}),
          "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {"out_hidden_size": 64})}
SPECIAL = {"image_token_id": VOCAB_SIZE - 1, "video_token_id": VOCAB_SIZE - 2, "vision_start_token_id": VOCAB_SIZE - 3,
           "vision_end_token_id": VOCAB_SIZE - 4}  # inside the vocabulary; the prompts hold none of them


def build(name: str, tie: bool = False, seed: int = 0):
    config_class, model_class, vision_extra = MODELS[name]
    text = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "initializer_range": 0.3,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, **vision_extra}
    config = getattr(transformers, config_class)(text_config=text, vision_config=vision, tie_word_embeddings=tie,
                                                 **SPECIAL)
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()


@pytest.fixture(scope="module", params=list(MODELS))
def vision_language(request, tmp_path_factory):
    hf_model = build(request.param)
    model_dir = save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param) / "model", with_tokenizer=False)
    build_tokenizer(model_dir, vocab_size=VOCAB_SIZE)
    return hf_model, model_dir


def test_language_model_matches_transformers_on_text(vision_language):
    hf_model, model_dir = vision_language
    config = ModelConfig.from_dir(model_dir)
    assert config.family == "qwen2" and config.attention_bias and config.rope.rope_type == "default"
    assert not config.tie_word_embeddings
    prompts = random_prompts(4, [3, 17, 40, 9], seed=2, vocab=VOCAB_SIZE - 4)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, 10)
    assert min(row.max() - row.min() for row in ref_logprobs).item() > 5  # not flat: the comparison means something
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0, logprobs=3)
    assert_outputs_match_transformers(llm.generate(prompts, params, use_tqdm=False), refs, ref_logprobs, FP32_ATOL)
    greedy = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    handed = handoff(hf_model, None, tokenizer=model_dir).generate(prompts, greedy, use_tqdm=False)  # its modules
    assert [o.outputs[0].token_ids for o in handed] == [r[:6] for r in refs]


def test_flat_hub_config_and_tied_heads_read_as_transformers_reads_them(vision_language, tmp_path):
    """The hub's Qwen2-VL configs keep the text model's keys at the top level (transformers 4); a text config that
    ties the head ties it, as transformers 5 reads configs saved before it."""
    _, model_dir = vision_language
    written = json.loads((model_dir / "config.json").read_text())
    nested = ModelConfig.from_hf_dict(written)
    flat = {k: v for k, v in written.items() if k != "text_config"} | written["text_config"]
    flat["architectures"] = written["architectures"]
    flat["rope_scaling"] = flat.pop("rope_parameters")
    assert ModelConfig.from_hf_dict(flat) == nested
    del written["tie_word_embeddings"]
    assert not ModelConfig.from_hf_dict(written).tie_word_embeddings
    written["text_config"]["tie_word_embeddings"] = True
    assert ModelConfig.from_hf_dict(written).tie_word_embeddings
    name = written["architectures"][0].removesuffix("ForConditionalGeneration")
    assert getattr(transformers, f"{name}Config")(**written).tie_word_embeddings


def test_a_hub_config_of_mrope_alone_reads_as_the_plain_rotation(vision_language):
    """The hub's Qwen2-VL configs name M-RoPE by "type" only (no rope_type beside it, as transformers 5 writes)."""
    _, model_dir = vision_language
    written = json.loads((model_dir / "config.json").read_text())
    nested = ModelConfig.from_hf_dict(written)
    flat = {k: v for k, v in written.items() if k != "text_config"} | written["text_config"]
    flat["architectures"] = written["architectures"]
    del flat["rope_parameters"]
    flat |= {"rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    assert ModelConfig.from_hf_dict(flat) == nested


def test_the_language_model_under_two_namings_is_refused(vision_language, tmp_path):
    """Were the last name read silently taken."""
    _, model_dir = vision_language
    twice = tmp_path / "twice"
    shutil.copytree(model_dir, twice)
    tensors = load_file(twice / "model.safetensors")
    tensors["language_model.model.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, twice / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensors '(language_model\.)?model\.norm\.weight' and "
                                         r"'(language_model\.)?model\.norm\.weight' both hold norm\.weight"):
        LLM(str(twice))


@pytest.mark.slow
def test_tp2_matches_one_rank(vision_language):
    assert_layout_matches_one_rank(vision_language[1], 2, {"tp": 2}, {"tp"})
