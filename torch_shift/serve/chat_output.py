"""A chat choice's text as OpenAI message fields: the reasoning (with a reasoning parser) kept apart, then the
content read for tool calls as the request's tool_choice says; whole for a response, or piece by piece for the
stream's deltas, with the same result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_shift.serve.reasoning import ReasoningParser
from torch_shift.serve.tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from torch_shift.serve.tools import ToolChoice


@dataclass(frozen=True)
class ChatOutputFormat:
    """How the choices of one request are read."""

    tools: ToolChoice
    tool_parser: type[ToolParser] | None = None  # the server's, for tool_choice "auto"
    reasoning_parser: type[ReasoningParser] | None = None
    prompt: str = ""  # the rendered prompt (where the reasoning parser may find an open thinking block)
    include_reasoning: bool = True
    id_parser: type[ToolParser] | None = None  # the server's --tool-call-parser (the model's call id format)
    # stop strings may cut the output: a stream then holds a forced call until the output ends (a call cut by one
    # is no call, which a stream could not take back once announced)
    stop_strings: bool = False
    # the reply's role: "assistant", or the last message's where no generation prompt opened a new turn (vLLM's)
    role: str = "assistant"

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self)

    @property
    def reasoning_first(self) -> bool:
        """Whether the model may reason before it answers (a constrained output's grammar then waits for the
        reasoning's end): with a reasoning parser, unless the prompt closed the thinking block itself (vLLM's test
        of the prompt; Qwen3's template with enable_thinking false)."""
        return self.reasoning_parser is not None and not self.reasoning_parser.prompt_closed_reasoning(self.prompt)

    @property
    def hides_reasoning(self) -> bool:
        """include_reasoning=false with a reasoning parser: the tokens' logprobs would show it, so none are sent
        (vLLM's rule)."""
        return self.reasoning_parser is not None and not self.include_reasoning

    def finish_reason(self, engine_reason: str | None, tools_called: bool) -> str | None:
        """As OpenAI: "tool_calls" when complete calls ended the output under "auto" or "required" ("stop" for a
        named function)."""
        if engine_reason == "stop" and tools_called and self.tools.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


class ChatOutputParser:
    """One choice's text: `parse` it whole, or `feed` it piece by piece and `finish`."""

    def __init__(self, output: ChatOutputFormat):
        self.output = output
        tools = output.tools
        # a constrained output (a forced call, response_format) may follow reasoning too: its grammar waits for it
        self._reasoning = output.reasoning_parser(output.prompt) if output.reasoning_parser else None
        self._make_tool_parser: Callable[[], ToolParser] | None = None
        if tools.mode == "required":
            self._make_tool_parser = RequiredToolCallsParser
        elif tools.mode == "named":
            self._make_tool_parser = lambda: NamedToolCallParser(tools.function)
        elif tools.mode == "auto":
            self._make_tool_parser = output.tool_parser
        self._tools = self._make_tool_parser() if self._make_tool_parser else None
        id_parser = output.id_parser or output.tool_parser
        if tools.forced and id_parser is not None:
            self._tools.make_call_id = id_parser.make_call_id  # the model's id format (Mistral's)
        self._held: str | None = "" if tools.forced and output.stop_strings else None  # a forced call's held text
        self.tools_called = False  # complete calls were made (what finish_reason "tool_calls" says)

    def parse(self, text: str, finish_reason: str | None) -> dict:
        """The message of a whole output that ended with `finish_reason`: content, tool_calls and the reasoning
        as OpenAI (and vLLM) send them."""
        reasoning, content = (self._reasoning.parse(text, self.output.prompt) if self._reasoning is not None
                              else (None, text))
        content, calls = self._calls_of(content, finish_reason)
        self.tools_called = bool(calls)
        if content is None and not calls and self._reasoning is None:
            content = ""  # an empty output; with a reasoning parser, null beside the reasoning (vLLM's)
        message: dict = {"role": self.output.role, "content": content}
        if self._reasoning is not None and self.output.include_reasoning:
            message.update(_reasoning_fields(reasoning))
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    def _calls_of(self, content: str | None, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """A whole output's content and calls, read as the tool choice says."""
        if self._tools is None or not content:
            return content, []
        parser = self._make_tool_parser()
        parser.make_call_id = self._tools.make_call_id
        self._keep_truncated_calls(parser, finish_reason)
        parsed = parser.parse_whole(content)
        content, calls = parsed.content, parsed.tool_calls
        if self.output.tools.forced and not calls and self.output.stop_strings:
            # a forced call cut short by a stop string is no call, and no text (vLLM's). Otherwise the text stays, as
            # the stream sends it: what a grammar that never started left (it waits for a reasoning parser's
            # </think>, which a model that does not think never writes)
            content = None
        return content, calls if self.output.tools.parallel else calls[:1]

    def feed(self, text: str) -> dict:
        """The delta fields for more of the output (empty when all of it is held back for now)."""
        return self._delta(text, None)

    def finish(self, finish_reason: str) -> dict:
        """The last delta fields, once the output ended with `finish_reason`."""
        return self._delta("", finish_reason)

    def _delta(self, text: str, finish_reason: str | None) -> dict:
        final = finish_reason is not None
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        calls: list[ToolCallDelta] = []
        if self._held is not None:  # a forced call is sent whole once the output ended (stop strings may cut it)
            self._held += content
            content = ""
            if final:
                content, whole = self._calls_of(self._held, finish_reason)
                calls = [ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(whole)]
                self.tools_called = bool(whole)
        elif self._tools is not None:
            piece = self._tools.feed(content) if content else StreamDelta()
            if final:
                self._keep_truncated_calls(self._tools, finish_reason)
                rest = self._tools.finish()
                piece.content += rest.content
                piece.tool_calls += rest.tool_calls
            content, calls = piece.content, piece.tool_calls
            if not self.output.tools.parallel:
                calls = [call for call in calls if call.index == 0]
            self.tools_called |= bool(calls)
            if final and self._tools.failed:
                self.tools_called = False  # a call announced, then cut or malformed: not "tool_calls"
        delta: dict = {}
        if reasoning and self.output.include_reasoning:
            delta.update(_reasoning_fields(reasoning))
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        return delta

    def _keep_truncated_calls(self, parser: ToolParser, finish_reason: str | None) -> None:
        """A forced call the output ended inside is kept when max_tokens cut it (finish_reason "length" says so),
        not when a stop string did (a client could not tell it from a whole call)."""
        if self.output.tools.forced:
            parser.keeps_truncated_calls = finish_reason == "length"


def _reasoning_fields(reasoning: str | None) -> dict:
    """vLLM's field (`reasoning`, since 0.11) and the one DeepSeek's API and earlier vLLM send."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}
