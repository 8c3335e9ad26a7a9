"""GPT-OSS against Hugging Face `transformers` on random checkpoints: YaRN rotary tables, the sparse block
(router with a bias, softmax after top-k, expert biases, clamped SwiGLU, interleaved gate/up columns), the
engine's greedy tokens and logprobs with attention sinks and alternating windowed and full layers (chunked
prefill, preemption, eager and compiled, every CPU attention backend), the checkpoint layouts, MXFP4 experts
dequantized as transformers does, other quantized checkpoints refused."""

from __future__ import annotations

import json
import shutil

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
    refuse_python_ulysses,
)
from safetensors.torch import load_file, save_file
from test_moe import SHARDED, assert_layout_matches_one_rank

from torch_shift import LLM, LLMEngine, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.models import load_model
from torch_shift.models.convert import convert_checkpoint
from torch_shift.models.mxfp4 import Mxfp4Experts, dequantize
from torch_shift.models.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4
SLIDING_WINDOW = 8  # prompts run past it, so that windowed and full layers differ
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def build_gpt_oss(name: str = "gpt_oss", seed: int = 0, **overrides):
    """Four layers (windowed, full, windowed, full), 4 experts of which 2 per token, random biases and sinks."""
    kwargs = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
              "sliding_window": SLIDING_WINDOW, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256,
              "initializer_range": 0.3, "rms_norm_eps": 1e-6, "rope_parameters": YARN,
              "swiglu_limit": 1.5,  # low, so that the clamps bite
              "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3, **overrides}
    config = transformers.GptOssConfig(**kwargs)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or name_.endswith("sinks"):  # zero-initialised by transformers
                p.normal_(0.0, 0.5)
        for layer in model.model.layers:
            layer.mlp.router.weight *= 3.0  # decisive routing: top-k margins far above float32 noise
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, build_gpt_oss)("gpt_oss")


def test_config_reads_layers_windows_experts_and_counts_parameters(gpt_oss):
    hf_model, model_dir = gpt_oss
    config = ModelConfig.from_dir(model_dir)
    assert config.family == "gpt_oss" and config.sparse_layers == (0, 1, 2, 3)
    assert config.layer_windows == (SLIDING_WINDOW, None) * 2 and config.sliding_window is None
    assert config.attention_sinks and config.o_proj_bias and config.attention_bias
    assert config.moe_routing == "topk_softmax" and config.router_bias and config.expert_bias
    assert config.swiglu_limit == 1.5 and config.swiglu_alpha == pytest.approx(1.702)
    assert config.num_parameters == sum(p.numel() for p in hf_model.parameters())
    per_expert = 3 * 64 * 32 + 2 * 32 + 64
    assert config.num_parameters - config.num_active_parameters == 4 * (4 - 2) * per_expert


def test_mxfp4_is_read_for_gpt_oss_only_and_unknown_methods_refused(gpt_oss, tmp_path):
    _, model_dir = gpt_oss
    hf = json.loads((model_dir / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    assert ModelConfig.from_hf_dict(hf).quantization.method == "mxfp4"
    hf["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="GptOssForCausalLM: bitsandbytes checkpoints are not supported"):
        ModelConfig.from_hf_dict(hf)
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 1, "vocab_size": 128, "intermediate_size": 32,
             "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match="LlamaForCausalLM: mxfp4 checkpoints are read for GPT-OSS's experts only"):
        ModelConfig.from_hf_dict(llama)


MXFP4_SCALES = (118, 124)  # E8M0 bytes of the random experts: weights up to 6 * 2 ** -3


def mxfp4_checkpoint(model_dir, out_dir, seed: int = 0):
    """`model_dir`'s checkpoint with every expert projection replaced by random MXFP4 blocks and scales, as
    openai/gpt-oss-* store them (`quantization_config` and a bfloat16 `dtype` in config.json)."""
    out_dir.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out_dir / f.name)
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # [E, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(*MXFP4_SCALES, (experts, rows, cols // 32), generator=generator,
                                                  dtype=torch.uint8)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((model_dir / "config.json").read_text())
    hf |= {"dtype": "bfloat16", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (out_dir / "config.json").write_text(json.dumps(hf))
    return out_dir


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """An MXFP4 checkpoint and transformers' model of it (its experts dequantized, `Mxfp4Config`), float32."""
    model_dir = mxfp4_checkpoint(gpt_oss[1], tmp_path_factory.mktemp("mxfp4") / "model")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    return hf_model, model_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_dequantized_as_transformers_does(dtype):
    """Every E2M1 code and every finite E8M0 scale (the extremes overflow and underflow as in transformers)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 4), generator=generator, dtype=torch.uint8)
    scales[0, 0, :] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    experts = Mxfp4Experts("experts.gate_up_proj", blocks, scales, dtype)
    assert experts.get_shape() == tuple(ref.shape) == (3, 128, 40)
    got = torch.stack([experts[e] for e in range(3)])
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))
    assert dequantize(blocks, scales, dtype).shape == (3, 40, 128)


def test_mxfp4_expert_kept_only_for_its_reads():
    """A gate/up projection's expert is dequantized once for its gate and up parts, then dropped (a loaded model's
    experts are not held twice); a down projection's is not kept."""
    generator = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 8, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.full((2, 8, 2), 127, dtype=torch.uint8)
    gate_up = Mxfp4Experts("gate_up_proj", blocks, scales, torch.float32, reads=2)
    first = gate_up[1]
    assert gate_up[1] is first and gate_up._kept is None
    assert gate_up[1] is not first and torch.equal(gate_up[1], first)
    down = Mxfp4Experts("down_proj", blocks, scales, torch.float32)
    down[0]
    assert down._kept is None


def test_mxfp4_blocks_and_scales_in_different_shards(gpt_oss_mxfp4, tmp_path):
    _, model_dir = gpt_oss_mxfp4
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if not n.endswith("_scales")},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n.endswith("_scales")}}
    for file, part in shards.items():
        save_file(part, sharded / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompt = random_prompts(1, [20], seed=6)[0]
    whole = engine_logits(LLMEngine(EngineArgs(str(model_dir), dtype="float32")), prompt)
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(sharded), dtype="float32")), prompt), whole,
                               atol=0, rtol=0)


def test_mxfp4_nan_scales_and_unpaired_blocks_are_refused(gpt_oss_mxfp4, tmp_path):
    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.full((2, 3), 127, dtype=torch.uint8)
    scales[1, 2] = 0xFF
    with pytest.raises(ValueError, match="scale 0xFF"):
        dequantize(blocks, scales)
    with pytest.raises(ValueError, match="blocks .* and scales .* expected"):
        dequantize(blocks, scales[:, :2])
    _, model_dir = gpt_oss_mxfp4
    shutil.copytree(model_dir, tmp_path / "model")
    tensors = load_file(tmp_path / "model" / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model" / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj_blocks' has no 'model.layers.2.mlp.experts.down_proj_scales'"):
        load_model(tmp_path / "model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_mxfp4_checkpoint_matches_transformers(gpt_oss_mxfp4, dtype):
    """The experts dequantized as read: greedy tokens and logprobs transformers' (float32); in bfloat16, the
    checkpoint's dtype and the engine's default here, the parameters those of transformers' model in bfloat16."""
    hf_model, model_dir = gpt_oss_mxfp4
    if dtype == "bfloat16":
        hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True))
        ours = load_model(model_dir, dtype=torch.bfloat16)
        for layer, ref in zip(ours.layers, hf_bf16.model.layers):
            assert torch.equal(layer.mlp.experts.down_proj, ref.mlp.experts.down_proj.transpose(1, 2))
            gate_up = ref.mlp.experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
            assert torch.equal(layer.mlp.experts.gate_up_proj, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
        return
    prompts = random_prompts(8, PROMPT_LENGTHS, seed=2)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), dtype=dtype, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_match_transformers(outs, refs, ref_logprobs, FP32_ATOL)


def test_mxfp4_checkpoint_converts_to_an_unquantized_one(gpt_oss_mxfp4, tmp_path):
    _, model_dir = gpt_oss_mxfp4
    prompt = random_prompts(1, [30], seed=5)[0]
    ref = engine_logits(LLMEngine(EngineArgs(str(model_dir), dtype="float32")), prompt)
    converted = convert_checkpoint(model_dir, tmp_path / "converted", progress=False)
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    stored = load_file(converted / "model-00000.safetensors")
    assert stored["layers.0.mlp.experts.down_proj.1"].dtype == torch.bfloat16  # the checkpoint's dtype
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(converted), tokenizer=str(model_dir),
                                                                  dtype="float32")), prompt), ref, atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tp2", "ep_shift_sp2"])
def test_mxfp4_checkpoint_in_layouts_matches_one_rank(gpt_oss_mxfp4, family):
    """Each rank reads its slice of the dequantized experts (TP: their rows; EP: whole experts)."""
    assert_layout_matches_one_rank(gpt_oss_mxfp4[1], *SHARDED[family], dtype="float32")


def test_yarn_rotary_tables_match_transformers(gpt_oss):
    hf_model, model_dir = gpt_oss
    config = ModelConfig.from_dir(model_dir)
    positions = torch.arange(200)
    cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    half = config.head_dim // 2
    assert hf_model.model.rotary_emb.attention_scaling != 1.0
    torch.testing.assert_close(ours.cos_sin[0, :200, :half], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(ours.cos_sin[1, :200, :half], sin[0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_block_matches_transformers(gpt_oss, dtype):
    _, model_dir = gpt_oss
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ours = load_model(model_dir, dtype=dtype)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        ref = hf_model.model.layers[1].mlp(x[None])[0][0]
        got = ours.layers[1].mlp(x)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tolerance * ref.abs().max().item(), rtol=0)


def test_the_lm_heads_rows_alone_leave_the_last_layer(gpt_oss):
    assert_lm_head_rows_alone(gpt_oss[1], exact=False)  # a sparse MLP, sinks and windows


PROMPT_LENGTHS = [3, 17, 40, 1, 9, 64, 33, 5]
MAX_TOKENS = 10


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 16},  # prompts split into chunks, mixed with decodes
    {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},  # a pool small enough to preempt
    {"max_num_batched_tokens": 16, "compile": False},  # eager
    {"max_num_batched_tokens": 16, "compile": True},  # sinks and windows through the compiled C++ attention call
    {"max_num_batched_tokens": 16, "attention_backend": "sdpa"},  # the reference backend
], ids=["chunked", "preempted", "eager", "compiled", "sdpa"])
def test_greedy_tokens_and_logprobs_match_transformers(gpt_oss, engine_args):
    hf_model, model_dir = gpt_oss
    prompts = random_prompts(8, PROMPT_LENGTHS)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_match_transformers(outs, refs, ref_logprobs, FP32_ATOL)
    engine = llm.engine
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sinks_and_windows_matter(gpt_oss):
    """The comparison above would notice either feature missing: without sinks, or with every layer full, the
    logits of a prompt longer than the window move far beyond the tolerance."""
    hf_model, model_dir = gpt_oss
    prompt = random_prompts(1, [40], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        got = engine_logits(LLMEngine(EngineArgs(str(model_dir), block_size=8, max_num_batched_tokens=24)), prompt)
        torch.testing.assert_close(got, ref, atol=FP32_ATOL, rtol=1e-5)
        sinks = [layer.self_attn.sinks.clone() for layer in hf_model.model.layers]
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (hf_model(torch.tensor([prompt])).logits[0] - ref).abs().max() > 100 * FP32_ATOL
        for layer, s in zip(hf_model.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
        full = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, layer_types=["full_attention"] * 4).eval()
        assert (full(torch.tensor([prompt])).logits[0] - ref).abs().max() > 100 * FP32_ATOL


def test_converted_checkpoint_and_in_memory_model_give_the_same_outputs(gpt_oss, tmp_path):
    assert_converted_and_handed_off_alike(*gpt_oss, tmp_path / "converted")


# every family that shards the model, and DP replicas and pipeline stages (SHARDED: test_moe's)
LAYOUTS = {**SHARDED, "dp2": (2, {"dp": 2}, {"dp@0", "dp@1"}), "pp2": (2, {"pp": 2}, {"pp"}),
           # SP-4 alone, compiled: the last steps' 1-3 tokens leave SP ranks without rows (they only attend, with
           # their sinks and windows), and Ulysses runs in C++ around the paged attention
           "sp4_compiled": (4, {"sp": 4, "shift_threshold": None, "compile": True}, {"base"})}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_every_layout_matches_one_rank(gpt_oss, family, monkeypatch):
    """Sinks sharded with their heads (and handed to each Ulysses rank for its head chunk), o_proj's and the
    experts' down bias added once after the TP sum, the gate/up biases split with their rows, windows per
    layer in pipeline stages: greedy tokens and logprobs those of one rank."""
    world, engine_args, layouts = LAYOUTS[family]
    _, model_dir = gpt_oss
    if engine_args.get("compile"):
        refuse_python_ulysses(monkeypatch)  # the compiled steps' Ulysses runs in C++
    assert_layout_matches_one_rank(model_dir, world, engine_args, layouts)
