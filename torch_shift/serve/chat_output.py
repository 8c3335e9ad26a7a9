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

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self)

    def finish_reason(self, engine_reason: str | None, tools_called: bool) -> str | None:
        """As OpenAI: "tool_calls" when calls ended the output under "auto" or "required" ("stop" for a named
        function)."""
        if engine_reason == "stop" and tools_called and self.tools.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


class ChatOutputParser:
    """One choice's text: `parse` it whole, or `feed` it piece by piece and `finish`."""

    def __init__(self, output: ChatOutputFormat):
        self.output = output
        tools = output.tools
        # a forced call is all of the output: there is no reasoning before it
        self._reasoning = (output.reasoning_parser(output.prompt) if output.reasoning_parser and not tools.forced
                           else None)
        self._make_tool_parser: Callable[[], ToolParser] | None = None
        if tools.mode == "required":
            self._make_tool_parser = RequiredToolCallsParser
        elif tools.mode == "named":
            self._make_tool_parser = lambda: NamedToolCallParser(tools.function)
        elif tools.mode == "auto":
            self._make_tool_parser = output.tool_parser
        self._tools = self._make_tool_parser() if self._make_tool_parser else None
        self.tools_called = False

    def parse(self, text: str) -> dict:
        """The message of a whole output: content, tool_calls and reasoning_content as OpenAI (and vLLM) send them."""
        reasoning, content = (self._reasoning.parse(text, self.output.prompt) if self._reasoning is not None
                              else (None, text))
        calls: list[ToolCall] = []
        if self._tools is not None and content:
            parsed = self._make_tool_parser().parse_whole(content)
            content, calls = parsed.content, parsed.tool_calls
            if not self.output.tools.parallel:
                calls = calls[:1]
        self.tools_called = bool(calls)
        message: dict = {"role": "assistant", "content": content if content is not None or calls else ""}
        if self._reasoning is not None and self.output.include_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    def feed(self, text: str) -> dict:
        """The delta fields for more of the output (empty when all of it is held back for now)."""
        return self._delta(text, final=False)

    def finish(self) -> dict:
        return self._delta("", final=True)

    def _delta(self, text: str, final: bool) -> dict:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            piece = self._tools.feed(content) if content else StreamDelta()
            if final:
                rest = self._tools.finish()
                piece.content += rest.content
                piece.tool_calls += rest.tool_calls
            content, calls = piece.content, piece.tool_calls
            if not self.output.tools.parallel:
                calls = [call for call in calls if call.index == 0]
            self.tools_called |= bool(calls)
        delta: dict = {}
        if reasoning and self.output.include_reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        return delta
