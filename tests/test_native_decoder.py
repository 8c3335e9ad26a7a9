"""The C++ decoder (kernels/cpu_decoder.cpp, torch_shift.models.native_decoder): a step of up to 64 tokens gives the
eager forward's logits bit for bit, for every dense family, in float32 and bfloat16, for decodes and prompt chunks;
it declines what it cannot run exactly, and the engine's switch turns it off."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import build_hf_model, hf_greedy, interrupted_at_random, random_prompts, save_checkpoint

from torch_shift import LLM, SamplingParams
from torch_shift.engine import core, decode_pool
from torch_shift.kernels import decoder_kernels
from torch_shift.models import native_decoder
from torch_shift.models.fused import ROW_ARGMAX, argmax_list
from torch_shift.models.linear import PackedWeight, packing_supported
from torch_shift.models.native_decoder import MAX_TOKENS, NativeDecoder
from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint
from torch_shift.parallel import comm, shared_kv
from torch_shift.parallel.layers import ShardDecoder
from torch_shift.parallel.shift import ShiftModule
from torch_shift.parallel.shm import ShmCommunicator

# shapes whose every weight the GEMV reads in oneDNN's packing (whole blocks of 64 outputs): hidden 128, 8 heads of 16,
# 2 KV heads
SHAPES = dict(hidden_size=128, intermediate_size=352, head_dim=16)
# and a vocabulary and MLP of no whole blocks ("llama_odd"), which oneDNN pads: the GEMV reads copies of its own
ODD_SHAPES = dict(SHAPES, intermediate_size=344, vocab_size=500)
DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if packing_supported(torch.device("cpu"), dt)]

pytestmark = [
    pytest.mark.skipif(decoder_kernels() is None, reason="the C++ decoder does not run here (no compiler, no AVX2, "
                       "or a torch without its vectorised exp)"),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            model = (build_hf_model("llama", **ODD_SHAPES) if family == "llama_odd"
                     else build_hf_model(family, **SHAPES))
            cache[family] = (model, save_checkpoint(model, tmp_path_factory.mktemp(family)))
        return cache[family]

    return get


@pytest.fixture
def counted(monkeypatch):
    """Steps the C++ decoder ran (called, launched on its thread, or in a multi-step run's call)."""
    calls = []
    original, original_launch, original_steps = NativeDecoder.__call__, NativeDecoder.launch, NativeDecoder.steps

    def call(self, input_ids, *args):
        calls.append(len(input_ids))
        return original(self, input_ids, *args)

    def launch(self, input_ids, *args, **options):
        calls.append(len(input_ids))
        return original_launch(self, input_ids, *args, **options)

    def steps(self, input_ids, *args):
        drawn = original_steps(self, input_ids, *args)
        calls.extend([len(input_ids)] * (0 if drawn is None else len(drawn)))
        return drawn

    monkeypatch.setattr(NativeDecoder, "__call__", call)
    monkeypatch.setattr(NativeDecoder, "launch", launch)
    monkeypatch.setattr(NativeDecoder, "steps", steps)
    return calls


class Launches(list):
    drawn: list[bool]

    def __init__(self):
        super().__init__()
        self.drawn = []


@pytest.fixture
def launches(monkeypatch):
    """Steps launched on the C++ decoder's thread: whether each read its input ids there (placeholders); `.drawn`:
    whether each drew its tokens there (with a sampler's draws, not by argmax)."""
    read_there = Launches()
    original = NativeDecoder.launch

    def launch(self, input_ids, positions, logits_indices, attention, placeholders=None, draws=None, *stages):
        read_there.append(placeholders is not None)
        read_there.drawn.append(draws is not None)
        return original(self, input_ids, positions, logits_indices, attention, placeholders, draws, *stages)

    monkeypatch.setattr(NativeDecoder, "launch", launch)
    return read_there


def _decoder_limit(dtype: torch.dtype) -> int:
    """The most tokens of a step the C++ decoder takes where this CPU packs `dtype`: MAX_TOKENS (in bfloat16 packed
    for AMX, its matmuls of more than 5 rows are oneDNN's, called as the eager forward calls them), or the GEMV's
    rows where the operator library does not hold the weights."""
    packed = PackedWeight(torch.randn(64, 64).to(dtype))
    return MAX_TOKENS if packed.blocked or packed.native else min(MAX_TOKENS, packed.gemv_max_rows)


def _generate(model_dir, dtype, native: bool, ledger: dict | None = None, **engine_args):
    """The outputs of a few greedy and sampled requests; `ledger`: filled with rank 0's counts of collectives."""
    llm = LLM(str(model_dir), dtype=dtype, native_decode=native, compile=False, seed=0, **engine_args)
    try:
        assert llm.engine.worker.runner.native_decode is native
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        prompts = [{"prompt_token_ids": p} for p in random_prompts(4, [3, 17, 40, 9], vocab=vocab)]
        greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
        sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=3, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False) + llm.generate(prompts[:2], sampled, use_tqdm=False)
        # the 40-token prompt again: its blocks come from the prefix cache, and its last token is computed alone
        outs += llm.generate(prompts[2:3], greedy, use_tqdm=False)
        if ledger is not None:
            ledger.update(calls=dict(llm.engine.model.ledger.calls), bytes=dict(llm.engine.model.ledger.bytes))
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), [[(t, lp.logprob) for t, lp in sorted(step.items())]
                                            for step in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "llama_tied", "llama3", "qwen2", "qwen3", "mistral_window", "llama_odd"])
def test_steps_give_the_eager_forwards_logits_bit_for_bit(families, family, dtype, counted):
    """Decodes of one to four requests at once and, with as many tokens a step as the decoder takes, every prompt
    chunk: the same tokens and the same logprobs, to the last bit, as the eager forward (Qwen2's q/k/v bias, Qwen3's
    q/k norms, Mistral's window, Llama 3's rotary scaling, a tied LM head, a vocabulary of 500 and an MLP of 344)."""
    _, model_dir = families(family)
    limit = _decoder_limit(dtype)
    reference = _generate(model_dir, dtype, native=False, max_num_batched_tokens=limit)
    assert not counted
    assert _generate(model_dir, dtype, native=True, max_num_batched_tokens=limit) == reference
    assert max(counted) == limit and min(counted) <= 2  # prompt chunks and decodes both ran here


def test_greedy_tokens_match_transformers(families, monkeypatch):
    """Greedy tokens drawn from the argmax the decoder finds beside its logits, each row's torch.argmax."""
    model, model_dir = families("llama")
    # each step called, not launched (tests below)
    llm = LLM(str(model_dir), dtype=torch.float32, compile=False, seed=0, async_scheduling=False)
    assert llm.engine.worker.runner.native_decode
    original, steps = NativeDecoder.__call__, []

    def call(self, *args):
        logits = original(self, *args)
        steps.append(getattr(logits, ROW_ARGMAX).tolist() == logits.argmax(dim=-1).tolist())
        return logits

    monkeypatch.setattr(NativeDecoder, "__call__", call)
    for prompt in random_prompts(3, [5, 30, 12], seed=3):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=10, temperature=0.0,
                                                                            ignore_eos=True), use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 10)
    assert len(steps) >= 27 and all(steps)


def test_argmax_list_takes_the_row_argmax_a_logits_tensor_carries():
    logits = torch.randn(3, 50)
    setattr(logits, ROW_ARGMAX, np.array([7, 1, 4]))
    assert argmax_list(logits) == [7, 1, 4]
    assert argmax_list(logits[:2]) == logits[:2].argmax(dim=-1).tolist()  # a tensor made from it has none


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_rounds_as_pytorch_at_every_thread_count(dtype):
    """Every finite bfloat16 (a spread of float32 values) through the C++ `silu(gate) * up` and through PyTorch's, on
    one thread and on two: TensorIterator splits rows between threads above 32768 elements, which moves where its
    vectorised exp ends and std::exp begins. The exp's width is that of the build PyTorch runs here."""
    lanes = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    if lanes is None:
        pytest.skip(f"PyTorch runs its {torch.backends.cpu.get_cpu_capability()} build here")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            native_decoder._silu_lanes.cache_clear()
            for intermediate in (352, 2816):
                assert native_decoder._silu_lanes(dtype, intermediate) == lanes
    finally:
        torch.set_num_threads(threads)
        native_decoder._silu_lanes.cache_clear()


def test_declines_what_it_cannot_run_exactly(families, tmp_path):
    """Dense weights, experts, a module it does not know, the switch off: the forward serves. Weights of any shape
    run here (q/k/v of 96 rows: whole blocks of the GEMV's, or of the 16-feature blocks, padded with zeros)."""
    _, model_dir = families("llama")
    assert LLM(str(model_dir), dtype=torch.float32, compile=False).engine.worker.runner.native_decode
    odd = save_checkpoint(build_hf_model("llama"), tmp_path / "odd")  # hidden 64: q/k/v of 96 rows
    assert LLM(str(odd), compile=False).engine.worker.runner.native_decode
    assert not LLM(str(model_dir), compile=False, prepack_weights=False).engine.worker.runner.native_decode
    assert not LLM(str(model_dir), compile=False, native_decode=False).engine.worker.runner.native_decode
    mixtral = write_random_checkpoint(tmp_path / "mixtral", tiny_llama_config(
        architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=128, num_local_experts=4,
        num_experts_per_tok=2))
    assert not LLM(str(mixtral), compile=False).engine.worker.runner.native_decode
    assert NativeDecoder.build(build_hf_model("llama", **SHAPES)) is None  # transformers' module, not ours
    # Flying's TP groups of zero-copy views: nothing packed, every step the forward's
    llm = LLM(str(model_dir), dp=2, policy="flying", flying_weights="view", compile=False)
    try:
        assert not llm.engine.worker.runner.native_decode
        assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()


def test_dp_replicas_run_it_on_every_rank(families, counted):
    """DP-2: each replica's own layout is one rank's full model; outputs as one process's without it."""
    _, model_dir = families("llama")
    expected = _generate(model_dir, torch.float32, native=False, max_num_batched_tokens=MAX_TOKENS)
    llm = LLM(str(model_dir), dp=2, compile=False, seed=0, max_num_batched_tokens=MAX_TOKENS)
    try:
        assert llm.engine.worker.runner.native_decode
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        prompts = [{"prompt_token_ids": p} for p in random_prompts(4, [3, 17, 40, 9], vocab=vocab)]
        greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        got = [(list(o.outputs[0].token_ids), [[(t, lp.logprob) for t, lp in sorted(step.items())]
                                               for step in o.outputs[0].logprobs]) for o in outs]
        assert got == expected[:4] and counted
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [dict(tp=2), dict(sp=2, shift_threshold=MAX_TOKENS), dict(dp=2, policy="flying"),
                                    dict(pp=2, policy="seesaw")], ids=["tp2", "shift", "flying", "seesaw"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tensor_parallel_ranks_run_it(tmp_path, family, layout, monkeypatch):
    """A TP-2 rank's shard (static TP, the shift layout's TP steps beside SP-2, Flying's TP group of two replicas,
    whose views take their rows of the replicas' whole LM head, Seesaw's decode beside its pipeline): the same
    tokens and logprobs, to the last bit, as the eager forward's shards, whose partial sums the same shared-memory
    all-reduce adds (Qwen2's sharded q/k/v bias); the decoder runs the tensor-parallel steps on each rank."""
    # shards the GEMV reads whole: q/k/v 128 rows a rank, gate/up 256, a vocabulary of 2 x 256 rows
    model_dir = save_checkpoint(build_hf_model(family, hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, vocab_size=512), tmp_path / family)
    sharded = []
    original = NativeDecoder.__call__

    def call(self, input_ids, *args):
        sharded.append(self.tensor_parallel)
        return original(self, input_ids, *args)

    monkeypatch.setattr(NativeDecoder, "__call__", call)
    engine_args = dict(max_num_batched_tokens=MAX_TOKENS, **layout)
    ledgers = [{}, {}]
    expected = _generate(model_dir, torch.float32, native=False, ledger=ledgers[0], **engine_args)
    got = _generate(model_dir, torch.float32, native=True, ledger=ledgers[1], **engine_args)
    assert got == expected and any(sharded)
    assert ledgers[1] == ledgers[0]  # the decoder's all-reduces counted as the forward's


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2, policy="flying"), dict(pp=2, policy="seesaw")],
                         ids=["tp2", "flying", "seesaw"])
def test_a_rank_without_the_decoder_is_warned_about(tmp_path, layout, monkeypatch):
    """A TP-2 rank whose shard the decoder refuses (rank 1's here, made to) runs its steps in Python beside rank 0's
    C++ ones (static TP, Flying's TP group of two replicas, Seesaw's decode): the same tokens and logprobs, and a
    warning on rank 0 that names each rank's decoders."""
    model_dir = save_checkpoint(build_hf_model("llama", hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, vocab_size=512), tmp_path / "llama")
    engine_args = dict(max_num_batched_tokens=MAX_TOKENS, **layout)
    expected = _generate(model_dir, torch.float32, native=False, **engine_args)
    build = ShardDecoder.build
    monkeypatch.setattr(ShardDecoder, "build", lambda model: None if dist.get_rank() == 1 else build(model))
    with pytest.warns(RuntimeWarning, match=r"C\+\+ decoder runs each layout's steps .*\(\{0: \{'[^']+': True\}, "
                                            r"1: \{'[^']+': False\}\}, by rank\)"):
        got = _generate(model_dir, torch.float32, native=True, **engine_args)
    assert got == expected


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2, policy="flying")], ids=["tp2", "flying"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sharded_vocabulary_is_gathered_in_the_call(tmp_path, dtype, layout, monkeypatch):
    """Under TP-2 (static, and Flying's group of two replicas, whose views take their rows of the replicas' whole
    head) the C++ decoder gathers the LM head's shards of the vocabulary (501 tokens: 251 rows a rank, the last one
    padding) through the head's communicator inside its call, and finds each row's argmax there: the same tokens,
    logprobs and ledger as the eager forward, whose all-gather runs in Python."""
    model_dir = save_checkpoint(build_hf_model("llama", hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, vocab_size=501), tmp_path / "llama")
    steps = []
    original = ShardDecoder.step

    def step(self, *args):
        logits = original(self, *args)
        if logits is not None and len(logits):
            argmax = getattr(logits, ROW_ARGMAX, None)
            steps.append((self.decoder.gathers_logits, logits.shape[-1],
                          argmax is not None and argmax.tolist() == logits.argmax(-1).tolist()))
        return logits

    monkeypatch.setattr(ShardDecoder, "step", step)
    engine_args = dict(max_num_batched_tokens=MAX_TOKENS, **layout)
    ledgers = [{}, {}]
    expected = _generate(model_dir, dtype, native=False, ledger=ledgers[0], **engine_args)
    got = _generate(model_dir, dtype, native=True, ledger=ledgers[1], **engine_args)
    assert got == expected
    assert ledgers[1] == ledgers[0]  # the gathers counted as the forward's
    assert steps and set(steps) == {(True, 501, True)}


def test_flying_view_weights_shard_an_uneven_vocabulary(tmp_path):
    """Flying's zero-copy views (which the C++ decoder does not run) take their rows of the whole LM head as a view,
    the last rank's padded to the others' count in a copy (501 tokens over two replicas): the greedy tokens of
    static TP-2, logprobs to float32 rounding."""
    model_dir = save_checkpoint(build_hf_model("llama", hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, vocab_size=501), tmp_path / "llama")
    expected = _generate(model_dir, torch.float32, native=True, max_num_batched_tokens=MAX_TOKENS, tp=2)
    ledger = {}
    got = _generate(model_dir, torch.float32, native=False, ledger=ledger, max_num_batched_tokens=MAX_TOKENS, dp=2,
                    policy="flying", flying_weights="view")
    assert any(op == "all_gather" for _, op in ledger["calls"])  # the TP group's steps gathered their logits
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, got_steps), (_, want_steps) in zip(got, expected, strict=True):
        for got_step, want_step in zip(got_steps, want_steps, strict=True):
            assert [t for t, _ in got_step] == [t for t, _ in want_step]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got_step, want_step)) < 1e-4


def test_a_late_peer_hands_the_cpp_all_gather_to_pythons_wait(tmp_path, monkeypatch):
    """TP-2 with rank 1 in Python (its decoder refused, made to) and 3 ms late to each all-gather of the LM head's
    logits: rank 0's decoder spins 1 ms for it, then hands the gather it published to the communicator's Python wait
    (resume_all_gather, with its deadline and liveness checks); the two paths share the protocol. The tokens and
    logprobs of the eager forward."""
    model_dir = save_checkpoint(build_hf_model("llama", hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, vocab_size=512), tmp_path / "llama")
    engine_args = dict(max_num_batched_tokens=MAX_TOKENS, tp=2)
    expected = _generate(model_dir, torch.float32, native=False, **engine_args)
    build, all_gather, resume = ShardDecoder.build, comm.all_gather, ShmCommunicator.resume_all_gather
    monkeypatch.setattr(ShardDecoder, "build", lambda model: None if dist.get_rank() == 1 else build(model))
    monkeypatch.setattr(comm, "all_gather", lambda x, group, dim=0: (dist.get_rank() == 1 and time.sleep(3e-3))
                        or all_gather(x, group, dim))
    resumed = []
    monkeypatch.setattr(ShmCommunicator, "resume_all_gather",
                        lambda self, x, step: resumed.append(step) or resume(self, x, step))
    with pytest.warns(RuntimeWarning, match=r"C\+\+ decoder runs each layout's steps"):
        got = _generate(model_dir, torch.float32, native=True, **engine_args)
    assert got == expected and resumed  # rank 0's resumed gathers


# shards the GEMV reads whole (q/k/v 128 rows a TP rank), and at SP-2 x TP-2 one KV head a TP rank, repeated for its
# two head chunks
@pytest.mark.parametrize("layout", [
    dict(sp=2, family=family, model=dict(num_key_value_heads=4))
    for family in ("llama", "qwen2", "qwen3", "mistral_window")
] + [dict(sp=2, family="llama", model=dict(num_key_value_heads=4), dtype=torch.bfloat16),
     dict(sp=2, tp=2, family="llama", model=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32))],
    ids=["sp2-llama", "sp2-qwen2", "sp2-qwen3", "sp2-mistral_window", "sp2-llama-bf16", "sp2tp2-replicated-kv"])
def test_sequence_parallel_ranks_run_it(tmp_path, layout, monkeypatch):
    """Static SP's steps (no shift layout): each SP rank runs its share of a step's tokens in the C++ decoder, Ulysses'
    all-to-alls inside each layer's attention call and, at SP-2 x TP-2, its TP shard's all-reduces; where the SP
    ranks' KV caches are not shared (/dev/shm refused them here), a rank without tokens (a batch-1 decode) attends for
    the others in one C++ call meanwhile. The same tokens and logprobs, to the last bit, as the eager forward's, and
    the same collectives counted (Qwen2's q/k/v bias, Qwen3's q/k norms, Mistral's window; KV heads repeated for the
    head chunks where SP x TP exceeds them)."""
    dtype, model_dir, layout = _sp_model(tmp_path, layout)
    monkeypatch.setattr(shared_kv, "_create_segment_file", lambda nbytes: None)
    hidden_out = []
    attends = multiprocessing.get_context("fork").Value("i", 0)  # on the other SP rank, a forked worker
    original_call, original_attend = NativeDecoder.__call__, NativeDecoder.attend

    def call(self, input_ids, *args):
        hidden_out.append((not self.head, len(input_ids)))
        return original_call(self, input_ids, *args)

    def attend(self, attention):
        attends.value += 1
        return original_attend(self, attention)

    monkeypatch.setattr(NativeDecoder, "__call__", call)
    monkeypatch.setattr(NativeDecoder, "attend", attend)
    engine_args = dict(max_num_batched_tokens=MAX_TOKENS, shift_threshold=None, **layout)
    ledgers = [{}, {}]
    engine_args["max_num_batched_tokens"] = min(MAX_TOKENS, 2 * _decoder_limit(dtype))  # each rank's half runs here
    expected = _generate(model_dir, dtype, native=False, ledger=ledgers[0], **engine_args)
    assert not hidden_out and not attends.value
    got = _generate(model_dir, dtype, native=True, ledger=ledgers[1], **engine_args)
    assert got == expected
    assert all(sp for sp, _ in hidden_out)
    assert {1, engine_args["max_num_batched_tokens"] // 2} <= {n for _, n in hidden_out}
    assert attends.value  # the batch-1 decodes' rank without tokens attended in one call
    assert ledgers[1] == ledgers[0] and ledgers[0]["calls"]  # the decoder's all-to-alls counted as the forward's


def _sp_model(tmp_path, layout: dict) -> tuple[torch.dtype, object, dict]:
    """`layout`'s dtype (skipped where the GEMV does not pack it), a checkpoint of its family and model shape, and the
    rest of it (engine arguments)."""
    layout = dict(layout)
    dtype = layout.pop("dtype", torch.float32)
    if dtype not in DTYPES:
        pytest.skip(f"{dtype} is not packed for the GEMV on this CPU")
    family, shape = layout.pop("family"), dict(hidden_size=128, intermediate_size=256, head_dim=16, vocab_size=512)
    shape.update(layout.pop("model"))
    return dtype, save_checkpoint(build_hf_model(family, **shape), tmp_path / family), layout


@pytest.mark.parametrize("layout", [
    dict(sp=2, family="llama", model=dict(num_key_value_heads=4)),
    dict(sp=2, family="mistral_window", model=dict(num_key_value_heads=4)),
    dict(sp=2, family="qwen3", model=dict(num_key_value_heads=4), dtype=torch.bfloat16),
    dict(sp=2, tp=2, family="llama", model=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32))],
    ids=["sp2-llama", "sp2-mistral_window", "sp2-qwen3-bf16", "sp2tp2-replicated-kv"])
def test_one_token_steps_run_on_the_first_sp_rank_over_the_shared_kv(tmp_path, layout, monkeypatch):
    """Where the SP ranks' KV caches are shared (torch_shift.parallel.shared_kv), a one-token step runs on SP rank 0
    (with its TP group) alone: it attends every head chunk into that chunk's rank's cache, without Ulysses'
    all-to-alls, in the C++ decoder and on the eager path alike. The same tokens and logprobs, to the last bit, as
    the all-to-alls' (the caches not shared); one-token steps read the KV that steps of several tokens wrote into the
    other ranks' caches, and a later prompt's chunk reads, through its prefix cache hit, the KV that one-token steps
    wrote there. Without TP, SP rank 0 computes a one-token step's logits alone, with the whole LM head."""
    dtype, model_dir, layout = _sp_model(tmp_path, layout)
    solo_steps = []
    original = ShiftModule._solo_step

    def solo_step(self, input_ids, *args):
        solo_steps.append(len(input_ids))
        return original(self, input_ids, *args)

    monkeypatch.setattr(ShiftModule, "_solo_step", solo_step)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    (alone,), (other,) = random_prompts(1, [40]), random_prompts(2, [9])

    def run(native: bool) -> tuple[list, dict]:
        llm = LLM(str(model_dir), dtype=dtype, native_decode=native, compile=False, seed=0, shift_threshold=None,
                  max_num_batched_tokens=min(MAX_TOKENS, 2 * _decoder_limit(dtype)), **layout)
        try:
            first = llm.generate([{"prompt_token_ids": alone}], greedy, use_tqdm=False)
            # its 48 tokens in whole blocks, 40-47 written by one-token steps, from the prefix cache
            again = alone + list(first[0].outputs[0].token_ids) + [5, 6, 7]
            outs = first + llm.generate([{"prompt_token_ids": again}, {"prompt_token_ids": other}], greedy,
                                        use_tqdm=False)
            ledger = dict(llm.engine.model.ledger.calls)
            assert sum(o.num_cached_tokens or 0 for o in outs) >= 48
        finally:
            llm.shutdown()
        return [(list(o.outputs[0].token_ids), [[(t, lp.logprob) for t, lp in sorted(step.items())]
                                                for step in o.outputs[0].logprobs]) for o in outs], ledger

    shared_native, ledger_native = run(native=True)
    assert len(solo_steps) >= 11 and set(solo_steps) == {1}
    del solo_steps[:]
    shared_eager, ledger_eager = run(native=False)
    assert len(solo_steps) >= 11
    with monkeypatch.context() as refused:
        refused.setattr(shared_kv, "_create_segment_file", lambda nbytes: None)
        del solo_steps[:]
        exchanged, ledger_exchanged = run(native=False)
        assert not solo_steps
    assert shared_native == exchanged and shared_eager == exchanged
    assert ledger_native == ledger_eager
    assert ledger_eager[("base", "all_to_all")] < ledger_exchanged[("base", "all_to_all")]  # none in one-token steps
    # SP rank 0 holds the whole LM head where the base layout is SP alone: its one-token steps gather no logits
    gathers = ledger_eager.get(("base", "all_gather"), 0)
    assert gathers < ledger_exchanged[("base", "all_gather")] if layout.get("tp", 1) == 1 else gathers > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(sp=2, shift_threshold=None)], ids=["tp2", "sp2"])
def test_a_rank_killed_during_a_parallel_step_ends_the_other_with_an_error(tmp_path, counted, layout):
    """A TP-2 or SP-2 rank killed while the C++ decoder runs the steps: the other rank's all-reduce (TP) or Ulysses
    all-to-all (SP) inside the decoder hands its wait to the communicator, which finds the peer dead, and generate
    raises an error naming it (no hang)."""
    model_dir = save_checkpoint(build_hf_model("llama", hidden_size=128, intermediate_size=256, head_dim=16,
                                               num_key_value_heads=4, max_position_embeddings=2048), tmp_path / "m")
    llm = LLM(str(model_dir), compile=False, seed=0, **layout)
    worker = llm.engine.parallel.launched.procs[1]
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the result of this test
            errors.append(e)

    try:
        assert llm.engine.worker.runner.native_decode
        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 30
        while len(counted) < 20:  # the decoder runs the decode steps
            assert time.monotonic() < deadline and thread.is_alive(), errors
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the step did not end"
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "rank 1" in str(errors[0]), errors[0]
    finally:
        llm.shutdown(timeout_s=5)


def test_a_draft_models_forwards_run_it(families, counted):
    """The draft proposer's forwards of a few tokens (speculative decoding's draft_model method): the same proposals
    as the draft's own forward, rounds of prompts, proposals and bonus tokens."""
    from torch_shift.engine.request import Request
    from torch_shift.engine.spec_decode.draft import DraftModelProposer
    from torch_shift.models.linear import prepare_linears
    from torch_shift.models.loader import load_model

    _, model_dir = families("qwen3")
    model = load_model(model_dir)
    prepare_linears(model)
    proposers = [DraftModelProposer(model, num_blocks=64, block_size=4, max_num_batched_tokens=12,
                                    native_decode=native) for native in (True, False)]
    assert proposers[0].native is not None and proposers[1].native is None
    params = SamplingParams(max_tokens=100)
    requests = [[Request(f"r{i}", p, params, max_tokens=100) for i, p in enumerate(random_prompts(3, [5, 20, 9]))]
                for _ in proposers]
    for step in range(6):
        proposals = [proposer.propose(reqs, [3, 1, 4]) for proposer, reqs in zip(proposers, requests)]
        assert proposals[0] == proposals[1] and all(proposals[0])
        for reqs in requests:
            for request, proposal in zip(reqs, proposals[0]):
                new = proposal[:step % 3] + [7 + step]
                request.all_token_ids.extend(new)
                request.output_token_ids.extend(new)
    assert counted


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_on_the_decode_pool_give_the_same_bits(families, dtype, counted):
    """Generations long enough for the GEMV's decode pool to arm (after 8 small steps): the C++ decoder's matmuls
    run on the pool's threads, its logprobs stay the eager forward's. (Synchronous scheduling: with asynchronous
    scheduling the C++ decoder's steps run on its own thread, as the pool's caller, launched or waited for.)"""
    from torch_shift.engine.decode_pool import SMALL_STEPS_BEFORE_POOL
    from torch_shift.kernels import gemv_pool_workers

    _, model_dir = families("llama")
    params = SamplingParams(max_tokens=4 * SMALL_STEPS_BEFORE_POOL, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [30, 7, 12], seed=5)]
    results = []
    for native in (False, True):
        llm = LLM(str(model_dir), dtype=dtype, native_decode=native, compile=False, seed=0, async_scheduling=False)
        runner = llm.engine.worker.runner
        runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 1 MB here)
        armed = []
        run_groups = runner._run_groups

        def spy(*args, run_groups=run_groups, armed=armed):
            armed.append(gemv_pool_workers())
            return run_groups(*args)

        runner._run_groups = spy
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        results.append([(list(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in top.items())
                                                         for top in o.outputs[0].logprobs]) for o in outs])
        if runner.decode_pool.enabled and torch.get_num_threads() > 1:
            assert max(armed) > 0
        llm.shutdown()
    assert results[0] == results[1] and counted


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_launched_steps_give_the_synchronous_engines_tokens(families, dtype, launches):
    """Asynchronous scheduling on the CPU (on by default where the C++ decoder runs single steps): small steps
    launched on the C++ decoder's thread while the engine prepares the next, their decodes' input ids read there from
    the tokens of the step before, which that thread drew (the argmax, or for sampled requests with the uniforms the
    sampler took before the step). Greedy and seeded sampled requests (temperature, top-k, top-p, min-p), a stop
    token, prompts arriving while others decode, a request with logprobs (whose steps are synchronous), one with a
    logit bias (whose draws are the host's) and an abort with a step in flight: the synchronous engine's tokens and
    finish reasons, every KV block returned."""
    _, model_dir = families("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [30, 7, 12, 3, 21], seed=5)]
    sampled = {1: {"top_k": 20}, 3: {"top_p": 0.7, "min_p": 0.02}, 4: {"temperature": 1.3}}
    params = [SamplingParams(**{"max_tokens": 40, "temperature": 0.0 if i % 2 == 0 else 0.8, "seed": i,
                                "ignore_eos": i != 2, "stop_token_ids": list(range(3, 512, 7)) if i == 2 else [],
                                **sampled.get(i, {})}) for i in range(5)]
    results = []
    for mode in (False, True):
        # the default (None) on the CPU: on where the runner launches the decoder's single steps
        llm = LLM(str(model_dir), dtype=dtype, async_scheduling=None if mode else False, compile=False, seed=0,
                  max_num_seqs=4, num_scheduler_steps=1)
        runner = llm.engine.worker.runner
        assert runner.launch_steps is mode and llm.engine.config.scheduler.async_scheduling is mode
        runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 1 MB here)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[:2], [params[0], SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True)],
                             use_tqdm=False)
        outs += llm.generate(prompts[2:4], [params[3], SamplingParams(max_tokens=20, temperature=0.8, seed=9,
                                                                      logit_bias={5: 3.0}, ignore_eos=True)],
                             use_tqdm=False)
        engine = llm.engine
        engine.add_request("aborted", prompts[1]["prompt_token_ids"],
                           SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        for _ in range(20):
            engine.step()
        engine.abort_request("aborted")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        results.append([(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs])
        llm.shutdown()
    assert results[0] == results[1]
    assert any(r[1] == "stop" for r in results[0])
    assert sum(launches) >= 20 and not all(launches)  # placeholders read on the decoder's thread, and on the host
    assert sum(launches.drawn) >= 20 and not all(launches.drawn)  # sampled there, and greedy steps by argmax


def _check_every_proposal(speculator) -> None:
    """Every request's proposals checked whole, whatever the step cost fit made of the timed steps (on a loaded
    machine it priced later checks out, and a test's second generation made none)."""
    speculator._prices = lambda num_running, cost, wait_seconds: (0.0, 16)
    speculator.step_cost.at = lambda num_running: None


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
def test_launched_steps_beside_speculative_decoding(families, launches, monkeypatch):
    """With speculative decoding (on by default here too) the steps after which nothing is proposed are launched on
    the decoder's thread, their input ids read there; a step that checks proposals is launched there too, with
    nothing in flight, and waited for. Greedy and seeded sampled requests: the tokens of the synchronous engine
    without speculation. Single steps only (num_scheduler_steps=1): by default quiet stretches of two steps or more
    run as multi-step runs (test_spec_decode.py's test_quiet_steps_run_in_multi_step_runs)."""
    # the pool from a prefill's first small step on: on a Zen 3 every check of this work fell in the first 8 steps
    # after one, which run off the pool (decode_pool.SMALL_STEPS_BEFORE_POOL), and none was launched
    monkeypatch.setattr(decode_pool, "SMALL_STEPS_BEFORE_POOL", 0)
    _, model_dir = families("llama")
    base = random_prompts(3, [5, 9, 3], seed=8)
    prompts = [{"prompt_token_ids": p} for p in [base[0] * 4, random_prompts(1, [20], seed=9)[0], base[1] * 3,
                                                 base[2] * 6]]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    reference = LLM(str(model_dir), compile=False, seed=0, async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)
                + reference.generate(prompts, sampled, use_tqdm=False)]
    reference.shutdown()
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={"method": "suffix"}, num_scheduler_steps=1)
    assert llm.engine.config.scheduler.async_scheduling and llm.engine.worker.runner.launch_steps
    runner = llm.engine.worker.runner
    runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 1 MB here)
    _check_every_proposal(llm.engine.core.speculator)
    checks, launch = [], runner._launch  # (whether a launched step checks proposals, whether nothing was in flight)
    runner._launch = lambda plan, previous, draws: checks.append(
        (plan.groups[0].num_spec is not None, previous is None)) or launch(plan, previous, draws)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert sum(launches) > 0  # greedy steps ran ahead, their input ids read on the decoder's thread
    outputs += llm.generate(prompts, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["spec_decode"]["num_drafts"] > 0
    assert any(check for check, _ in checks) and all(alone for check, alone in checks if check)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}, {"dp": 2}, {"dp": 2, "declined": True}],
                         ids=["one-rank", "shift", "dp", "dp-declined"])
def test_a_batch_1_check_in_two_stages(families, monkeypatch, layout):
    """A batch-1 greedy check runs in two stages on the C++ decoder: the proposals that pay (two here), then more
    of the draft only where every row of the first drew the next proposal (run_in_stages). With one rank the check
    is launched on the decoder's thread; under Shift it is a TP-2 step, both ranks running the same stages; with DP-2
    a replica's own synchronous step, on the replica without rank 0 (a short request beside each takes rank 0's),
    which sends rank 0 its rows' argmax (or, where its decoder declines the check and the forward runs every row, that
    it did not run it in stages). An
    oracle proposes each request's true continuation, a token wrong here and there, so that second stages run, are
    skipped and reject within themselves: the tokens of the same engine without speculation, the speculator
    counting the proposals a skipped second stage did not check as not proposed, LLM.stats() the rows the stages
    computed (a skipped second stage's slots not among them), every KV block back."""
    from torch_shift.engine import spec_decode

    monkeypatch.setattr(decode_pool, "SMALL_STEPS_BEFORE_POOL", 0)
    layout = dict(layout)
    declined = layout.pop("declined", False)
    staged_rows = []  # rank 0's decoder: each staged step's rows' argmax (-1: a row not run)
    call, launch = NativeDecoder.__call__, NativeDecoder.launch

    def staged_call(self, input_ids, positions, logits_indices, attention, first_stage=0, redraft=None):
        if declined and first_stage and dist.get_rank() != 0:  # forked ranks inherit it
            return None
        logits = call(self, input_ids, positions, logits_indices, attention, first_stage, redraft)
        if first_stage:
            staged_rows.append(getattr(logits, ROW_ARGMAX))
        return logits

    def staged_launch(self, input_ids, positions, logits_indices, attention, placeholders=None, draws=None,
                      first_stage=0, redraft=None):
        logits, step = launch(self, input_ids, positions, logits_indices, attention, placeholders, draws, first_stage,
                              redraft)
        if first_stage:
            staged_rows.append(step.row_argmax)  # written once the step ran: read after the generations
        return logits, step

    monkeypatch.setattr(NativeDecoder, "__call__", staged_call)
    monkeypatch.setattr(NativeDecoder, "launch", staged_launch)
    _, model_dir = families("llama")
    *prompts, beside = [{"prompt_token_ids": p} for p in random_prompts(4, [9, 14, 5, 3], seed=11)]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def generate(engine, prompt):  # the prompt's tokens, under DP-2 on replica 1
        if "dp" not in layout:
            return list(engine.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        return list(engine.generate([beside, prompt], [short, greedy], use_tqdm=False)[1].outputs[0].token_ids)

    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    expected = [generate(reference, prompt) for prompt in prompts]
    reference.shutdown()
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={"method": "suffix",
                                                                         "num_speculative_tokens": 8}, **layout)
    runner, speculator = llm.engine.worker.runner, llm.engine.core.speculator
    runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 1 MB here)
    assert speculator.staged_check_tokens >= 8
    truth = {tuple(p["prompt_token_ids"]): tokens for p, tokens in zip(prompts, expected)}
    wrong = iter(range(1 << 20))

    class Oracle:
        name = "oracle"

        def propose(self, requests, max_tokens):
            out = []
            for request, k in zip(requests, max_tokens):
                done = request.num_output_tokens
                tokens = truth.get(tuple(request.prompt_token_ids), [])[done:done + k]
                # every fifth proposal wrong: first stages that reject, second stages skipped or rejecting
                out.append([t if next(wrong) % 5 else t + 1 for t in tokens])
            return out

        def on_finish(self, request, cache):
            pass

    speculator.proposer = Oracle()
    monkeypatch.setattr(spec_decode, "tokens_that_pay", lambda rates, lengths, num_running, cost: [
        min(2, n) for n in lengths])
    speculator._prices = lambda num_running, cost, wait_seconds: (0.0, 16)  # every request checked
    # a fixed step cost: without a fit (none yet, or none plausible from steps timed on a loaded machine) a check
    # keeps its whole draft in one stage, and CI once saw no second stage run
    speculator.step_cost.at = lambda num_running: (1e-3, 1e-4, 1e-4, 1e-4)
    stages = []  # per staged check: (its first stage's proposals, the proposals accepted, those counted)
    replicas = set()
    observe = speculator.observe

    def observed(entries, sampled, seconds):
        checks = observe(entries, sampled, seconds)
        for (e,), (counted, accepted) in zip(entries, checks):
            if 0 < e.request.spec_stage < len(e.spec_token_ids):
                stages.append((e.request.spec_stage, accepted, counted, len(e.spec_token_ids)))
                replicas.add(e.request.replicas)
        return checks

    speculator.observe = observed
    outputs = [generate(llm, prompt) for prompt in prompts]
    assert outputs == expected
    assert replicas == ({(1,)} if "dp" in layout else {(0,)})
    ran = [s for s in stages if s[1] > s[0]]
    skipped = [s for s in stages if s[1] <= s[0]]
    assert ran and skipped and any(accepted < proposed for _, accepted, _, proposed in ran)
    assert all(counted == proposed for _, _, counted, proposed in ran)
    assert all(counted == first + 1 for first, _, counted, _ in skipped)
    # rank 0's C++ decoder ran them (under DP-2 rank 1's, whose rows' argmax the stats below read): second stages
    # run whole, and skipped (their rows' argmax -1)
    assert len(staged_rows) == (0 if "dp" in layout else len(stages))
    if staged_rows:
        assert any((rows == -1).any() for rows in staged_rows) and any((rows >= 0).all() for rows in staged_rows)
    stats = llm.stats()
    spec = stats["spec_decode"]
    # a row per prompt token, per token drawn after the prompt's, per rejected proposal that a stage checked, less
    # one per skipped second stage: the first's last row checked a proposal and drew no token kept; where the forward
    # ran a declined check's rows, every slot (the speculator still counts the first stage's proposals only)
    num_rows = sum(len(p["prompt_token_ids"]) + len(out) - 1 for p, out in zip(prompts, outputs))
    if "dp" in layout:
        num_rows += len(prompts) * (len(beside["prompt_token_ids"]) + short.max_tokens - 1)
    ran_whole = sum(num_slots - first for first, _, _, num_slots in skipped) if declined else 0
    assert stats["num_scheduled_tokens"] == (num_rows + spec["num_draft_tokens"] - spec["num_accepted_tokens"]
                                             - len(skipped) + ran_whole)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


def _cycle_prompt(reference: LLM, greedy: SamplingParams) -> dict:
    """A prompt that holds the cycle the cycling model's greedy output falls into: its output repeats the cycle, so
    long checks are accepted."""
    start = random_prompts(1, [6], seed=5)[0]
    cycle = reference.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids[-24:]
    return {"prompt_token_ids": start + list(cycle)}


def _recorded_checks(speculator) -> list:
    """The stages of each redrafting check the speculator observes from now on (Request.spec_stages), in order."""
    checks, observe = [], speculator.observe

    def observed(entries, sampled, seconds):
        checks.extend(e.request.spec_stages for group in entries for e in group if e.request.spec_stages is not None)
        return observe(entries, sampled, seconds)

    speculator.observe = observed
    return checks


def _redrafting_engine(model_dir: Path, layout: dict) -> LLM:
    """Suffix decoding of up to 8 tokens a stage, its drafts the request's own (no earlier outputs cached), the decode
    pool's KV budget lifted (a model of 1 MB here)."""
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}, **layout)
    llm.engine.worker.runner.decode_pool.kv_budget_tokens = None
    return llm


def _cycling_model(tmp_path: Path) -> Path:
    """A random Llama whose attention adds nothing (o_proj zero): each token follows from the one before, and a
    greedy output falls into a cycle."""
    model = build_hf_model("llama", **SHAPES)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return save_checkpoint(model, tmp_path)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}, {"dp": 2}], ids=["one-rank", "shift", "dp"])
def test_a_batch_1_check_that_redrafts(tmp_path, layout, monkeypatch):
    """With suffix decoding a batch-1 greedy check's stages after the first are drafted by the C++ decoder from the
    request's tokens and those each stage drew, after a rejection too (run_redrafting): the tokens of the same engine
    without speculation, a stop token included; checks of several stages, some after a stage that rejected a
    proposal, some stages that found no draft and decoded a token alone, each stage with a draft observed as a check;
    every KV block back. The model's attention adds nothing (o_proj zero), so each token follows from the one before
    and the output falls into a cycle; two prompts hold the cycle reversed, so that drafts from it are rejected until
    the output's own copies outweigh it."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    starts = random_prompts(2, [6, 4], seed=5)
    outputs = [list(reference.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
               for p in starts]
    # a prompt that ends as the first start does, after which it held the first output's first 3 tokens and then 4
    # others: a first stage accepts 3, and the next token follows nothing in the prompt
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    others = [t for t in range(vocab_size) if t not in outputs[0] + starts[0]][:4]
    prompts = [{"prompt_token_ids": starts[0] + outputs[0][:3] + others + starts[0][-1:]}]
    prompts += [{"prompt_token_ids": p + list(reversed(o[-24:]))} for p, o in zip(starts, outputs)]
    expected = [list(reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
                for prompt in prompts]
    stop = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, stop_token_ids=[expected[1][60]])
    expected.append(list(reference.generate(prompts[1], stop, use_tqdm=False)[0].outputs[0].token_ids))
    reference.shutdown()
    assert len(expected[3]) <= 61
    # no earlier outputs cached: every draft is the request's own, which the decoder redrafts, going on with a token
    # alone where it finds none
    llm = _redrafting_engine(model_dir, layout)
    speculator = llm.engine.core.speculator
    assert speculator.staged_check_tokens >= 8
    _check_every_proposal(speculator)
    # every draft checked whole, whatever the step cost fit its stages' timings form
    from torch_shift.engine import spec_decode

    monkeypatch.setattr(spec_decode, "tokens_that_pay", lambda rates, lengths, num_running, cost: list(lengths))
    checks, observe, priced = [], speculator.observe, []
    fit_observe = speculator.step_cost.observe
    speculator.step_cost.observe = lambda *args: priced.append(args) or fit_observe(*args)

    def observed(entries, sampled, seconds):
        stages = [e.request.spec_stages for group in entries for e in group if e.request.spec_stages is not None]
        num_priced = len(priced)
        found = observe(entries, sampled, seconds)
        if stages:
            assert found == [s[:2] for s in stages[0] if s[0]]  # each stage with a draft a check
            # each stage priced as a step of its proposals, its time in the decoder and a share of the host's
            assert [p[:3] for p in priced[num_priced:]] == [(1, s.proposed, int(s.proposed > 0)) for s in stages[0]]
            assert all(p[3] >= s.seconds > 0 for p, s in zip(priced[num_priced:], stages[0]))
            in_decoder = sum(s.seconds for s in stages[0])  # (a DP replica's on its rank, the step's on rank 0)
            assert sum(p[3] for p in priced[num_priced:]) == pytest.approx(max(seconds, in_decoder))
            checks.append(stages[0])
        return found

    speculator.observe = observed
    outputs = [list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids) for prompt in prompts]
    outputs.append(list(llm.generate(prompts[1], stop, use_tqdm=False)[0].outputs[0].token_ids))
    assert outputs == expected
    assert any(len(stages) > 1 for stages in checks)
    assert any(accepted < proposed for stages in checks for proposed, accepted, _ in stages[:-1])  # went on after one
    assert any(stage.proposed == 0 for stages in checks for stage in stages)  # a token alone
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}], ids=["one-rank", "shift"])
def test_a_redrafting_check_from_a_token_alone(tmp_path, layout, monkeypatch):
    """Where the proposer finds no draft after a batch-1 request's last token but drafts pay at its rate, the request
    still gets a redrafting check: its first stage decodes the token alone and the decoder drafts the stages after it
    (Speculator._second_stage), where a plain step would wait for its token beside the speculator and then back off.
    The tokens of the engine without speculation; such checks go on to stages with drafts; a plain decode step only
    where the check would hold fewer than two slots (the last tokens); every KV block back. On by default at one rank
    only (under Shift quiet steps run 8 to a plan), turned on here under Shift too."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts(1, [6], seed=5)[0]}
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    expected = reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    reference.shutdown()
    llm = _redrafting_engine(model_dir, layout)
    speculator = llm.engine.core.speculator
    assert speculator.redraft_from_token_alone == (not layout)
    speculator.redraft_from_token_alone = True
    speculator._prices = lambda num_running, cost, wait_seconds: (0.0, 16)  # every request proposes
    speculator.step_cost.at = lambda num_running: (1e-3, 1e-4, 1e-4, 1e-4)  # a fit, whatever the machine's timing
    from torch_shift.engine import spec_decode

    monkeypatch.setattr(spec_decode, "tokens_that_pay", lambda rates, lengths, num_running, cost: list(lengths))
    checks = _recorded_checks(speculator)
    plain, builder = [], llm.engine.core.plan_builder.build  # each plain decode step's position

    def build(*args):
        plan = builder(*args)
        plain.extend(group.num_kv_tokens for group in plan.groups
                     if group.num_tokens == 1 and group.num_spec is None and group.num_kv_tokens > 0)
        return plan

    llm.engine.core.plan_builder.build = build
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    alone = [stages for stages in checks if stages[0].proposed == 0]
    assert alone and any(len(stages) > 1 and any(s.proposed for s in stages[1:]) for stages in alone)
    end = len(prompt["prompt_token_ids"]) + len(expected)
    assert all(position >= end - 3 for position in plain), (plain, end)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}], ids=["one-rank", "shift"])
def test_redrafting_checks_count_the_rows_their_stages_ran(tmp_path, layout, monkeypatch):
    """LLM.stats() after a batch-1 request whose checks redrafted: its scheduled tokens (and so /metrics' tokens per
    step) are the rows its steps computed, each stage its proposals and the token before them, not the slots a plan
    held for stages that never ran (checks of two stages here, ending before their slots); steps of checks are decode
    steps, the prompt's the only other; `stages_by_rows` counts the stages observed by their rows."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, [6], seed=5)[0]
    llm = _redrafting_engine(model_dir, layout)
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    from torch_shift.engine import spec_decode

    monkeypatch.setattr(spec_decode, "tokens_that_pay", lambda rates, lengths, num_running, cost: list(lengths))
    monkeypatch.setattr(spec_decode, "REDRAFT_STAGES", 2)
    checks = _recorded_checks(speculator)
    generated = len(llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    stats = llm.stats()
    spec = stats["spec_decode"]
    assert generated == 64 and any(len(stages) > 1 for stages in checks)
    # a row per prompt token, per token drawn after the prompt's, per rejected proposal
    num_rows = len(prompt) + generated - 1 + spec["num_draft_tokens"] - spec["num_accepted_tokens"]
    assert stats["num_scheduled_tokens"] == num_rows
    assert stats["num_decode_steps"] == stats["num_steps"] - 1
    assert stats["time_s"]["decode"] > 0 and stats["time_s"]["mixed"] == 0
    # the stages by their rows, each as observed: their count, the proposals they kept, a time each
    stages = [stage for check in checks for stage in check]
    by_rows = spec["stages_by_rows"]
    assert sorted(by_rows) == sorted({stage.proposed + 1 for stage in stages})
    for rows, figures in by_rows.items():
        of_rows = [stage for stage in stages if stage.proposed + 1 == rows]
        assert figures["stages"] == len(of_rows) and figures["mean_seconds"] > 0
        assert figures["mean_accepted"] * len(of_rows) == pytest.approx(sum(stage.accepted for stage in of_rows))
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}], ids=["one-rank", "shift"])
def test_a_redrafting_check_drafts_from_earlier_outputs(tmp_path, layout):
    """With earlier outputs cached, a redrafting check's later stages are drafted from them too (rank 0 holds the
    global tree; under Shift it tells rank 1 each draft): a request whose own tokens hold nothing to repeat, but
    whose prompt ends as an earlier output began, runs checks of several stages, and its tokens stay those without
    speculation. The model's attention adds nothing (o_proj zero), so each token follows from the one before."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    start = random_prompts(1, [6], seed=5)[0]
    earlier = list(reference.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    others = [t for t in range(vocab_size) if t not in earlier + start][:4]
    prompt = {"prompt_token_ids": others + earlier[:2]}  # its output follows the earlier one's from its third token
    expected = list(reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    reference.shutdown()
    assert len(set(earlier[2:12])) == 10  # the first tokens repeat nothing: their drafts are the earlier output's
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={"method": "suffix",
                                                                         "num_speculative_tokens": 8}, **layout)
    llm.engine.worker.runner.decode_pool.kv_budget_tokens = None  # whatever its context (a model of 1 MB here)
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    assert llm.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids == earlier
    checks = _recorded_checks(speculator)
    assert list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids) == expected
    # the first check's draft and its later stages' could only come from the earlier output
    assert checks and len(checks[0]) > 1 and all(stage.proposed > 0 for stage in checks[0])
    assert sum(stage.accepted for stages in checks for stage in stages) >= 20
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}, {"dp": 2}], ids=["one-rank", "shift", "dp"])
def test_rank_0s_interrupt_ends_a_redrafting_check_after_its_stage(tmp_path, layout):
    """A redrafting check is a run whose steps are its stages (torch_shift.parallel.runs): interrupted, as a request
    arriving at the server does, it ends after the stage it is in on every rank of its layout, and the tokens stay
    those without speculation; with the interrupt set and cleared at random moments, the same tokens (a rank that
    ended a stage apart from the others would draw other tokens, or wait for them forever)."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    prompt = _cycle_prompt(reference, greedy)
    expected = reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    reference.shutdown()
    llm = _redrafting_engine(model_dir, layout)
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    checks = _recorded_checks(speculator)
    try:
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert any(len(stages) > 1 for stages in checks)
        checks.clear()
        llm.engine.interrupt_run()
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert checks and all(len(stages) == 1 for stages in checks)
        llm.engine.clear_run_interrupt()
        with interrupted_at_random(llm.engine):
            for _ in range(3):
                assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("layout", [{}, {"sp": 2, "shift_threshold": 32}], ids=["one-rank", "shift"])
def test_a_redrafting_check_ends_at_the_stage_that_completes_a_stop_string(tmp_path, layout):
    """A request with a stop string: its redrafting checks end after a stage that drew a token that may complete it
    (Tokenizer.stop_string_token_ids), not up to REDRAFT_STAGES stages later, whose tokens the host would only cut
    off; the text and tokens those of the engine without speculation. (With no such tokens, the checks drew 64 tokens
    for an output of 12 here.)"""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    prompt = _cycle_prompt(reference, greedy)
    text = reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    # the stop: three characters of the output (no replacement character), those it completes latest
    windows = [text[i:i + 3] for i in range(len(text) - 2) if "\ufffd" not in text[i:i + 3]]
    stop = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, stop=[max(windows, key=text.find)])
    expected = reference.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
    reference.shutdown()
    assert expected.finish_reason == "stop" and len(expected.token_ids) >= 10
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}, **layout)
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    checks = _recorded_checks(speculator)
    try:
        output = llm.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
        assert (output.text, output.token_ids, output.finish_reason) == (
            expected.text, expected.token_ids, expected.finish_reason)
        assert any(len(stages) > 1 for stages in checks)
        drawn = sum(accepted + 1 for stages in checks for _, accepted, _ in stages)
        # what plain steps and checks' rows drew in all: the output, and the rest of the stop's stage at most
        assert drawn <= len(expected.token_ids) + 8, (drawn, len(expected.token_ids))
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("declined", [False, True], ids=["redrafted", "declined"])
def test_a_dp_replica_without_rank_0_redrafts_from_its_copy_of_earlier_outputs(tmp_path, monkeypatch, declined):
    """Under DP-2 the global tree of earlier outputs is rank 0's, and rank 1 keeps a copy that adds what rank 0's took
    before each step (StepPlan.global_tree_outputs): a request on replica 1 whose drafts come from an earlier output
    gets redrafting checks whose later stages draft from the copy, their stages and tokens sent to rank 0, and its
    tokens stay those without speculation. (Without the copy its first check's later stages found no draft.) Where
    rank 1's decoder declines the checks (as over an emulated link), the forward's rows are read as one-stage checks'
    (their drawn tokens were -1s read as the request's)."""
    if declined:  # forked ranks inherit it; rank 0's own steps run on
        call = native_decoder.NativeDecoder.__call__

        def declining(self, *args, **kwargs):
            redraft = args[5] if len(args) > 5 else kwargs.get("redraft")
            return None if redraft is not None and dist.get_rank() != 0 else call(self, *args, **kwargs)

        monkeypatch.setattr(native_decoder.NativeDecoder, "__call__", declining)
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False, seed=0, dp=2)
    start = random_prompts(1, [6], seed=5)[0]
    earlier = list(reference.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    others = [t for t in range(vocab_size) if t not in earlier + start][:5]
    prompts = [{"prompt_token_ids": others[4:] + start[:3]}, {"prompt_token_ids": others[:4] + earlier[:2]}]
    expected = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, [short, greedy], use_tqdm=False)]
    reference.shutdown()
    assert len(set(earlier[2:12])) == 10  # the first tokens repeat nothing: their drafts are the earlier output's
    llm = LLM(str(model_dir), compile=False, seed=0, dp=2, speculative_config={"method": "suffix",
                                                                                "num_speculative_tokens": 8})
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    llm.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)
    replicas, checks, observe = set(), [], speculator.observe

    def observed(entries, sampled, seconds):
        for e in (e for group in entries for e in group if e.request.max_tokens == 40):
            replicas.add(e.request.replicas)  # () once it finished
            if e.request.spec_stages is not None:
                checks.append(e.request.spec_stages)
        return observe(entries, sampled, seconds)

    speculator.observe = observed
    outputs = llm.generate(prompts, [short, greedy], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert replicas - {()} == {(1,)}  # the second request went to the replica without rank 0
    if declined:
        assert not checks and llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    else:  # the first check's draft and its later stages' could only come from the earlier output
        assert checks and len(checks[0]) > 1 and all(stage.proposed > 0 for stage in checks[0])
        assert llm.stats()["spec_decode"]["num_accepted_tokens"] >= 20
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
@pytest.mark.parametrize("replica", [0, 1])
def test_a_request_that_arrives_beside_a_redrafting_check_makes_it_one_of_two_stages(tmp_path, replica):
    """Under DP-2 a request alone on a replica gets a redrafting check (its proposals made while it ran alone); one
    that arrives before the check runs takes the other replica, and the plan of both runs the check as a plain check in
    two stages (the engine reads a redrafting check's rows as its plan's only group: core._take_redrafted), on either
    replica; the tokens stay those without speculation."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, [6], seed=5)[0]
    reference = LLM(str(model_dir), compile=False, seed=0)
    expected = list(reference.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    reference.shutdown()
    llm = LLM(str(model_dir), compile=False, seed=0, dp=2, speculative_config={"method": "suffix",
                                                                                "num_speculative_tokens": 8})
    _check_every_proposal(llm.engine.core.speculator)
    engine, outputs = llm.engine, {}
    try:
        if replica == 1:  # the first request takes replica 0 and ends at once
            engine.add_request("first", {"prompt_token_ids": prompt[1:]}, short)
        engine.add_request("long", {"prompt_token_ids": prompt}, greedy)
        redrafted = arrived = False
        while engine.has_unfinished_requests():
            request = engine.core.scheduler.requests.get("long")
            if not arrived and request is not None and request.spec_redraft is not None:
                assert request.replicas == (replica,)
                engine.add_request("arrived", {"prompt_token_ids": prompt[2:]}, short)
                redrafted = arrived = True
            for output in engine.step():
                outputs[output.request_id] = output
        assert redrafted and list(outputs["long"].outputs[0].token_ids) == expected
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("from_token_alone", [False, True], ids=["drafted", "token-alone"])
def test_a_redrafting_check_the_decoder_declines_runs_in_one_stage(tmp_path, monkeypatch, from_token_alone):
    """A TP-2 step over an emulated link is not the C++ decoder's (ShardDecoder declines it): a redrafting check runs
    the forward as a one-stage check of every slot's proposal, and the tokens stay those without speculation. A check
    from a token alone (a fit under which drafts pay, where the proposer found none) holds only fillers in its slots:
    none of them is counted as a proposal."""
    model_dir = _cycling_model(tmp_path)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    start = random_prompts(1, [6], seed=5)[0]
    layout = dict(tp=2, interconnect_gbps=100.0)
    reference = LLM(str(model_dir), compile=False, seed=0, **layout)
    cycle = reference.generate({"prompt_token_ids": start}, greedy, use_tqdm=False)[0].outputs[0].token_ids[-24:]
    # from a token alone: the start alone, whose first tokens the proposer finds no draft after
    prompt = {"prompt_token_ids": start if from_token_alone else start + list(reversed(cycle))}
    expected = reference.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    reference.shutdown()
    llm = LLM(str(model_dir), compile=False, seed=0, speculative_config={
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}, **layout)
    speculator = llm.engine.core.speculator
    _check_every_proposal(speculator)
    if from_token_alone:
        speculator.redraft_from_token_alone = True  # (off by default at two ranks)
        speculator.step_cost.at = lambda num_running: (1e-3, 1e-4, 1e-4, 1e-4)
        from torch_shift.engine import spec_decode

        monkeypatch.setattr(spec_decode, "tokens_that_pay", lambda rates, lengths, num_running, cost: list(lengths))
    redrafts, builder = [], llm.engine.core.plan_builder.build

    def build(*args):
        plan = builder(*args)
        redrafts.extend(group.first_stage for group in plan.groups if group.redraft is not None)
        return plan

    llm.engine.core.plan_builder.build = build
    ran, stages = [], native_decoder.redraft_stages
    monkeypatch.setattr(core, "redraft_stages", lambda counts: ran.append(stages(counts)) or ran[-1])
    from_alone, observe = [], speculator.observe  # what each check from a token alone was observed as

    def observed(entries, sampled, seconds):
        found = observe(entries, sampled, seconds)
        from_alone.extend(found for group in entries for e in group
                          if e.spec_token_ids and e.spec_fillers == len(e.spec_token_ids))
        return found

    speculator.observe = observed
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert redrafts and llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert (1 in redrafts) == from_token_alone == bool(from_alone)  # a first stage of the token alone
    assert all(found == [] for found in from_alone)  # its fillers counted as no check
    assert ran and not any(ran)  # the decoder ran none of them
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a launched step needs the decode pool (two threads or more)")
def test_the_decoders_thread_runs_on_one_openmp_thread(families):
    """The launched steps' thread starts no OpenMP team, whatever torch's process-wide count: a team of two beside
    the engine's helping thread made each step 3x as long. Over a generation of small steps, CPU time goes to the
    engine's thread and the decoder's, none to a third."""
    import os
    import threading

    def cpu_ticks() -> dict[str, int]:
        ticks = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
            except OSError:  # ended meanwhile
                pass
        return ticks

    _, model_dir = families("llama")
    torch.set_num_threads(torch.get_num_threads())  # a count set process-wide, as a benchmark or a user does
    llm = LLM(str(model_dir), dtype=torch.float32, compile=False, seed=0, num_scheduler_steps=1)
    runner = llm.engine.worker.runner
    runner.decode_pool.kv_budget_tokens = None
    prompt = [{"prompt_token_ids": random_prompts(1, [20], seed=2)[0]}]
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # the decoder's thread starts
    before = cpu_ticks()
    for _ in range(5):  # 2,000 steps: 4 ticks of 10 ms took one generation on a slower machine, 3 on a faster one
        llm.generate(prompt, params, use_tqdm=False)
    after = cpu_ticks()
    assert runner.launch_steps
    used = sorted((after[tid] - before.get(tid, 0) for tid in after if tid != str(threading.get_native_id())),
                  reverse=True)
    assert used[0] >= 4 and sum(used[1:]) * 4 <= used[0], used  # the decoder's thread; the others idle
    llm.shutdown()
