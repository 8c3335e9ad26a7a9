"""The decoder and the loader against Hugging Face `transformers` on random checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    FAMILIES,
    assert_lm_head_rows_alone,
    build_hf_model,
    engine_logits,
    random_prompts,
    rewrite_config,
    save_checkpoint,
)

from torch_shift import LLM, LLMEngine, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.models import load_model

FP32_ATOL = 1e-4  # logits reach |15|: 7e-6 relative, a few float32 ulps of accumulated rounding


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(checkpoints, family):
    hf_model, model_dir = checkpoints(family)
    prompt = random_prompts(1, [50])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    engine = LLMEngine(EngineArgs(str(model_dir), block_size=8, max_num_batched_tokens=24))
    got = engine_logits(engine, prompt)  # three chunks: 24 + 24 + 2 tokens
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=FP32_ATOL, rtol=1e-5)
    assert ref.abs().max() > 5  # logits not flat: the comparison means something


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_lm_heads_rows_alone_leave_the_last_layer(checkpoints, family):
    assert_lm_head_rows_alone(checkpoints(family)[1], compiled=family == "llama")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_as_close_to_fp32_as_transformers(checkpoints, dtype):
    """In half precision the engine errs from the fp32 logits no more than transformers does."""
    hf_model, model_dir = checkpoints("llama")
    prompt = random_prompts(1, [20])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        hf_half = build_hf_model("llama").to(getattr(torch, dtype))
        hf_err = (hf_half(torch.tensor([prompt])).logits[0].float() - ref).abs().mean()
    engine = LLMEngine(EngineArgs(str(model_dir), dtype=dtype))
    assert engine.model.model.lm_head.weight.dtype == getattr(torch, dtype)
    got = engine_logits(engine, prompt)
    assert got.dtype == getattr(torch, dtype)
    our_err = (got.float() - ref).abs().mean()
    assert our_err < 1.5 * hf_err
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_bf16_long_prompt_as_close_to_fp32_as_transformers(tmp_path):
    """A bfloat16 prompt of 64 tokens or more (head_dim 32) takes the CPU kernel's dot-product tiles, whose
    probabilities are rounded to bfloat16: its logits still err from fp32 no more than transformers' do."""
    hf_model = build_hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model_dir = save_checkpoint(hf_model, tmp_path / "head_dim_32")
    prompt = random_prompts(1, [150])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        hf_half = build_hf_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
        hf_err = (hf_half.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float() - ref).abs().mean()
    engine = LLMEngine(EngineArgs(str(model_dir), dtype="bfloat16"))
    got = engine_logits(engine, prompt)  # one chunk of 150 tokens
    our_err = (got.float() - ref).abs().mean()
    assert our_err < 1.5 * hf_err, (our_err, hf_err)
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def assert_engine_logits_match(hf_model, model_dir, prompt_len: int = 40) -> LLMEngine:
    """The engine's prompt logits of a `prompt_len`-token prompt against transformers' (float32); the engine."""
    prompt = random_prompts(1, [prompt_len])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    engine = LLMEngine(EngineArgs(str(model_dir)))
    torch.testing.assert_close(engine_logits(engine, prompt), ref, atol=FP32_ATOL, rtol=1e-5)
    return engine


def test_sharded_checkpoint_and_tied_embeddings(tmp_path, checkpoints):
    hf_model, _ = checkpoints("llama_tied")
    model_dir = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    model = load_model(model_dir)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert_engine_logits_match(hf_model, model_dir, 12)


def test_a_tied_head_stored_beside_the_embedding_must_be_it(tmp_path, checkpoints):
    """A checkpoint that holds `lm_head.weight` although config.json ties it: the embedding's copy loads, a
    different head is refused by name (transformers unties it with a warning; it was dropped without a word)."""
    from safetensors.torch import load_file, save_file

    hf_model, model_dir = checkpoints("llama_tied")
    tensors = load_file(model_dir / "model.safetensors")
    for name, head, loads in (("same", tensors["model.embed_tokens.weight"].clone(), True),
                              ("other", torch.randn_like(tensors["model.embed_tokens.weight"]), False)):
        shutil.copytree(model_dir, tmp_path / name)
        save_file(tensors | {"lm_head.weight": head}, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        if loads:
            assert torch.equal(load_model(tmp_path / name).lm_head.weight, hf_model.lm_head.weight)
        else:
            with pytest.raises(ValueError, match="ties the LM head to the embedding .* 'lm_head.weight' differs from "
                                                 "'model.embed_tokens.weight'; set tie_word_embeddings to false"):
                load_model(tmp_path / name)


def test_transformers_4_config_layout(tmp_path, checkpoints):
    """config.json as transformers 4.x writes it: rope_theta and rope_scaling at the top level."""
    hf_model, model_dir = checkpoints("llama3")
    old = shutil.copytree(model_dir, tmp_path / "v4")
    config = json.loads((old / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (old / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(old).rope == ModelConfig.from_dir(model_dir).rope
    assert ModelConfig.from_dir(old).rope.rope_type == "llama3"
    assert_engine_logits_match(hf_model, old)


ROPE_CONFIGS = {  # config.json's rope keys as written -> what transformers reads them as
    # the scaled types without their pretraining length: max_position_embeddings (256 here)
    "yarn_without_original": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
    "llama3_without_original": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    # both layouts written: transformers 5 takes rope_scaling (read as default rope, its linear scaling was dropped)
    "scaling_beside_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


@pytest.mark.parametrize("case", list(ROPE_CONFIGS))
def test_rope_keys_read_as_transformers_reads_them(tmp_path, llama, case):
    import transformers

    model_dir = shutil.copytree(llama[1], tmp_path / case)
    rewrite_config(model_dir, **ROPE_CONFIGS[case])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert_engine_logits_match(hf_model, model_dir)


def test_a_linear_scaling_extends_the_context_as_vllm_reads_it(tmp_path, llama):
    """vLLM's context of a linearly scaled rotation is config.json's length times the factor; the engine refused any
    max_model_len beyond 32 here."""
    import transformers

    model_dir = shutil.copytree(llama[1], tmp_path / "linear")
    rewrite_config(model_dir, max_position_embeddings=32,
                   rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    assert ModelConfig.from_dir(model_dir).max_position_embeddings == 128
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert assert_engine_logits_match(hf_model, model_dir, 100).scheduler_config.max_model_len == 128
    with pytest.raises(ValueError, match="context of 128 tokens .config.json's max_position_embeddings x its linear "
                                         "rope factor 4."):
        LLMEngine(EngineArgs(str(model_dir), max_model_len=200))
    # Gemma 3's length is already scaled (131,072 with a factor of 8), as vLLM reads it
    gemma = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
        "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 128, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma.rope.rope_type == "linear" and gemma.max_position_embeddings == 131072


def test_a_yarn_context_beyond_config_json_is_refused_with_its_remedy(tmp_path, llama):
    """Qwen's long-context recipe adds YaRN and keeps max_position_embeddings at the pretrained length; vLLM 0.32 and
    transformers take max_position_embeddings as YaRN's whole context, so the engine refuses more and says how."""
    model_dir = shutil.copytree(llama[1], tmp_path / "yarn")
    rewrite_config(model_dir, max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="max_position_embeddings to 128"):
        LLMEngine(EngineArgs(str(model_dir), max_model_len=100))


def test_keys_left_out_of_config_json_take_transformers_defaults():
    """A config.json without a key reads as transformers' config class of its family reads it: Mixtral's rope theta
    (1e6) and norm epsilon (1e-5), Mistral's window (4096), Qwen3's head_dim (128), each family's context (were
    Llama's defaults for every family)."""
    import transformers

    from torch_shift.config import SUPPORTED_ARCHITECTURES

    for arch in SUPPORTED_ARCHITECTURES:
        written = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 128}
        if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"):
            written |= {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        if arch.endswith("ForConditionalGeneration"):  # a vision-language model: its language model's text_config,
            # which transformers 4 wrote as its difference from the text config class's defaults, sizes included
            text = {"num_hidden_layers": 2}
            config_class = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))
            hf = config_class(text_config=text).text_config
            got = ModelConfig.from_hf_dict({"architectures": [arch], "text_config": text})
            assert (got.vocab_size, got.hidden_size, got.intermediate_size, got.num_attention_heads,
                    got.num_key_value_heads) == (hf.vocab_size, hf.hidden_size, hf.intermediate_size,
                                                 hf.num_attention_heads, hf.num_key_value_heads), arch
        else:
            config_class = "Gemma3TextConfig" if arch == "Gemma3ForCausalLM" else arch.replace("ForCausalLM", "Config")
            hf = getattr(transformers, config_class)(**written)
            got = ModelConfig.from_hf_dict(written)
        rope = hf.rope_parameters
        if arch.startswith("Gemma3"):  # a table per layer type
            assert got.local_rope.theta == rope["sliding_attention"]["rope_theta"] == 10000.0
            assert hf.sliding_window == 4096 and got.layer_windows == tuple(
                hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
            rope = rope["full_attention"]
        assert (got.max_position_embeddings, got.rms_norm_eps, got.rope.theta, got.rope.rope_type) == (
            hf.max_position_embeddings, hf.rms_norm_eps, rope["rope_theta"], rope["rope_type"]), arch
        assert got.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads), arch
        if arch == "MistralForCausalLM":
            assert got.sliding_window == hf.sliding_window == 4096
        if arch == "GptOssForCausalLM":
            assert got.o_proj_bias and got.attention_bias and got.rope.factor == rope["factor"] == 32.0
            assert got.rope.original_max_position_embeddings == rope["original_max_position_embeddings"]


def _pickled_checkpoint(source: Path, out: Path, shards: int, legacy: bool = False) -> Path:
    """`source`'s weights as PyTorch's pickled pytorch_model*.bin files (one, or shards under their index)."""
    from safetensors.torch import load_file

    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors |= load_file(f)
    names = sorted(tensors)
    if shards == 1:
        torch.save(tensors, out / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
        return out
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: tensors[n] for n in part}, out / file, _use_new_zipfile_serialization=not legacy)
        weight_map |= dict.fromkeys(part, file)
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize("shards, legacy", [(1, False), (3, False), (1, True)])
def test_pickled_bin_checkpoints_load_as_their_safetensors(tmp_path, llama, shards, legacy):
    """vLLM reads pytorch_model*.bin where a checkpoint has no safetensors (older fine-tunes); one file, shards
    under their index, and torch.save's format before 1.6 (read whole: it cannot be mapped)."""
    hf_model, model_dir = llama
    pickled = _pickled_checkpoint(model_dir, tmp_path / "bin", shards, legacy)
    assert not list(pickled.glob("*.safetensors"))
    assert_engine_logits_match(hf_model, pickled)


def test_a_pickled_checkpoint_serves_tensor_parallel_ranks(tmp_path, llama):
    _, model_dir = llama
    pickled = _pickled_checkpoint(model_dir, tmp_path / "bin", 2)
    prompts, params = random_prompts(3, [9, 17, 30]), SamplingParams(max_tokens=6, temperature=0.0)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(pickled), tp=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()


def test_unsupported_architecture_names_supported_ones(tmp_path, llama):
    model_dir = shutil.copytree(llama[1], tmp_path / "gpt2")
    rewrite_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(model_dir)


def test_a_config_without_architectures_is_read_by_its_model_type(tmp_path, llama):
    """As transformers' AutoModelForCausalLM reads it; the error said "unsupported architectures []"."""
    model_dir = shutil.copytree(llama[1], tmp_path / "untyped")
    rewrite_config(model_dir, architectures=None)
    assert ModelConfig.from_dir(model_dir) == ModelConfig.from_dir(llama[1])
    rewrite_config(model_dir, model_type="gpt2")
    with pytest.raises(ValueError, match="names no architectures, and its model_type 'gpt2' is none of gemma3, "):
        ModelConfig.from_dir(model_dir)


def test_every_part_of_every_family_has_its_hugging_face_name():
    """hf_tensor_name (a missing tensor's name in the loader's error) is the inverse of hf_name_mapper: every part a
    model of each supported architecture reads maps back from the name it gives."""
    from torch_shift.config import SUPPORTED_ARCHITECTURES
    from torch_shift.models import loader

    for arch in SUPPORTED_ARCHITECTURES:
        written = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 128,
                   "attention_bias": arch == "LlamaForCausalLM", "num_experts": 4, "num_local_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
        if arch.endswith("ForConditionalGeneration"):
            written = {"architectures": [arch], "text_config": {k: v for k, v in written.items()
                                                                if k != "architectures"}}
        config = ModelConfig.from_hf_dict(written)
        to_model = loader.hf_name_mapper(config.family)
        whole = (loader.FUSED, loader.STACKED, loader.STACKED_INTERLEAVED)
        for param, part in loader.expected_parts(config):
            name = loader.hf_tensor_name(config.family, param, part)
            assert name is not None, (arch, param, part)
            placed = to_model(name)
            assert placed == (param, part) or placed[0] == param and placed[1] in whole, (arch, name)


def test_missing_and_inconsistent_checkpoint_files(tmp_path, checkpoints):
    hf_model, _ = checkpoints("llama")
    sharded = save_checkpoint(hf_model, tmp_path / "sharded", with_tokenizer=False, max_shard_size="100KB")
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"missing: {shard.name}"):
        load_model(sharded)

    wrong_shape = save_checkpoint(hf_model, tmp_path / "shape", with_tokenizer=False)
    rewrite_config(wrong_shape, intermediate_size=96)
    with pytest.raises(ValueError, match="mlp.*has shape .* config.json implies"):
        load_model(wrong_shape)

    fewer_layers = save_checkpoint(hf_model, tmp_path / "layers", with_tokenizer=False)
    rewrite_config(fewer_layers, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lacks tensors for model\.layers\.2\.input_layernorm\.weight"):
        load_model(fewer_layers)  # named as the checkpoint names them, not as the engine's fused parameters

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(empty)
    shutil.copy(sharded / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(empty)


def test_resolve_hub_id_from_local_cache(tmp_path, monkeypatch, llama):
    """A hub id resolves through huggingface_hub's cache layout; an unknown one offline is a clear error."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny--llama" / "snapshots" / ("a" * 40)
    shutil.copytree(llama[1], snapshot)
    (cache / "models--tiny--llama" / "refs").mkdir()
    (cache / "models--tiny--llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from torch_shift.models.hub import resolve_model_dir

    assert resolve_model_dir("tiny/llama") == snapshot
    with pytest.raises(ValueError, match=f"'tiny/absent'.*{cache}"):
        resolve_model_dir("tiny/absent")
    pickled = cache / "models--tiny--pickled" / "snapshots" / ("b" * 40)  # no safetensors: the .bin files
    _pickled_checkpoint(llama[1], pickled, 1)
    (cache / "models--tiny--pickled" / "refs").mkdir()
    (cache / "models--tiny--pickled" / "refs" / "main").write_text("b" * 40)
    assert resolve_model_dir("tiny/pickled") == pickled


def test_hub_id_with_dots_resolves_from_a_cache_laid_out_by_huggingface_hub(tmp_path, monkeypatch, llama):
    """Most real ids have a dot (Qwen2.5-0.5B, Llama-3.2-1B): blobs named by hash, a snapshot of symlinks
    to them, refs/main naming the commit, as huggingface_hub writes its cache. A missing path is named."""
    import hashlib
    import os

    from huggingface_hub import constants

    from torch_shift.models.hub import resolve_model_dir

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--Tiny-Llama-3.2-0.5B"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in llama[1].iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert resolve_model_dir("tiny-org/Tiny-Llama-3.2-0.5B") == snapshot
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert (LLM("tiny-org/Tiny-Llama-3.2-0.5B").generate([[7, 8, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == LLM(str(llama[1])).generate([[7, 8, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    (tmp_path / "file.bin").write_bytes(b"")
    for missing in (tmp_path / "nowhere", "./nowhere", "a/b/c", "tiny-org/Absent-0.5B"):
        with pytest.raises(ValueError, match="no such directory"):
            resolve_model_dir(str(missing))
    with pytest.raises(ValueError, match="is a file: a model is a checkpoint directory"):
        resolve_model_dir(str(tmp_path / "file.bin"))
