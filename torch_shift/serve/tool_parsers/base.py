"""What every tool-call parser shares: text in (whole, or streamed in pieces of any size), content and tool calls
out, the same either way.

A parser reads the model's text character by character. Text that may still turn out to be the start of a
format's marker is held back until it is decided. A call is announced (`ToolCallDelta` with its id and name) once
its name is known and its arguments have begun, and its arguments are then streamed as the model writes them
(the model's own JSON text). Whatever cannot be a call is content.

A malformed call (not JSON, no name, arguments that are not an object, text inside the call after its JSON) makes
the whole output content when parsed whole (`parse`), as in vLLM. While streaming, text that was not yet
announced as a call is sent as content; a call already announced cannot be taken back, so what follows its
failure is sent as content.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from torch_shift.serve.tool_parsers.json_calls import WHITESPACE, CallObject, MalformedCall


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of the call at `index`: its id and name when it is announced, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        delta: dict = {"index": self.index}
        if self.id is not None:
            delta.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            delta["function"] = {"arguments": self.arguments}
        return delta


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def random_call_id() -> str:
    """An id in OpenAI's style."""
    return f"call_{secrets.token_hex(12)}"


def held_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (text to hold back)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolParser:
    """Base of the tool-call parsers; a parser reads one output (make one per choice)."""

    name = ""  # vLLM's name of the format (--tool-call-parser)
    # True when the format's markers are special tokens, which the text only holds if they are not skipped
    needs_special_tokens = False
    # a call the output ended inside (cut by max_tokens) is kept as it is, not made content: forced calls
    keeps_truncated_calls = False

    def __init__(self) -> None:
        self.failed = False  # a call was malformed
        self.calls: list[ToolCall] = []  # announced calls, complete or not
        self._buffer = ""  # text received and not yet read
        self._out = StreamDelta()
        self._call: CallObject | None = None  # the call being read
        self._call_raw = ""  # the text read since the call began (its marker included)
        self._call_index: int | None = None  # its index once announced
        self._sent_arguments = 0  # characters of its arguments already sent
        self._plain = False  # everything from here on is content
        self._held_whitespace = ""  # whitespace next to a call: dropped unless text follows it
        self._text_since_call = False  # the content since the last call (or the start) has more than whitespace

    # -- the interface --------------------------------------------------------------------------------------
    def feed(self, text: str) -> StreamDelta:
        """Read more of the output; what can be sent now."""
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """The output ended: what was held back, decided."""
        self._run(final=True)
        if self._call is not None:
            if self._call.done or (self.keeps_truncated_calls and self._call.committed):
                self._end_call()  # complete, or cut by the length limit in a forced call once it has a name
            else:
                self._fail_call(final=True)  # the output ended inside a call
        if not self.calls:
            self._out.content += self._held_whitespace  # no call: the output as it was written
        self._held_whitespace = ""
        return self._take()

    @classmethod
    def parse(cls, text: str, **kwargs) -> ParsedOutput:
        """A whole output: its content and its calls; all of it content if a call in it is malformed."""
        return cls(**kwargs).parse_whole(text)

    def parse_whole(self, text: str) -> ParsedOutput:
        """`parse` with this (new) parser."""
        content = self.feed(text).content + self.finish().content
        if self.failed:
            return ParsedOutput(text or None, [])
        return ParsedOutput(content or None, self.calls)

    @staticmethod
    def make_call_id() -> str:
        return random_call_id()

    @classmethod
    def calls_grammar(cls, parameters: dict[str, dict]) -> str | None:
        """A grammar (llguidance's Lark) of free text in which each call, once the model opens it in this format,
        names one of the functions and has arguments valid for its `parameters` schema (structural tags, as
        vLLM holds strict tools); None for a format without them."""
        tags = cls.call_tags(parameters)
        if tags is None:
            return None
        from llguidance import StructTag

        # JSON as the templates show it to the model (json.dumps' separators), no free whitespace: a small model
        # would fill the call with spaces
        style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return StructTag.to_grammar([StructTag(trigger=trigger, begin=begin, end=end,
                                               grammar={**schema, "x-guidance": style})
                                     for trigger, begin, schema, end in tags], assume_special=False)

    @classmethod
    def call_tags(cls, parameters: dict[str, dict]) -> list[tuple[str, str, dict, str]] | None:
        """Per function: (trigger, begin, arguments schema, end) of a call as the format writes it."""
        return None

    # -- for the formats ------------------------------------------------------------------------------------
    def _read(self, final: bool) -> bool:
        """Read from the buffer; False when nothing more can be read until more text (or the end) arrives."""
        raise NotImplementedError

    def _run(self, final: bool) -> None:
        """Read while reading makes progress; at the end of the output (`final`), also with nothing left in the
        buffer, so that a format can decide what it was waiting for."""
        while self._buffer or final:
            if self._plain:
                self._content(self._buffer)
                self._buffer = ""
                return
            if not self._read(final):
                return

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _content(self, text: str) -> None:
        """Content text. Whitespace alone before, between or after calls is dropped (it is held until text or a
        call decides); an output with no call keeps all of it."""
        if not text:
            return
        if self._plain:
            text, self._held_whitespace = self._held_whitespace + text, ""
        elif not self._text_since_call:
            if not text.strip(WHITESPACE):
                self._held_whitespace += text
                return
            text, self._held_whitespace = self._held_whitespace + text, ""
            self._text_since_call = True
        self._out.content += text

    def _begin_call(self, prefix: str, call: CallObject) -> None:
        """A call begins; `prefix`: the text read since its marker (content if the call turns out malformed)."""
        # whitespace held before the call is content again if the call turns out malformed
        prefix, self._held_whitespace = self._held_whitespace + prefix, ""
        self._call, self._call_raw, self._call_index, self._sent_arguments = call, prefix, None, 0

    def _push(self, ch: str) -> bool:
        """One character of the call being read; False when it made the call malformed."""
        self._call_raw += ch
        try:
            self._call.push(ch)
        except MalformedCall:
            self._fail_call(final=False, failing=ch)
            return False
        return True

    def _read_call(self) -> bool:
        """Characters of the call being read, up to the end of its JSON; False when the buffer ran out first."""
        for i, ch in enumerate(self._buffer):
            if not self._push(ch) or self._call.done:
                self._buffer = self._buffer[i + 1:]
                if self._call is not None:
                    self._announce()
                return True
        self._buffer = ""
        self._announce()
        return False

    def _read_content_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`, which is consumed; False when the buffer ran out first (the start of a
        marker at its end held back)."""
        i = self._buffer.find(marker)
        if i >= 0:
            self._content(self._buffer[:i])
            self._buffer = self._buffer[i + len(marker):]
            return True
        keep = 0 if final else held_marker_prefix(self._buffer, marker)
        self._content(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _announce(self) -> None:
        call = self._call
        if not call.committed:
            return
        if self._call_index is None:
            self._call_index = len(self.calls)
            self.calls.append(ToolCall(self.make_call_id(), call.name, ""))
            self._out.tool_calls.append(ToolCallDelta(self._call_index, self.calls[-1].id, call.name))
        piece = call.arguments(self._sent_arguments)
        if piece:
            self._sent_arguments += len(piece)
            self.calls[self._call_index].arguments += piece
            last = self._out.tool_calls[-1] if self._out.tool_calls else None
            if last is not None and last.index == self._call_index:
                last.arguments += piece
            else:
                self._out.tool_calls.append(ToolCallDelta(self._call_index, arguments=piece))

    def _end_call(self) -> None:
        """The call is complete (its closing marker, if the format has one, was read)."""
        self._announce()
        self._call = None
        self._text_since_call = False

    def _fail_call(self, final: bool, failing: str = "") -> None:
        """The call being read is malformed (`failing`: the character that made it so, already read) or the
        output ended inside it: from here on, all is content."""
        if self._call.committed:
            self._announce()  # as it would have been had the text arrived in smaller pieces
        # a call not yet announced is content from its marker on; an announced one's text was sent as arguments
        raw = self._call_raw if self._call_index is None else failing
        self._call = None
        self._fail(raw)
        if final:
            self._out.content += self._buffer
            self._buffer = ""

    def _fail(self, raw: str) -> None:
        """Malformed: `raw` (what was read of the failed call) and all that follows are content."""
        self.failed = True
        self._plain = True
        self._out.content += raw


class CallArrayReader:
    """Calls written as a JSON array of call objects (`[{"name": ..., "arguments": {...}}, ...]`), read by a
    parser after the array's opening bracket: Mistral's format before its v11 tokenizer, and the output of
    tool_choice "required"."""

    def __init__(self, parser: ToolParser, argument_keys: tuple[str, ...], lenient_arguments: bool = False):
        self.parser = parser
        self.argument_keys = argument_keys
        self.lenient_arguments = lenient_arguments  # see CallObject
        self.expect = "element_or_end"
        self.raw = ""  # read since the marker while no call of the array was announced

    def read(self, final: bool) -> bool | None:
        """Read; None once the array closed, False when more text is needed."""
        p = self.parser
        text = p._buffer.lstrip(WHITESPACE)
        self.raw += p._buffer[:len(p._buffer) - len(text)]
        p._buffer = text
        if not text:
            if final and p.keeps_truncated_calls:
                return None  # a forced output cut by max_tokens after a complete call
            if final:
                p._fail(self.raw)  # the array never closed
            return False
        ch = text[0]
        if ch == "{" and self.expect in ("element_or_end", "element"):
            p._begin_call(self.raw, CallObject(self.argument_keys, lenient_arguments=self.lenient_arguments))
            self.expect = "comma_or_end"
            return True
        if (ch == "]" and self.expect in ("element_or_end", "comma_or_end")) or (ch == "," and
                                                                                 self.expect == "comma_or_end"):
            p._buffer = text[1:]
            if ch == "]":
                return None
            self.expect = "element"
            return True
        p._fail(self.raw)
        return True

    def call_ended(self) -> None:
        self.raw = ""
