"""Quantized checkpoints read as the weights they stand for: GPTQ (both formats, 2/4/8 bits, act-order), AWQ (GEMM),
FP8 with block scales and compressed-tensors (packed and unpacked integers, float8) against transformers on the same
weights (the checkpoint itself where transformers reads the format on a CPU: FP8, compressed-tensors; else the
weights dequantized by the format's formula), every window a parallel plan reads, TP-2 / Shift / Flying / Seesaw
against one rank, `torch-shift convert`, and each unsupported configuration refused by name."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import (
    assert_converted_and_handed_off_alike,
    assert_outputs_match_transformers,
    build_hf_model,
    hf_greedy_logprobs,
    random_prompts,
    save_checkpoint,
)
from safetensors.torch import load_file, save_file
from test_moe import DENSE_SHARDED, SHARDED, assert_layout_matches_one_rank, build_moe_model

from torch_shift import LLM, SamplingParams
from torch_shift.config import ModelConfig, WeightQuantization
from torch_shift.models import load_model
from torch_shift.models.quantized import QuantizedWeight
from torch_shift.models.toy import awq_tensors, fp8_tensors, gptq_tensors, quantize_checkpoint

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4


def write_quantized_checkpoint(hf_model, out_dir, method: str, **kwargs):
    """`hf_model` saved, then quantized by toy.quantize_checkpoint -> the quantized checkpoint's directory and a
    copy of `hf_model` holding the weights it stands for (a dense model's: its names are the checkpoint's)."""
    stands_for = quantize_checkpoint(save_checkpoint(hf_model, out_dir / "source"), out_dir / method, method,
                                     **kwargs)
    reference = copy.deepcopy(hf_model)
    assert not reference.load_state_dict(stands_for, strict=False).unexpected_keys
    return out_dir / method, reference


def write_compressed_checkpoint(hf_model, out_dir, fmt: str, **weights):
    """`hf_model` quantized by compressed-tensors (min-max scales and zero points) and saved compressed in `fmt`,
    as llm-compressor saves its checkpoints."""
    compressed_tensors = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    del compressed_tensors
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(hf_model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in hf_model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.data
            if args.strategy == "group":
                weight = weight.view(weight.shape[0], -1, args.group_size)
                low, high = weight.amin(-1), weight.amax(-1)
            elif args.strategy == "tensor":
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            else:
                low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(hf_model, quantization_format=fmt)
    compressor.compress_model(hf_model)
    save_checkpoint(hf_model, out_dir)
    compressor.update_config(str(out_dir))
    return out_dir


COMPRESSED = {
    "w4_group_asym": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                         "group_size": 32}),
    "w8_channel": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}),
    "w8_channel_packed_asym": ("pack-quantized", {"num_bits": 8, "type": "int", "symmetric": False,
                                                  "strategy": "channel"}),
    "fp8_channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
    # the format compressed-tensors itself infers for float8 weights of one scale per tensor
    "fp8_tensor_naive": ("naive-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}),
}


INTEGER = {  # name -> quantize_checkpoint's arguments
    "gptq": {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True},
    "gptq_v2_8bit": {"method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2", "symmetric": True},
    "gptq_2bit": {"method": "gptq", "bits": 2, "group_size": 16},
    "awq": {"method": "awq", "group_size": 32},
}


def reference_of(model_dir):
    """transformers' model from the checkpoint itself, dequantized as it loads (FP8 on a CPU always is)."""
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    kwargs = {}
    if config["quant_method"] == "compressed-tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """name -> (transformers' model of the weights the checkpoint stands for, the checkpoint's directory), each
    written once."""
    cache = {}

    def get(name):
        if name not in cache:
            model = build_moe_model("qwen3_moe") if name == "fp8_qwen3_moe" else build_hf_model("llama")
            out_dir = tmp_path_factory.mktemp(name)
            if name in INTEGER:
                cache[name] = write_quantized_checkpoint(model, out_dir, **INTEGER[name])[::-1]
            else:
                if name.startswith("fp8"):  # blocks of 16 rows: transformers requires whole blocks
                    out_dir = out_dir / "fp8"
                    quantize_checkpoint(save_checkpoint(model, out_dir.with_name("source")), out_dir, "fp8",
                                        block=(16, 32))
                else:
                    write_compressed_checkpoint(model, out_dir, COMPRESSED[name][0], **COMPRESSED[name][1])
                cache[name] = reference_of(out_dir), out_dir
        return cache[name]
    return get


ALL = [*INTEGER, "fp8", *COMPRESSED]


@pytest.mark.parametrize("name", [*ALL, "fp8_qwen3_moe"])
def test_greedy_outputs_match_transformers(quantized, name):
    """Greedy tokens and logprobs of the quantized checkpoint those of transformers on the weights it stands
    for, chunked prefill on; a Qwen3-MoE's experts each stored in FP8 too. (transformers 5.25 dequantizes a
    Mixtral's FP8 w2 experts wrongly, by up to 0.19 here: torch_shift's are the formula's.)"""
    reference, model_dir = quantized(name)
    prompts = random_prompts(3, [5, 40, 17])
    refs, ref_logprobs = hf_greedy_logprobs(reference, prompts, 8)
    llm = LLM(str(model_dir), max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_match_transformers(outputs, refs, ref_logprobs, FP32_ATOL)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_the_dequantized_ones(quantized, name, dtype):
    """Every linear layer's weight bit for bit transformers' dequantized one, rounded once into the engine's
    dtype."""
    reference, model_dir = quantized(name)
    model = load_model(model_dir, dtype=dtype)
    for layer, ref in zip(model.layers, reference.model.layers):
        attention, mlp = ref.self_attn, ref.mlp
        expected = {
            layer.attn.qkv_proj: [attention.q_proj, attention.k_proj, attention.v_proj],
            layer.attn.o_proj: [attention.o_proj],
            layer.mlp.gate_up_proj: [mlp.gate_proj, mlp.up_proj],
            layer.mlp.down_proj: [mlp.down_proj],
        }
        for linear, parts in expected.items():
            assert torch.equal(linear.weight, torch.cat([p.weight for p in parts]).to(dtype))


WINDOWS = [(slice(None), slice(None)), (slice(3, 29), slice(None)), (slice(None), slice(5, 51)),
           (slice(13, 14), slice(0, 64)), (slice(7, 40), slice(33, 64)), (slice(40, 40), slice(None))]


def _weights(seed: int = 0) -> dict[str, QuantizedWeight]:
    """One [40, 64] weight per format, with windows that cut words, groups and blocks."""
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(seed))
    weights = {}
    for bits, group_size, act_order in ((4, 16, True), (2, -1, False), (8, 32, False)):
        tensors, _ = gptq_tensors(weight, bits, group_size, act_order, 1, seed)
        weights[f"gptq{bits}"] = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()}, WeightQuantization(
            "gptq", bits=bits, group_size=max(group_size, 0), zero_offset=1))
    tensors, _ = awq_tensors(weight, 16)
    weights["awq"] = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()},
                                     WeightQuantization("awq", bits=4, group_size=16))
    for block in ((16, 32), (32, 48)):  # the second cut at the weight's edges
        tensors, _ = fp8_tensors(weight, block)
        weights[f"fp8_{block}"] = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()},
                                                  WeightQuantization("fp8", bits=8, block=block))
    pack_to_int32 = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (40, 64), generator=generator, dtype=torch.int8)
    zero_points = torch.randint(-8, 8, (40, 4), generator=generator, dtype=torch.int8)
    weights["compressed_group_asym"] = QuantizedWeight("w", {
        ".weight_packed": pack_to_int32(codes, 4), ".weight_shape": torch.tensor([40, 64]),
        ".weight_scale": torch.rand(40, 4, generator=generator).bfloat16(),
        ".weight_zero_point": pack_to_int32(zero_points, 4, packed_dim=0),
        ".weight_g_idx": torch.randperm(64, generator=generator).to(torch.int32) // 16,
    }, WeightQuantization("compressed-tensors", bits=4, group_size=16, format="pack-quantized", strategy="group"))
    weights["compressed_block"] = QuantizedWeight("w", {
        ".weight": torch.randint(-128, 128, (40, 64), generator=generator, dtype=torch.int8),
        ".weight_scale": torch.rand(3, 2, generator=generator),
    }, WeightQuantization("compressed-tensors", bits=8, block=(16, 48), format="int-quantized", strategy="block"))
    return weights


@pytest.mark.parametrize("window", WINDOWS)
def test_windows_read_what_the_whole_weight_holds(window):
    """Every window a parallel plan reads (rows of a column shard, columns of a row shard, both for a fused part)
    is the window of the whole weight, bit for bit, where it cuts packed words, groups and scale blocks."""
    for name, weight in _weights().items():
        whole = weight[:]
        assert whole.shape == weight.get_shape() == (40, 64), name
        assert torch.equal(weight[window], whole[window]), name


def test_formats_dequantize_by_their_formulas():
    """Each format's weight is its formula on the codes: GPTQ's v1 zero points one above the stored ones, AWQ's
    interleaved columns, FP8's float32 product, the edges of partial FP8 blocks."""
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    for (tensors, dense), quant in ((gptq_tensors(weight, 4, 16, True), WeightQuantization(
            "gptq", bits=4, group_size=16, zero_offset=1)),
                                    (awq_tensors(weight, 16), WeightQuantization("awq", bits=4, group_size=16))):
        got = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()}, quant)[:]
        assert got.dtype == torch.float16 and torch.equal(got, dense), quant.method
    tensors, dense = fp8_tensors(weight, (32, 48))
    got = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()}, WeightQuantization("fp8", block=(32, 48)))[:]
    assert got.dtype == torch.float32 and torch.equal(got, dense)
    # E8M0 scales (scale_fmt "ue8m0"): a byte b scales by 2 ** (b - 127)
    tensors["weight_scale_inv"] = torch.full((2, 2), 130, dtype=torch.uint8)
    got = QuantizedWeight("w", {"." + k: v for k, v in tensors.items()}, WeightQuantization("fp8", block=(32, 48)))[:]
    assert torch.equal(got, tensors["weight"].float() * 8)


def test_window_reads_refuse_steps():
    weight = _weights()["awq"]
    with pytest.raises(TypeError, match="windows of rows and columns"):
        weight[::2]


@pytest.mark.slow
@pytest.mark.parametrize("family", DENSE_SHARDED)
def test_layouts_match_one_rank(quantized, family):
    """TP-2, Shift's SP-2 x TP-2, Flying and Seesaw on a GPTQ checkpoint with act-order (each rank reading its
    rows and columns of the packed tensors): greedy tokens and logprobs those of one rank."""
    assert_layout_matches_one_rank(quantized("gptq")[1], *DENSE_SHARDED[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tp2", "ep_tp2"])
def test_quantized_experts_match_one_rank(quantized, family):
    """A Qwen3-MoE's FP8 experts split by TP, or whole per rank: greedy tokens and logprobs those of one rank."""
    assert_layout_matches_one_rank(quantized("fp8_qwen3_moe")[1], *SHARDED[family])


@pytest.mark.parametrize("name", ["gptq", "fp8", "w4_group_asym"])
def test_converted_and_handed_off(quantized, name, tmp_path):
    """`torch-shift convert` writes the dequantized weights (its config without a quantization_config) and gives
    the same logits; transformers' module of the same weights handed over gives the checkpoint's tokens."""
    reference, model_dir = quantized(name)
    assert_converted_and_handed_off_alike(reference, model_dir, tmp_path / "converted")
    assert "quantization_config" not in json.loads((tmp_path / "converted" / "config.json").read_text())


def _config(quant: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 512,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "quantization_config": quant}


def _compressed(weights: dict | None = None, **changes) -> dict:
    scheme = {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                          "dynamic": False, **(weights or {})}}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, **changes}


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "4-bit weights only"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes checkpoints are not supported"),
    ({"quant_method": "mxfp4"}, "GPT-OSS's experts only"),
    (_compressed(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]}),
     "sparsity_config is not supported"),
    (_compressed(moe_sparsity_config={"format": "sparse-24-bitmask"}), "moe_sparsity_config is not supported"),
    (_compressed(quantization_status="frozen"), "quantization_status 'frozen'"),
    ({**_compressed(), "config_groups": {}}, "0 config_groups"),
    (_compressed({"num_bits": 4, "type": "float"}), "4-bit float weights are not supported"),
    (_compressed({"num_bits": 8, "type": "float"}), "float weights in format 'pack-quantized'"),
    (_compressed({"strategy": "token"}), "strategy 'token'"),
    (_compressed({"strategy": "group", "group_size": None}), "group_size None"),
    (_compressed({"dynamic": True}), "quantized dynamically"),
    ({**_compressed(), "config_groups": {"group_0": {**_compressed()["config_groups"]["group_0"],
                                                     "input_activations": {"num_bits": 8, "dynamic": False}}}},
     "static scales"),
    ({**_compressed(), "config_groups": {"group_0": {**_compressed()["config_groups"]["group_0"],
                                                     "format": "nvfp4-pack-quantized"}}}, "format 'nvfp4"),
])
def test_unsupported_quantization_is_refused(quant, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(_config(quant))


def test_configs_read_as_hub_checkpoints_write_them():
    """Qwen2.5's GPTQ-Int4 (no checkpoint_format: the original one) and llm-compressor's w4a16 of 2024 (a "dense"
    sparsity_config without targets); a compression_config (compressed-tensors' old name) is named."""
    qwen_gptq = {"bits": 4, "desc_act": False, "exllama_config": {"version": 1}, "group_size": 128,
                 "quant_method": "gptq", "sym": True, "true_sequential": True, "use_exllama": True}
    assert ModelConfig.from_hf_dict(_config(qwen_gptq)).quantization == WeightQuantization(
        "gptq", bits=4, group_size=128, zero_offset=1)
    dense = _compressed(sparsity_config={"format": "dense", "global_sparsity": 0.1, "targets": [], "ignore": [],
                                         "sparsity_structure": "unstructured"})
    assert ModelConfig.from_hf_dict(_config(dense)).quantization.format == "pack-quantized"
    legacy = _config({})
    legacy["compression_config"] = _compressed()
    with pytest.raises(ValueError, match="'compression_config' .* rename it to 'quantization_config'"):
        ModelConfig.from_hf_dict(legacy)


def test_dynamic_activations_leave_the_weights_read():
    """A scheme that also quantizes activations dynamically (W8A8, FP8-dynamic) loads its weights; the
    activations stay in the engine's dtype (as transformers runs FP8 checkpoints on a CPU)."""
    quant = _compressed(input_activations={"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"})
    quant["config_groups"]["group_0"]["input_activations"] = quant.pop("input_activations")
    config = ModelConfig.from_hf_dict(_config(quant))
    assert config.quantization == WeightQuantization("compressed-tensors", bits=4, group_size=32,
                                                     format="pack-quantized", strategy="group")


def test_a_missing_companion_tensor_is_named(quantized, tmp_path):
    _, model_dir = quantized("gptq")
    broken = tmp_path / "broken"
    tensors = _copy_checkpoint(model_dir, broken)
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.qweight' has no "
                                         r"'model.layers.1.mlp.down_proj.qzeros' beside it"):
        load_model(broken)


def test_a_float16_checkpoint_keeps_its_dtype_on_a_cpu_with_a_warning(quantized, caplog):
    """dtype "auto" keeps a float16 checkpoint's dtype (vLLM's rule, what GPTQ and AWQ checkpoints name) and says
    what float16 costs on a CPU; a dtype given is taken without a word."""
    from dataclasses import replace

    from torch_shift.engine.llm_engine import EngineArgs

    _, model_dir = quantized("gptq")
    config = replace(ModelConfig.from_dir(model_dir), torch_dtype="float16")
    with caplog.at_level("WARNING", logger="torch_shift"):
        assert EngineArgs(str(model_dir)).create_engine_config(config, model_dir).dtype == torch.float16
    assert "dtype='float32' holds float16 weights exactly" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="torch_shift"):
        assert EngineArgs(str(model_dir), dtype="float16").create_engine_config(config, model_dir).dtype == \
            torch.float16
    assert "float16" not in caplog.text


def test_a_sharded_checkpoint_is_quantized_and_read_alike(tmp_path):
    """toy.quantize_checkpoint keeps a sharded checkpoint's index right, and the reader pairs each weight's tensors
    across the shards: the same parameters as from one file."""
    model = build_hf_model("llama")
    one = quantize_checkpoint(save_checkpoint(model, tmp_path / "one"), tmp_path / "one_gptq", "gptq", group_size=32)
    sharded_dir = save_checkpoint(model, tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(sharded_dir.glob("*.safetensors"))) > 2
    sharded = quantize_checkpoint(sharded_dir, tmp_path / "sharded_gptq", "gptq", group_size=32)
    assert one.keys() == sharded.keys()
    index = json.loads((tmp_path / "sharded_gptq" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.down_proj.qweight" in index and "model.layers.0.mlp.down_proj.weight" not in index
    expected = dict(load_model(tmp_path / "one_gptq").named_parameters())
    for name, value in load_model(tmp_path / "sharded_gptq").named_parameters():
        assert torch.equal(value, expected[name]), name


def _copy_checkpoint(model_dir, out_dir):
    out_dir.mkdir()
    for f in model_dir.iterdir():
        (out_dir / f.name).write_bytes(f.read_bytes())
    return load_file(out_dir / "model.safetensors")


def test_gptqs_zero_biases_beside_layers_without_one_are_dropped(quantized, tmp_path):
    """Older AutoGPTQ checkpoints give every quantized layer a bias, zeros where the model has none: dropped, as
    vLLM drops them; one that is not zero is refused."""
    _, model_dir = quantized("gptq")
    copy_dir = tmp_path / "with_biases"
    tensors = _copy_checkpoint(model_dir, copy_dir)
    stems = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    tensors |= {f"{stem}.bias": torch.zeros(tensors[f"{stem}.scales"].shape[1], dtype=torch.float16)
                for stem in stems}
    save_file(tensors, copy_dir / "model.safetensors", metadata={"format": "pt"})
    expected = dict(load_model(model_dir).named_parameters())
    for name, value in load_model(copy_dir).named_parameters():
        assert torch.equal(value, expected[name]), name
    tensors[f"{stems[0]}.bias"][0] = 1.0
    save_file(tensors, copy_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{stems[0]}.bias' is not part of a LlamaForCausalLM, and not zero"):
        load_model(copy_dir)


def test_fp8_with_a_scale_per_tensor_is_named(quantized, tmp_path):
    _, model_dir = quantized("fp8")
    copy_dir = tmp_path / "per_tensor"
    tensors = _copy_checkpoint(model_dir, copy_dir)
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name.removesuffix("_inv")] = tensors.pop(name).amax().reshape(1)
    save_file(tensors, copy_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="FP8 with one scale per tensor"):
        load_model(copy_dir)


def test_scales_and_zero_points_of_other_shapes_are_refused():
    """A zero point unpacked where pack-quantized packs it (compressed-tensors' layout before April 2025) and a
    g_idx naming a group that is not there."""
    weights = _weights()
    group_asym = weights["compressed_group_asym"]
    tensors = dict(group_asym.tensors)
    tensors[".weight_zero_point"] = torch.zeros(40, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r".weight_zero_point has shape \(40, 4\), the weight implies \(5, 4\)"):
        QuantizedWeight("w", tensors, group_asym.quant)
    tensors = dict(group_asym.tensors)
    tensors[".weight_g_idx"] = torch.full((64,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="names groups outside the 4 of its scales"):
        QuantizedWeight("w", tensors, group_asym.quant)[:]
