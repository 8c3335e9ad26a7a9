"""The output of a forced tool call, constrained by its JSON schema (torch_shift.serve.tools), whatever the model:

    tool_choice "required":                  [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    tool_choice {"function": {"name": ...}}: {"city": "Paris"}

as vLLM renders them. A call cut by max_tokens is kept as it is (finish_reason "length" says so) once its name and
arguments began, and is the text as written before (vLLM's: content); the server makes one cut by a stop string no
call (`ChatOutputParser`), as nothing would tell a client it is incomplete.
"""

from __future__ import annotations

from torch_shift.serve.tool_parsers.base import CallArrayReader, ToolParser
from torch_shift.serve.tool_parsers.json_calls import WHITESPACE, CallObject


class RequiredToolCallsParser(ToolParser):
    keeps_truncated_calls = True

    def __init__(self) -> None:
        super().__init__()
        self._array: CallArrayReader | None = None
        self._closed = False

    def _read(self, final: bool) -> bool:
        if self._call is not None:
            if not self._call.done:
                return self._read_call()
            self._end_call()
            self._array.call_ended()
            return True
        if self._closed:
            self._plain = True  # nothing follows the array in a constrained output
            return True
        if self._array is None:
            text = self._buffer.lstrip(WHITESPACE)
            if not text:
                return False
            if text[0] != "[":
                self._fail("")
                return True
            self._array = CallArrayReader(self, ("parameters",))
            self._array.raw = self._buffer[:len(self._buffer) - len(text) + 1]  # content again if no call comes
            self._buffer = text[1:]
            return True
        progress = self._array.read(final)
        if progress is None:
            self._closed = True
            return True
        return progress


class NamedToolCallParser(ToolParser):
    keeps_truncated_calls = True

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def _read(self, final: bool) -> bool:
        if self._call is None:
            if self.calls:
                self._plain = True
                return True
            self._begin_call("", CallObject(name=self.function))
        if not self._call.done:
            return self._read_call()
        self._end_call()
        return True
