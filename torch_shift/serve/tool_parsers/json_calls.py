"""JSON read character by character as a model writes it.

`JsonValue` validates one JSON object or array as its characters arrive and records where each member of the
outermost object starts and ends, so that a tool call's name can be known, and its arguments streamed, before
the object is complete. `CallObject` is a tool call written as one JSON object (`{"name": ..., "arguments":
{...}}`), or, when its name is known already, the arguments object alone.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# number states (JSON's grammar) -> whether a number may end there
_NUMBER_ENDS = {"sign": False, "zero": True, "int": True, "frac0": False, "frac": True, "exp0": False,
                "expsign": False, "exp": True}


class MalformedCall(ValueError):
    """The text cannot be the tool call its format says it is."""


class JsonValue:
    """One JSON object (or array) read one character at a time; `push` raises MalformedCall at the first
    character that no JSON text can continue with. Whitespace before the opening bracket is skipped."""

    def __init__(self, opening: str = "{"):
        self.opening = opening
        self.chars: list[str] = []
        self.done = False
        # members of the outermost object: key -> [start, end) in `chars` (end None while the value is open)
        self.members: dict[str, list[int | None]] = {}
        self._stack: list[list[str]] = []  # [bracket, state] per open container
        self._key: str | None = None  # the outermost object's current key
        self._string: list | None = None  # [is_key, escape state, raw start] inside a string
        self._number: str | None = None  # number state inside a number
        self._literal: str | None = None  # what is left of true/false/null

    def text(self, start: int, end: int | None = None) -> str:
        return "".join(self.chars[start:end])

    def push(self, ch: str) -> None:
        pos = len(self.chars)
        self.chars.append(ch)
        if self.done:
            raise MalformedCall(f"text after the end of the JSON value: {ch!r}")
        if self._string is not None:
            return self._push_string(ch, pos)
        if self._literal is not None:
            if ch != self._literal[0]:
                raise MalformedCall(f"expected {self._literal[0]!r} in a literal, got {ch!r}")
            self._literal = self._literal[1:]
            if not self._literal:
                self._literal = None
                self._value_done(pos + 1)
            return
        if self._number is not None and self._push_number(ch):
            return  # the character continued the number; otherwise the number ended just before it
        if not self._stack:
            if ch in WHITESPACE:
                return
            if ch != self.opening:
                raise MalformedCall(f"expected {self.opening!r}, got {ch!r}")
            self._stack.append([ch, "key_or_end" if ch == "{" else "value_or_end"])
            return
        if ch in WHITESPACE:
            return
        top = self._stack[-1]
        bracket, state = top
        if bracket == "{":
            if state in ("key_or_end", "key"):
                if ch == '"':
                    self._string = [True, "", pos + 1]
                elif ch == "}" and state == "key_or_end":
                    self._close(pos)
                else:
                    raise MalformedCall(f"expected a key, got {ch!r}")
            elif state == "colon":
                if ch != ":":
                    raise MalformedCall(f"expected ':', got {ch!r}")
                top[1] = "value"
            elif state == "value":
                self._start_value(ch, pos)
            elif ch == ",":
                top[1] = "key"
            elif ch == "}":
                self._close(pos)
            else:
                raise MalformedCall(f"expected ',' or '}}', got {ch!r}")
        else:
            if state == "value_or_end" and ch == "]":
                self._close(pos)
            elif state in ("value_or_end", "value"):
                self._start_value(ch, pos)
            elif ch == ",":
                top[1] = "value"
            elif ch == "]":
                self._close(pos)
            else:
                raise MalformedCall(f"expected ',' or ']', got {ch!r}")

    def _in_outer_object(self) -> bool:
        return len(self._stack) == 1 and self._stack[0][0] == "{"

    def _start_value(self, ch: str, pos: int) -> None:
        if self._in_outer_object():
            if self._key in self.members:
                raise MalformedCall(f"the key {self._key!r} is given twice")
            self.members[self._key] = [pos, None]
        self._stack[-1][1] = "comma_or_end"
        if ch in "{[":
            self._stack.append([ch, "key_or_end" if ch == "{" else "value_or_end"])
        elif ch == '"':
            self._string = [False, "", pos]
        elif ch == "-":
            self._number = "sign"
        elif ch in _DIGITS:
            self._number = "zero" if ch == "0" else "int"
        elif ch in _LITERALS:
            self._literal = _LITERALS[ch][1:]
        else:
            raise MalformedCall(f"expected a JSON value, got {ch!r}")

    def _value_done(self, end: int) -> None:
        """A value inside the innermost open container ended at `end` (exclusive)."""
        if self._in_outer_object():
            self.members[self._key][1] = end

    def _close(self, pos: int) -> None:
        self._stack.pop()
        if not self._stack:
            self.done = True
        else:
            self._value_done(pos + 1)

    def _push_string(self, ch: str, pos: int) -> None:
        is_key, escape, start = self._string
        if escape == "":
            if ch == '"':
                self._string = None
                if is_key:
                    if self._in_outer_object():
                        self._key = json.loads(self.text(start - 1, pos + 1))
                    self._stack[-1][1] = "colon"
                else:
                    self._value_done(pos + 1)
            elif ch == "\\":
                self._string[1] = "\\"
            elif ord(ch) < 0x20:
                raise MalformedCall(f"a control character ({ord(ch):#04x}) inside a string")
        elif escape == "\\":
            if ch == "u":
                self._string[1] = "u4"
            elif ch in _ESCAPES:
                self._string[1] = ""
            else:
                raise MalformedCall(f"an invalid escape '\\{ch}' in a string")
        else:  # "uN": N hex digits still to come
            if ch not in _HEX:
                raise MalformedCall(f"an invalid \\u escape in a string: {ch!r}")
            remaining = int(escape[1:]) - 1
            self._string[1] = f"u{remaining}" if remaining else ""

    def _push_number(self, ch: str) -> bool:
        state = self._number
        following = {
            "sign": {"0": "zero", **{d: "int" for d in "123456789"}},
            "zero": {".": "frac0", "e": "exp0", "E": "exp0"},
            "int": {".": "frac0", "e": "exp0", "E": "exp0", **{d: "int" for d in _DIGITS}},
            "frac0": {d: "frac" for d in _DIGITS},
            "frac": {"e": "exp0", "E": "exp0", **{d: "frac" for d in _DIGITS}},
            "exp0": {"+": "expsign", "-": "expsign", **{d: "exp" for d in _DIGITS}},
            "expsign": {d: "exp" for d in _DIGITS},
            "exp": {d: "exp" for d in _DIGITS},
        }[state]
        if ch in following:
            self._number = following[ch]
            return True
        if not _NUMBER_ENDS[state]:
            raise MalformedCall(f"an incomplete number before {ch!r}")
        self._number = None
        self._value_done(len(self.chars) - 1)
        return False


class CallObject:
    """One tool call as a JSON object with its name under "name" and its arguments (an object) under one of
    `argument_keys` (required: a JSON object with a "name" and no arguments is not a call, as in vLLM); other keys
    are ignored. With `name` given, the whole object is the arguments.

    `committed` once the name is known and the arguments have begun: from then on the call can be announced and
    its arguments streamed as they arrive. With `lenient_arguments` (Mistral's format before v11, as vLLM's mistral
    parser reads it), the arguments may also be a JSON string holding an object's JSON text (its models write them
    so at times; vLLM takes the text), committed once the string is whole, or null, or absent from a call of its name
    alone, for none ("{}")."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments",), name: str | None = None,
                 lenient_arguments: bool = False):
        self.json = JsonValue("{")
        self.argument_keys = argument_keys
        self.name = name
        self.lenient_arguments = lenient_arguments
        self._whole_is_arguments = name is not None
        self._arguments_start: int | None = 0 if name is not None else None
        self._checked: set[str] = set()
        self._decoded: str | None = None  # encoded arguments' text, once their string ended

    @property
    def done(self) -> bool:
        return self.json.done

    @property
    def committed(self) -> bool:
        if self._decoded is not None:
            return self.name is not None
        # (a named call's arguments begin with their first character: an empty output announces nothing; a
        # string's or a null's once they are whole: _decoded)
        return (self.name is not None and self._arguments_start is not None and bool(self.json.chars)
                and self.json.chars[self._arguments_start] not in '"n')

    def push(self, ch: str) -> None:
        if self._whole_is_arguments and not self.json.chars and ch in WHITESPACE:
            return  # leading whitespace is not part of the arguments
        try:
            self.json.push(ch)
        except MalformedCall:
            # the character no JSON continues with is the failed call's content, not its arguments' last one (it
            # was streamed twice, as both)
            self.json.chars.pop()
            raise
        if self._whole_is_arguments:
            return
        members = self.json.members
        if "name" in members:
            start, end = members["name"]
            if "name" not in self._checked:
                self._checked.add("name")
                if self.json.chars[start] != '"':
                    raise MalformedCall("the call's name is not a string")
            if end is not None and self.name is None:
                self.name = json.loads(self.json.text(start, end))
                if not self.name:
                    raise MalformedCall("the call's name is empty")
        for key in self.argument_keys:
            if key in members and key not in self._checked:
                self._checked.add(key)
                if self._arguments_start is not None:
                    raise MalformedCall(f"the call's arguments are given twice ({' and '.join(self.argument_keys)})")
                first = self.json.chars[members[key][0]]
                if first != "{" and not (first in '"n' and self.lenient_arguments):
                    raise MalformedCall(f"the call's {key!r} is not a JSON object")
                self._arguments_start = members[key][0]
        if (self._arguments_start is not None and self._decoded is None
                and self.json.chars[self._arguments_start] in '"n' and members[self._argument_key()][1] is not None):
            value = json.loads(self.json.text(self._arguments_start, members[self._argument_key()][1]))
            if value is None:
                self._decoded = "{}"
            else:
                try:
                    if not isinstance(json.loads(value), dict):
                        raise ValueError
                except ValueError:
                    raise MalformedCall("the call's arguments are a string that holds no JSON object") from None
                self._decoded = value
        if self.json.done and self.name is None:
            raise MalformedCall("the call has no name")
        if self.json.done and self._arguments_start is None:  # as vLLM's parsers: a call names its arguments
            # (leniently, a call of its name alone: none; one with other keys may have meant them as its arguments)
            if not self.lenient_arguments or set(members) != {"name"}:
                raise MalformedCall(f"the call has no {' or '.join(map(repr, self.argument_keys))}")
            self._decoded = "{}"

    def arguments(self, offset: int = 0) -> str:
        """The arguments' JSON text so far (all of it once `done`), after its first `offset` characters (a stream's
        next piece, without joining what it sent before: that made a long argument's stream quadratic)."""
        if self._decoded is not None:
            return self._decoded[offset:]
        if self._arguments_start is None:
            return ""
        if self._whole_is_arguments:
            return self.json.text(offset)
        end = self.json.members[self._argument_key()][1]
        return self.json.text(self._arguments_start + offset, end)

    def _argument_key(self) -> str:
        return next(k for k in self.argument_keys if k in self.json.members)
