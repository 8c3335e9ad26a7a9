"""The offline engine end to end, against `transformers.generate` and against itself."""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import re
import shutil
import time
from dataclasses import replace

import pytest
import torch
from conftest import VOCAB_SIZE, LogLines, hf_greedy, random_prompts, rewrite_config

from torch_shift import LLM, SamplingParams
from torch_shift.engine.errors import ParameterError
from torch_shift.engine.output_processor import StopStrings
from torch_shift.engine.sampling_params import RequestOutputKind
from torch_shift.engine.structured_output import StructuredOutputsParams, ascii_shorthands

PROMPT_LENGTHS = [3, 17, 40, 1, 9, 64, 33, 5]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def greedy_refs(checkpoints):
    refs = {}
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        hf_model, _ = checkpoints(family)
        refs[family] = [hf_greedy(hf_model, p, MAX_TOKENS) for p in random_prompts(8, PROMPT_LENGTHS)]
    return refs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},  # prompts split into chunks, mixed with decodes
    {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},  # a pool small enough to preempt
], ids=["batched", "chunked", "preempted"])
def test_greedy_matches_transformers_generate(checkpoints, greedy_refs, family, engine_args):
    _, model_dir = checkpoints(family)
    llm = LLM(str(model_dir), **engine_args)
    outs = llm.generate(random_prompts(8, PROMPT_LENGTHS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_refs[family]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    engine = llm.engine
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_match_transformers(checkpoints):
    hf_model, model_dir = checkpoints("qwen3")
    llm = LLM(str(model_dir), max_num_batched_tokens=8)
    prompt = random_prompts(1, [21])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=3),
                       use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + generated])).logits[0].float(), dim=-1)
    # prompt logprobs: None for the first token, then the actual token plus the top 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        assert math.isclose(entry[prompt[pos]].logprob, ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4)
        top = ref[pos - 1].topk(3)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert math.isclose(entry[tid].logprob, lp, abs_tol=1e-4) and entry[tid].rank == rank
    # generated logprobs: one dict per token with the sampled token (rank 1 when greedy) and the top 5
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(generated)
    for i, tok in enumerate(generated):
        row = ref[len(prompt) + i - 1]
        assert logprobs[i][tok].rank == 1
        assert math.isclose(logprobs[i][tok].logprob, row[tok].item(), abs_tol=1e-4)
        assert set(logprobs[i]) == set(row.topk(5).indices.tolist())
    assert math.isclose(out.outputs[0].cumulative_logprob, sum(lp[t].logprob for lp, t in zip(logprobs, generated)),
                        abs_tol=1e-4)


def test_prefix_cache_hits_give_identical_outputs_and_compute_fewer_tokens(llama):
    _, model_dir = llama
    shared = random_prompts(1, [40], seed=3)[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    cold = LLM(str(model_dir), enable_prefix_caching=False, block_size=8)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(model_dir), block_size=8)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    scheduled = []
    original = llm.engine.scheduler.schedule

    def counting_schedule(*args):
        plan = original(*args)
        scheduled.append(plan.num_scheduled_tokens)
        return plan

    llm.engine.scheduler.schedule = counting_schedule
    second = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 40  # five full blocks of the shared prefix
    assert scheduled[0] == len(prompts[1]) - 40
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected


def test_seeded_sampling_same_alone_and_in_a_batch(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    prompt = random_prompts(1, [10], seed=5)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(6, [4, 20, 7, 33, 2, 15], seed=9)
    batch_params = [SamplingParams(max_tokens=16, temperature=0.8) for _ in others] + [seeded]
    batched = llm.generate(others + [prompt], batch_params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == batched
    unseeded = [llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0), use_tqdm=False)[0]
                .outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # without a seed the draws differ


def test_n_samples_and_seeds(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    prompt = random_prompts(1, [8], seed=2)[0]
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and len(c.logprobs) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    single = llm.generate([prompt], replace(params, n=1), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids  # sample 0 draws from the seed itself
    # the other samples' streams derive from (seed, index): nearby seeds share no sample (vLLM: seed + index)
    samples = {seed: [tuple(c.token_ids) for c in llm.generate([prompt], replace(params, seed=seed),
                                                                use_tqdm=False)[0].outputs]
               for seed in (7, 8, 9)}
    assert len(set(samples[7]) | set(samples[8]) | set(samples[9])) == 9


def test_min_tokens_keeps_the_end_token_out_with_ignore_eos_too(llama):
    """vLLM's rule, found by a differential run: ignore_eos let a forced end token through before min_tokens."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    (eos,) = llm.engine.eos_token_ids
    params = SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={eos: 100})
    tokens = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in tokens[:3] and tokens[3:] == [eos] * 3


def test_text_prompts_stop_strings_and_stop_tokens(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    free = llm.generate("the quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, min_tokens=24),
                        use_tqdm=False)[0].outputs[0]
    assert free.text == llm.tokenizer.decode(free.token_ids)
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = llm.generate("the quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]  # the stop string is not shown
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < 24
    kept = llm.generate("the quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, stop=stop,
                                                              include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]

    stop_token = free.token_ids[5]
    by_token = llm.generate("the quick brown fox", SamplingParams(max_tokens=24, temperature=0.0,
                                                                  stop_token_ids=[stop_token]),
                            use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_token)
    assert by_token.token_ids == free.token_ids[: first + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token


def test_eos_ends_generation_unless_ignored(llama, tmp_path):
    _, model_dir = llama
    prompt = random_prompts(1, [6], seed=11)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    tokens = LLM(str(model_dir)).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[3]
    copy = shutil.copytree(model_dir, tmp_path / "eos")
    rewrite_config(copy, eos_token_id=[1, eos])  # a list, as Llama 3 configs write it
    # beside a generation_config.json (transformers writes one) its ids are the model's, as transformers and vLLM
    # read them; config.json's are read without it
    assert LLM(str(copy)).engine.eos_token_ids == frozenset({1})
    (copy / "generation_config.json").unlink()
    llm = LLM(str(copy))
    assert llm.engine.eos_token_ids == frozenset({1, eos})
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    # the model's end id beside the tokenizer's eos (1) is a stop token id to vLLM: its id is the stop_reason
    assert llm.tokenizer.eos_token_id == 1 and stopped.finish_reason == "stop" and stopped.stop_reason == eos
    ignored = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_penalties_and_filters_change_only_what_they_should(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    prompt = random_prompts(1, [12], seed=4)[0]
    base = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    penalised = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=5.0,
                                                      frequency_penalty=2.0), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalised)) >= len(set(tokens))
    assert penalised != tokens or len(set(tokens)) == len(tokens)
    top1 = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=3),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == tokens  # top_k=1 is greedy
    tiny_p = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, top_p=1e-6, seed=3),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert tiny_p == tokens
    min_p = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, min_p=1.0, seed=3),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert min_p == tokens


@pytest.mark.parametrize("bad, match", [
    ([], "empty"),  # ("" is the BOS token: test_an_empty_text_prompt_is_its_bos_where_the_tokenizer_adds_one)
    ([5, 600], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    (list(range(6, 6 + 256)), "context"),
    (3.5, "string or a list"),
])
def test_bad_prompts_are_value_errors_and_disturb_nothing(llama, bad, match):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    good = random_prompts(1, [5])[0]
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([good, bad], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = llm.generate([good], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_prompt_larger_than_the_kv_pool(llama, caplog, monkeypatch):
    _, model_dir = llama
    monkeypatch.setattr(logging.getLogger("torch_shift"), "propagate", True)  # the CLI's tests stop it
    with caplog.at_level(logging.WARNING, logger="torch_shift"):
        llm = LLM(str(model_dir), num_kv_blocks=4, block_size=4, max_model_len=200)
    assert "the KV cache holds 16 tokens a request, fewer than max_model_len=200" in caplog.text
    with pytest.raises(ValueError, match="KV pool holds only 16 tokens"):
        llm.generate([list(range(6, 26))], use_tqdm=False)
    # a sequence that would outgrow the whole pool ends with "length" instead of preempting itself forever
    out = llm.generate([list(range(6, 11))], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16 - 5 and out.outputs[0].finish_reason == "length"


def test_sampling_params_changed_after_they_were_made_are_checked_again(llama):
    """A SamplingParams is checked when it is made, and again by the engine on a copy of its own: a field set
    later is refused (n = 0 made no sequence and generate spun forever) or applied (a stop set later was not)."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    free = llm.generate([[6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    params.n = 0
    with pytest.raises(ValueError, match="n must be >= 1"):
        llm.generate([[6, 7]], params, use_tqdm=False)
    params.n, params.stop_token_ids = 1, [free[0].outputs[0].token_ids[2]]
    cut = llm.generate([[6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == free[0].outputs[0].token_ids[:3] and cut.finish_reason == "stop"
    params.stop_token_ids, params.stop = None, [free[0].outputs[0].text[3:6]]
    cut = llm.generate([[6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == free[0].outputs[0].text[:free[0].outputs[0].text.index(
        params.stop[0])]
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="request_id must be a non-empty str"):
        llm.engine.add_request(7, [6, 7], SamplingParams())


def test_unfinished_outputs_hold_back_what_a_stop_string_may_still_cut(llama):
    """vLLM's output_text_buffer_length: a step's cumulative text leaves out the last len(longest stop) - 1
    characters until the output ends, so no text it showed is cut later (it showed them, then took them back)."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    output = llm.generate([[6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    free = output.text
    # a stop string across a token boundary, so that its start is shown before its end is drawn
    ends = [len(llm.get_tokenizer().decode(output.token_ids[:k])) for k in range(1, len(output.token_ids))]
    stop = next(free[e - 2:e + 2] for e in ends if 2 <= e and free.find(free[e - 2:e + 2]) == e - 2
                and "\ufffd" not in free[e - 2:e + 2] and len(free[e - 2:e + 2]) == 4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    engine = llm.engine
    engine.add_request("held", [6, 7], params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == free[:free.index(stop)]
    assert all(texts[-1].startswith(text) for text in texts), texts
    assert params.stop == [stop] and params.output_text_buffer_length == len(stop) - 1
    assert SamplingParams(stop=stop, include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams().stop == [] and SamplingParams(top_k=-1).top_k == -1  # vLLM's normal forms


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": "x"}, "seed must be an int"), ({"seed": 1.5}, "seed must be an int"), ({"seed": -1}, "seed must be"),
    ({"seed": 2**70}, "seed must be"), ({"tokenizer": "/nonexistent"}, "no tokenizer.json there"),
    ({"device": "tpu"}, "runs on .cpu. or .cuda."),
    ({"tensor_parallel_size": 2, "tp": 1}, "tensor_parallel_size=2 and tp=1 disagree"),  # tp given at its default
    *([({"device": "cuda"}, "sees no CUDA device")] if not torch.cuda.is_available() else []),
])
def test_bad_engine_args_are_refused_when_the_engine_is_made(llama, kwargs, match):
    _, model_dir = llama
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(str(model_dir), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"n": 0}, "n must"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints, got int"),
    ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output must be True or False"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
    ({"seed": 2**63}, r"seed must be an int in \[0, 2\*\*63 - 1\], got 9223372036854775808"),
    ({"seed": 2**64}, r"seed must be an int in \[0, 2\*\*63 - 1\]"),
    *[({name: value}, f"{name} must be a finite number, got {value}")
      for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
      for value in (math.nan, math.inf, -math.inf)],
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"n": 2, "temperature": 0.0}, "n"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ["x", ""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"seed": 2**63}, "seed"), ({"temperature": math.nan}, "temperature"),
])
def test_bad_sampling_params_name_their_field(kwargs, param):
    with pytest.raises(ParameterError) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param and isinstance(error.value, ValueError)


def test_engine_checks_name_their_field(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    for params, priority, param in [(SamplingParams(stop_token_ids=[10_000]), 0, "stop_token_ids"),
                                    (SamplingParams(logit_bias={10_000: 1.0}), 0, "logit_bias"),
                                    (SamplingParams(logprobs=10_000), 0, "logprobs"),
                                    # more than the context leaves after the prompt: never met
                                    (SamplingParams(min_tokens=100_000, max_tokens=None), 0, "min_tokens"),
                                    (SamplingParams(), -1, "priority")]:
        with pytest.raises(ParameterError) as error:
            llm.generate([[6, 7]], params, use_tqdm=False, priority=[priority])
        assert error.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_the_token_that_ends_a_request_adds_no_text(llama):
    """As in vLLM: an eos or stop token id ends the request without its text, also when special tokens are kept,
    unless include_stop_str_in_output."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    eos = llm.tokenizer.eos_token_ids
    shown = SamplingParams(max_tokens=4, temperature=0.0, skip_special_tokens=False)
    out = llm.generate("the quick", replace(shown, logit_bias={min(eos): 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [min(eos)] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate("the quick", replace(shown, logit_bias={77: 100.0}, stop_token_ids=[77]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [77] and out.stop_reason == 77 and out.text == ""
    kept = llm.generate("the quick", replace(shown, logit_bias={77: 100.0}, stop_token_ids=[77],
                                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.tokenizer.decode([77])


def test_a_grammar_that_fails_while_generating_ends_the_request_with_an_error():
    """A pattern of 2,400 characters of (a|a)*(b|b)* exhausts llguidance's lexer once the string starts: the
    request ends with finish_reason "error" (stop_reason says why), never "stop" with text that is not JSON."""
    pytest.importorskip("llguidance")
    llm = LLM()  # the embedded default model: its vocabulary makes the lexer give up
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(a|a)*(b|b)*" * 200}},
              "required": ["x"]}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate("And God said", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and "grammar" in out.stop_reason and "lexer" in out.stop_reason
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_structured_outputs_as_vllm_reads_them():
    """What a probe against vLLM 0.32 found: a grammar that fails at its first token showed the unconstrained token
    drawn there; an empty regex, GBNF grammars and vLLM's option fields were refused; a regex's \\d drew
    non-ASCII digits."""
    pytest.importorskip("llguidance")
    llm = LLM()

    def first(so, **kwargs):
        params = SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **kwargs}, structured_outputs=so)
        return llm.generate("And the LORD said unto Moses,", params, use_tqdm=False)[0].outputs

    (failed,) = first(StructuredOutputsParams(regex=r"[^\s\S]"))  # matches nothing: no token may come
    assert (failed.text, failed.token_ids, failed.finish_reason) == ("", [], "error")
    assert "grammar" in failed.stop_reason and "<" not in failed.stop_reason  # llguidance's marker left out
    (empty,) = first(StructuredOutputsParams(regex=""))
    assert (empty.text, empty.finish_reason) == ("", "stop")
    gbnf = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue"'
    (sentence,) = first(StructuredOutputsParams(grammar=gbnf))
    assert re.fullmatch(r"The (cat|dog) is (red|blue)\.", sentence.text) and sentence.finish_reason == "stop"
    with pytest.raises(ParameterError, match="the grammar cannot be used"):
        first(StructuredOutputsParams(grammar="root ::= ("))
    dates = first(StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"), n=6, temperature=1.0, seed=3)
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", d.text) for d in dates)
    (digits,) = first(StructuredOutputsParams(regex=r"[x\d]{6}"), temperature=1.0, seed=3)  # in a class too
    assert re.fullmatch("[x0-9]{6}", digits.text)
    with pytest.raises(ParameterError, match="the regex cannot be used"):  # a range's end, as Rust refuses it
        first(StructuredOutputsParams(regex=r"[+-\d]"))
    with pytest.raises(ParameterError, match="the JSON schema cannot be used: not JSON"):
        first(StructuredOutputsParams(json="{bad", disable_additional_properties=True))
    (spaced,) = first(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                    "required": ["a"]}, whitespace_pattern=" "), max_tokens=8)
    assert spaced.text.startswith('{ "a": ')
    closed = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}, disable_additional_properties=True, disable_any_whitespace=True)
    assert json.loads(closed.schema) == {"type": "object", "additionalProperties": False, "properties": {"a": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}}}
    with pytest.raises(ParameterError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"structures": []}')
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_grammar_is_compiled_once_for_every_sequence_that_follows_it(monkeypatch):
    """A request of n samples compiled its grammar n times, and every request again (a 40,000-value enum: 0.3 s a
    sample on the engine's thread); now once, each sequence with a copy of its matcher, and refusals are kept too."""
    pytest.importorskip("llguidance")
    from torch_shift.engine import structured_output

    compiled = []
    compile_grammar = structured_output.GrammarCompiler._compile
    monkeypatch.setattr(structured_output.GrammarCompiler, "_compile",
                        lambda self, so: compiled.append(so) or compile_grammar(self, so))
    llm = LLM()
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=8, structured_outputs=choice)
    outs = llm.generate(["And God said", "In the beginning"], params, use_tqdm=False)
    texts = [o.text for out in outs for o in out.outputs]
    assert len(texts) == 16 and set(texts) <= {"yes", "no", "maybe"} and len(set(texts)) > 1
    assert compiled == [choice]
    # an equal grammar given again (its dict schema as text) is not compiled again; another one is
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for so in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema)),
               StructuredOutputsParams(choice=("yes", "no", "maybe"))):
        llm.generate("And God said", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so),
                     use_tqdm=False)
    assert len(compiled) == 2
    bad = StructuredOutputsParams(regex=r"[+-\d]")
    for _ in range(2):
        with pytest.raises(ParameterError, match="the regex cannot be used"):
            llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert len(compiled) == 3
    with pytest.raises(ParameterError, match="nests too deeply"):
        nested: dict = {}
        for _ in range(5000):
            nested = {"not": nested}
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            json=nested, disable_additional_properties=True)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("regex, ascii_regex", [
    (r"\d", "[0-9]"), (r"[\d]", "[[0-9]]"), (r"[^\d\s]", r"[^[0-9]\s]"), (r"\D", "[^0-9]"), (r"[\D]", "[[^0-9]]"),
    (r"\\d", r"\\d"), (r"[]\d]", "[][0-9]]"), (r"[^]\d]", "[^][0-9]]"), (r"[[:alpha:]\d]", "[[:alpha:][0-9]]"),
    (r"\p{L}\w", r"\p{L}[0-9A-Za-z_]"), (r"\W+", "[^0-9A-Za-z_]+"), (r"[a-c]\d|x", "[a-c][0-9]|x"),
    (r"\d-\d", "[0-9]-[0-9]"), (r"[\d-]", "[[0-9]-]"),
    # a range's end inside a class: left for llguidance, which refuses it as Rust does
    (r"[+-\d]", r"[+-\d]"), (r"[\d-z]", r"[\d-z]"), (r"[.-\w]", r"[.-\w]"),
])
def test_regex_shorthands_are_ascii(regex, ascii_regex):
    assert ascii_shorthands(regex) == ascii_regex


def test_logprobs_under_a_grammar_are_of_the_masked_distribution():
    """vLLM masks the logits before its sampler: a token the grammar forces has logprob 0 and rank 1, and no token the
    grammar refuses is among the top ones (found by a differential run: the unmasked distribution was returned)."""
    pytest.importorskip("llguidance")
    llm = LLM()
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3,
                            structured_outputs=StructuredOutputsParams(regex=" (unto|of) the [A-Z]+"))
    out = llm.generate("Blessed are the", params, use_tqdm=False)[0].outputs[0]
    free = llm.generate("Blessed are the", replace(params, structured_outputs=None), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(" (unto|of) the [A-Z]+", out.text) and out.token_ids != free.token_ids[:len(out.token_ids)]
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert position[token_id].rank == 1
        assert sum(math.exp(lp.logprob) for lp in position.values()) <= 1 + 1e-5
    forced = [p[t].logprob for t, p in zip(out.token_ids, out.logprobs) if p[t].logprob > -1e-6]
    assert forced and all(lp == pytest.approx(0.0, abs=1e-6) for lp in forced)


def test_logprob_entries_of_a_character_split_over_byte_tokens_are_vllms():
    """The tokens that begin a multi-byte character read "", the one that completes it the character (vLLM 0.32's
    correction; each read "\ufffd" before, found by a differential run)."""
    llm = LLM()  # the default model: byte-fallback tokens
    out = llm.generate("The café au lait", SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0,
                                                         logprobs=2), use_tqdm=False)[0]
    decoded = [e[t].decoded_token for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    assert "".join(decoded) == "The café au lait" and "\ufffd" not in "".join(decoded) and "" in decoded
    sample = out.outputs[0]
    assert "".join(e[t].decoded_token for e, t in zip(sample.logprobs, sample.token_ids)) == sample.text


def test_an_empty_text_prompt_is_its_bos_where_the_tokenizer_adds_one():
    """vLLM's: "" tokenizes to the BOS token and generates (it was refused as empty)."""
    llm = LLM()
    params = SamplingParams(max_tokens=5, temperature=0.0)
    out = llm.generate("", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == [llm.tokenizer.bos_token_id]
    assert out.outputs[0].token_ids == llm.generate([[llm.tokenizer.bos_token_id]], params,
                                                    use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_that_starts_after_its_marker():
    """A reasoning model reasons first: with `starts_after`, the grammar applies once the output's tokens end with
    the marker's (drawn here by a logit bias, which the grammar then overrides), and not before it."""
    pytest.importorskip("llguidance")
    import json

    from torch_shift.engine.structured_output import WaitingGrammar

    llm = LLM()  # the embedded default model: a real tokenizer
    marker = llm.get_tokenizer().encode(" LORD", add_special_tokens=False)
    assert len(marker) == 1
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    params = SamplingParams(max_tokens=30, temperature=0.0, logit_bias={marker[0]: 100.0})
    waits = replace(params, structured_outputs=StructuredOutputsParams(json=schema, starts_after=" LORD"))
    at_once = replace(params, structured_outputs=StructuredOutputsParams(json=schema))
    waited, constrained = (o.outputs[0] for o in llm.generate(["And God said"] * 2, [waits, at_once],
                                                                use_tqdm=False))
    assert waited.token_ids[0] == marker[0] and marker[0] not in waited.token_ids[1:]
    assert waited.text.startswith(" LORD") and isinstance(json.loads(waited.text[len(" LORD"):])["a"], int)
    assert waited.finish_reason == "stop" and isinstance(json.loads(constrained.text)["a"], int)
    with pytest.raises(TypeError, match="starts_after"):
        StructuredOutputsParams(json_object=True, starts_after="")
    two = WaitingGrammar(None, [5, 6])  # a marker of several tokens ends with its last, after the others
    assert two.starts_after([1, 5], 6) and not two.starts_after([6], 6) and not two.starts_after([], 6)
    assert not two.starts_after([5], 5)


def _with_generation_config(model_dir, directory, **fields):
    """A copy of the checkpoint whose generation_config.json also sets `fields`."""
    import json

    shutil.copytree(model_dir, directory)
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **fields}))
    return directory


def test_the_models_generation_config_sets_the_sampling_defaults(llama, tmp_path):
    """vLLM's --generation-config auto: a call without sampling params takes the model's generation_config.json
    (top_k 1 here: greedy, and max_new_tokens as max_tokens); "vllm" leaves it out; do_sample is not read, and a
    field at transformers 4's default (top_k 50) is read, as vLLM 0.32 (with transformers 5) reads it."""
    _, model_dir = llama
    model = _with_generation_config(model_dir, tmp_path / "m", do_sample=True, temperature=0.7, top_k=1,
                                    top_p=1.0, max_new_tokens=5)
    llm = LLM(str(model))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.7, 1, 1.0, 5)
    greedy = llm.generate(["the quick"], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    for _ in range(2):
        assert llm.generate(["the quick"], use_tqdm=False)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    neutral = LLM(str(model), generation_config="vllm").get_default_sampling_params()
    assert (neutral.temperature, neutral.top_k, neutral.max_tokens) == (1.0, 0, 16)
    assert LLM(str(model_dir), generation_config=str(model)).get_default_sampling_params().top_k == 1
    hf_default = _with_generation_config(model_dir, tmp_path / "hf", top_k=50, temperature=1.0)
    assert LLM(str(hf_default)).engine.default_sampling_fields == {"top_k": 50, "temperature": 1.0}
    with pytest.raises(ValueError, match="temperature must be a number"):
        LLM(str(_with_generation_config(model_dir, tmp_path / "bad", temperature="hot")))
    with pytest.raises(ValueError, match="generation_config.json: top_k must be an int"):  # the file named
        LLM(str(_with_generation_config(model_dir, tmp_path / "float", top_k=20.0)))
    with pytest.raises(ValueError, match="no such directory"):
        LLM(str(model_dir), generation_config=str(tmp_path / "nowhere"))


def test_unknown_stop_token_and_engine_arguments(llama):
    _, model_dir = llama
    with pytest.raises(TypeError, match="unknown engine arguments: max_seqs"):
        LLM(str(model_dir), max_seqs=3)
    llm = LLM(str(model_dir))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[6, 7]], SamplingParams(stop_token_ids=[10_000]), use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_kv_pool_sized_from_a_memory_budget(llama):
    _, model_dir = llama
    # 2 layers x (K + V) x 16 tokens x 2 KV heads x 8 dims x 4 bytes = 4096 bytes per block
    llm = LLM(str(model_dir), kv_cache_memory_bytes=300 * 4096 + 100, max_model_len=128)
    assert llm.engine.block_manager.num_blocks == 300
    assert llm.engine.kv_cache.k[0].shape == (300, 16, 2, 8)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        LLM(str(model_dir), kv_cache_memory_bytes=4 * 4096, max_model_len=128)


def test_chat_renders_the_template(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    messages = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = llm.generate([llm.tokenizer.encode(rendered, add_special_tokens=False)], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids and out.prompt == rendered  # vLLM's prompt text
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    for bad in ("hello", [], ["hello"], [[]], {"role": "user", "content": "x"}):
        with pytest.raises(TypeError, match="messages must be a conversation"):
            llm.chat(bad, params, use_tqdm=False)
    # OpenAI's text parts, as the server takes them (joined with newlines, vLLM's); roles checked as the server does
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    assert llm.chat(parts, params, use_tqdm=False)[0].prompt == llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello\nthere"}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="this model reads text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    with pytest.raises(ValueError, match=r"messages\[0\].role: a role name"):
        llm.chat([{"role": 5, "content": "x"}], params)
    # a role beyond OpenAI's (Llama 3.1's "ipython") is the template's to take or refuse, as in vLLM
    with pytest.raises(ValueError, match="the chat template refused the messages: Unknown role: ipython"):
        llm.chat([{"role": "ipython", "content": "x"}], params, use_tqdm=False)
    # continue_final_message: the output continues an assistant turn the caller began (vLLM's, transformers' cut)
    begun = [*messages, {"role": "assistant", "content": "General Kenobi"}]
    out = llm.chat(begun, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nGeneral Kenobi")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(begun, params, use_tqdm=False, continue_final_message=True)


def test_stop_string_completed_by_the_last_allowed_token(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    free = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0]
    k = next(k for k in range(1, len(free.text)) if free.text.count(free.text[-k:]) == 1)
    stop = free.text[-k:]  # appears once, at the very end: completed by the 16th token
    out = llm.generate("the quick brown fox", replace(params, stop=stop), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:-k]


def test_request_errors_leave_requests_in_flight_untouched(llama):
    _, model_dir = llama
    engine = LLM(str(model_dir)).engine
    engine.add_request("x#0", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(ValueError, match="collides"):
        engine.add_request("x", [7, 8], SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="logprobs=600 exceeds the vocabulary size 512"):
        engine.add_request("y", [7, 8], SamplingParams(logprobs=600))
    with pytest.raises(ValueError, match="prompt logprobs of 21, which is greater than max allowed: 20"):
        engine.add_request("z", [7, 8], SamplingParams(prompt_logprobs=21))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(final_only=True)
    assert [o.request_id for o in outputs] == ["x#0"] and len(outputs[0].outputs[0].token_ids) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_strings_without_a_tokenizer_and_bad_engine_arguments(llama, tmp_path):
    _, model_dir = llama
    bare = shutil.copytree(model_dir, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    llm = LLM(str(bare))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[7, 8]], SamplingParams(stop="a"), use_tqdm=False)
    for kwargs, match in [({"sp": 0}, "sp must be an int >= 1"), ({"shift_weights": "share"}, "shift_weights"),
                          ({"shift_threshold": -1}, "shift_threshold"), ({"attention_backend": "x"}, "attention")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(model_dir), **kwargs)


def test_stop_strings_count_only_after_min_tokens(llama):
    """vLLM checks stop strings only once more than min_tokens tokens were generated."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    free = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[:1]  # completed by the first token
    early = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                               stop=stop), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == "" and len(early.token_ids) <= 1 + len(stop)
    late = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                              stop=stop, min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > 4 and late.token_ids == free.token_ids[:len(late.token_ids)]
    assert late.text.startswith(stop)  # the early occurrence stays in the text


def _stop_found_one_character_at_a_time(stops, text, num_new):
    """vLLM 0.32's rule (`check_stop_strings`): the new text read a character at a time; the first stop string (in
    the request's order) that a character completes."""
    for end in range(len(text) - num_new + 1, len(text) + 1):
        for stop in stops:
            if text[:end].endswith(stop):
                return stop, end - len(stop)
    return None


def test_stop_strings_found_as_one_character_at_a_time_finds_them():
    """A differential run against vLLM found the first string in the list taken where another ended earlier
    (stop=["LORD", "the L"] on " unto the LORD": " unto the " where vLLM gives " unto ")."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 12)))
        num_new = rng.randint(1, len(text))
        assert StopStrings(stops).find(text, num_new) == _stop_found_one_character_at_a_time(stops, text, num_new)
    assert StopStrings(("LORD", "the L")).find(" unto the LORD", 14) == ("the L", 6)


def test_a_hundred_thousand_stop_strings(llama):
    """A body may hold that many; matching them costs a lookup per new character and length (was a search each)."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = llm.generate("the quick brown fox", params, use_tqdm=False)[0].outputs[0]
    stop = free.text[10:13]
    noise = ["".join(p) for p in itertools.product("QZXJKV", repeat=6)][:100_000]
    out = llm.generate("the quick brown fox", replace(params, stop=[*noise, stop]), use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == stop and out.text == free.text[:free.text.index(stop)]


def test_temperatures_below_0_01_are_raised_to_it_as_vllm_does(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir))
    with LogLines("torch_shift.engine.sampling_params", logging.WARNING) as log:
        tiny = SamplingParams(max_tokens=8, temperature=5e-6, n=2, seed=3)
    assert tiny.temperature == 0.01 and not tiny.greedy and "raised to 0.01" in log.messages[0]
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.01).temperature == 0.01
    prompts = random_prompts(3, [4, 9, 2], seed=6)
    assert ([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, tiny, use_tqdm=False)]
            == [[c.token_ids for c in o.outputs]
                for o in llm.generate(prompts, replace(tiny, temperature=0.01), use_tqdm=False)])


def test_vllm_and_arctic_inference_argument_names():
    from torch_shift import EngineArgs

    args = EngineArgs("m", tensor_parallel_size=2, ulysses_sequence_parallel_size=4, shift_parallel_threshold=64,
                      data_parallel_size=3, pipeline_parallel_size=1)
    assert (args.tp, args.sp, args.shift_threshold, args.dp) == (2, 4, 64, 3)
    assert EngineArgs("m", tp=2, tensor_parallel_size=2).tp == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and tp=4 disagree"):
        EngineArgs("m", tp=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and tp=1 disagree"):  # tp given at its default
        EngineArgs("m", tp=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="shift_parallel_threshold=64 and shift_threshold=256 disagree"):
        EngineArgs("m", shift_threshold=256, shift_parallel_threshold=64)
    # dataclasses.replace passes every field's old value: an alias there replaces its field
    assert replace(EngineArgs("m"), tensor_parallel_size=2).tp == 2
    assert replace(EngineArgs("m", tp=2), dp=3).tp == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and tp=4 disagree"):
        replace(EngineArgs("m", tp=4), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size=2 and dp=4 disagree"):
        EngineArgs("m", dp=4, data_parallel_size=2)
    assert EngineArgs("m", pipeline_parallel_size=2).pp == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 and pp=4 disagree"):
        EngineArgs("m", pp=4, pipeline_parallel_size=2)


def test_vllms_calling_conventions(llama):
    """What code written for vLLM's offline API passes: priority as one int, lora_request=None, the engine's
    from_engine_args and add_request's argument order (arrival time fourth; it returns the id), abort_request with
    a list, -1 for every logprob and for no seed, SamplingParams.from_optional and clone; vLLM's fields
    torch_shift does not honour are refused by name at anything but their defaults."""
    from torch_shift import EngineArgs
    from torch_shift.engine.llm_engine import LLMEngine

    _, model_dir = llama
    llm = LLM(str(model_dir))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    assert len(llm.generate([[6, 7], [8, 9]], params, priority=0, lora_request=None, use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="lora_request: not supported"):
        llm.generate([[6, 7]], params, lora_request=object())
    engine = LLMEngine.from_engine_args(EngineArgs(str(model_dir)))
    assert engine.add_request("a", [6, 7, 8], params, 123.0) == "a"
    engine.add_request("b", [6, 7], params)
    engine.abort_request(["a", "b", "never-added"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="Requested sample logprobs of 512, which is greater than max allowed: 20"):
        llm.generate([[6, 7]], SamplingParams(max_tokens=1, logprobs=-1))  # vLLM's max_logprobs, 20 by default
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"):
        llm.generate([[6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=21))
    unbounded = LLM(str(model_dir), max_logprobs=-1)
    everything = unbounded.generate([[6, 7]], SamplingParams(max_tokens=1, logprobs=-1, seed=-1),
                                    use_tqdm=False)[0].outputs[0]
    assert len(everything.logprobs[0]) == llm.engine.config.model.vocab_size
    assert len(LLM(str(model_dir), max_logprobs=30).generate(
        [[6, 7]], SamplingParams(max_tokens=1, logprobs=30), use_tqdm=False)[0].outputs[0].logprobs[0]) >= 30
    assert SamplingParams(seed=-1).seed is None
    optional = SamplingParams.from_optional(temperature=None, max_tokens=None, logit_bias={"5": 300.0})
    assert (optional.temperature, optional.max_tokens, optional.logit_bias) == (1.0, 16, {5: 100.0})
    assert params.clone() == params and params.clone() is not params
    assert SamplingParams(detokenize=True, spaces_between_special_tokens=True).max_tokens == 16
    for name, value in (("bad_words", ["x"]), ("allowed_token_ids", [1]), ("detokenize", False),
                        ("flat_logprobs", True), ("thinking_token_budget", 8), ("logprob_token_ids", [3])):
        with pytest.raises(ValueError, match=f"{name}=.* is not supported by torch_shift"):
            SamplingParams(**{name: value})
    # vLLM 0.32's fields at their defaults, as ported code passes them (were TypeErrors)
    assert SamplingParams(flat_logprobs=False, skip_clone=True, stream_interval=None,
                          output_kind=RequestOutputKind.FINAL_ONLY).max_tokens == 16
    assert SamplingParams(logprobs=True).logprobs == 1  # vLLM's: True is 1
    with pytest.raises(ValueError, match="output_kind=.*DELTA.* is not supported"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    # FINAL_ONLY: LLMEngine.step returns a request's output once, when it finishes
    engine.add_request("final", [6, 7], replace(params, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("each", [6, 7], replace(params, max_tokens=3))
    seen = []
    while engine.has_unfinished_requests():
        seen.append([o.request_id for o in engine.step()])
    seen = [ids for ids in seen if ids]  # a launched step's outputs come with the next step (asynchronous scheduling)
    assert seen[:2] == [["each"], ["each"]] and sorted(seen[2]) == ["each", "final"] and len(seen) == 3


def test_a_request_of_several_samples_steps_as_vllms_engine_does(llama):
    """LLMEngine.step gives a request of n samples as vLLM's engine does: one output per sample that advanced, that
    sample alone in it; a finished sample never again; the request `finished` on its last sample's last output.
    Merged with RequestOutput.add they are what FINAL_ONLY gives at once. get_num_unfinished_requests counts
    samples; metrics carry vLLM's names."""
    from torch_shift import EngineArgs
    from torch_shift.engine.llm_engine import LLMEngine

    _, model_dir = llama
    engine = LLMEngine.from_engine_args(EngineArgs(str(model_dir)))
    # about half the vocabulary ends a sample: the samples end at different steps
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, stop_token_ids=list(range(VOCAB_SIZE // 2)))
    before = time.time()
    engine.add_request("each", [6, 7, 8], params)
    assert engine.get_num_unfinished_requests() == 3
    outputs, ended_at, step = [], {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            assert len(out.outputs) == 1 and out.outputs[0].index not in ended_at
            if out.outputs[0].finished():
                ended_at[out.outputs[0].index] = step
            outputs.append(out)
        assert engine.get_num_unfinished_requests() == 3 - len(ended_at)
    assert sorted(ended_at) == [0, 1, 2] and len(set(ended_at.values())) > 1
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    merged = outputs[0]
    for out in outputs[1:]:
        merged.add(out, aggregate=False)
    engine.add_request("final", [6, 7, 8], replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step()
    (final,) = finals
    assert final.finished and len(final.outputs) == 3
    assert ({c.index: (c.token_ids, c.finish_reason) for c in merged.outputs}
            == {c.index: (c.token_ids, c.finish_reason) for c in final.outputs})
    times = outputs[-1].metrics
    assert before <= times.arrival_time <= time.time()
    assert 0 < times.queued_ts <= times.scheduled_ts <= times.first_token_ts <= times.last_token_ts
    assert times.first_token_latency == times.first_token_ts - times.queued_ts
    assert times.num_generation_tokens == len(outputs[-1].outputs[0].token_ids) and times.num_preemptions == 0
    assert outputs[-1].lora_request is None and outputs[-1].kv_transfer_params is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_request_outputs_merge_as_vllms():
    """RequestOutput.add: a later output's samples replace those of the same index (new ones appended), or with
    `aggregate` extend them."""
    from torch_shift.engine.outputs import CompletionOutput, RequestOutput

    def output(index, text, tokens, finish=None):
        return RequestOutput("r", "p", [1], None, [CompletionOutput(index, text, tokens, None, None, finish)],
                             finished=finish is not None)

    replaced = output(0, "a", [1])
    replaced.add(output(1, "x", [9]), aggregate=False)
    replaced.add(output(0, "ab", [1, 2], "stop"), aggregate=False)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in replaced.outputs] == [
        (0, "ab", [1, 2], "stop"), (1, "x", [9], None)]
    assert replaced.finished
    joined = output(0, "a", [1])
    joined.add(output(0, "b", [2], "length"), aggregate=True)
    assert (joined.outputs[0].text, joined.outputs[0].token_ids, joined.outputs[0].finish_reason) == (
        "ab", [1, 2], "length")


def test_vllm_names_through_llm(llama):
    _, model_dir = llama
    expected = LLM(str(model_dir)).generate("the quick", SamplingParams(max_tokens=6, temperature=0.0),
                                            use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    try:
        assert llm.engine.args.tp == 2 and llm.engine.parallel is not None
        assert llm.generate("the quick", SamplingParams(max_tokens=6, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="pp=4 stages need at least 4 layers"):
        LLM(str(model_dir), pipeline_parallel_size=4)


def test_prompt_and_sampling_param_types(llama):
    """Type errors name the argument and what it takes; vLLM's prompt dicts work."""
    _, model_dir = llama
    llm = LLM(str(model_dir))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    text = llm.generate("the quick", greedy, use_tqdm=False)[0].outputs[0]
    ids = llm.tokenizer.encode("the quick")
    for prompt in ({"prompt": "the quick"}, [{"prompt": "the quick"}], {"prompt_token_ids": ids}):
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == text.token_ids
    with pytest.raises(TypeError, match=r"prompt 0: a dict with keys \['a', 'b'\]; a prompt is a string or a list"):
        llm.generate({"a": 1, "b": 2}, greedy, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a prompt or a list of prompts, got int"):
        llm.generate(5, greedy, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams .* got dict \(make one with"):
        llm.generate("the quick", {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: the prompt holds a lone surrogate \(U\+D800\) at character 4: "
                                         "text must be valid Unicode"):
        llm.generate(["fine", "bad \ud800 text"], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # the engine takes the same prompts as LLM (vLLM's LLMEngine.add_request does)
    engine = llm.engine
    engine.add_request("dict", {"prompt_token_ids": ids}, greedy)
    with pytest.raises(TypeError, match=r"a dict with keys \['prompt_ids'\]; a prompt is a string or a list"):
        engine.add_request("bad", {"prompt_ids": ids}, greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["dict"]
    assert outputs[-1].outputs[0].token_ids == text.token_ids


def test_llm_without_a_model_uses_the_embedded_default_model():
    from torch_shift.models.default import default_model_dir

    llm = LLM()
    assert llm.engine.model_dir == default_model_dir()
    out = llm.generate("And God said", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text.strip()
