"""The OpenAI-compatible server, driven by the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from openai.types import Completion
from openai.types.chat import ChatCompletion
from prometheus_client.parser import text_string_to_metric_families

from torch_shift import LLM, SamplingParams
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.parallel.launch import free_port
from torch_shift.serve.api_server import create_server

PROMPT = "the quick brown fox"


class RunningServer:
    def __init__(self, model_dir, **kwargs):
        engine_kwargs = kwargs.pop("engine", {})
        self.app, self.async_engine = create_server(EngineArgs(str(model_dir), **engine_kwargs),
                                                    served_model_name="tiny", **kwargs)
        self.engine = self.async_engine.engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, api_key="none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def idle_free_blocks(self) -> bool:
        deadline = time.monotonic() + 10
        bm = self.engine.block_manager
        while time.monotonic() < deadline:
            if bm.num_free_blocks == bm.num_blocks and not self.engine.has_unfinished_requests():
                return True
            time.sleep(0.02)
        return False

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(checkpoints):
    _, model_dir = checkpoints("llama")
    s = RunningServer(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(checkpoints):
    _, model_dir = checkpoints("llama")
    return LLM(str(model_dir))


def greedy(reference, prompt=PROMPT, **kwargs):
    params = SamplingParams(temperature=0.0, **{"max_tokens": 8, **kwargs})
    return reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_completion_streamed_and_not_equal_the_engine(server, reference):
    client = server.client()
    expected = greedy(reference)
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    Completion.model_validate(json.loads(raw.text))
    full = raw.parse()
    assert full.choices[0].text == expected.text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_template(server, reference):
    client = server.client()
    messages = [{"role": "user", "content": "hello there"}]
    expected = reference.chat(messages, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=6,
                                                           temperature=0)
    ChatCompletion.model_validate(json.loads(raw.text))
    out = raw.parse()
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_n_with_seed_is_reproducible_and_stop_strings(server, reference):
    client = server.client()
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, n=3, seed=11, temperature=1.0)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.text for c in first.choices}) > 1

    free = greedy(reference, max_tokens=16, ignore_eos=True)
    stop = free.text[3:5]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == free.text[: free.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_logprobs_and_echo_with_prompt_logprobs(server, reference):
    client = server.client()
    expected = greedy(reference, logprobs=2)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 8
    assert lp.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(expected.logprobs, expected.token_ids)],
                                              abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # lm-eval's local-completions loglikelihood: echo, max_tokens=0, logprobs
    prompt_ids = reference.tokenizer.encode(PROMPT)
    ref = reference.generate([prompt_ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = echo.choices[0]
    assert choice.text == PROMPT
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [e[t].logprob for e, t in zip(ref.prompt_logprobs[1:], prompt_ids[1:])], abs=1e-5)
    assert echo.usage.completion_tokens == 0


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "8"}, 400),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [600, 7]}, 400),
    ("/v1/completions", {"prompt": "word " * 400}, 400),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-5"}, 404),
    ("/v1/completions", {"max_tokens": 3}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_input_gets_its_4xx_and_the_server_keeps_serving(server, reference, path, body, status):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    response = httpx.post(server.url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    out = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy(reference).text
    assert server.idle_free_blocks()


def test_dropped_stream_frees_its_blocks(server):
    async def drop():
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True, "model": "tiny"}
            async with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk, then hang up
        busy = server.engine.block_manager.num_free_blocks < server.engine.block_manager.num_blocks
        return busy

    asyncio.run(drop())
    assert server.idle_free_blocks()


def test_burst_larger_than_the_queue_is_fully_accounted(checkpoints):
    _, model_dir = checkpoints("llama")
    s = RunningServer(model_dir, max_waiting_requests=4, engine={"max_num_seqs": 2})
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
                return await asyncio.gather(*(http.post(s.url + "/v1/completions", json=body) for _ in range(24)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(200) >= 4 and codes.count(429) >= 1
        for r in responses:
            if r.status_code == 200:
                assert len(r.json()["choices"][0]["text"]) > 0 and r.json()["usage"]["completion_tokens"] == 12
            else:
                assert r.json()["error"]["type"] == "rate_limit_error"
        assert s.idle_free_blocks()
    finally:
        s.stop()


def test_metrics_parse_and_move(server):
    def scrape():
        text = httpx.get(server.url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + ("{" + sample.labels.get("finished_reason", "") + sample.labels.get("layout", "")
                                     + "}" if len(sample.labels) > 1 else "")
                values[key] = values.get(key, 0) + sample.value
        return values

    before = scrape()
    server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = scrape()
    assert after["torch_shift:request_success_total{length}"] == before.get(
        "torch_shift:request_success_total{length}", 0) + 1
    assert after["torch_shift:generation_tokens_total"] - before.get("torch_shift:generation_tokens_total", 0) == 5
    assert after["torch_shift:prompt_tokens_total"] > before.get("torch_shift:prompt_tokens_total", 0)
    assert after["torch_shift:time_to_first_token_seconds_count"] == before.get(
        "torch_shift:time_to_first_token_seconds_count", 0) + 1
    assert after["torch_shift:steps_total{single}"] >= before.get("torch_shift:steps_total{single}", 0) + 5
    assert "torch_shift:kv_cache_usage_perc" in after and "torch_shift:num_requests_running" in after


def test_api_key_models_health_and_openapi(checkpoints):
    _, model_dir = checkpoints("llama")
    s = RunningServer(model_dir, api_key="sekret", max_body_bytes=2000)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert httpx.get(s.url + "/v1/models").status_code == 401
        ok = s.client(api_key="sekret")
        assert [m.id for m in ok.models.list().data] == ["tiny"]
        assert ok.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        big = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 5000},
                         headers={"authorization": "Bearer sekret"})
        assert big.status_code == 413
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        assert "/v1/chat/completions" in httpx.get(s.url + "/openapi.json").json()["paths"]
    finally:
        s.stop()


def test_shutdown_fails_requests_in_flight_explicitly(checkpoints):
    _, model_dir = checkpoints("llama")
    s = RunningServer(model_dir)
    try:
        async def long_stream():
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"prompt": PROMPT, "max_tokens": 230, "stream": True, "ignore_eos": True}
                lines = []
                async with http.stream("POST", s.url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line)
                            if len(lines) == 2:
                                threading.Thread(target=s.async_engine.shutdown).start()
                return lines

        lines = asyncio.run(long_stream())
        assert lines[-1] == "data: [DONE]"
        assert "shut down" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        after = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert after.status_code == 503
    finally:
        s.stop()


@pytest.mark.slow
def test_server_with_sequence_parallel_ranks(checkpoints, reference):
    """`torch-shift serve --sp 2`: this server process starts rank 1 itself."""
    import subprocess
    import sys

    _, model_dir = checkpoints("llama")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch_shift", "serve", "--model", str(model_dir), "--sp", "2", "--shift-threshold",
                             "4", "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        expected = greedy(reference).text
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text \
            == expected
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'layout="base"' in metrics and 'layout="shift"' in metrics
    finally:
        proc.send_signal(2)  # SIGINT: uvicorn shuts down, the engine stops its rank
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_several_prompts_in_one_completion_request(server, reference):
    prompts = [PROMPT, "café au lait", "x"]
    out = server.client().completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        expected = greedy(reference, prompt, max_tokens=5).text
        assert out.choices[2 * i].text == expected and out.choices[2 * i + 1].text == expected
    assert out.usage.completion_tokens == 6 * 5
