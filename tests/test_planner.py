"""The planner's cost model: FLOPs and bytes per op against hand counts, collectives against the ledger of
torch_shift's own layouts, memory against the engine's own shards, profiles, and `torch-shift calibrate`."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from conftest import random_prompts

from torch_shift import LLM, SamplingParams
from torch_shift.bench.traffic import RequestSpec
from torch_shift.cli import main
from torch_shift.config import ModelConfig
from torch_shift.models.linear import weight_bytes
from torch_shift.models.toy import tiny_llama_config
from torch_shift.parallel.launch import run_ranks
from torch_shift.planner import (
    ACHIEVABLE_FRACTION,
    AlphaBeta,
    CollectiveModel,
    EngineOverhead,
    HardwareProfile,
    Layout,
    ModelShape,
    RankMemory,
    Seq,
    fit_alpha_beta,
    get_profile,
    kv_capacity_tokens,
    memory_per_rank,
    step_cost,
)
from torch_shift.planner.simulate import predict

# hidden 64, MLP 128, 8 heads / 2 KV heads of 8 dims, vocab 512, fp32 (4 bytes everywhere)
SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8,
                   vocab_size=512, weight_dtype="fp32", name="toy")
# a 4-token prompt (samples) and a decode token after 10 tokens of context: 5 tokens, 2 sampled rows
BATCH = [Seq(4, 0), Seq(1, 10)]
GIGA = 1e9


def unit_profile(node_bandwidth=None, overhead=EngineOverhead(0.0, 0.0)) -> HardwareProfile:
    """Every rate 1e9 (FLOP/s, bytes/s), every collective 10 us + wire bytes / 1e9: times in ns = counts."""
    rates = {"fp32": GIGA, "bf16": GIGA}
    return HardwareProfile(
        name="unit", num_devices=8, device_memory_bytes=1e6, matmul_flops=rates, attention_flops=rates,
        matmul_bandwidth=rates, attention_bandwidth=rates, copy_bandwidth=GIGA, node_bandwidth=node_bandwidth,
        collectives=CollectiveModel({op: {n: AlphaBeta(1e-5, GIGA) for n in (2, 4)}
                                     for op in ("all_reduce", "all_to_all", "all_gather", "send_recv")}),
        overhead=overhead)


def ops_of(cost):
    return {o.name: (o.flops, o.bytes) for o in cost.ops}


def comms_of(cost):
    return {c.name: (c.op, c.group_size, c.calls, c.wire_bytes) for c in cost.collectives}


def test_tp2_one_layer_by_hand():
    cost = step_cost(SHAPE, unit_profile(), Layout("tp", tp=2), BATCH)
    ops = ops_of(cost)
    # per rank: 4 query heads, 1 KV head; 5 tokens; weights + tokens x (in + out) x 4 bytes
    assert ops["qkv"] == (2 * 5 * 64 * 48, 64 * 48 * 4 + 5 * (64 + 48) * 4)
    # the last layer (the only one) projects and runs its MLP on the 2 sampled rows alone
    assert ops["o_proj"] == (2 * 2 * 32 * 64, 32 * 64 * 4 + 2 * (32 + 64) * 4)
    assert ops["gate_up"] == (2 * 2 * 64 * 128, 64 * 128 * 4 + 2 * (64 + 128) * 4)
    assert ops["down"] == (2 * 2 * 64 * 64, 64 * 64 * 4 + 2 * (64 + 64) * 4)
    # prompt: keys 1+2+3+4 = 10; 4 FLOPs per (head, key, dim); K/V read (4) and written (4), 1 head of 8
    assert ops["attention_prefill"] == (4 * 8 * 4 * 10, 2 * 8 * 4 * (4 + 4) + 2 * 4 * 4 * 8 * 4)
    # decode: 11 keys; 11 positions read, 1 written
    assert ops["attention_decode"] == (4 * 8 * 4 * 11, 2 * 8 * 4 * (11 + 1) + 2 * 1 * 4 * 8 * 4)
    # LM head: 2 sampled rows x 256 of the 512 vocabulary rows
    assert ops["lm_head"] == (2 * 2 * 64 * 256, 64 * 256 * 4 + 2 * (64 + 256) * 4)
    assert ops["embedding"] == (0, 5 * 64 * 8)
    assert ops["sampling"] == (0, 2 * 2 * 512 * 4)
    assert comms_of(cost) == {
        "tp_all_reduce": ("all_reduce", 2, 2, 2 * (2 * 1 * 2 * 64 * 4 // 2)),
        "lm_head_all_gather": ("all_gather", 2, 1, 1 * 2 * 256 * 4),
    }
    # roofline at 1e9 FLOP/s and 1e9 bytes/s: q/k/v on 5 rows is compute-bound, the MLP on 2 rows and the LM head
    # memory-bound
    by_op = {o.name: o for o in cost.ops}
    assert by_op["qkv"].time_s == pytest.approx(30720e-9) and by_op["qkv"].compute_s > by_op["qkv"].memory_s
    assert by_op["gate_up"].time_s == pytest.approx(34304e-9) and by_op["gate_up"].memory_s > by_op["gate_up"].compute_s
    assert by_op["lm_head"].time_s == pytest.approx(68096e-9) and by_op["lm_head"].memory_s > by_op["lm_head"].compute_s
    assert cost.communication_s == pytest.approx(2 * (1e-5 + 512e-9) + 1e-5 + 2048e-9)
    assert cost.total_s == pytest.approx(sum(cost.breakdown().values()))
    assert cost.total_s == pytest.approx(sum(o.time_s for o in cost.ops) + cost.communication_s)


def test_sp2_one_layer_by_hand():
    cost = step_cost(SHAPE, unit_profile(), Layout("sp_tp", sp=2, tp=1), BATCH)
    ops = ops_of(cost)
    # 5 tokens, 3 and 2 on the SP ranks, through the full (tp=1) weights; both sampled rows (positions 3 and 4) on
    # the second rank, whose last layer's MLP runs on them alone
    assert ops["qkv"] == (2 * 3 * 64 * 96, 64 * 96 * 4 + 3 * (64 + 96) * 4)
    assert ops["down"] == (2 * 2 * 128 * 64, 128 * 64 * 4 + 2 * (128 + 64) * 4)
    # after the all-to-all a rank attends all 5 tokens with half the heads: as TP-2
    tp2 = ops_of(step_cost(SHAPE, unit_profile(), Layout("tp", tp=2), BATCH))
    assert ops["attention_prefill"] == tp2["attention_prefill"] and ops["attention_decode"] == tp2["attention_decode"]
    assert ops["lm_head"] == tp2["lm_head"]  # vocab-parallel over both ranks
    assert comms_of(cost) == {
        "sp_all_to_all_qkv": ("all_to_all", 2, 1, 6 * (4 + 2) * 8 * 4 // 2),
        "sp_all_to_all_out": ("all_to_all", 2, 1, 6 * 4 * 8 * 4 // 2),
        "sp_all_reduce_rows": ("all_reduce", 2, 1, 2 * 64 * 4),
        "lm_head_all_gather": ("all_gather", 2, 1, 2 * 256 * 4),
    }


def test_sp2_tp2_replicates_kv_heads_and_reduces_over_tp():
    cost = step_cost(SHAPE, unit_profile(), Layout("sp_tp", sp=2, tp=2), BATCH)
    comms = comms_of(cost)
    # 4 head chunks of 2 KV heads: each chunk carries 1 (replicated) KV head; 3 local tokens of 6
    assert comms["sp_all_to_all_qkv"] == ("all_to_all", 2, 1, 6 * (2 + 2) * 8 * 4 // 2)
    assert comms["tp_all_reduce"] == ("all_reduce", 2, 2, 2 * (2 * 64 * 4))  # the 2 sampled rows' (last layer)
    assert comms["lm_head_all_gather"] == ("all_gather", 4, 1, 3 * 2 * 128 * 4)
    assert ops_of(cost)["qkv"][0] == 2 * 3 * 64 * (4 + 2 * 1) * 8


def test_pipeline_by_hand():
    shape = ModelShape(**{**SHAPE.__dict__, "num_layers": 2})
    hw = unit_profile()
    # two decode sequences -> two micro-batches of one token; stage 0: embedding + layer 0, stage 1: layer 1 +
    # final norm + LM head + sampling; each stage sends [1, 64] on, the last one 1 x 512 logits to rank 0
    cost = step_cost(shape, hw, Layout("pp", pp=2), [Seq(1, 10), Seq(1, 20)])
    one_layer = Layout("tp", tp=1)
    per_mb = {s: step_cost(SHAPE, hw, one_layer, [s]).breakdown() for s in (Seq(1, 10), Seq(1, 20))}
    last_only = ("final_norm", "lm_head", "sampling")
    stage0 = {s: sum(v for k, v in b.items() if k not in last_only) for s, b in per_mb.items()}
    stage1 = {s: sum(v for k, v in b.items() if k != "embedding") for s, b in per_mb.items()}
    send, logits = 1e-5 + 64 * 4e-9, 1e-5 + 512 * 4e-9
    a, b = Seq(1, 10), Seq(1, 20)  # in the order given
    t0a, t0b, t1a, t1b = stage0[a] + send, stage0[b] + send, stage1[a] + logits, stage1[b] + logits
    makespan = max(t0a + t1a, t0a + t0b) + t1b
    assert cost.total_s == pytest.approx(makespan)
    assert cost.bubble_s == pytest.approx(makespan - max(t0a + t0b, t1a + t1b))
    assert comms_of(cost)["pp_send_logits"] == ("send_recv", 2, 2, 2 * 512 * 4)
    # one sequence, one micro-batch: no overlap at all, the bubble is the other stage's time
    single = step_cost(shape, hw, Layout("pp", pp=2), [Seq(1, 10)])
    assert single.total_s == pytest.approx(stage0[a] + send + stage1[a] + logits)


def test_dp_groups_price_the_slowest_group():
    hw = unit_profile(overhead=EngineOverhead(1e-3, 1e-6))
    layout = Layout.dp_groups(2, 1, 1)
    cost = step_cost(SHAPE, hw, layout, [Seq(512, 0), Seq(1, 10), Seq(1, 30)], groups=[1, 0, 0])
    alone = {g: step_cost(SHAPE, hw, lay, seqs).total_s - hw.overhead.time(len(seqs), lay.num_ranks)
             for g, lay, seqs in ((0, Layout("tp", tp=2), [Seq(1, 10), Seq(1, 30)]), (1, Layout("tp"), [Seq(512, 0)]))}
    assert cost.group_s == pytest.approx((alone[0], alone[1], 0.0))
    assert cost.total_s == pytest.approx(alone[1] + 1e-3 + 3e-6)  # the prompt's replica, overhead once
    with pytest.raises(ValueError, match="groups"):
        step_cost(SHAPE, hw, layout, [Seq(1, 1)])


def test_shared_memory_bandwidth_slows_ranks_that_stream_together():
    shared = unit_profile(node_bandwidth=1.5 * GIGA)
    one = step_cost(SHAPE, shared, Layout("tp"), [Seq(1, 10)])
    two = step_cost(SHAPE, shared, Layout.dp_groups(1, 1), [Seq(1, 10), Seq(1, 10)], groups=[0, 1])
    idle_peer = step_cost(SHAPE, shared, Layout.dp_groups(1, 1), [Seq(1, 10)], groups=[0])
    assert one.memory_s == pytest.approx(idle_peer.memory_s)
    assert two.memory_s == pytest.approx(one.memory_s * GIGA / 0.75e9)


def scaled_rates(hw: HardwareProfile, factor: float) -> dict:
    """hw's device rates times `factor`, in a profile's `borrowed` form."""
    def scaled(rate):
        return factor * rate if isinstance(rate, (int, float)) else tuple((rows, factor * r) for rows, r in rate)

    return {"matmul_flops": {d: factor * r for d, r in hw.matmul_flops.items()},
            "attention_flops": {d: factor * r for d, r in hw.attention_flops.items()},
            "matmul_bandwidth": {d: scaled(r) for d, r in hw.matmul_bandwidth.items()},
            "attention_bandwidth": {d: factor * r for d, r in hw.attention_bandwidth.items()},
            "copy_bandwidth": factor * hw.copy_bandwidth}


def test_a_group_alone_with_work_is_priced_on_the_idle_groups_cores():
    """model_runner.step_threads: a DP replica (or a TP group) alone with work runs on the idle ranks' cores; the
    profile's rates measured at that multiple of a rank's threads price it, and only it."""
    plain = unit_profile(overhead=EngineOverhead(1e-3, 1e-6))
    hw = replace(plain, borrowed={2: scaled_rates(plain, 2), 4: scaled_rates(plain, 4)})
    assert plain.borrowing(2) is plain and hw.borrowing(1) is hw
    assert hw.borrowing(2).matmul_flops == {"fp32": 2 * GIGA, "bf16": 2 * GIGA} and hw.borrowing(2).borrowed == {}
    assert hw.borrowing(3) == hw.borrowing(2)  # the largest multiple measured up to it
    pair = Layout.dp_groups(1, 1)
    alone = step_cost(SHAPE, hw, pair, [Seq(512, 0)], groups=[1])
    both = step_cost(SHAPE, hw, pair, [Seq(512, 0), Seq(1, 10)], groups=[1, 0])
    unborrowed = step_cost(SHAPE, plain, pair, [Seq(512, 0)], groups=[1])
    assert both.group_s[1] == pytest.approx(unborrowed.group_s[1])
    assert alone.group_s[1] == pytest.approx(unborrowed.group_s[1] / 2)  # every rate twice, no collectives
    assert alone.total_s == pytest.approx(step_cost(SHAPE, hw.borrowing(2), Layout("tp"), [Seq(512, 0)]).total_s)
    four = Layout.dp_groups(1, 1, 1, 1)
    assert step_cost(SHAPE, hw, four, [Seq(512, 0)], groups=[3]).group_s[3] == pytest.approx(
        unborrowed.group_s[1] / 4)
    # a TP-2 group alone among 4 ranks: twice its threads
    wide = Layout.dp_groups(2, 1, 1)
    assert step_cost(SHAPE, hw, wide, [Seq(1, 10)], groups=[0]).group_s[0] == pytest.approx(
        step_cost(SHAPE, hw.borrowing(2), wide, [Seq(1, 10)], groups=[0]).group_s[0])
    assert step_cost(SHAPE, hw, wide, [Seq(1, 10)], groups=[0]).group_s[0] < step_cost(
        SHAPE, plain, wide, [Seq(1, 10)], groups=[0]).group_s[0]



def test_sp_ranks_with_a_step_of_fewer_tokens_than_sp_ranks_are_priced_on_the_others_cores():
    """model_runner.step_threads: in a Ulysses step of fewer tokens than SP ranks the ranks with rows run on the
    others' cores too, while every rank attends with its heads on its own: the profile's borrowed rates price that
    step's other ops, and only that step's. A step of one token on CPU ranks (the SP group's KV shared,
    torch_shift.parallel.shared_kv) runs on SP rank 0 alone: every head's attention on the borrowed cores too, and no
    all-to-all. Not with experts split over the SP ranks (every rank computes)."""
    plain = unit_profile(overhead=EngineOverhead(1e-3, 1e-6))
    hw = replace(plain, borrowed={2: scaled_rates(plain, 2), 4: scaled_rates(plain, 4)})
    sp2, sp4 = Layout("sp_tp", sp=2), Layout("sp_tp", sp=4)

    def ops(profile, layout, tokens):
        return {o.name: o.time_s for o in step_cost(SHAPE, profile, layout, [Seq(1, 100)] * tokens).ops}

    def all_to_alls(profile, layout, tokens):
        return [c for c in step_cost(SHAPE, profile, layout, [Seq(1, 100)] * tokens).collectives
                if c.name.startswith("sp_all_to_all")]

    # one token: SP rank 0's step at the borrowed rates, all heads attended there, priced as one rank's
    assert ops(hw, sp2, 1) == pytest.approx(ops(hw.borrowing(2), Layout("sp_tp", sp=1), 1))
    assert not all_to_alls(hw, sp2, 1) and all_to_alls(hw, sp2, 2)
    # ranks with their own device memory (a host link): the exchanges, every rank attending its heads on its own
    device = replace(hw, host_link_bandwidth=1e9)
    lent, own = ops(device, sp2, 1), ops(replace(plain, host_link_bandwidth=1e9), sp2, 1)
    borrowed = ops(device.borrowing(2), sp2, 1)
    assert lent["attention_decode"] == pytest.approx(own["attention_decode"])
    assert {k: v for k, v in lent.items() if k != "attention_decode"} == pytest.approx(
        {k: v for k, v in borrowed.items() if k != "attention_decode"})
    assert lent["qkv"] < own["qkv"] and all_to_alls(device, sp2, 1)
    assert ops(hw, sp2, 2) == pytest.approx(ops(plain, sp2, 2))
    # SP-4, two tokens: the two ranks with rows on twice their threads, each rank attending on its own
    lent, own, borrowed = ops(hw, sp4, 2), ops(plain, sp4, 2), ops(hw.borrowing(2), sp4, 2)
    assert lent["attention_decode"] == pytest.approx(own["attention_decode"])
    assert lent["qkv"] == pytest.approx(borrowed["qkv"])
    # SP-4: one token, four times a rank's threads; two tokens, twice; three, a rank's own (4 // 3 = 1)
    for tokens, profile in ((1, hw.borrowing(4)), (2, hw.borrowing(2)), (3, plain)):
        assert ops(hw, sp4, tokens)["qkv"] == pytest.approx(ops(profile, sp4, tokens)["qkv"])
    ep = Layout("sp_tp", sp=2, expert_parallel=True)
    moe = replace(SHAPE, num_experts=4, experts_per_token=2, expert_intermediate_size=32, num_sparse_layers=1)
    assert step_cost(moe, hw, ep, [Seq(1, 100)]).total_s == pytest.approx(
        step_cost(moe, plain, ep, [Seq(1, 100)]).total_s)

def test_matmul_bandwidth_by_rows():
    """A profile may give the weight-streaming rate per number of input rows (CPU GEMMs with a few rows pack
    their weights): interpolated in log(rows), constant past the ends, and used for each linear's token count."""
    hw = unit_profile()
    hw = HardwareProfile(**{**hw.__dict__, "matmul_bandwidth": {"fp32": ((1, 4 * GIGA), (4, 2 * GIGA), (16, GIGA))}})
    assert [hw.bandwidth("matmul", "fp32", rows=r) for r in (1, 2, 4, 8, 16, 64)] == pytest.approx(
        [4e9, 3e9, 2e9, 1.5e9, 1e9, 1e9])
    assert hw.bandwidth("attention", "fp32") == GIGA
    one, eight = (step_cost(SHAPE, hw, Layout("tp"), [Seq(1, 10)] * n) for n in (1, 8))
    qkv = {n: next(o for o in c.ops if o.name == "qkv") for n, c in ((1, one), (8, eight))}
    assert qkv[1].memory_s == pytest.approx(qkv[1].bytes / 4e9)
    assert qkv[8].memory_s == pytest.approx(qkv[8].bytes / 1.5e9)


def test_sliding_window_caps_keys_and_kv_reads():
    windowed = ModelShape(**{**SHAPE.__dict__, "sliding_window": 8})
    ops = ops_of(step_cost(windowed, unit_profile(), Layout("tp"), [Seq(1, 100), Seq(4, 6)]))
    # decode at position 100 sees 8 keys; the chunk at positions 6..9 sees 7, 8, 8, 8 keys, reads positions 0..9
    # and writes 4
    assert ops["attention_decode"][0] == 4 * 8 * 8 * 8
    assert ops["attention_prefill"] == (4 * 8 * 8 * (7 + 8 + 8 + 8), 2 * 2 * 8 * 4 * (10 + 4) + 2 * 4 * 8 * 8 * 4)


def test_memory_per_rank_by_hand():
    shape = ModelShape(**{**SHAPE.__dict__, "num_layers": 3})
    layer = 64 * (8 + 2 * 2) * 8 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    embed = 512 * 64
    assert memory_per_rank(shape, Layout("tp")).weight_bytes == 4 * (3 * layer + 2 * embed + 64)
    tp2_layer = 64 * (4 + 2 * 1) * 8 + 32 * 64 + 3 * 64 * 64 + 2 * 64
    assert memory_per_rank(shape, Layout("tp", tp=2)) == RankMemory(4 * (3 * tp2_layer + embed + 256 * 64 + 64),
                                                                    2 * 3 * 1 * 8 * 4)
    # PP-2: stages of 2 and 1 layers; the first holds the embedding, the second the whole LM head
    pp = memory_per_rank(shape, Layout("pp", pp=2))
    assert pp.weight_bytes == 4 * max(2 * layer + embed, layer + embed + 64)
    assert pp.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4
    # TP-4 > 2 KV heads: one replicated KV head per rank
    assert memory_per_rank(shape, Layout("tp", tp=4)).kv_bytes_per_token == 2 * 3 * 1 * 8 * 4
    hw = unit_profile()  # 1e6 bytes per device
    free = 0.9e6 - memory_per_rank(shape, Layout("tp", tp=2)).weight_bytes
    assert kv_capacity_tokens(shape, hw, Layout("tp", tp=2)) == int(free // (2 * 3 * 8 * 4))


# SHAPE with its one layer's MLP a mixture of 4 experts of FFN 16, top-2
MOE = ModelShape(**{**SHAPE.__dict__, "num_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 16,
                    "num_sparse_layers": 1, "name": "toy-moe"})


def test_moe_layer_by_hand():
    """A sparse layer: the router replicated, each token's 2 experts run on this rank's slice of their FFN, and
    the weights of the experts the step's tokens reach read once: 2 of 4 for one token, E (1 - (1 - k/E)^T) in
    expectation for T tokens (3 for 2 tokens), all 4 for many."""
    assert (MOE.expected_experts(1), MOE.expected_experts(2), round(MOE.expected_experts(64), 6)) == (2, 3, 4)
    cost = step_cost(MOE, unit_profile(), Layout("tp", tp=2), [Seq(1, 10)])
    counts = ops_of(cost)
    assert "gate_up" not in counts and "down" not in counts
    assert counts["router"] == (2 * 64 * 4, 4 * (64 * 4 + (64 + 4)))
    # 2 token-expert pairs, 8 of each expert's 16 FFN columns on this rank
    assert counts["experts"] == (2 * 2 * 3 * 64 * 8, 4 * (2 * 3 * 64 * 8 + 2 * 2 * 64))
    assert {o.name: o.rows for o in _group_ops_of(MOE, [Seq(5, 0)])}["experts"] == 3  # 10 pairs over ~3.8 experts
    # collectives as the dense model's: the experts' down projection is row-parallel like down_proj
    assert comms_of(cost) == comms_of(step_cost(SHAPE, unit_profile(), Layout("tp", tp=2), [Seq(1, 10)]))
    # a TP-2 rank: the attention shards, the router whole, half of every expert
    layer = 64 * (4 + 2 * 1) * 8 + 32 * 64 + 2 * 64 + 64 * 4 + 4 * 3 * 64 * 8
    assert memory_per_rank(MOE, Layout("tp", tp=2)).weight_bytes == 4 * (layer + 512 * 64 + 256 * 64 + 64)
    assert MOE.num_parameters() - MOE.num_active_parameters() == 2 * 3 * 64 * 16
    with pytest.raises(ValueError, match="expert_intermediate_size=16 is not divisible by TP=32"):
        step_cost(ModelShape(**{**MOE.__dict__, "num_heads": 32, "num_kv_heads": 32}), unit_profile(),
                  Layout("tp", tp=32), BATCH)
    with pytest.raises(ValueError, match="experts_per_token=5 must be between 1 and num_experts=4"):
        ModelShape(**{**MOE.__dict__, "experts_per_token": 5})


def _group_ops_of(shape, seqs):
    from torch_shift.planner.cost import _group_ops

    # not the last stage, whose last layer's MLP runs on the sampled rows alone
    return _group_ops(shape, seqs, tp=1, sp=1, num_layers=shape.num_layers, first_stage=True, last_stage=False)


@pytest.mark.parametrize("config,total,active", [
    # Mistral's announcement of Mixtral-8x7B: 46.7B parameters, 12.9B per token
    ({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
      "num_experts_per_tok": 2, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}, 46.7, 12.9),
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated
    ({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
      "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
      "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
      "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}, 30.5, 3.3),
    # Qwen1.5-MoE-A2.7B's model card: 14.3B parameters, 2.7B activated (a shared expert beside 60 routed ones)
    ({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
      "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60,
      "num_experts_per_tok": 4, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}, 14.3, 2.7),
], ids=["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_moe_configs_have_their_published_sizes(tmp_path, capsys, config, total, active):
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_pretrained(tmp_path)
    assert shape.num_parameters() / 1e9 == pytest.approx(total, abs=0.06)
    assert shape.num_active_parameters() / 1e9 == pytest.approx(active, abs=0.06)  # Qwen3: 3.35
    # batch-1 decode reads the active experts' weights only; a 512-token prefill nearly all of them
    decode = ops_of(step_cost(shape, get_profile("h100"), Layout("tp"), [Seq(1, 100)]))["experts"][1]
    prefill = ops_of(step_cost(shape, get_profile("h100"), Layout("tp"), [Seq(512, 0)]))["experts"][1]
    h, k, layers = shape.hidden_size, shape.experts_per_token, shape.num_layers
    per_expert = 3 * h * shape.expert_intermediate_size * 2  # bf16 weights of a layer
    per_pair = 2 * h * 2  # a token-expert pair's input and output
    assert decode == pytest.approx(layers * (k * per_expert + k * per_pair), rel=1e-9)
    # the last layer's experts on the prompt's last row alone
    assert prefill == pytest.approx((layers - 1) * (shape.num_experts * per_expert + 512 * k * per_pair)
                                    + k * per_expert + k * per_pair, rel=1e-6)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--hardware", "h100x8", "--synthetic", "2048:64",
                 "--num-requests", "16", "--rate", "4", "--policies", "dp,tp", "--json", str(out)]) == 0
    tp8 = next(c for c in json.loads(out.read_text())["candidates"] if c["label"] == "TP8")
    assert tp8["num_finished"] == 16
    assert tp8["weight_bytes_per_rank"] == memory_per_rank(shape, Layout("tp", tp=8)).weight_bytes


GPT_OSS_120B = {  # openai/gpt-oss-120b's config.json (the fields the engine reads)
    "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 4096},
    "rope_theta": 150000, "attention_bias": True, "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention", "full_attention"] * 18}


def test_gpt_oss_config_has_its_published_size_and_windowed_layers_are_priced(tmp_path):
    """OpenAI's model card: 116.8B parameters, 5.1B active per token (counting the unembedding, not the
    embedding table); half the layers attend over the last 128 positions only."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    shape = ModelShape.from_pretrained(tmp_path)
    assert shape.num_parameters() / 1e9 == pytest.approx(116.83, abs=0.01)
    embedding = shape.vocab_size * shape.hidden_size
    assert (shape.num_active_parameters() - embedding) / 1e9 == pytest.approx(5.13, abs=0.01)
    assert (shape.sliding_window, shape.num_window_layers) == (128, 18)
    prompt = [Seq(4096, 0)]
    windowed = ops_of(step_cost(shape, get_profile("h100"), Layout("tp", tp=8), prompt))["attention_prefill"][0]
    full = ops_of(step_cost(replace(shape, num_window_layers=0, sliding_window=None), get_profile("h100"),
                            Layout("tp", tp=8), prompt))["attention_prefill"][0]
    # a full layer's 4096 x 4097 / 2 (query, key) pairs against a windowed one's 128 per query (127 fewer at first)
    pairs_full, pairs_window = 4096 * 4097 / 2, 4096 * 128 - 127 * 128 / 2
    assert windowed / full == pytest.approx((pairs_full + pairs_window) / (2 * pairs_full), rel=1e-9)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--hardware", "h100x8", "--synthetic", "2048:64",
                 "--num-requests", "16", "--rate", "4", "--policies", "dp,tp", "--json", str(out)]) == 0
    by_label = {c["label"]: c for c in json.loads(out.read_text())["candidates"]}
    tp8, ep8 = by_label["TP8"], by_label["TP8+EP"]  # 128 experts: 16 whole ones per rank as a candidate too
    assert tp8["num_finished"] == ep8["num_finished"] == 16
    assert tp8["weight_bytes_per_rank"] == memory_per_rank(shape, Layout("tp", tp=8)).weight_bytes
    assert ep8["weight_bytes_per_rank"] == memory_per_rank(shape, Layout("tp", tp=8, expert_parallel=True)).weight_bytes
    assert "DP8+EP" not in by_label and "DP8" in by_label


def test_predict_prices_the_experts_as_enable_expert_parallel_places_them(tmp_path):
    """The same schedule under both placements; only the step times differ, and by what step_cost says."""
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    config = ModelConfig.from_dir(tmp_path)
    requests = [RequestSpec("r0", 0.0, list(range(1, 257)), 8)]
    results = {ep: predict({"tp": 8, "num_kv_blocks": 1024, "enable_expert_parallel": ep}, config,
                           get_profile("h100x8"), requests) for ep in (False, True)}
    assert [s.num_tokens for s in results[True].steps] == [s.num_tokens for s in results[False].steps]
    shape, hw, prefill = ModelShape.from_config(config), get_profile("h100x8"), [Seq(256, 0)]
    first = {ep: r.steps[0].seconds for ep, r in results.items()}
    for ep in (False, True):
        assert first[ep] == pytest.approx(step_cost(shape, hw, Layout("tp", tp=8, expert_parallel=ep), prefill).total_s)
    assert first[True] != first[False]


def test_layouts_the_model_cannot_use_are_refused():
    with pytest.raises(ValueError, match="num_heads=8 is not divisible by TP=3"):
        step_cost(SHAPE, unit_profile(), Layout("tp", tp=3), BATCH)
    with pytest.raises(ValueError, match="no sp"):
        Layout("tp", sp=2)
    with pytest.raises(ValueError, match="more stages"):
        step_cost(SHAPE, unit_profile(), Layout("pp", pp=2), BATCH)


def test_fit_alpha_beta_recovers_the_line():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    fit = fit_alpha_beta(sizes, [50e-6 + b / 2e9 for b in sizes])
    assert fit.alpha_s == pytest.approx(50e-6) and fit.beta_bytes_per_s == pytest.approx(2e9)
    # a group size that was not measured: the ring steps scale alpha, beta stays
    model = CollectiveModel({"all_reduce": {2: fit}})
    assert model.lookup("all_reduce", 4).alpha_s == pytest.approx(3 * 50e-6)
    assert model.time("all_reduce", 1, 10**9) == 0.0


def test_datasheet_profiles():
    h200 = get_profile("h200x8")
    assert h200.num_devices == 8 and h200.device_memory_bytes == 141e9
    assert h200.flops("matmul", "fp8") == pytest.approx(1978.9e12 * ACHIEVABLE_FRACTION["matmul"])
    assert h200.bandwidth("matmul", "fp8") == pytest.approx(4.8e12 * ACHIEVABLE_FRACTION["memory"])
    nvlink = 450e9 * ACHIEVABLE_FRACTION["nvlink"]
    assert h200.collectives.lookup("all_reduce", 8).beta_bytes_per_s == pytest.approx(nvlink)
    a10 = get_profile("a10x4")
    assert a10.flops("matmul", "fp8") == a10.flops("matmul", "bf16")  # no FP8 units: weight-only FP8
    assert get_profile("l4").num_devices == 1
    with pytest.raises(ValueError, match="unknown hardware"):
        get_profile("tpu-v5")


def test_profile_json_round_trip(tmp_path):
    profile = get_profile("a100x8")
    path = tmp_path / "a100.json"
    profile.save(path)
    assert get_profile(path) == profile
    cpu = unit_profile(node_bandwidth=1.5 * GIGA)
    cpu = replace(cpu, matmul_bandwidth={"fp32": ((1, 4 * GIGA), (8, 2 * GIGA))})
    cpu = replace(cpu, borrowed={2: scaled_rates(cpu, 2)})
    cpu.save(path)
    assert get_profile(path) == cpu and get_profile(path).borrowing(2) == cpu.borrowing(2) != cpu
    assert get_profile(path).borrowing(2).matmul_bandwidth == {"fp32": ((1, 8 * GIGA), (8, 4 * GIGA))}
    data = json.loads(path.read_text())
    data["format"] = "something else"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a torch_shift hardware profile"):
        get_profile(path)


def test_fp8_halves_weight_bytes_not_activations(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(dtype="bfloat16")))
    bf16 = ModelShape.from_pretrained(tmp_path)
    fp8 = ModelShape.from_pretrained(tmp_path / "config.json", dtype="fp8")
    assert (bf16.weight_dtype, fp8.weight_dtype, fp8.activation_dtype) == ("bf16", "fp8", "bf16")
    fp8_memory, bf16_memory = memory_per_rank(fp8, Layout("tp")), memory_per_rank(bf16, Layout("tp"))
    assert fp8_memory.weight_bytes * 2 == bf16_memory.weight_bytes
    assert fp8_memory.kv_bytes_per_token == bf16_memory.kv_bytes_per_token
    with pytest.raises(ValueError, match="dtype 'int3'"):
        ModelShape.from_pretrained(tmp_path, dtype="int3")


# -- against torch_shift's own layouts ---------------------------------------------------------------------
def _ledger_rank(rank, world, model_dir, sp, tp):
    # single steps: the plans are the steps the cost model prices
    llm = LLM(str(model_dir), sp=sp, tp=tp, shift_threshold=8, enable_prefix_caching=False, max_num_seqs=4,
              num_scheduler_steps=1)
    engine, module = llm.engine, llm.engine.model
    plans = []
    if rank == 0:
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *args: plans.append(schedule(*args)) or plans[-1]
        # one base step of 36 tokens, 18 on each SP rank, with two of the LM head's rows each (positions 9, 17 | 26,
        # 35): the ranks' last layers sum as many rows, the cost model's busiest rank's (the ledgers stay alike)
        for i, prompt in enumerate(random_prompts(4, [10, 8, 9, 9], seed=2)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.send_result("result", None)
    else:
        engine.follow()
    return {
        "ledger": (dict(module.ledger.bytes), dict(module.ledger.calls)),
        "steps": [(p.layout, [Seq.from_scheduled(e) for e in p.scheduled]) for p in plans if not p.is_empty],
        "weight_bytes": weight_bytes(module.base),
        "kv_bytes_per_token": sum(t[0, 0].numel() * t.element_size() for t in engine.kv_cache.k + engine.kv_cache.v),
    }


@pytest.mark.parametrize("sp,tp", [(2, 1), (2, 2)], ids=["sp2", "sp2tp2"])
def test_collectives_and_memory_match_the_engine(llama, sp, tp):
    """A real multi-rank run (prompts in the base layout, decodes in the shift layout): the cost model's
    collectives per layout, summed over the steps, equal the communication ledger in calls and bytes; its
    weights and KV bytes per token equal the engine's own shards."""
    hf_model, model_dir = llama
    shape = ModelShape.from_pretrained(model_dir)
    hw = unit_profile()
    layouts = {"base": Layout("sp_tp", sp=sp, tp=tp), "shift": Layout("tp", tp=sp * tp)}
    results = run_ranks(_ledger_rank, sp * tp, model_dir, sp, tp)
    steps = results[0]["steps"]
    assert {layout for layout, _ in steps} == {"base", "shift"}
    expected_bytes, expected_calls = {}, {}
    for layout, seqs in steps:
        for c in step_cost(shape, hw, layouts[layout], seqs).collectives:
            expected_bytes[(layout, c.op)] = expected_bytes.get((layout, c.op), 0) + c.wire_bytes
            expected_calls[(layout, c.op)] = expected_calls.get((layout, c.op), 0) + c.calls
    for result in results:
        assert result["ledger"] == (expected_bytes, expected_calls)
        memory = memory_per_rank(shape, layouts["base"])
        assert result["weight_bytes"] == memory.weight_bytes
        assert result["kv_bytes_per_token"] == memory.kv_bytes_per_token


@pytest.mark.slow
def test_calibrate_cli_writes_a_profile_the_cost_model_prices_with(tmp_path, capsys):
    out = tmp_path / "this_machine.json"
    assert main(["calibrate", "--out", str(out), "--world", "2", "--threads", "1"]) == 0
    assert "wrote" in capsys.readouterr().err
    hw = get_profile(out)
    assert hw.num_devices == 2 and hw.node_bandwidth > 0
    if os.cpu_count() >= 2:  # a rank alone with work runs on both ranks' cores: measured at 2 threads
        assert set(hw.borrowed) == {2} and min(hw.borrowing(2).matmul_flops.values()) > 0
    assert set(hw.matmul_flops) == {"fp32", "bf16"} and min(hw.matmul_flops.values()) > 0
    assert set(hw.collectives.table) == {"all_reduce", "all_to_all", "all_gather", "send_recv"}
    assert all(set(sizes) == {2} for sizes in hw.collectives.table.values())
    assert hw.overhead.step_s > 0 and hw.overhead.parallel_step_s > 0
    # a config-only model (a config.json, no weights) prices a step on it
    config_dir = tmp_path / "config_only"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(tiny_llama_config(hidden_size=1024, intermediate_size=2816,
                                                                         num_hidden_layers=8, num_attention_heads=16,
                                                                         num_key_value_heads=4, head_dim=64,
                                                                         vocab_size=8192)))
    shape = ModelShape.from_pretrained(config_dir)
    decode = step_cost(shape, hw, Layout("tp", tp=2), [Seq(1, 100)] * 8)
    prefill = step_cost(shape, hw, Layout("sp_tp", sp=2), [Seq(512, 0)])
    assert 0 < decode.total_s < prefill.total_s
    assert decode.memory_s > decode.compute_s  # small steps stream weights
    # and plans a deployment of it on this machine's two ranks
    assert main(["plan", "--model", str(config_dir), "--hardware", str(out), "--world", "2", "--synthetic", "128:8",
                 "--num-requests", "12", "--policies", "dp,tp,shift", "--thresholds", "64"]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert main(["calibrate", "--out", str(tmp_path / "missing" / "x.json")]) == 2


def test_calibrate_refuses_what_it_cannot_measure():
    from torch_shift.planner.calibrate import calibrate

    with pytest.raises(ValueError, match="device must be"):
        calibrate(device="tpu")
    with pytest.raises(ValueError, match="one GPU"):
        calibrate(device="cuda", world=2)
    with pytest.raises(ValueError, match="threads"):
        calibrate(device="cuda", world=1, threads=4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            calibrate(device="cuda", world=1)
