"""Tool calls parsed out of a model's text, by the format its checkpoint was trained on, under vLLM's parser
names (`--tool-call-parser`): whole (`parse`) or streamed (`feed` pieces of any size, then `finish`), with the
same calls either way."""

from __future__ import annotations

from torch_shift.serve.tool_parsers.base import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser
from torch_shift.serve.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from torch_shift.serve.tool_parsers.hermes import HermesToolParser
from torch_shift.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from torch_shift.serve.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "NamedToolCallParser", "ParsedOutput", "RequiredToolCallsParser", "StreamDelta",
           "ToolCall", "ToolCallDelta", "ToolParser", "tool_parser"]


def tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; torch_shift has {', '.join(sorted(TOOL_PARSERS))}"
                         ) from None
