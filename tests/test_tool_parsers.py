"""Tool-call and reasoning parsers on recorded model outputs: whole, and streamed in every split, with the same
calls; malformed calls come back as text, never as an error."""

from __future__ import annotations

import json
import random
import re

import pytest

from torch_shift.serve.chat_output import ChatOutputFormat
from torch_shift.serve.reasoning import REASONING_PARSERS
from torch_shift.serve.tool_parsers import TOOL_PARSERS, NamedToolCallParser, RequiredToolCallsParser
from torch_shift.serve.tools import ToolChoice

WEATHER = {"city": "Paris", "unit": "celsius"}
# (parser, output as the model wrote it, expected content, expected calls as (name, arguments object))
RECORDED = [
    ("hermes",  # Qwen2.5-7B-Instruct: one call
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes",  # Qwen2.5: text, then two parallel calls
     'Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": '
     '"celsius"}}\n</tool_call>',
     "Let me check both cities.\n", [("get_weather", WEATHER), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("hermes",  # escapes, unicode, nested values, numbers of every form, empty arguments
     '<tool_call>\n{"name": "search", "arguments": {"q": "caf\\u00e9 \\"cr\\u00e8me\\"\\n", "limit": 10, '
     '"score": -1.5e-3, "filters": {"tags": ["a", "b"], "exact": true, "after": null}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     None, [("search", {"q": 'café "crème"\n', "limit": 10, "score": -1.5e-3,
                        "filters": {"tags": ["a", "b"], "exact": True, "after": None}}), ("now", {})]),
    ("hermes",  # a last call without its closing tag (the output stopped there): accepted, as in vLLM
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("hermes",  # the output ended inside the closing tag (max_tokens): the complete call stands, whole or streamed
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_ca',
     None, [("get_weather", WEATHER)]),
    ("hermes",  # no call at all; text that looks like the start of a tag
     "The weather is fine. Use <tool to check, or <tool_cal", "The weather is fine. Use <tool to check, or <tool_cal",
     []),
    ("llama3_json",  # Llama-3.1-8B-Instruct
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json",  # special tokens kept; two calls separated by ";"
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("llama3_json", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("mistral",  # Mistral-7B-Instruct-v0.3
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral",  # Mistral Small 3.2 (tokenizer v11+): name then arguments, text before
     'Checking.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"tz": "UTC"}',
     "Checking.", [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]),
    ("mistral",  # Magistral / Mistral v13: [ARGS]
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [("get_weather", WEATHER)]),
    ("mistral",  # arguments encoded as a JSON string before v11 (vLLM's parser takes the string's text)
     '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}]', None,
     [("get_weather", WEATHER)]),
    ("mistral",  # a call before v11 without its array (vLLM's parser reads it too)
     'Sure.[TOOL_CALLS] {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "Sure.",
     [("get_weather", WEATHER)]),
    # before v11, calls without arguments (vLLM's parser gives them "{}"; they were text, the calls lost)
    ("mistral", '[TOOL_CALLS][{"name": "now"}, {"name": "today", "arguments": null}]', None,
     [("now", {}), ("today", {})]),
    ("mistral", '[TOOL_CALLS]{"name": "now"}', None, [("now", {})]),
]
MALFORMED = [  # (parser, output): never a call, all of it content, whole or streamed
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    # no arguments (vLLM's parsers fail on the missing key): a plain JSON answer, or arguments written beside
    # the name, are not a call with arguments {}
    ("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "city": "Paris"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>'),
    ("llama3_json", '{"name": "John", "age": 30}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "city": "Paris"}]'),
    ("hermes", '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "city=Paris"}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "f",, "arguments": {}}\n</tool_call>'),
    ("hermes", "Use <tool_call> tags like <tool_call>this</tool_call>."),
    ("hermes", " \n<tool_call>\nnot json"),
    ("mistral", "\n\n[TOOL_CALLS] I cannot call tools."),
    ("llama3_json", '{"name": "get_weather" "parameters": {}}'),
    ("llama3_json", "{ not json at all"),
    ("mistral", "[TOOL_CALLS] I cannot call tools."),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "city=Paris"}]'),  # a string, but no JSON object in it
]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser_class, pieces: list[str], **kwargs):
    """Feed the pieces; the content and the calls as a client would assemble them from the deltas."""
    parser = parser_class(**kwargs)
    content, calls = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.index == len(calls)  # announced once, in order
                calls[call.index] = {"id": call.id, "name": call.name, "arguments": ""}
            calls[call.index]["arguments"] += call.arguments
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], parser


def splits(text: str, seed: int = 0):
    """Every cut in two, every character alone, and random cuts into many pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_recorded_outputs_whole_and_in_every_split(name, text, content, calls):
    parser_class = TOOL_PARSERS[name]
    whole = parser_class.parse(text)
    assert whole.content == content and calls_of(whole.tool_calls) == calls
    assert len({c.id for c in whole.tool_calls}) == len(calls)
    for pieces in splits(text):
        got_content, got_calls, parser = streamed(parser_class, pieces)
        assert (got_content or None, got_calls) == (content, calls), pieces
        assert not parser.failed
        assert [c.arguments for c in parser.calls] == [c.arguments for c in whole.tool_calls]


@pytest.mark.parametrize("name, text", MALFORMED)
def test_a_malformed_call_is_text(name, text):
    whole = TOOL_PARSERS[name].parse(text)
    assert whole.content == text and whole.tool_calls == []
    for pieces in splits(text):
        content, calls, _ = streamed(TOOL_PARSERS[name], pieces)
        assert (content, calls) == (text, []), pieces


def test_a_call_that_breaks_after_it_was_announced():
    """Whole: all text (vLLM's rule). Streamed: the call announced before the break stays (it was sent); what
    follows the break is content; nothing raises."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing</tool_call>'
    assert TOOL_PARSERS["hermes"].parse(text).content == text
    for pieces in splits(text):
        content, calls, parser = streamed(TOOL_PARSERS["hermes"], pieces)
        assert parser.failed and calls == [("f", {"a": 1})] and content.endswith("trailing</tool_call>")
    truncated = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'  # cut by max_tokens
    assert TOOL_PARSERS["hermes"].parse(truncated).content == truncated


@pytest.mark.parametrize("name, text, arguments, content", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', '{"x": ', 'NaN}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"city": "Paris",}}', '{"city": "Paris",', "}}"),
    ("mistral", '[TOOL_CALLS]f{"a": 01}', '{"a": 0', "1}"),
])
def test_the_character_that_breaks_an_announced_call_is_sent_once(name, text, arguments, content):
    """Found by a differential run against vLLM's parsers: the character was streamed as the arguments' last and
    again as the content's first."""
    for pieces in splits(text):
        parser = TOOL_PARSERS[name]()
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert parser.failed
        assert "".join(call.arguments for d in deltas for call in d.tool_calls) == arguments, pieces
        assert "".join(d.content for d in deltas) == content, pieces


def test_mistral_ids_are_nine_letters_and_digits():
    (call,) = TOOL_PARSERS["mistral"].parse('[TOOL_CALLS]f{"a": 1}').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    assert TOOL_PARSERS["mistral"].needs_special_tokens and TOOL_PARSERS["hermes"].needs_special_tokens


def test_forced_calls_whole_and_streamed():
    required = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},{"name":"now","parameters":{}}]'
    assert calls_of(RequiredToolCallsParser.parse(required).tool_calls) == [("get_weather", WEATHER), ("now", {})]
    named = '{"city":"Paris","unit":"celsius"}'
    assert calls_of(NamedToolCallParser.parse(named, function="get_weather").tool_calls) == [("get_weather", WEATHER)]
    for pieces in splits(required):
        assert streamed(RequiredToolCallsParser, pieces)[:2] == ("", [("get_weather", WEATHER), ("now", {})])
    for pieces in splits(named):
        assert streamed(NamedToolCallParser, pieces, function="get_weather")[:2] == ("", [("get_weather", WEATHER)])
    # cut by max_tokens: the call is kept as it is (finish_reason "length" tells the client)
    (cut,) = NamedToolCallParser.parse('{"city":"Par', function="get_weather").tool_calls
    assert cut.arguments == '{"city":"Par'
    # ... once it has a name and its arguments began; before, the text as written (vLLM's content; was an empty
    # message, found by a differential run against vLLM's server)
    for early in ('[{"na', ' [{"name":"now","param'):
        for pieces in splits(early):
            parser = RequiredToolCallsParser()
            parser.keeps_truncated_calls = True  # as the server sets it for finish_reason "length"
            deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
            assert "".join(d.content for d in deltas) == early and not parser.calls, pieces


REASONING = [  # (parser, prompt, output, reasoning, content)
    ("deepseek_r1", "<｜User｜>2+2?<｜Assistant｜><think>\n", "The user asks 2+2. That is 4.\n</think>\n\nIt is 4.",
     "The user asks 2+2. That is 4.\n", "\n\nIt is 4."),
    ("deepseek_r1", "<｜User｜>2+2?<｜Assistant｜>", "<think>\nAdd them.\n</think>4", "\nAdd them.\n", "4"),
    ("deepseek_r1", "", "Still thinking when the output was cut", "Still thinking when the output was cut", None),
    # text before a late <think>: kept as reasoning, the marker dropped (as vLLM streams it); one after </think> is
    # content
    ("deepseek_r1", "", "x<think>a</think>b", "xa", "b"),
    ("deepseek_r1", "", "a</think>b<think>c", "a", "b<think>c"),
    ("deepseek_r1", "", "a <thin", "a <thin", None),
    ("deepseek_r1", "", "x<think>a", "xa", None),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nOkay, 2+2.\n</think>\n\n4", "\nOkay, 2+2.\n", "\n\n4"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "4, without thinking.", None, "4, without thinking."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "the template opened it</think>4", "the template opened it", "4"),
    ("qwen3", "<|im_start|>assistant\n", "No think block here", None, "No think block here"),
    # a call in a block the model never closed begins the answer (vLLM's qwen3); in one it closes, it is reasoning
    ("qwen3", "<|im_start|>assistant\n", "<think>maybe <tool_call>\n{}\n</tool_call>", "maybe ",
     "<tool_call>\n{}\n</tool_call>"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "let me call <tool_call>x", "let me call ", "<tool_call>x"),
    ("qwen3", "<|im_start|>assistant\n", "<think>a <tool_call> b</think>c", "a <tool_call> b", "c"),
    ("qwen3", "<|im_start|>assistant\n", "<think>a <tool_c", "a <tool_c", None),
]


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING)
def test_reasoning_whole_and_in_every_split(name, prompt, text, reasoning, content):
    parser_class = REASONING_PARSERS[name]
    assert parser_class.parse(text, prompt) == (reasoning, content)
    for pieces in splits(text):
        parser = parser_class(prompt)
        parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == (reasoning, content)


QWEN3_WITH_CALL = ('<think>\nThe user wants the weather; <tool_call> is how I call tools.\n</think>\n\n'
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                   '</tool_call>')


def test_reasoning_is_kept_out_of_content_and_tool_parsing():
    """The <tool_call> mentioned inside the reasoning is not a call; the one after </think> is."""
    output = ChatOutputFormat(ToolChoice("auto", tools=[]), TOOL_PARSERS["hermes"], REASONING_PARSERS["qwen3"],
                              prompt="<|im_start|>assistant\n")
    message = output.parser().parse(QWEN3_WITH_CALL, "stop")
    assert message["reasoning"] == message["reasoning_content"] == \
        "\nThe user wants the weather; <tool_call> is how I call tools.\n"
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", WEATHER)]
    for pieces in splits(QWEN3_WITH_CALL):
        parser = output.parser()
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish("stop")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert "".join(d.get("content", "") for d in deltas) == ""
        arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
        assert json.loads(arguments) == WEATHER and parser.tools_called
    assert output.finish_reason("stop", True) == "tool_calls" and output.finish_reason("length", True) == "length"
    hidden = ChatOutputFormat(ToolChoice("none"), None, REASONING_PARSERS["qwen3"], include_reasoning=False)
    assert {"reasoning_content", "reasoning"}.isdisjoint(hidden.parser().parse("<think>x</think>y", "stop"))
    assert hidden.hides_reasoning and not output.hides_reasoning  # no logprobs: they would show the reasoning
    # only reasoning: content null beside it (vLLM's); without a reasoning parser an empty output is ""
    assert output.parser().parse("<think>x</think>", "stop")["content"] is None
    assert ChatOutputFormat(ToolChoice("none")).parser().parse("", "stop")["content"] == ""


def test_a_call_in_a_thinking_block_never_closed_is_a_call():
    """The model called a tool without closing its thinking: the call was reasoning, and lost (vLLM's qwen3 takes
    it)."""
    output = ChatOutputFormat(ToolChoice("auto", tools=[]), TOOL_PARSERS["hermes"], REASONING_PARSERS["qwen3"],
                              prompt="<|im_start|>assistant\n")
    text = '<think>maybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' \
           '</tool_call>'
    message = output.parser().parse(text, "stop")
    assert message["reasoning"] == "maybe " and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", WEATHER)]
    for pieces in splits(text):
        parser = output.parser()
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish("stop")]
        assert "".join(d.get("reasoning", "") for d in deltas) == "maybe "
        arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
        assert json.loads(arguments) == WEATHER and parser.tools_called


def test_only_the_first_call_without_parallel_tool_calls():
    text = RECORDED[1][1]
    output = ChatOutputFormat(ToolChoice("auto", tools=[], parallel=False), TOOL_PARSERS["hermes"])
    assert len(output.parser().parse(text, "stop")["tool_calls"]) == 1
    parser = output.parser()
    deltas = [parser.feed(text), parser.finish("stop")]
    assert {c["index"] for d in deltas for c in d.get("tool_calls", [])} == {0}


def test_forced_calls_take_the_id_format_of_the_servers_parser():
    """Mistral's templates refuse ids other than 9 letters and digits: a forced call on a server with the mistral
    parser gets one, whole and streamed, as the model's own calls do."""
    forced = ChatOutputFormat(ToolChoice("named", tools=[], function="f", schema={}), TOOL_PARSERS["mistral"])
    (call,) = forced.parser().parse('{"a": 1}', "stop")["tool_calls"]
    parser = forced.parser()
    (delta,) = parser.feed('{"a": 1}')["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and parser.finish("stop") == {}
    assert all(len(i) == 9 and i.isalnum() for i in (call["id"], delta["id"]))
    plain = ChatOutputFormat(ToolChoice("named", tools=[], function="f", schema={}))
    assert plain.parser().parse('{"a": 1}', "stop")["tool_calls"][0]["id"].startswith("call_")
    # --tool-call-parser mistral without --enable-auto-tool-choice: the forced calls' ids still Mistral's
    named = ChatOutputFormat(ToolChoice("named", tools=[], function="f", schema={}), id_parser=TOOL_PARSERS["mistral"])
    assert len(named.parser().parse('{"a": 1}', "stop")["tool_calls"][0]["id"]) == 9


def test_a_constrained_output_waits_for_reasoning_unless_the_prompt_closed_it():
    """Qwen3's template in thinking mode ends with the assistant's turn and the model opens <think> itself; with
    enable_thinking false it closes an empty block in the prompt; DeepSeek-R1's opens one in the prompt."""
    def waits(parser: str, prompt: str) -> bool:
        return ChatOutputFormat(ToolChoice("none"), None, REASONING_PARSERS[parser], prompt).reasoning_first

    assert waits("qwen3", "<|im_start|>assistant\n") and waits("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not waits("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert waits("deepseek_r1", "<｜Assistant｜><think>\n") and not waits("deepseek_r1", "<｜Assistant｜></think>")
    # and the parser reads such an output as the answer (it was all reasoning)
    assert REASONING_PARSERS["deepseek_r1"].parse("Paris.", "<｜Assistant｜></think>") == (None, "Paris.")
    assert REASONING_PARSERS["deepseek_r1"].parse("Paris.", "<｜Assistant｜><think>\n") == ("Paris.", None)
    assert not ChatOutputFormat(ToolChoice("none"), None, None, "<|im_start|>assistant\n").reasoning_first


def test_a_streamed_forced_call_is_held_while_a_stop_string_may_cut_it():
    """With stop strings, a forced call streams whole at the end: a call a stop string cut is no call, as when
    not streamed (it was announced with arguments that are not JSON)."""
    forced = ChatOutputFormat(ToolChoice("named", tools=[], function="f", schema={}), stop_strings=True)
    parser = forced.parser()
    assert parser.feed('{"a": 1') == {} and parser.finish("stop") == {} and not parser.tools_called
    parser = forced.parser()
    assert parser.feed('{"a": 1}') == {}
    (call,) = parser.finish("stop")["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["index"] == 0 and call["id"]


@pytest.mark.parametrize("mode", ["required", "named"])
@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_a_forced_choices_free_text_is_the_same_whole_and_streamed(mode, reasoning):
    """A grammar that never started (it waits for a reasoning parser's </think>, which a model that does not think
    never writes) leaves free text: sent as content by the stream, it was dropped from the whole message (a helper's
    probe). Both now keep it; with stop strings both drop it, a call a stop string may have cut being no call."""
    text = "The children of Israel said unto"
    for stop_strings in (False, True):
        output = ChatOutputFormat(ToolChoice(mode, tools=[], function="f" if mode == "named" else None, schema={}),
                                  reasoning_parser=REASONING_PARSERS[reasoning] if reasoning else None,
                                  stop_strings=stop_strings)
        whole = output.parser().parse(text, "length")
        parser = output.parser()
        deltas = [parser.feed(piece) for piece in re.findall(r"\S+\s*", text)] + [parser.finish("length")]
        streamed = "".join(d.get("content", "") for d in deltas)
        assert "tool_calls" not in whole and not any("tool_calls" in d for d in deltas)
        if stop_strings:
            assert streamed == "" and whole["content"] == (None if reasoning else "")
        else:
            assert streamed == whole["content"] == text
