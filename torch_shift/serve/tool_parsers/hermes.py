"""Hermes-style calls (`--tool-call-parser hermes`): Qwen2.5, Qwen3, QwQ, Hermes 2 Pro / 3.

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is a JSON object between `<tool_call>` and `</tool_call>`; text before the first call is content. As
in vLLM, a last call whose closing tag never came is accepted when its JSON is complete.
"""

from __future__ import annotations

import json

from torch_shift.serve.tool_parsers.base import ToolParser
from torch_shift.serve.tool_parsers.json_calls import WHITESPACE, CallObject

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    needs_special_tokens = True  # <tool_call> is a special token in some Hermes tokenizers (vLLM keeps them too)

    @classmethod
    def call_tags(cls, parameters: dict[str, dict]) -> list[tuple[str, str, dict, str]]:
        # as Qwen's and Hermes' templates show the format to the model
        return [(START, f'{START}\n{{"name": {json.dumps(name)}, "arguments": ', schema, f"}}\n{END}")
                for name, schema in parameters.items()]

    def _read(self, final: bool) -> bool:
        if self._call is None:
            if not self._read_content_until(START, final):
                return False
            self._begin_call(START, CallObject(("arguments",)))
            return True
        if not self._call.done:
            return self._read_call()
        rest = self._buffer.lstrip(WHITESPACE)
        if rest.startswith(END):
            self._buffer = rest[len(END):]
            self._end_call()
            return True
        if END.startswith(rest):  # whitespace, or the start of the closing tag
            if final:  # the output ended there (max_tokens, a stop string): finish() accepts the complete call
                self._buffer = ""
            return False
        self._fail_call(final=False)  # text after the call's JSON, inside its tags
        return True
