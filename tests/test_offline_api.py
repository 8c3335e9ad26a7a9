"""The offline API under a user's mistakes and unusual calls, as a probe of it found them: each a ValueError or
TypeError that says what is wrong, with no KV block held and the engine usable afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tqdm import tqdm

from torch_shift import LLM, SamplingParams
from torch_shift.engine.input_processor import TokenizedPrompt


@pytest.fixture(scope="module")
def llm(llama):
    _, model_dir = llama
    engine = LLM(str(model_dir))
    yield engine
    engine.shutdown()


def _clean(llm) -> bool:
    engine = llm.engine
    return (not engine.has_unfinished_requests()
            and all(pool.num_free_blocks == pool.num_blocks for pool in engine.pools))


def test_a_prompt_tokenized_elsewhere_is_checked_again(llm):
    for prompt, error in [(TokenizedPrompt(None, [10**6]), "outside the vocabulary"),
                          (TokenizedPrompt(None, []), "empty"), (TokenizedPrompt(None, [5] * 5000), "context")]:
        with pytest.raises(ValueError, match=error):
            llm.engine.add_request("t", prompt, SamplingParams(max_tokens=2))
        assert _clean(llm)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("arrival_time", ["now", float("nan"), True])
def test_arrival_time_is_a_finite_number(llm, arrival_time):
    with pytest.raises((TypeError, ValueError), match="arrival_time"):
        llm.engine.add_request("a", [5, 6], SamplingParams(max_tokens=2), arrival_time=arrival_time)
    assert _clean(llm)


def test_generate_never_touches_requests_added_through_the_engine(llm):
    engine = llm.engine
    engine.add_request("gen-0", [5, 6], SamplingParams(max_tokens=3))  # an id generate might have made
    with pytest.raises(ValueError, match="step them to their end or abort them"):
        llm.generate([[7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(final_only=True)
    assert [o.request_id for o in outputs] == ["gen-0"] and len(outputs[0].outputs[0].token_ids) == 3
    assert _clean(llm)


def test_reset_prefix_cache_forgets_every_cached_prefix(llm):
    prompt = list(range(5, 5 + 40))  # two whole blocks and more
    params = SamplingParams(max_tokens=2, temperature=0.0)
    pool = llm.engine.block_manager
    llm.generate([prompt], params, use_tqdm=False)
    hits = pool.num_prefix_hits
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert pool.num_prefix_hits > hits
    assert llm.reset_prefix_cache() is True
    hits = pool.num_prefix_hits
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert pool.num_prefix_hits == hits
    llm.engine.add_request("running", [5, 6], SamplingParams(max_tokens=2))
    assert llm.reset_prefix_cache() is False  # vLLM's answer while a request holds blocks
    with pytest.raises(ValueError, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests=True)
    llm.engine.abort_request("running")
    assert _clean(llm)


def test_calls_from_several_threads_wait_for_each_other(llm):
    """Two threads' generate calls shared the engine's requests: the second raised a ValueError about requests it
    never added. Each call now waits for the one in progress, and gets what it gets alone."""
    import threading

    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [[[5 + i, 6, 7 + i]] * (i + 1) for i in range(4)]
    expected = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in prompts]
    got, errors = {}, []

    def call(i):
        try:
            got[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i], params, use_tqdm=False)]
            llm.stats()
        except Exception as e:  # noqa: BLE001 - any error fails the test below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and [got[i] for i in range(len(prompts))] == expected
    assert _clean(llm)


def test_an_interrupt_while_generate_adds_its_requests_leaves_none_behind(llm, monkeypatch):
    core, calls = llm.engine.core, []
    add = core.add_request

    def interrupted(child):
        calls.append(child.request_id)
        if len(calls) == 2:  # the second sample of the n=2 request: its parent is registered already
            raise KeyboardInterrupt
        return add(child)

    monkeypatch.setattr(core, "add_request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    assert _clean(llm)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_requests_aborted_while_generate_runs_end_it_with_an_error(llm):
    def bar_that_aborts(**kwargs):
        llm.engine.abort_request(list(llm.engine.output_processor.requests))
        return tqdm(disable=True, **kwargs)

    with pytest.raises(RuntimeError, match="were aborted while it ran"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=4), use_tqdm=bar_that_aborts)
    assert _clean(llm)


@pytest.mark.parametrize("call, error", [
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}), "holds a list of token ids"),
    (lambda llm: llm.generate({"prompt": [1, 2]}), "holds text"),
    (lambda llm: llm.generate("a", priority=1.5), "priority must be an int"),
    (lambda llm: llm.engine.abort_request(None), "request_ids"),
    (lambda llm: llm.engine.abort_request([5]), "request_ids"),
    (lambda llm: llm.engine.abort_request(5), "request_ids"),
    (lambda llm: SamplingParams.from_optional(logit_bias={"1": float("nan")}), "logit_bias"),
    (lambda llm: SamplingParams(stop=["a\ud800"]), "lone surrogate"),
    (lambda llm: llm.chat([{"role": "user", "content": "a\ud800"}]), "render to holds a lone surrogate"),
    (lambda llm: llm.chat([{"role": "assistant", "content": None, "tool_calls": "x"}]), "a list of calls"),
    (lambda llm: llm.chat([{"role": "assistant", "content": None, "tool_calls": ["x"]}]), "a tool call is"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], chat_template_kwargs={"self": 1}), "own arguments"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], add_generation_prompt="x"), "True or False"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], chat_template_kwargs={"chat_template": "x"}),
     "own arguments"),  # was rendered with the model's template, the one given silently dropped
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], lora_request=object()), "lora_request: .*no LoRA"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], mm_processor_kwargs={}),
     "mm_processor_kwargs: .*multi-modal inputs"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], chat_template_content_format="xml"), "'openai'"),
    (lambda llm: llm.tokenizer.apply_chat_template([{"role": "user", "content": "a"}], return_tensors="pt"),
     "return_tensors .* not supported"),  # was a template variable: a list came back where a tensor was asked for
    (lambda llm: llm.generate({"prompt": "a", "multi_modal_data": {"image": 1}}), "multi_modal_data: .* text only"),
    (lambda llm: llm.generate({"prompt_token_ids": [5], "prompt": 5}), "is their text"),
])
def test_a_mistake_is_said_plainly(llm, call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call(llm)
    assert _clean(llm)


@pytest.mark.parametrize("kwargs, option", [
    ({"num_kv_blocks": 10**12}, "num_kv_blocks=1000000000000 on each rank"),
    ({"num_kv_blocks": 10**12, "tp": 2}, "num_kv_blocks=1000000000000 on each rank"),
    ({"num_cpu_kv_blocks": 10**12}, r"the host KV tier \(num_cpu_kv_blocks=1000000000000\)"),
    ({"cpu_kv_gb": 1e6}, r"the host KV tier \(cpu_kv_gb=1000000.0\)"),
])
def test_a_memory_size_beyond_the_machine_is_refused_by_name(llama, kwargs, option):
    """Were the allocator's RuntimeError, which names no option."""
    with pytest.raises(ValueError, match=f"{option}: .* GiB, more than the .* GiB of memory this machine has"):
        LLM(str(llama[1]), **kwargs)


@pytest.mark.parametrize("kwargs, weights", [({}, "weights in bfloat16: 131.4 GiB"),
                                             ({"dp": 2, "dtype": "float32"}, "weights in float32 for 2 replicas")])
def test_weights_beyond_the_machine_are_refused_before_a_tensor_is_read(tmp_path, kwargs, weights, monkeypatch):
    """Llama-3-70B's shape with no tensors at all: refused from config.json, were a kill by the OOM killer mid-load
    (on a machine of less than 131 GiB: the test tells it 64)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}))
    monkeypatch.setattr("torch_shift.kv.cache.total_memory_bytes", lambda device: 64 << 30)
    with pytest.raises(ValueError, match=f"the model's {weights}.*, more than the 64.0 GiB of memory this machine has"):
        LLM(str(tmp_path), **kwargs)


def test_a_bad_shutdown_timeout_changes_nothing(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir), tp=2)
    with pytest.raises(TypeError, match="timeout_s"):
        llm.shutdown(None)
    for bad in (-1, float("inf"), float("nan")):  # infinity overflowed a thread's join after the engine closed
        with pytest.raises(ValueError, match="timeout_s"):
            llm.shutdown(bad)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown(0)  # no time left: the group is still released
    again = LLM(str(model_dir), tp=2)
    assert again.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    again.shutdown()


def test_a_fresh_process_keeps_its_environment_warnings_and_start_method(llama):
    """torch's first import of torch._dynamo (building on the meta device) sets TORCHINDUCTOR_CACHE_DIR and a
    warnings filter, both undone; a tqdm bar takes a multiprocessing lock, which fixes the start method: no bar,
    no tqdm object."""
    _, model_dir = llama
    script = (f"import multiprocessing, os, warnings\nfrom torch_shift import LLM\n"
              f"env, filters = dict(os.environ), list(warnings.filters)\n"
              f"LLM({str(model_dir)!r}).generate('x', use_tqdm=False)\n"
              "assert dict(os.environ) == env, set(os.environ) ^ set(env)\n"
              "assert warnings.filters == filters\n"
              "multiprocessing.set_start_method('spawn')\nprint('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_what_scripts_written_for_vllm_pass_and_read(llm, llama):
    """A probe's findings: vLLM's LLM.chat parameters (in vLLM's order) and LLM arguments, a TokensPrompt with its
    text, and transformers' tokenizer names."""
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    template = "X{{ messages[0]['content'] }}Y"
    given = llm.chat(messages, params, False, None, template)[0]  # vLLM's positional order
    assert given.prompt == "XhiY" == llm.tokenizer.apply_chat_template(messages, chat_template=template)
    assert given.outputs[0].token_ids == llm.generate([llm.tokenizer.encode("XhiY", add_special_tokens=False)],
                                                      params, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.chat(messages, params, use_tqdm=False, lora_request=None, chat_template_content_format="auto",
                     mm_processor_kwargs=None)[0]
    assert plain.prompt == llm.tokenizer.apply_chat_template(messages)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    walks = "{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}{% for p in m.content %}" \
            "P:{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
    for content_format, rendered in (("string", "S:a\nb"), ("openai", "P:aP:b"), ("auto", "P:aP:b")):
        assert llm.chat(parts, params, use_tqdm=False, chat_template=walks,
                        chat_template_content_format=content_format)[0].prompt == rendered
    ids = llm.tokenizer.encode("the quick")
    out = llm.generate({"prompt_token_ids": ids, "prompt": "the quick", "multi_modal_data": None}, params,
                       use_tqdm=False)[0]
    assert (out.prompt, out.prompt_token_ids) == ("the quick", ids)
    tok = llm.get_tokenizer()
    assert tok.eos_token_id in tok.eos_token_ids and tok.convert_tokens_to_ids(tok.eos_token) == tok.eos_token_id
    assert tok("the quick") == {"input_ids": ids} and tok(["a", "b"])["input_ids"] == [tok.encode("a"),
                                                                                       tok.encode("b")]
    assert tok.batch_decode([ids[1:], ids[1:2]]) == [tok.decode(ids[1:]), tok.decode(ids[1:2])]
    assert tok.get_vocab()[tok.convert_ids_to_tokens([ids[-1]])[0]] == ids[-1] and len(tok.get_vocab()) == len(tok)
    assert set(tok.all_special_ids) >= {tok.eos_token_id} and len(tok.all_special_tokens) == len(tok.all_special_ids)
    assert _clean(llm)
    _, model_dir = llama
    taken = LLM(str(model_dir), trust_remote_code=True, disable_log_stats=True, kv_cache_dtype="auto",
                quantization=None, tokenizer_mode="auto")
    taken.shutdown()
    for kwargs, error in (({"swap_space": 4}, "cpu_kv_gb"), ({"kv_cache_dtype": "fp8"}, "model's dtype"),
                          ({"quantization": "awq"}, "read from its config.json"),
                          ({"trust_remote_code": "yes"}, "taken: True or False")):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))}=.*vLLM's argument; .*{error}"):
            LLM(str(model_dir), **kwargs)


@pytest.mark.parametrize("kwargs, error", [
    ({"tp": 2, "policy": "flying"}, "it needs dp >= 2"),
    ({"tp": 2, "policy": "shift"}, "it needs sp > 1"),
    ({"dp": 2, "policy": "flying", "policy_config": {"tp_width": 4}}, "tp_width=4"),
])
def test_a_policy_that_cannot_run_is_refused_before_any_rank_starts(llama, monkeypatch, kwargs, error):
    """These were refused after the ranks had started and loaded the weights (a helper's probe)."""
    from torch_shift.parallel import runtime

    def no_ranks(*args, **kw):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(runtime, "LocalRanks", no_ranks)
    with pytest.raises(ValueError, match=error):
        LLM(str(llama[1]), **kwargs)
