"""Mixture of experts (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral) against Hugging Face `transformers` on
random checkpoints: the sparse block bit for bit, routing ties, the engine's greedy tokens and logprobs (chunked
prefill, preemption, prefix caching), the checkpoint layouts, and every layout that shards experts (TP, Shift,
Flying, Seesaw) against one rank."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    assert_outputs_match_transformers,
    checkpoint_cache,
    engine_logits,
    hf_greedy,
    hf_greedy_logprobs,
    random_prompts,
    rewrite_config,
    save_checkpoint,
)
from safetensors.torch import save_file
from test_shift import assert_same_outputs

from torch_shift import LLM, LLMEngine, SamplingParams
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.handoff import handoff
from torch_shift.kernels import cpu_ops, register_native_moe
from torch_shift.models import load_model
from torch_shift.models.convert import convert_checkpoint
from torch_shift.models.linear import PackedWeight, weight_bytes
from torch_shift.models.loader import build_model
from torch_shift.models.moe import SparseMoeBlock, route
from torch_shift.models.sources import DecoderSource
from torch_shift.parallel.launch import run_ranks
from torch_shift.parallel.layouts import build_deployment
from torch_shift.parallel.plan import validate_mesh_for_model
from torch_shift.planner import Layout, ModelShape, Seq, get_profile, memory_per_rank, step_cost, validate_layout
from torch_shift.planner.shape import busiest_rank_pairs

transformers = pytest.importorskip("transformers")

FP32_ATOL = 1e-4
ROUTER_SCALE = 3.0  # router weights 3x the initializer's: top-k margins far above float32 noise (decisive routing)

# name -> (config class, config); 8 query and 2 KV heads, hidden 64, top-2 routing
MOE_MODELS = {
    # layer 1 dense (mlp_only_layers), 4 layers so that each of two pipeline stages has a sparse layer at a
    # local index that differs from its index in the model
    "qwen3_moe": ("Qwen3MoeConfig", {"num_hidden_layers": 4, "intermediate_size": 128, "num_experts": 8,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": True,
                                     "head_dim": 16}),
    # every second layer sparse (decoder_sparse_step=2: layer 1), routing weights not renormalised
    "qwen3_moe_step2": ("Qwen3MoeConfig", {"num_hidden_layers": 2, "intermediate_size": 96, "num_experts": 4,
                                           "moe_intermediate_size": 48, "decoder_sparse_step": 2,
                                           "norm_topk_prob": False, "head_dim": 16}),
    "mixtral": ("MixtralConfig", {"num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": 4}),
    # a shared expert beside the routed ones in every sparse layer (layer 1 dense), q/k/v biases, no q/k norms
    "qwen2_moe": ("Qwen2MoeConfig", {"num_hidden_layers": 4, "intermediate_size": 128, "num_experts": 8,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                     "mlp_only_layers": [1], "norm_topk_prob": False, "initializer_range": 0.2}),
}


def build_moe_model(name: str, seed: int = 0, **overrides):
    config_cls, extra = MOE_MODELS[name]
    kwargs = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "num_experts_per_tok": 2,
              "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256, "initializer_range": 0.3, "rms_norm_eps": 1e-6,
              "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 3, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for router in routers(model):
            router.weight *= ROUTER_SCALE
    return model


def routers(hf_model) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in hf_model.model.layers if hasattr(layer.mlp, "gate")]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """name -> (transformers model, checkpoint directory as save_pretrained writes it); built once."""
    return checkpoint_cache(tmp_path_factory, build_moe_model)


def test_config_reads_the_experts_and_counts_parameters(moe_checkpoints):
    for name, sparse in (("qwen3_moe", (0, 2, 3)), ("qwen3_moe_step2", (1,)), ("mixtral", (0, 1)),
                         ("qwen2_moe", (0, 2, 3))):
        hf_model, model_dir = moe_checkpoints(name)
        config = ModelConfig.from_dir(model_dir)
        assert config.is_moe and config.sparse_layers == sparse and config.num_experts_per_tok == 2
        hf_config = hf_model.config
        assert config.num_experts == (getattr(hf_config, "num_local_experts", None) or hf_config.num_experts)
        assert config.num_parameters == sum(p.numel() for p in hf_model.parameters())
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        assert config.num_parameters - config.num_active_parameters == \
            len(sparse) * (config.num_experts - 2) * per_expert
    mixtral = ModelConfig.from_dir(moe_checkpoints("mixtral")[1])
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 48
    assert mixtral.norm_topk_prob and mixtral.float32_routing_weights
    qwen = ModelConfig.from_dir(moe_checkpoints("qwen3_moe")[1])
    assert qwen.norm_topk_prob and not qwen.float32_routing_weights and qwen.qk_norm
    assert not ModelConfig.from_dir(moe_checkpoints("qwen3_moe_step2")[1]).norm_topk_prob
    qwen2 = ModelConfig.from_dir(moe_checkpoints("qwen2_moe")[1])
    assert qwen2.shared_expert_intermediate_size == 48 and qwen2.attention_bias and not qwen2.o_proj_bias
    assert not (qwen2.norm_topk_prob or qwen2.float32_routing_weights or qwen2.qk_norm)
    assert qwen.shared_expert_intermediate_size == mixtral.shared_expert_intermediate_size == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_sparse_block_is_bitwise_transformers(moe_checkpoints, name, dtype):
    """The block on the same hidden states: the same bits as transformers' default (grouped) experts."""
    _, model_dir = moe_checkpoints(name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ours = load_model(model_dir, dtype=dtype)
    layer = ModelConfig.from_dir(model_dir).sparse_layers[-1]
    assert isinstance(ours.layers[layer].mlp, SparseMoeBlock)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    block, hf_block = ours.layers[layer].mlp, hf_model.model.layers[layer].mlp
    with torch.no_grad():
        ref = hf_block(x[None])[0]
        if block.shared_expert is not None:
            # the shared expert is a dense MLP: PyTorch's SiLU over its gate projection alone (transformers) rounds
            # some elements otherwise than over the fused gate/up rows (the dense layers' path), so it is compared
            # apart; with transformers' own module in its place, the block is transformers' bits
            torch.testing.assert_close(block.shared_expert(x), hf_block.shared_expert(x))
            block.shared_expert = hf_block.shared_expert
        got = block(x)
        assert got.dtype == dtype
        assert torch.equal(got, ref)
        assert torch.equal(block(x[:0]), ref[:0])  # a step without tokens


@pytest.mark.skipif(not cpu_ops(), reason="torch_shift's operator library does not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpp_experts_are_the_python_ones_bit_for_bit(dtype):
    """torch_shift::sparse_moe in C++ (kernels/cpu_ops.cpp, what compiled forwards run) against its Python
    implementation, which the test above holds to transformers: every routing, with and without biases, GPT-OSS's
    clamped SwiGLU, 0-200 tokens; experts that are not packed go to Python."""
    g = torch.Generator().manual_seed(0)
    experts, hidden, intermediate = 8, 64, 96
    gate_up = (torch.randn(experts, 2 * intermediate, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, intermediate, generator=g) * 0.1).to(dtype)
    packed = [PackedWeight(gate_up[e]) for e in range(experts)], [PackedWeight(down[e]) for e in range(experts)]
    handles = [w.handle for w in packed[0]], [w.handle for w in packed[1]]
    assert register_native_moe()
    with torch.inference_mode():
        for tokens in (0, 1, 3, 17, 200):
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            logits = torch.randn(tokens, experts, generator=g).to(dtype)
            for routing, norm, float32_weights in (("softmax_topk", False, False), ("softmax_topk", True, True),
                                                  ("topk_softmax", False, False)):
                for biases in (None, ((torch.randn(experts, 2 * intermediate, generator=g) * 0.1).to(dtype),
                                      (torch.randn(experts, hidden, generator=g) * 0.1).to(dtype))):
                    for limit in (None, 0.5):
                        for experts_handles in (handles, ([], [])):
                            args = (x, logits, gate_up, down, 2, norm, float32_weights, *experts_handles, routing,
                                    *(biases or (None, None)), limit, 1.702)
                            expected = torch.ops.torch_shift.sparse_moe_python(*args)
                            assert torch.equal(torch.ops.torch_shift.sparse_moe(*args), expected), (tokens, routing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_router_picks_the_experts_transformers_picks_on_ties(moe_checkpoints, name, dtype):
    """Experts with equal router rows tie on every token, a zero hidden state ties all experts: the same
    experts win in the same order, with the same weights."""
    hf_model, _ = moe_checkpoints(name)
    hf_router = copy.deepcopy(routers(hf_model)[0])
    config = ModelConfig.from_hf_dict({**hf_model.config.to_dict(), "architectures": hf_model.config.architectures})
    block = SparseMoeBlock(config)
    num_experts = config.num_experts
    weight = torch.randn(num_experts, 64, generator=torch.Generator().manual_seed(2))
    weight[num_experts - 1] = weight[0]  # experts 0 and E-1 always tie
    weight[2] = weight[1]  # and 1 and 2
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    x[:8] = 0  # every expert ties
    with torch.no_grad():
        hf_router = hf_router.to(dtype)
        hf_router.weight.copy_(weight)
        block.router.weight.copy_(weight)
        block.to(dtype)
        x = x.to(dtype)
        _, ref_weights, ref_ids = hf_router(x)
        weights, ids = route(block.router(x), block.top_k, block.norm_topk_prob, block.float32_routing_weights)
    assert torch.equal(ids, ref_ids) and weights.dtype == ref_weights.dtype and torch.equal(weights, ref_weights)
    assert (weights[8:, 0] == weights[8:, 1]).any()  # tied experts do win together
    assert torch.equal(ids[:8], ids[:1].expand(8, -1))


def _min_routing_margin(hf_model, sequences) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logit over `sequences` in every sparse layer."""
    margins = []
    hooks = [router.register_forward_hook(
        lambda module, inputs, output: margins.append(torch.topk(output[0].float(), 3, -1).values.diff(dim=-1)[:, 1]))
        for router in routers(hf_model)]
    with torch.no_grad():
        for seq in sequences:
            hf_model(torch.tensor([seq]))
    for hook in hooks:
        hook.remove()
    return -torch.cat(margins).max().item()


PROMPT_LENGTHS = [3, 17, 40, 1, 9, 64, 33, 5]
MAX_TOKENS = 10


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 16},  # prompts split into chunks, mixed with decodes
    {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},  # a pool small enough to preempt
    {"max_num_batched_tokens": 16, "compile": False},  # eager (compiled by default at world 1)
], ids=["chunked", "preempted", "eager"])
def test_greedy_tokens_and_logprobs_match_transformers(moe_checkpoints, name, engine_args):
    hf_model, model_dir = moe_checkpoints(name)
    prompts = random_prompts(8, PROMPT_LENGTHS)
    refs, ref_logprobs = hf_greedy_logprobs(hf_model, prompts, MAX_TOKENS)
    # no near-tie between the k-th and (k+1)-th expert: the router logits' float32 rounding (~1e-6 of logits of
    # a few units) cannot pick other experts
    assert _min_routing_margin(hf_model, [p + r for p, r in zip(prompts, refs)]) > 1e-4
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_match_transformers(outs, refs, ref_logprobs, FP32_ATOL)
    engine = llm.engine
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_prompt_logits_match_transformers(moe_checkpoints, name):
    hf_model, model_dir = moe_checkpoints(name)
    prompt = random_prompts(1, [50])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    got = engine_logits(LLMEngine(EngineArgs(str(model_dir), block_size=8, max_num_batched_tokens=24)), prompt)
    torch.testing.assert_close(got, ref, atol=FP32_ATOL, rtol=1e-5)
    assert ref.abs().max() > 5  # logits not flat: the comparison means something


def test_prefix_cache_hits_give_the_tokens_of_transformers(moe_checkpoints):
    hf_model, model_dir = moe_checkpoints("qwen3_moe")
    shared = random_prompts(1, [40], seed=3)[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    llm = LLM(str(model_dir), block_size=8)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    second = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_greedy(hf_model, p, 8) for p in prompts]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bfloat16_is_as_close_to_fp32_as_transformers(moe_checkpoints, name):
    hf_model, model_dir = moe_checkpoints(name)
    prompt = random_prompts(1, [30])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        hf_logits = hf_bf16(torch.tensor([prompt])).logits[0].float()
    engine = LLMEngine(EngineArgs(str(model_dir), dtype="bfloat16", max_num_batched_tokens=16))
    got = engine_logits(engine, prompt)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().mean() < 1.5 * (hf_logits - ref).abs().mean()
    # random experts amplify bfloat16's rounding: transformers itself agrees with float32 on 85-97% of argmaxes
    agreement = (got.float().argmax(-1) == ref.argmax(-1)).float().mean()
    assert agreement >= (hf_logits.argmax(-1) == ref.argmax(-1)).float().mean() - 0.1


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_stacked_experts_convert_and_in_memory_models(moe_checkpoints, tmp_path, name):
    """Experts stacked in one tensor per projection (transformers' in-memory layout) on disk and in a handoff
    of the model object, and `torch-shift convert`'s checkpoint: the logits of save_pretrained's layout."""
    hf_model, model_dir = moe_checkpoints(name)
    prompt = random_prompts(1, [30], seed=5)[0]
    ref = engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt)

    state = hf_model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    (stacked / "config.json").write_text((model_dir / "config.json").read_text())
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(stacked), tokenizer=str(model_dir))), prompt),
                               ref, atol=0, rtol=0)

    converted = convert_checkpoint(model_dir, tmp_path / "converted", progress=False)
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(converted))), prompt), ref, atol=0, rtol=0)
    # row-parallel weights stored transposed (a rank's shard one run of rows), a shared expert's down projection too
    manifest = json.loads((converted / "torch_shift_checkpoint.json").read_text())
    down = {e["param"]: e["transposed"] for e in manifest["tensors"].values()
            if e["param"].endswith("down_proj.weight")}
    assert down and all(down.values()), down

    prompts = random_prompts(3, [4, 9, 1], seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(prompts, greedy, use_tqdm=False)]
    got = handoff(hf_model, None, tokenizer=model_dir).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    ours = load_model(model_dir)
    got = LLM(ours, tokenizer=str(model_dir)).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    rebuilt = build_model(ours.config, DecoderSource(ours))  # what torch_shift.parallelize reads a DecoderLM with
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), rebuilt.state_dict().values(), strict=True))


def test_checkpoints_that_do_not_fit_the_config_are_clear_errors(moe_checkpoints, tmp_path):
    hf_model, _ = moe_checkpoints("mixtral")
    fewer_experts = save_checkpoint(hf_model, tmp_path / "fewer", with_tokenizer=False)
    rewrite_config(fewer_experts, num_local_experts=3)
    with pytest.raises(ValueError, match="block_sparse_moe.experts.3.w1.weight.*has no place"):
        load_model(fewer_experts)
    more_experts = save_checkpoint(hf_model, tmp_path / "more", with_tokenizer=False)
    rewrite_config(more_experts, num_local_experts=5)
    with pytest.raises(ValueError, match="has shape \\(4, 64\\), config.json implies \\(5, 64\\)"):
        load_model(more_experts)
    hf_qwen, _ = moe_checkpoints("qwen3_moe")
    dense_layer = save_checkpoint(hf_qwen, tmp_path / "dense", with_tokenizer=False)
    rewrite_config(dense_layer, mlp_only_layers=[])  # layer 1 is dense in the checkpoint
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj.weight.*has no place"):
        load_model(dense_layer)


def test_layouts_shard_every_experts_ffn_and_check_its_width(moe_checkpoints):
    config = ModelConfig.from_dir(moe_checkpoints("qwen3_moe")[1])  # moe_intermediate_size 32
    for args in ({"tp": 2}, {"sp": 2}, {"sp": 2, "tp": 2}, {"dp": 2, "flying": True}, {"pp": 2, "seesaw": True}):
        build_deployment(config, **args)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 \\(each expert's FFN\\) is not divisible by SP x TP"
                                         " = 64"):
        validate_mesh_for_model(replace(config, num_attention_heads=64, num_key_value_heads=64,
                                        intermediate_size=64 * 4), 8, 8)
    # a shared expert (Qwen2-MoE) is split as a dense MLP: its width must divide too, in the engine and the planner
    qwen2 = ModelConfig.from_dir(moe_checkpoints("qwen2_moe")[1])  # shared_expert_intermediate_size 48
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=48 is not divisible by SP x TP = 32"):
        validate_mesh_for_model(replace(qwen2, num_attention_heads=32, num_key_value_heads=32, intermediate_size=32,
                                        moe_intermediate_size=32), 1, 32)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=48 is not divisible by TP=32"):
        validate_layout(ModelShape.from_config(replace(qwen2, num_attention_heads=32, num_key_value_heads=32,
                                                       intermediate_size=32, moe_intermediate_size=32)),
                        Layout("tp", tp=32))
    # with every layer dense there is no shared expert either
    all_dense = ModelConfig.from_hf_dict({**json.loads((moe_checkpoints("qwen2_moe")[1] / "config.json").read_text()),
                                          "mlp_only_layers": [0, 1, 2, 3]})
    assert not all_dense.is_moe and all_dense.shared_expert_intermediate_size == 0


def _weights_rank(rank, world, model_dir):
    llm = LLM(str(model_dir), tp=world, enable_prefix_caching=False)
    return weight_bytes(llm.engine.model.base if world > 1 else llm.engine.model)  # world 1: one replica


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_planner_counts_the_weights_each_rank_holds(moe_checkpoints, name):
    """The planner's shape of a MoE config.json: its parameters and active parameters as the model's own, and
    a rank's weight bytes under TP-1 and TP-2 (every expert's FFN split, the router replicated) as the
    engine's ranks hold them."""
    hf_model, model_dir = moe_checkpoints(name)
    config = ModelConfig.from_dir(model_dir)
    shape = ModelShape.from_config(config)
    assert shape.num_parameters() == config.num_parameters == sum(p.numel() for p in hf_model.parameters())
    assert shape.num_active_parameters() == config.num_active_parameters
    assert shape.num_sparse_layers == len(config.sparse_layers)
    for world in (1, 2):
        held = run_ranks(_weights_rank, world, model_dir) if world > 1 else [_weights_rank(0, 1, model_dir)]
        assert held == [memory_per_rank(shape, Layout("tp", tp=world)).weight_bytes] * world


def _generate_rank(rank, world, model_dir, engine_args, prompts, params):
    llm = LLM(str(model_dir), **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, set(llm.engine.stats()["steps_by_layout"]) if rank == 0 else None


@pytest.mark.parametrize("engine_args,layouts", [({"dp": 2}, {"dp@0", "dp@1"}), ({"pp": 2}, {"pp"})],
                         ids=["dp2", "pp2"])
def test_data_parallel_replicas_and_pipeline_stages_match_one_rank(moe_checkpoints, engine_args, layouts):
    _, model_dir = moe_checkpoints("qwen3_moe")
    prompts = random_prompts(4, [3, 17, 40, 9])
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=3)
    ref = LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)
    results = run_ranks(_generate_rank, 2, model_dir, engine_args, prompts, params)
    for outputs, _ in results:
        assert_same_outputs(outputs, ref)
    assert results[0][1] == layouts


# family -> (world size, engine arguments, layouts that must have run)
SHARDED = {
    "tp2": (2, {"tp": 2}, {"tp"}),
    "shift_sp2": (2, {"sp": 2, "shift_threshold": 8}, {"base", "shift"}),
    "shift_sp2_tp2": (4, {"sp": 2, "tp": 2, "shift_threshold": 8}, {"base", "shift"}),
    "shift_sp4_kv_replicated": (4, {"sp": 4, "shift_threshold": 8}, {"base", "shift"}),
    # DP while four requests run, one TP group of both replicas once two have finished
    "flying": (2, {"dp": 2, "policy": "flying", "policy_config": {"dp_above": 1.5, "tp_below": 1}},
               {"dp@0", "dp@1", "tp2@0"}),
    "seesaw": (2, {"pp": 2, "policy": "seesaw", "block_size": 4, "num_kv_blocks": 64, "num_cpu_kv_blocks": 96},
               {"pp", "tp"}),
    # expert parallelism: whole experts per rank; over TP (tokens replicated: one all-reduce), over Shift's SP
    # ranks (the base layout dispatches tokens by all-to-all, the shift layout runs the same experts)
    "ep_tp2": (2, {"tp": 2, "enable_expert_parallel": True}, {"tp"}),
    "ep_shift_sp2": (2, {"sp": 2, "shift_threshold": 8, "enable_expert_parallel": True}, {"base", "shift"}),
    "ep_shift_sp4": (4, {"sp": 4, "shift_threshold": 8, "enable_expert_parallel": True}, {"base", "shift"}),
}
# those of a dense model's weights: TP, Shift SP-2 x TP-2, Flying's TP group of replicas, Seesaw's TP decode
DENSE_SHARDED = {family: SHARDED[family] for family in ("tp2", "shift_sp2_tp2", "flying", "seesaw")}


@pytest.mark.slow
@pytest.mark.parametrize("family,name", [(family, "qwen3_moe") for family in SHARDED] + [
    (family, "qwen2_moe") for family in ("tp2", "shift_sp2_tp2", "flying", "seesaw", "ep_tp2", "ep_shift_sp2")])
def test_layouts_that_shard_experts_match_one_rank(moe_checkpoints, family, name):
    """Every expert's FFN split by TP (the router whole): Shift's base and shift layouts (the shift one derived
    from the base's expert shards), SP x TP with KV heads replicated, Flying's TP groups of replicas, Seesaw's TP
    decode beside its pipeline: greedy tokens and logprobs those of one rank. Qwen2-MoE's shared expert is split
    as a dense MLP in each (whole on each SP rank of expert parallelism's base layout)."""
    assert_layout_matches_one_rank(moe_checkpoints(name)[1], *SHARDED[family])


def assert_layout_matches_one_rank(model_dir, world: int, engine_args: dict, layouts: set[str],
                                   lengths: tuple[int, ...] = (3, 17, 40, 9), **common) -> None:
    """Greedy tokens and logprobs of four requests (3-16 new tokens) in a layout of `world` ranks those of one rank,
    the layouts of `layouts` among its steps; `common`: engine arguments of both."""
    prompts = random_prompts(len(lengths), list(lengths))
    params = [SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0, logprobs=3) for m in (3, 5, 12, 16)]
    ref = LLM(str(model_dir), **common).generate(prompts, params, use_tqdm=False)
    results = run_ranks(_generate_rank, world, model_dir, {**engine_args, **common}, prompts, params, timeout_s=300)
    for outputs, _ in results:
        assert_same_outputs(outputs, ref)
    assert results[0][1] >= layouts, results[0][1]


def _expert_parallel_rank(rank, world, model_dir, prompts):
    from torch.distributed.tensor import distribute_tensor

    from torch_shift.parallel.expert_parallel import ExpertParallelSparseMoe
    from torch_shift.parallel.plan import EXPERT_PARAMETERS, base_plan

    llm = LLM(str(model_dir), sp=world, shift_threshold=8, enable_expert_parallel=True, enable_prefix_caching=False,
              prepack_weights=False)
    module = llm.engine.model
    # the declared placement is the oracle: DTensor's shard of each full stacked parameter is this rank's
    full, plan = load_model(model_dir), base_plan(module.groups, expert_parallel=True)
    checked = 0
    for name, local in module.base.named_parameters():
        if name.split(".")[-1] in EXPERT_PARAMETERS:
            mesh, placements = plan.lookup(name)
            assert torch.equal(local, distribute_tensor(full.get_parameter(name).data, mesh, placements).to_local())
            checked += 1
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    base, shift = module.base.layers[0].mlp, module.shift.layers[0].mlp
    assert isinstance(base, ExpertParallelSparseMoe) and isinstance(shift, ExpertParallelSparseMoe)
    return {"experts": (base.experts.first_expert, base.experts.num_experts), "checked": checked,
            "shared": shift.experts is base.experts,  # the shift layout runs the base's expert shards
            "modes": (base.tokens_partitioned, shift.tokens_partitioned),
            "calls": dict(module.ledger.calls)}


def test_expert_parallel_places_whole_experts_and_dispatches_only_in_the_base_layout(moe_checkpoints):
    _, model_dir = moe_checkpoints("qwen3_moe")  # 8 experts, sparse layers 0, 2, 3
    prompts = random_prompts(3, [40, 2, 9])
    results = run_ranks(_expert_parallel_rank, 2, model_dir, prompts)
    assert [r["experts"] for r in results] == [(0, 4), (4, 4)]
    assert [r["checked"] for r in results] == [2 * 3] * 2  # gate_up_proj and down_proj of 3 sparse layers
    for r in results:
        assert r["shared"] and r["modes"] == (True, False)
        # per sparse layer and base step: the counts, the rows, their experts and the outputs back (4 all-to-alls)
        # beside Ulysses' two; the shift layout's steps all-reduce instead
        assert r["calls"][("base", "all_to_all")] % (2 * 4 + 3 * 4) == 0
        assert r["calls"].get(("shift", "all_to_all"), 0) == 0 and r["calls"][("shift", "all_reduce")] > 0


def test_expert_parallel_refuses_what_it_cannot_split(moe_checkpoints, checkpoints):
    _, model_dir = moe_checkpoints("qwen3_moe")
    config = ModelConfig.from_dir(model_dir)
    for args, match in (({"sp": 2, "tp": 2}, "over the SP ranks \\(tp=1\\) or the TP ranks"),
                        ({"dp": 2}, "not with dp=2"), ({"pp": 2}, "not with dp=1 or pp=2")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(str(model_dir), enable_expert_parallel=True, **args).create_engine_config(config, model_dir)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by the 16 ranks"):
        EngineArgs(str(model_dir), enable_expert_parallel=True, tp=16).create_engine_config(
            replace(config, num_attention_heads=16, num_key_value_heads=16, intermediate_size=512,
                    moe_intermediate_size=512), model_dir)
    _, dense_dir = checkpoints("llama")
    with pytest.raises(ValueError, match="give tp or sp > 1"):
        EngineArgs(str(model_dir), enable_expert_parallel=True).create_engine_config(config, model_dir)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        EngineArgs(str(dense_dir), enable_expert_parallel=True, tp=2).create_engine_config(
            ModelConfig.from_dir(dense_dir), dense_dir)


def test_expert_parallel_keeps_experts_whole_so_their_width_need_not_divide(tmp_path):
    """An expert FFN of 17 columns cannot be split over 2 ranks, but whole experts can be placed: TP-2 is refused,
    TP-2 and Shift over SP-2 with expert parallelism give one rank's tokens and logprobs, and the planner agrees."""
    model_dir = save_checkpoint(build_moe_model("qwen3_moe", moe_intermediate_size=17), tmp_path / "odd")
    config = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match="moe_intermediate_size=17 \\(each expert's FFN\\) is not divisible"):
        EngineArgs(str(model_dir), tp=2).create_engine_config(config, model_dir)
    shape = ModelShape.from_config(config)
    with pytest.raises(ValueError, match="expert_intermediate_size=17 is not divisible"):
        step_cost(shape, get_profile("h100"), Layout("tp", tp=2), [Seq(8, 0)])
    step_cost(shape, get_profile("h100"), Layout("tp", tp=2, expert_parallel=True), [Seq(8, 0)])
    prompts = random_prompts(3, [3, 17, 9])
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=3)
    ref = LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)
    for engine_args in ({"tp": 2}, {"sp": 2, "shift_threshold": 8}):
        results = run_ranks(_generate_rank, 2, model_dir, {**engine_args, "enable_expert_parallel": True}, prompts,
                            params)
        for outputs, _ in results:
            assert_same_outputs(outputs, ref)


def _ep_weights_rank(rank, world, model_dir):
    llm = LLM(str(model_dir), tp=world, enable_expert_parallel=True, enable_prefix_caching=False)
    return weight_bytes(llm.engine.model.base)


def test_planner_prices_expert_parallelism_as_the_engine_places_it(moe_checkpoints):
    """A rank's weight bytes with whole experts (E / 2 of them) as the engine's ranks hold them; the experts'
    weight reads and pairs halved per rank; under SP the dispatch and combine all-to-alls of each sparse layer."""
    _, model_dir = moe_checkpoints("qwen3_moe")
    shape = ModelShape.from_config(ModelConfig.from_dir(model_dir))
    ep = Layout("tp", tp=2, expert_parallel=True)
    assert run_ranks(_ep_weights_rank, 2, model_dir) == [memory_per_rank(shape, ep).weight_bytes] * 2

    # every row to the LM head (prompt logprobs): the last layer's MLP runs on all 65 tokens, as the others'
    hw, seqs = get_profile("h100"), [Seq(64, 0, logits_rows=64), Seq(1, 100)]
    tp_cost = step_cost(shape, hw, Layout("tp", tp=2), seqs)
    ep_cost = step_cost(shape, hw, ep, seqs)
    experts = {c.name: c for c in tp_cost.ops}["experts"], {c.name: c for c in ep_cost.ops}["experts"]
    # whole experts and the busiest rank's pairs, against half of every pair's FFN: the same work, times the
    # busiest rank's excess over an even share
    k = shape.experts_per_token
    excess = busiest_rank_pairs(shape, 65, 2) / (65 * k / 2)
    assert 1.0 < excess < 1.2 and experts[1].flops == pytest.approx(experts[0].flops * excess)
    # one token, top-2 of 8 experts on 2 ranks: both on one rank 12 times in 28, so 10/7 pairs on the busiest
    mixtral = replace(shape, num_experts=8, experts_per_token=2)
    assert busiest_rank_pairs(mixtral, 1, 2) == pytest.approx(10 / 7, rel=0.05)
    assert busiest_rank_pairs(mixtral, 4096, 2) == pytest.approx(4096, rel=0.02)  # large steps: even
    sp_ep = step_cost(shape, hw, Layout("sp_tp", sp=2, expert_parallel=True), seqs)
    comm = {c.name: c for c in sp_ep.collectives}
    tokens, k, h, sparse = 65, shape.experts_per_token, shape.hidden_size, shape.num_sparse_layers
    local = -(-tokens // 2)
    assert comm["ep_all_to_all_combine"].calls == sparse
    # each rank's pairs for the other rank's experts: half of them under balanced routing
    assert comm["ep_all_to_all_combine"].wire_bytes == sparse * (local * k * h * shape.activation_bytes // 2)
    # the four all-to-alls of each sparse layer, as the engine's ledger counts them (the test above)
    assert {"ep_all_to_all_counts", "ep_all_to_all_dispatch", "ep_all_to_all_expert_ids"} <= set(comm)
    assert "tp_all_reduce" not in comm
    with pytest.raises(ValueError, match="over TP, or over SP with tp 1"):
        Layout("sp_tp", sp=2, tp=2, expert_parallel=True)
