"""Mistral calls (`--tool-call-parser mistral`): Mistral 7B v0.3, Mistral Small / Large, Ministral.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (tokenizers before v11)
    [TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}        (the same call without its array)
    [TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]  (arguments encoded as a string)
    [TOOL_CALLS]get_weather{"city": "Paris"}                                  (v11 and later)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                            (v13 and later)

`[TOOL_CALLS]` is a special token, so the server keeps special tokens in the text it parses. Text before it is
content. Call ids are 9 letters and digits, as Mistral's chat templates require.
"""

from __future__ import annotations

import secrets
import string

from torch_shift.serve.tool_parsers.base import CallArrayReader, ToolParser
from torch_shift.serve.tool_parsers.json_calls import WHITESPACE, CallObject

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "_-.")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._state = "content"  # content | open (after the marker) | array | name | args
        self._array: CallArrayReader | None = None
        self._function = ""  # the v11 call's name so far
        self._raw = ""  # read since the marker

    @staticmethod
    def make_call_id() -> str:  # Mistral's templates refuse other ids than 9 letters and digits
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    def _read(self, final: bool) -> bool:
        if self._call is not None:
            if not self._call.done:
                return self._read_call()
            self._end_call()
            if self._array is not None:
                self._array.call_ended()
            return True
        state = self._state
        if state == "content":
            if not self._read_content_until(MARKER, final):
                return False
            self._state, self._raw, self._held_whitespace = "open", self._held_whitespace + MARKER, ""
            return True
        if state == "open":
            text = self._buffer.lstrip(WHITESPACE)
            self._raw += self._buffer[:len(self._buffer) - len(text)]
            self._buffer = text
            if not text:
                if final:
                    self._fail(self._raw)
                return False
            if text[0] == "[":
                self._buffer, self._raw = text[1:], self._raw + "["
                self._state, self._array = "array", CallArrayReader(self, ("arguments",), lenient_arguments=True)
                self._array.raw = self._raw
            elif text[0] in _NAME_CHARACTERS:
                self._state, self._function = "name", ""
            elif text[0] == "{":  # one call without its array: a call, as vLLM reads it
                self._buffer = text
                self._begin_call(self._raw, CallObject(("arguments",), lenient_arguments=True))
                self._state = "content"
            else:
                self._fail(self._raw)
            return True
        if state == "array":
            progress = self._array.read(final)
            if progress is None:
                self._state, self._array = "content", None
                self._text_since_call = False
                return True
            return progress
        if state == "name":
            length = 0
            while length < len(self._buffer) and self._buffer[length] in _NAME_CHARACTERS:
                length += 1
            self._function += self._buffer[:length]
            self._raw += self._buffer[:length]
            self._buffer = self._buffer[length:]
            if not self._buffer:
                if final:
                    self._fail(self._raw)
                return False
            if self._buffer.startswith(ARGS):
                self._buffer, self._raw, self._state = self._buffer[len(ARGS):], self._raw + ARGS, "args"
                return True
            if self._buffer[0] == "[" and ARGS.startswith(self._buffer) and not final:
                return False
            self._state = "args"
            return True
        # args: the arguments object of a v11 call
        text = self._buffer.lstrip(WHITESPACE)
        if not text:
            if final:
                self._fail(self._raw)
            return False
        if text[0] != "{":
            self._fail(self._raw)
            return True
        self._buffer = text
        self._begin_call(self._raw, CallObject(name=self._function))
        self._state = "content"
        return True
