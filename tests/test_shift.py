"""Shift parallelism on CPU with gloo: every layout against the single-device engine."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import random_prompts

from torch_shift import LLM, SamplingParams
from torch_shift.models.linear import weight_bytes
from torch_shift.parallel.launch import run_ranks
from torch_shift.parallel.layout_model import MicroBatch
from torch_shift.parallel.layouts import build_deployment

MESHES = [(1, 2), (2, 1), (2, 2), (4, 1), (1, 4)]
PROMPT_LENGTHS = [3, 17, 40, 1, 9, 6]
PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=3)


def reference(model_dir, prompts=None, params=PARAMS):
    prompts = prompts or random_prompts(6, PROMPT_LENGTHS)
    return LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)


def assert_same_outputs(got, ref, atol=1e-4):
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lg, lr in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert set(lg) == set(lr)
            assert max(abs(lg[t].logprob - lr[t].logprob) for t in lr) < atol


def _generate_rank(rank, world, model_dir, sp, tp, engine_args, random_layouts):
    llm = LLM(str(model_dir), sp=sp, tp=tp, **engine_args)
    if random_layouts and rank == 0:  # rank 0 decides; the plan carries the layout to the others
        rng = random.Random(1)
        llm.engine.policy.finalize = lambda layout, n: rng.choice(["base", "shift"])
    outputs = llm.generate(random_prompts(6, PROMPT_LENGTHS), PARAMS, use_tqdm=False)
    if random_layouts:
        # more head chunks than KV heads: the replication index is a buffer, which `.to()` moves with the weights
        # (on a GPU a CPU index in index_select fails)
        assert llm.engine.model.get_buffer("kv_send_index").device == llm.engine.kv_cache.device
    return outputs, dict(llm.engine.model.layout_counts)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("sp,tp", MESHES, ids=[f"sp{s}tp{t}" for s, t in MESHES])
def test_prefill_in_base_decode_in_shift_matches_single_device(checkpoints, family, sp, tp):
    _, model_dir = checkpoints(family)
    ref = reference(model_dir)
    # the first step holds every prompt (76 tokens) -> base; decode steps hold 6 -> shift
    results = run_ranks(_generate_rank, sp * tp, model_dir, sp, tp, {"shift_threshold": 16}, False)
    for outputs, counts in results:
        assert_same_outputs(outputs, ref)
        if sp == 1:  # plain TP: one layout, no second copy of the weights
            assert set(counts) == {"tp"}
        else:
            assert counts["base"] >= 1 and counts["shift"] >= 5
    assert all(r[0] == results[0][0] for r in results)  # every rank returns rank 0's outputs


def test_random_layout_at_every_step(llama):
    _, model_dir = llama
    ref = reference(model_dir)
    args = {"shift_threshold": 16, "max_num_batched_tokens": 24, "shift_weights": "view"}
    results = run_ranks(_generate_rank, 4, model_dir, 2, 2, args, True)
    for outputs, counts in results:
        assert_same_outputs(outputs, ref)
        assert counts == results[0][1]  # every rank ran the layout rank 0 chose
    assert results[0][1]["base"] >= 3 and results[0][1]["shift"] >= 3, results[0][1]


@pytest.mark.slow
def test_world_size_8(llama):
    _, model_dir = llama
    ref = reference(model_dir)
    results = run_ranks(_generate_rank, 8, model_dir, 2, 4, {"shift_threshold": 16}, False, timeout_s=600)
    for outputs, counts in results:
        assert_same_outputs(outputs, ref)
        assert counts["base"] >= 1 and counts["shift"] >= 5


def _parameter_bytes_rank(rank, world, model_dir, engine_args):
    return weight_bytes(LLM(str(model_dir), **engine_args).engine.model)


def test_tensor_parallel_without_sequence_parallel_holds_one_copy_of_the_weights(llama):
    """With SP = 1 the base layout is full TP already: the default shift threshold builds no second layout
    (it re-concatenated q/k/v and gate/up, about two thirds of each layer, for a switch that changed nothing)."""
    _, model_dir = llama
    single = LLM(str(model_dir), prepack_weights=False).engine.model.model  # the single-device DecoderLM, dense
    replicated = sum(p.nbytes for n, p in single.named_parameters() if "embed_tokens" in n or "norm" in n)
    sharded = sum(p.nbytes for p in single.parameters()) - replicated
    head = single.lm_head.weight.nbytes  # vocab-parallel over all ranks in every layout
    # the default threshold (256), with copied shift shards (the default)
    assert run_ranks(_parameter_bytes_rank, 2, model_dir, {"tp": 2}) == [replicated + sharded // 2] * 2
    # the same measure sees the shift layout's copies where there is a second layout (SP = 2)
    with_shift, without = (run_ranks(_parameter_bytes_rank, 2, model_dir, {"sp": 2, "shift_threshold": threshold})
                           for threshold in (256, None))
    # without a shift layout, SP rank 0 also holds the whole LM head for the one-token steps it runs alone
    assert with_shift[1] > without[1] == replicated + sharded - head + head // 2 == without[0] - head


def _uneven_rank(rank, world, model_dir, prompts):
    llm = LLM(str(model_dir), sp=world, tp=1, shift_threshold=0, enable_prefix_caching=False, block_size=4)
    engine = llm.engine
    base_forward = engine.model.forwards["base"]
    rows = []

    def recording(input_ids, positions, attention):
        rows.append(input_ids.shape[0])
        return base_forward(input_ids, positions, attention)

    engine.model.forwards["base"] = recording
    native = engine.model.native_decoders.get("base")
    if native is not None:  # where the C++ decoder takes the model's small steps (the AVX2 kernels take this one)
        native_step = native.step

        def native_recording(input_ids, positions, logits_rows, ulysses):
            hidden = native_step(input_ids, positions, logits_rows, ulysses)
            if hidden is not None:
                rows.append(input_ids.shape[0])
            return hidden

        native.step = native_recording
    if rank == 0:
        engine.add_request("r", prompts[0], SamplingParams(max_tokens=1))
        engine.step()  # the whole 1-token prompt in the base layout: n = 1 < SP
        written = engine.kv_cache.k[0].flatten(2).flatten(0, 1).abs().sum(dim=1).nonzero().flatten().tolist()
        engine.send_result("result", written)
        engine.abort_request("r")
    else:
        written = engine.follow()
    first_step_rows = rows[-1] if rows else None  # None: no forward ran
    slots_untouched = all(k.flatten(2).flatten(0, 1)[1:].abs().sum() == 0 for k in engine.kv_cache.k)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return written, slots_untouched, first_step_rows, outputs, dict(engine.model.layout_counts)


def test_tokens_that_do_not_divide_sp_are_split_unevenly(llama):
    _, model_dir = llama
    prompts = random_prompts(2, [1, 6], seed=3)  # n = 1 < SP, then n = 7 and decodes of 2 tokens
    ref = reference(model_dir, prompts)
    results = run_ranks(_uneven_rank, 4, model_dir, prompts)
    for written, untouched, _, outputs, counts in results:
        # the 1-token step wrote one slot of block 0 (slot 0) and nothing else
        assert written == [0] and untouched
        assert_same_outputs(outputs, ref)
        assert set(counts) == {"base"}
    # SP rank 0 ran the one token; the others ran no forward, only their head chunks' attention (no weights read)
    assert [rows for _, _, rows, _, _ in results] == [1, None, None, None]


def _kv_rank(rank, world, model_dir, sp, tp, prompt):
    llm = LLM(str(model_dir), sp=sp, tp=tp, enable_prefix_caching=False, block_size=4)
    engine = llm.engine
    forced = ["base"]
    if rank == 0:
        engine.policy.finalize = lambda layout, n: forced[0]
        for layout, rid in (("base", "a"), ("shift", "b")):
            forced[0] = layout
            engine.add_request(rid, prompt, SamplingParams(max_tokens=3))
            engine.step()  # step 2 also decodes "a", after its prompt positions were written
        tables = [engine.block_manager.block_table(r)[:] for r in "ab"]
        engine.send_result("result", tables)
    else:
        tables = engine.follow()
    n = len(prompt)
    per_layer = []
    for k_cache, v_cache in zip(engine.kv_cache.k, engine.kv_cache.v):
        written = [torch.cat([c[b] for b in t])[:n] for t in tables for c in (k_cache, v_cache)]
        k_base, v_base, k_shift, v_shift = written
        per_layer.append((torch.equal(k_base, k_shift) and torch.equal(v_base, v_shift),
                          max((k_base - k_shift).abs().max().item(), (v_base - v_shift).abs().max().item()),
                          k_base.abs().max().item()))
    return per_layer


@pytest.mark.parametrize("sp,tp", [(2, 1), (2, 2), (4, 1)], ids=["sp2tp1", "sp2tp2", "sp4tp1"])
def test_both_layouts_write_the_same_kv_blocks(llama, sp, tp):
    """The same prompt computed once in each layout. Layer 0's K/V come from identical inputs: they
    are equal byte for byte, so both layouts put every head at the same place of the same cache.
    Deeper layers differ by float32 rounding only: the layouts sum their partial products over
    different groups (TP over `tp` vs over all P ranks)."""
    _, model_dir = llama
    prompt = random_prompts(1, [13], seed=8)[0]
    for per_layer in run_ranks(_kv_rank, sp * tp, model_dir, sp, tp, prompt):
        equal0, _, scale = per_layer[0]
        assert equal0 and scale > 0
        for _, diff, scale in per_layer[1:]:
            assert diff <= 1e-5 * max(1.0, scale)


def _weights_rank(rank, world, model_dir, shift_weights):
    # the layouts' dense weights as built (packing them copies both, whatever shift_weights says)
    llm = LLM(str(model_dir), sp=2, tp=2, shift_weights=shift_weights, prepack_weights=False)
    model = llm.engine.model
    base_layer, shift_layer = model.base.layers[0], model.shift.layers[0]

    def storages(module):
        return {p.untyped_storage().data_ptr() for p in module.parameters()}

    sharded = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    base_bytes = sum(p.numel() * p.element_size() for n in sharded
                     for p in base_layer.get_submodule(n).parameters())
    shift_bytes = sum(p.numel() * p.element_size() for n in sharded
                      for p in shift_layer.get_submodule(n).parameters())
    shared = all(storages(shift_layer.get_submodule(n)) <= storages(base_layer.get_submodule(n)) for n in sharded)
    outputs = llm.generate(random_prompts(6, PROMPT_LENGTHS), PARAMS, use_tqdm=False)
    return shared, base_bytes, shift_bytes, outputs


def test_view_weights_share_storage_and_copy_costs_one_sp_th(llama):
    """At (SP, TP) = (2, 2) with 8 query and 2 KV heads, hidden 64, head_dim 8, MLP 128 (floats):
    base shards per layer: q 32x64, k and v 8x64 each (1 KV head), o 64x32, gate+up 128x64, down 64x64;
    shift shards: q, o and the MLP are half of that (1/SP), k and v stay one (replicated) KV head."""
    _, model_dir = llama
    base_floats = 32 * 64 + 2 * 8 * 64 + 64 * 32 + 128 * 64 + 64 * 64
    shift_floats = (32 * 64 + 64 * 32 + 128 * 64 + 64 * 64) // 2 + 2 * 8 * 64
    ref = reference(model_dir)
    for shift_weights in ("view", "copy"):
        for shared, base_bytes, shift_bytes, outputs in run_ranks(_weights_rank, 4, model_dir, shift_weights):
            assert shared == (shift_weights == "view")  # views: no memory of their own
            assert (base_bytes, shift_bytes) == (4 * base_floats, 4 * shift_floats)
            assert_same_outputs(outputs, ref)


def _mismatched_world_rank(rank, world, model_dir):
    try:
        LLM(str(model_dir), sp=2, tp=2)
    except ValueError as e:
        return str(e)
    return None


def test_mesh_errors_name_the_numbers(llama, checkpoints):
    from torch_shift.config import ModelConfig
    from torch_shift.parallel.plan import validate_mesh_for_model

    _, model_dir = llama
    config = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"num_attention_heads=8 is not divisible by SP x TP = 3 x 1 = 3"):
        validate_mesh_for_model(config, 3, 1)
    with pytest.raises(ValueError, match="sp and tp must be >= 1|num_attention_heads=8"):
        LLM(str(model_dir), sp=3, tp=1)
    messages = run_ranks(_mismatched_world_rank, 2, model_dir)
    assert all("SP x TP = 2 x 2 = 4 differs from the world size 2" in m for m in messages)


def _parallelize_rank(rank, world, model_dir, sp, tp, prompt):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import torch_shift
    from torch_shift.models import load_model
    from torch_shift.models.loader import part_views
    from torch_shift.parallel.plan import base_plan, shift_plan

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (sp, tp), mesh_dim_names=("sp", "tp"))
    full = load_model(model_dir)
    module = torch_shift.parallelize(full, mesh, shift_threshold=16, shift_weights="copy")

    # the declared placements are the oracle: DTensor's own sharding of each full part must equal
    # the local shard (for every part whose heads divide the mesh axis; replicated KV heads excepted)
    checked = 0
    for plan, model in ((base_plan(module.groups), module.base), (shift_plan(module.groups), module.shift)):
        for name in ("layers.1.attn.qkv_proj.weight", "layers.1.attn.o_proj.weight",
                     "layers.1.mlp.gate_up_proj.weight", "layers.1.mlp.down_proj.weight"):
            pmesh, placements = plan.lookup(name)
            for part, local in part_views(model, name).items():
                if part in ("k", "v") and pmesh.size() // (sp if plan.layout == "base" else 1) > 2:
                    continue
                expected = distribute_tensor(part_views(full, name)[part], pmesh, placements).to_local()
                assert torch.equal(local, expected), (plan.layout, name, part)
                checked += 1

    def causal(layer_idx, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)

    ids = torch.tensor(prompt)
    positions = torch.arange(len(prompt))
    every = torch.arange(len(prompt))
    deployment = build_deployment(module.config, sp=sp, tp=tp)
    batch = [MicroBatch(ids, positions, causal, every)]
    logits = {layout.kind: module.forward_step(layout, batch) for layout in deployment.layouts}
    assert set(logits) == {"sp_tp", "shift"}
    return checked, logits


@pytest.mark.parametrize("sp,tp", [(2, 2), (4, 1)], ids=["sp2tp2", "sp4tp1"])
def test_parallelize_in_memory_model(llama, sp, tp):
    hf_model, model_dir = llama
    prompt = random_prompts(1, [11], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    for checked, logits in run_ranks(_parallelize_rank, sp * tp, model_dir, sp, tp, prompt):
        assert checked >= 10
        for got in logits.values():
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def _ledger_rank(rank, world, model_dir, n):
    llm = LLM(str(model_dir), sp=2, tp=2, enable_prefix_caching=False)
    engine, module = llm.engine, llm.engine.model
    if rank == 0:
        forced = ["base"]
        engine.policy.finalize = lambda layout, num_tokens: forced[0]
        engine.add_request("a", random_prompts(1, [n], seed=1)[0], SamplingParams(max_tokens=2))
        engine.step()  # n prompt tokens in the base layout
        forced[0] = "shift"
        engine.step()  # 1 decode token in the shift layout
        engine.send_result("result", None)
    else:
        engine.follow()
    return dict(module.ledger.bytes), dict(module.ledger.calls)


def test_communication_ledger_matches_the_formulas(llama):
    """(SP, TP) = (2, 2), P = 4, 2 layers, hidden d = 64, 8 heads and 2 KV heads of 8 dims, vocab 512, fp32.
    Base (paper 000, Alg. 2 and Table 2): per layer two TP all-reduces of n/SP x d (the last layer's of the
    sampled row alone, on the SP rank that holds it), a q/k/v all-to-all and an output all-to-all over SP; shift
    (Alg. 3): per layer two all-reduces of n x d over all P ranks. Both: the LM head's all-gather of 1 row x V/P
    logits; base also sums the sampled row over SP."""
    _, model_dir = llama
    n, sp, tp, p, d, layers, f32 = 13, 2, 2, 4, 64, 2, 4
    counts = [7, 6]  # 13 tokens over SP = 2: SP rank 0 (global ranks 0, 1) holds 7, SP rank 1 (2, 3) holds 6
    qkv_chunk = (8 // p + 2 * 1) * 8  # per head chunk: 2 query heads + 1 K + 1 V head (replicated), 8 dims
    out_chunk = (8 // p) * 8
    calls = {("base", "all_reduce"): 2 * layers + 1, ("base", "all_to_all"): 2 * layers, ("base", "all_gather"): 1,
             ("shift", "all_reduce"): 2 * layers, ("shift", "all_gather"): 1}
    for rank, (got_bytes, got_calls) in enumerate(run_ranks(_ledger_rank, 4, model_dir, n)):
        n_local = counts[rank // tp]
        sampled_local = rank // tp  # the sampled row (position 12) is SP rank 1's
        expected = {
            ("base", "all_reduce"): ((layers - 1) * 2 * (2 * (tp - 1) * n_local * d * f32 // tp)
                                     + 2 * (2 * (tp - 1) * sampled_local * d * f32 // tp)
                                     + 2 * (sp - 1) * d * f32 // sp),
            # messages of 7 rows from both SP ranks: the rank of 6 tokens pads its own
            ("base", "all_to_all"): layers * (sp - 1) * counts[0] * (qkv_chunk + out_chunk) * f32,
            ("base", "all_gather"): (p - 1) * 512 // p * f32,
            ("shift", "all_reduce"): layers * 2 * (2 * (p - 1) * 1 * d * f32 // p),
            ("shift", "all_gather"): (p - 1) * 512 // p * f32,
        }
        assert got_bytes == expected
        assert got_calls == calls


def _idle_rank(rank, world, model_dir):
    import time

    # (a timeout of 2 s also bounded the start-up's and the steps' collectives: tight on a loaded machine)
    llm = LLM(str(model_dir), sp=2, tp=1, distributed_timeout_s=5)
    first = llm.generate(random_prompts(2, [5, 9]), PARAMS, use_tqdm=False)
    if rank == 0:
        time.sleep(7)  # longer than the collectives' timeout: the other rank waits on the control group
    second = llm.generate(random_prompts(2, [5, 9]), PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_ranks_survive_an_idle_gap_longer_than_the_collective_timeout(llama):
    _, model_dir = llama
    assert run_ranks(_idle_rank, 2, model_dir) == [True, True]


def test_the_kv_is_shared_only_where_every_rank_mapped_it(llama, monkeypatch):
    """SP rank 1 cannot map the segment of the SP ranks' KV caches: no rank shares it (a rank stepping alone while its
    peer still expected Ulysses' exchanges would hang), and static SP-2's one-token steps keep the all-to-alls, with
    the single-device engine's outputs."""
    import torch.distributed as dist

    from torch_shift.parallel import shared_kv

    _, model_dir = llama
    original = shared_kv._map_segment
    prompts = random_prompts(2, [5, 9])
    expected = reference(model_dir, prompts[:1]) + reference(model_dir, prompts[1:])
    with monkeypatch.context() as refused:
        refused.setattr(shared_kv, "_map_segment",
                        lambda path, nbytes: None if dist.get_rank() == 1 else original(path, nbytes))
        llm = LLM(str(model_dir), sp=2, shift_threshold=None)
    try:
        assert not llm.engine.model.solo_steps
        got = [out for prompt in prompts for out in llm.generate([prompt], PARAMS, use_tqdm=False)]
        assert llm.engine.model.ledger.calls[("base", "all_to_all")] >= 2 * 2 * (PARAMS.max_tokens - 1)
    finally:
        llm.shutdown()
    assert_same_outputs(got, expected)
    shared = LLM(str(model_dir), sp=2, shift_threshold=None)
    try:
        assert shared.engine.model.solo_steps  # where both map it
    finally:
        shared.shutdown()
    assert not shared.engine.model.solo_steps and shared.engine.model._kv_peers is None  # released with the engine
