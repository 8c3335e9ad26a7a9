"""Llama 3.1 / 3.2 JSON calls (`--tool-call-parser llama3_json`).

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The output is a call when it begins (after whitespace, and `<|python_tag|>` when special tokens are kept) with a
JSON object; several calls are separated by `;`. The arguments are under "parameters" (or "arguments"). An output
that does not begin with `{` is content.
"""

from __future__ import annotations

import json

from torch_shift.serve.tool_parsers.base import ToolParser
from torch_shift.serve.tool_parsers.json_calls import WHITESPACE, CallObject

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._started = False

    @classmethod
    def call_tags(cls, parameters: dict[str, dict]) -> list[tuple[str, str, dict, str]]:
        # as Llama 3.1's template shows the format to the model
        return [('{"name": ', f'{{"name": {json.dumps(name)}, "parameters": ', schema, "}")
                for name, schema in parameters.items()]

    def _read(self, final: bool) -> bool:
        if self._call is not None:
            if not self._call.done:
                return self._read_call()
            self._end_call()
            return True
        text = self._buffer.lstrip(WHITESPACE)
        if not self._started:
            if text.startswith(PYTHON_TAG):
                text = text[len(PYTHON_TAG):].lstrip(WHITESPACE)
            elif not final and text and PYTHON_TAG.startswith(text):
                return False
        elif text.startswith(";"):
            text = text[1:].lstrip(WHITESPACE)
        if not text:
            if final:
                if not self._started:
                    self._plain = True  # only whitespace: content
                else:
                    self._buffer = ""
            return False
        if text[0] != "{":
            self._plain = True  # not a call (or text after the calls): content, as written
            return True
        self._started = True
        self._begin_call(self._buffer[:len(self._buffer) - len(text)], CallObject(ARGUMENT_KEYS))
        self._buffer = text
        return True
