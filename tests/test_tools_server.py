"""Tool calling and reasoning through `torch-shift serve`'s app, driven by the unmodified openai client: every
tool_choice mode streamed and not, bad tools refused by name, reasoning split from content, an agent loop.

Random weights write random text, so the outputs that "auto" parses come from a scripted sampler (the real engine,
detokenizer and server, with the sampler replaced by one that writes a recorded model output), and "required" /
named functions come from the real model under constrained decoding."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from test_server import RunningServer

from torch_shift import LLM
from torch_shift.engine.errors import ParameterError
from torch_shift.engine.sampler import SamplerOutput
from torch_shift.engine.structured_output import start_waiting_grammars
from torch_shift.models.default import default_model_dir
from torch_shift.models.toy import TOOLS_CHAT_TEMPLATE, build_tokenizer, tiny_llama_config, write_random_checkpoint
from torch_shift.serve.options import ChatOptions

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_arguments(name: str, arguments: str) -> bool:
    """The arguments match the function's schema above."""
    value = json.loads(arguments)
    if name == "get_weather":
        return set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome", "Oslo") and \
            isinstance(value["days"], int) and 1 <= value["days"] <= 7
    return name == "get_time" and set(value) == {"utc"} and isinstance(value["utc"], bool)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A random checkpoint whose chat template renders tools (Qwen2.5's style, <tool_call> JSON)."""
    model_dir = write_random_checkpoint(tmp_path_factory.mktemp("tools"), tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=4096))
    return build_tokenizer(model_dir, chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(tools_model):
    # the scripted sampler draws every token on the host: synchronous steps
    s = RunningServer(tools_model, engine={"async_scheduling": False},
                      chat_options=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen3_server(tools_model):
    """With Qwen3's reasoning parser, whose grammars wait for the model's </think> (this template never closes a
    thinking block in the prompt), so the forced calls of the random model are tested on `server`."""
    s = RunningServer(tools_model, engine={"async_scheduling": False},
                      chat_options=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                               reasoning_parser="qwen3"))
    yield s
    s.stop()


class ScriptedSampler:
    """Writes the given texts (one per request, in arrival order), each followed by the end of sequence."""

    def __init__(self, tokenizer, texts: list[str]):
        self.scripts = [tokenizer.encode(t, add_special_tokens=False) + [min(tokenizer.eos_token_ids)] for t in texts]
        self.assigned: dict[str, list[int]] = {}

    def __call__(self, logits, requests) -> SamplerOutput:
        tokens = []
        for r in requests:
            if r.request_id not in self.assigned:
                self.assigned[r.request_id] = self.scripts.pop(0)
            script = self.assigned[r.request_id]
            tokens.append(script[r.num_output_tokens])
        return SamplerOutput(tokens, [None] * len(requests))


@contextmanager
def scripted(server, *texts):
    outputs = server.engine.output_processor
    real, outputs.sampler = outputs.sampler, ScriptedSampler(server.engine.tokenizer, list(texts))
    try:
        yield
    finally:
        outputs.sampler = real


def chat(server, stream: bool, **kwargs) -> tuple[str | None, list[dict], str, dict]:
    """(content, tool calls, finish reason, extra message fields) of one choice, assembled from the stream's
    deltas as a client does, or read from the response."""
    client = server.client()
    kwargs = {"model": "tiny", "messages": ASK, "max_tokens": 400, **kwargs}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        message = out.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or []]
        return message.content, calls, out.choices[0].finish_reason, message.model_extra or {}
    content, calls, finish, extra = None, {}, None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for key, value in (delta.model_extra or {}).items():
            extra[key] = extra.get(key, "") + value
        for call in delta.tool_calls or []:
            if call.id is not None:  # the first delta of a call: its id, type and name
                assert call.type == "function" and call.function.name and call.index == len(calls)
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, list(calls.values()), finish, extra


HERMES_OUTPUT = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                 '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_calls(server, stream):
    with scripted(server, HERMES_OUTPUT):
        content, calls, finish, _ = chat(server, stream, tools=TOOLS)
    assert content == "I will look it up.\n" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"utc": True})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    with scripted(server, HERMES_OUTPUT):  # one call only
        _, calls, _, _ = chat(server, stream, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in calls] == ["get_weather"]
    with scripted(server, "It is sunny."):  # no call: plain content
        assert chat(server, stream, tools=TOOLS)[:3] == ("It is sunny.", [], "stop")
    with scripted(server, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'):  # malformed
        content, calls, finish, _ = chat(server, stream, tools=TOOLS)
    assert calls == [] and finish == "stop" and content.startswith("<tool_call>") and content.endswith("</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_none_renders_the_tools_but_calls_nothing(server, stream):
    with scripted(server, HERMES_OUTPUT):
        content, calls, finish, _ = chat(server, stream, tools=TOOLS, tool_choice="none")
    assert (content, calls, finish) == (HERMES_OUTPUT, [], "stop")
    with_tools = server.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                                         max_tokens=1)
    without = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the template listed the tools


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_are_schema_valid_from_the_model(server, stream):
    for seed in range(3):
        content, calls, finish, _ = chat(server, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                         temperature=1.0, seed=seed)
        assert finish == "tool_calls" and content is None and len(calls) == 1
        assert valid_arguments(calls[0]["name"], calls[0]["arguments"]), calls
        content, calls, finish, _ = chat(server, stream, tools=TOOLS, temperature=1.0, seed=seed,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert finish == "stop" and len(calls) == 1 and calls[0]["name"] == "get_weather"  # "stop", as OpenAI
        assert valid_arguments("get_weather", calls[0]["arguments"]), calls


def test_required_and_named_from_the_default_model(tmp_path):
    """Any model: the embedded default model's template knows nothing of tools, and no parser is configured."""
    s = RunningServer(default_model_dir())
    try:
        for stream in (False, True):
            _, calls, finish, _ = chat(s, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       temperature=0.8, seed=3)
            assert finish == "tool_calls" and calls and all(valid_arguments(c["name"], c["arguments"]) for c in calls)
            _, (call,), finish, _ = chat(s, stream, tools=TOOLS, tool_choice={"type": "function",
                                                                              "function": {"name": "get_time"}})
            assert finish == "stop" and call["name"] == "get_time" and valid_arguments("get_time", call["arguments"])
        with pytest.raises(openai.BadRequestError) as refused:  # no --tool-call-parser: "auto" cannot be honoured
            s.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
        assert refused.value.body["param"] == "tool_choice" and "--tool-call-parser" in refused.value.body["message"]
    finally:
        s.stop()


BAD_TOOLS = [  # (extra fields, the param named, words of the message)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools[0].function.parameters", "properties.a.type: 'strin' is not a JSON Schema type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": ["a"]}}}]},
     "tools[0].function.parameters", "properties: an object of schemas"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}]},
     "tools[0].function.parameters", "required: a list of property names"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "type 'object'"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools", "'get_weather' is given twice (tools[0] and tools[2])"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools[0].function.name",
     "letters, digits"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "'get_news' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "gives none"),
    ({"tool_choice": "auto"}, "tool_choice", "needs `tools`"),  # vLLM's and OpenAI's rule
    ({"tools": []}, "tools", "an empty list"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "could never call a tool"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "could never call a tool"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
     "response_format.json_schema.schema", "dictionary"),  # llguidance's own words refused it before
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot also follow response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),  # was a 500
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "role 'user' needs content"),
    ({"messages": [{"role": "user"}]}, "messages[0]", "role 'user' needs content"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}, *ASK]}, "messages[1]",
     "only an assistant message with tool_calls may have content null"),
]


@pytest.mark.parametrize("extra, param, words", BAD_TOOLS)
def test_bad_tools_are_refused_by_name(server, extra, param, words):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert server.idle_free_blocks()


def test_agent_loop(server):
    """Call, tool result, call, tool result, answer: the openai client's messages (the response's message object
    appended as it is) go back through the template, tool results included."""
    client = server.client()
    messages: list = [{"role": "system", "content": "You help with travel."}, *ASK]
    results = {"get_weather": '{"forecast": "sunny", "celsius": 24}', "get_time": '{"time": "14:05"}'}
    for turn, function in enumerate(["get_weather", "get_time"]):
        out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=60, seed=turn,
                                             tool_choice={"type": "function", "function": {"name": function}})
        message = out.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == function and valid_arguments(function, call.function.arguments)
        messages.append(message)  # the SDK's own object, as its documentation shows
        messages.append({"role": "tool", "tool_call_id": call.id, "content": results[function]})
    with scripted(server, "It is sunny, 24 degrees, and 14:05 in Paris."):
        answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=60)
    assert answer.choices[0].message.content == "It is sunny, 24 degrees, and 14:05 in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    rendered = httpx.post(server.url + "/tokenize", json={"messages": json.loads(json.dumps(
        [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in messages]))}).json()
    prompt = server.engine.tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    for result in results.values():
        assert f"<tool_response>\n{result}\n</tool_response>" in prompt
    assert prompt.count("<tool_call>\n{\"name\": \"get_") == 2  # the earlier calls, rendered back
    assert server.idle_free_blocks()


THINKING = "<think>\nThe user wants Paris. I could write <tool_call> here; it is not a call.\n</think>\n\nIt is 24C."


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_content(qwen3_server, stream):
    server = qwen3_server
    with scripted(server, THINKING):
        content, calls, finish, extra = chat(server, stream)
    assert content == "\n\nIt is 24C." and calls == [] and finish == "stop"
    assert extra["reasoning_content"] == "\nThe user wants Paris. I could write <tool_call> here; it is not a call.\n"
    with scripted(server, THINKING.replace("It is 24C.", HERMES_OUTPUT)):  # reasoning, then calls
        content, calls, finish, extra = chat(server, stream, tools=TOOLS)
    assert "<tool_call>" in extra["reasoning_content"] and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert content == "\n\nI will look it up.\n" and finish == "tool_calls"  # the content as written after </think>
    with scripted(server, THINKING):
        _, _, _, extra = chat(server, stream, extra_body={"include_reasoning": False})
    assert "reasoning_content" not in extra and "reasoning" not in extra


class ScriptThenSample:
    """Writes the given text (reasoning, or the opening of a call), then samples as the engine does; a grammar
    consumes the written tokens as it would the drawn ones (one waiting for the reasoning's end starts there)."""

    def __init__(self, tokenizer, script: str, real):
        self.script = tokenizer.encode(script, add_special_tokens=False)
        self.real = real

    def __call__(self, logits, requests) -> SamplerOutput:
        (request,) = requests
        if request.num_output_tokens < len(self.script):
            tokens = [self.script[request.num_output_tokens]]
            if request.grammar is not None:
                assert request.grammar.consume_token(tokens[0]), "the script leaves the grammar"
            start_waiting_grammars(requests, tokens)
            return SamplerOutput(tokens, [None])
        return self.real(logits, requests)


@contextmanager
def script_then_sample(server, script: str):
    outputs = server.engine.output_processor
    real, outputs.sampler = outputs.sampler, ScriptThenSample(server.engine.tokenizer, script, outputs.sampler)
    try:
        yield
    finally:
        outputs.sampler = real


@pytest.fixture(scope="module")
def r1_server(tools_model):
    s = RunningServer(tools_model, engine={"async_scheduling": False},
                      chat_options=ChatOptions(reasoning_parser="deepseek_r1"))
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_output_follows_the_reasoning(r1_server, stream):
    """With a reasoning parser the model reasons first and the answer follows response_format, or is the forced
    call (vLLM's engine starts the grammar where the reasoning ends); it was constrained from the first token,
    which put the answer in the reasoning and left content empty."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}},
                  {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        with script_then_sample(r1_server, "<think>\nParis, surely.\n</think>"):
            content, calls, finish, fields = chat(r1_server, stream, temperature=1.0, seed=2, **extra)
        assert fields["reasoning"] == fields["reasoning_content"] == "\nParis, surely.\n"
        assert finish == "stop"
        if "tools" in extra:
            (call,) = calls
            assert call["name"] == "get_weather" and valid_arguments("get_weather", call["arguments"])
        else:
            assert json.loads(content)["city"] in ("Paris", "Rome") and not calls
    # a model that never ends its reasoning: the grammar never starts, and all of it is reasoning (as in vLLM)
    content, _, _, _ = chat(r1_server, stream, temperature=1.0, seed=2, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert content is None


@pytest.mark.parametrize("stream", [False, True])
def test_hidden_reasoning_sends_no_logprobs(r1_server, stream):
    """include_reasoning=false: the logprobs would spell the reasoning out, so none are sent (vLLM's rule)."""
    client = r1_server.client()
    kwargs = {"model": "tiny", "messages": ASK, "max_tokens": 6, "logprobs": True,
              "extra_body": {"include_reasoning": False}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    else:
        assert client.chat.completions.create(**kwargs).choices[0].logprobs is None
    kwargs["extra_body"] = {}
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is not None


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_a_stop_string_is_no_call(server, stream):
    """A stop string inside a forced call's JSON leaves arguments that are not JSON: it is no call and the finish
    reason is not "tool_calls" (it was, with arguments `{"`); max_tokens keeps the cut call ("length" says so)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        content, calls, finish, _ = chat(server, stream, tools=TOOLS, tool_choice=choice, stop=[","],
                                         temperature=1.0, seed=1, parallel_tool_calls=False)
        assert finish == "stop" and calls == [] and content in (None, "")  # streamed too: held until the end
        content, calls, finish, _ = chat(server, stream, tools=TOOLS, tool_choice=choice, stop=["{"])
        assert (calls, finish) == ([], "stop")  # nothing was written: nothing announced, streamed or not
    for max_tokens in range(8, 40):  # the first cut past the call's name
        _, calls, finish, _ = chat(server, stream, tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
        if calls:
            break
    assert finish == "length" and len(calls) == 1 and not calls[0]["arguments"].endswith("}")


@pytest.mark.parametrize("stream", [False, True])
def test_strict_tools_under_auto_hold_the_models_calls_to_their_schemas(server, stream):
    """strict: true under tool_choice "auto" (vLLM enforces it through structural tags): once the model opens a
    call (`<tool_call>`, written here), what follows is a call to one of the functions with valid arguments; without
    strict the random model writes no call there. The text before the call is free."""
    strict_tools = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    for seed in range(3):
        with script_then_sample(server, "I will check.<tool_call>"):
            content, calls, _, _ = chat(server, stream, tools=strict_tools, temperature=1.0, seed=seed,
                                        max_tokens=200)
        # (free text may follow the call: the random model writes some)
        assert content.startswith("I will check.") and len(calls) == 1, (content, calls)
        assert valid_arguments(calls[0]["name"], calls[0]["arguments"]), calls
    with script_then_sample(server, "I will check.<tool_call>"):
        content, calls, _, _ = chat(server, stream, tools=TOOLS, temperature=1.0, seed=0, max_tokens=20)
    assert calls == [] and content.startswith("I will check.<tool_call>")  # not held: random text, no call


def test_strict_tools_in_a_format_without_structural_tags_are_refused():
    from torch_shift.serve.tools import tool_choice

    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]
    assert tool_choice(strict, "auto", None, "hermes").grammar is not None
    assert tool_choice(strict, "auto", None, "llama3_json").grammar is not None
    assert tool_choice(TOOLS, "auto", None, "hermes").grammar is None  # nothing strict: the model's calls as written
    with pytest.raises(ParameterError, match="hermes and llama3_json formats, and this server parses mistral") as e:
        tool_choice(strict, "auto", None, "mistral")
    assert e.value.param == "tools[0].function.strict"
    from torch_shift.engine.structured_output import StructuredOutputsParams
    with pytest.raises(ParameterError, match="exactly one of"):
        StructuredOutputsParams(json_object=True, grammar="start: /a/")


def test_tokenize_renders_messages_as_a_chat_request(server):
    """vLLM's /tokenize with messages takes the request's tools and chat_template_kwargs (a tool request's prompt
    can be counted), and joins text parts with newlines, as a chat request renders them."""
    def tokenize(**body) -> httpx.Response:
        return httpx.post(server.url + "/tokenize", json={"messages": ASK, **body}, timeout=30)

    plain, with_tools = tokenize().json(), tokenize(tools=TOOLS).json()
    assert with_tools["count"] > plain["count"] + 50
    usage = server.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                                    max_tokens=1).usage
    assert usage.prompt_tokens == with_tools["count"]
    refused = tokenize(tools=[WEATHER, WEATHER])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert tokenize(chat_template_kwargs={"enable_thinking": False}).json()["count"] == plain["count"]
    parts = tokenize(messages=[{"role": "user", "content": [{"type": "text", "text": "Paris"},
                                                            {"type": "text", "text": "Rome"}]}]).json()
    assert "Paris\nRome" in server.engine.tokenizer.decode(parts["tokens"])
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x", "tools": TOOLS}).status_code == 400


def test_continue_final_message_and_reasoning_effort(server):
    """vLLM's continue_final_message: the prompt ends inside the caller's assistant turn (as /tokenize renders it
    with the same flag); reasoning_effort reaches the template as a variable (GPT-OSS's reads it)."""
    from torch_shift.serve.protocol import ChatCompletionRequest

    begun = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    usage = server.client().chat.completions.create(
        model="tiny", messages=begun, max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": False}).usage
    rendered = httpx.post(server.url + "/tokenize", json={"messages": begun, "continue_final_message": True,
                                                          "add_generation_prompt": False}).json()
    assert usage.prompt_tokens == rendered["count"]
    assert server.engine.tokenizer.decode(rendered["tokens"]).endswith("assistant\nThe weather in Paris is")
    refused = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": begun, "max_tokens": 1, "continue_final_message": True})
    assert refused.status_code == 400 and "add_generation_prompt=false" in refused.json()["error"]["message"]
    request = ChatCompletionRequest(messages=ASK, reasoning_effort="low", chat_template_kwargs={"x": 1})
    assert request.template_kwargs() == {"x": 1, "reasoning_effort": "low"}
    assert server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=1,
                                                   reasoning_effort="high").choices


def test_offline_chat_renders_tools(tools_model):
    llm = LLM(str(tools_model))
    out = llm.chat(ASK, tools=TOOLS, use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "24C"}]
    out = llm.chat(history, tools=TOOLS, use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in prompt and "24C" in prompt
    with pytest.raises(ParameterError, match="given twice"):
        llm.chat(ASK, tools=[WEATHER, WEATHER], use_tqdm=False)
    with pytest.raises(ParameterError, match="role 'user' needs content") as refused:  # as the server refuses it
        llm.chat([{"role": "user", "content": None}], use_tqdm=False)
    assert refused.value.param == "messages[0].content"
    null_content_call = [{**history[1], "content": None}]  # an assistant turn of tool calls may leave it out
    assert llm.chat([*ASK, *null_content_call, history[2]], tools=TOOLS, use_tqdm=False)[0].outputs[0].token_ids


def test_serve_flags_are_vllms(tmp_path, capsys):
    from torch_shift.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                      "--reasoning-parser", "deepseek_r1"])
    options = ChatOptions.from_args(args)
    assert options.auto_tool_parser == "llama3_json" and options.reasoning_parser == "deepseek_r1"
    assert ChatOptions(tool_call_parser="hermes").auto_tool_parser is None  # "auto" needs the flag too
    assert main(["serve", "--enable-auto-tool-choice"]) == 2  # refused before any model is loaded
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nonsense"])
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert ChatOptions(chat_template=str(template)).template() == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="no such file"):
        ChatOptions(chat_template=str(tmp_path / "missing.jinja")).template()
