"""Structured outputs (JSON schema, any JSON object) by constrained decoding with llguidance.

Each constrained sequence owns a matcher: before sampling, its bitmask of allowed next tokens masks the
logits; after sampling, the matcher consumes the chosen token. Once the grammar is complete the mask
allows only the end-of-sequence tokens. llguidance (Rust, CPU) reads our `tokenizers` tokenizer.json
directly; it is an optional dependency (the `serve` extra), imported only when a request asks for it.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from torch_shift.engine.errors import ParameterError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's name and fields, one of: `json` a JSON schema (str or dict), `json_object` for any JSON object,
    `regex` (Rust's regex syntax, as llguidance reads it, but \\d and \\w ASCII as vLLM's default backend reads
    them), `choice` (one of these strings), `grammar` (a Lark grammar in llguidance's syntax, or GBNF).

    `starts_after`: the grammar applies only once the output's tokens end with this text's tokens (a reasoning
    model's `</think>`: it reasons freely first, as vLLM's engine does with a reasoning parser); None: from the
    first token."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # also what strict tool calls under "auto" are held to
    starts_after: str | None = None
    # vLLM's options. JSON is always written compact (disable_any_whitespace=True is what it does; vLLM's False,
    # any whitespace, lets a small model fill max_tokens with spaces); whitespace_pattern: the regex JSON's
    # whitespace must match instead; disable_additional_properties: objects with properties but no
    # additionalProperties take none (vLLM's rule). structural_tag is not supported.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if self.structural_tag is not None:
            raise ParameterError("structured_outputs", "structured_outputs.structural_tag is not supported by "
                                                       "torch_shift (json, json_object, regex, choice or grammar)")
        if sum(given) != 1:
            raise ParameterError("structured_outputs", "structured outputs take exactly one of json (a schema), "
                                                       "json_object=True, regex, choice and grammar")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise TypeError(f"structured_outputs.whitespace_pattern is a regex, got {self.whitespace_pattern!r}")
        if self.whitespace_pattern == "":
            raise ParameterError("structured_outputs", "structured_outputs.whitespace_pattern is a non-empty regex, "
                                                       "got ''")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} is a string, got {value!r}")
        if self.grammar == "":
            raise ParameterError("structured_outputs", "structured_outputs.grammar is a non-empty string, got ''")
        if self.choice is not None and (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple))
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise TypeError(f"structured_outputs.choice is a non-empty list of strings, got {self.choice!r}")
        if self.choice is not None and not self.choice:
            raise ParameterError("structured_outputs", "structured_outputs.choice is a non-empty list of strings, "
                                                       "got []")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json is a JSON schema (str or dict), got {type(self.json).__name__}")
        if self.starts_after is not None and (not isinstance(self.starts_after, str) or not self.starts_after):
            raise TypeError(f"structured_outputs.starts_after is the text the grammar waits for, got "
                            f"{self.starts_after!r}")

    @property
    def schema(self) -> str:
        if self.json_object:
            return '{"type": "object"}'
        if not self.disable_additional_properties:
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        try:
            schema = json.loads(self.json) if isinstance(self.json, str) else copy.deepcopy(self.json)
        except json.JSONDecodeError as e:  # named as a schema that cannot be used where it is compiled
            raise ValueError(f"not JSON: {e}") from None
        _no_additional_properties(schema)
        return json.dumps(schema)


# the keywords whose values are a subschema or a list of them, and those whose values map names to subschemas
_SUBSCHEMA_KEYWORDS = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then", "else",
                       "allOf", "anyOf", "oneOf", "additionalProperties", "propertyNames", "unevaluatedItems",
                       "unevaluatedProperties", "contentSchema")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def _no_additional_properties(schema: Any) -> None:
    """vLLM's disable_additional_properties, in place: every object schema with properties and no
    additionalProperties gets additionalProperties false."""
    if isinstance(schema, list):
        for item in schema:
            _no_additional_properties(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(key), dict):
            for subschema in schema[key].values():
                _no_additional_properties(subschema)
    for key in _SUBSCHEMA_KEYWORDS:
        if isinstance(schema.get(key), (dict, list)):
            _no_additional_properties(schema[key])
    if "additionalProperties" not in schema and (isinstance(schema.get("properties"), dict)
                                                 or isinstance(schema.get("patternProperties"), dict)):
        schema["additionalProperties"] = False


# \d and \w: ASCII, as vLLM's default backend (xgrammar) and JSON Schema's patterns read them; llguidance reads a
# regex's \d as any Unicode digit ("4333-1۷-33" for a date)
_ASCII_SHORTHANDS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


def ascii_shorthands(regex: str) -> str:
    """`regex` with \\d, \\D, \\w and \\W written as ASCII classes, inside a class as a nested class (no range
    forms with a neighbour); one beside a class's `-` (a range's end, which Rust's syntax refuses) is left for
    llguidance to read. Every other character and escape as it was."""
    out: list[str] = []
    i, depth, n = 0, 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            ascii_class = _ASCII_SHORTHANDS.get(regex[i + 1])
            in_range = depth and (regex[i - 1:i] == "-" or regex[i + 2:i + 3] == "-" and regex[i + 3:i + 4] != "]")
            out.append(ascii_class if ascii_class is not None and not in_range else regex[i:i + 2])
            i += 2
            continue
        if c == "[":
            if depth and regex.startswith("[:", i) and (end := regex.find(":]", i + 2)) != -1:  # [:alpha:]
                out.append(regex[i:end + 2])
                i = end + 2
                continue
            depth += 1
            out.append(c)
            i += 1
            for literal in ("^", "]"):  # a class's negation, and a ] first in it: a literal
                if regex[i:i + 1] == literal:
                    out.append(literal)
                    i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (and refusals), the least recently used dropped first


class GrammarCompiler:
    """Builds matchers for one tokenizer (llguidance's tokenizer view is built once). A grammar is compiled once
    and kept (as vLLM's backends keep theirs): each sequence that follows it gets a copy of its matcher, 0.1 ms
    where compiling a schema of a 40,000-value enum took 0.14 s (and a request of n such samples compiled it n
    times on the engine's thread: a helper's probe, other clients waiting 40 s). Thread-safe: the server compiles
    on its own threads before the engine's step takes the copies."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int]):
        try:
            import llguidance
        except ImportError:
            raise ParameterError("structured_outputs", "structured outputs (response_format json_object / "
                                 "json_schema) need llguidance: pip install 'torch_shift[serve]'") from None
        if not eos_token_ids:
            raise ParameterError("structured_outputs",
                                 "structured outputs need an end-of-sequence token; this model has none")
        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=sorted(eos_token_ids))
        # errors name the failure only: the parser's state and the whole grammar would go to the client
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()  # grammar's key -> its fresh matcher, or refusal
        self._lock = threading.Lock()

    def prototype(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar's matcher (ParameterError where it cannot be used), kept to be copied: each sequence
        that follows it gets `prototype(params).deep_copy()`, never the prototype itself."""
        try:
            key = _grammar_key(params)
        except ValueError as e:  # a schema that is not JSON (disable_additional_properties reads it)
            raise ParameterError("structured_outputs", f"the JSON schema cannot be used: {e}") from None
        except RecursionError:
            raise ParameterError("structured_outputs", "the JSON schema cannot be used: it nests too deeply") from None
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            try:
                compiled = self._compile(params)
            except ParameterError as e:  # a client that sends it again is refused without compiling it again
                compiled = e
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, ParameterError):
            raise ParameterError(compiled.param, str(compiled)) from None
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        LLMatcher = self._llguidance.LLMatcher
        what = ("the grammar" if params.grammar is not None or params.choice is not None else "the regex"
                if params.regex is not None else "the JSON schema")
        try:
            if params.grammar is not None:
                grammar = self._lark_or_gbnf(params.grammar)
            elif params.regex is not None:
                grammar = LLMatcher.grammar_from_regex(ascii_shorthands(params.regex))
            elif params.choice is not None:
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
            else:  # compact separators, no free whitespace: a small model would otherwise fill max_tokens with spaces
                options = {"whitespace_flexible": False}
                if params.whitespace_pattern is not None:
                    options["whitespace_pattern"] = params.whitespace_pattern
                grammar = LLMatcher.grammar_from_json_schema(params.schema, defaults=options)
        except Exception as e:  # noqa: BLE001 - llguidance raises plain ValueError/RuntimeError on a bad schema
            raise ParameterError("structured_outputs", f"{what} cannot be used: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self._tokenizer, limits=self._limits)
        if error:
            raise ParameterError("structured_outputs", f"{what} cannot be used: {error}")
        matcher = LLMatcher(self._tokenizer, grammar, limits=self._limits)
        if matcher.is_error():
            raise ParameterError("structured_outputs", f"{what} cannot be used: {matcher.get_error()}")
        return matcher

    def _lark_or_gbnf(self, text: str) -> str:
        """A Lark grammar (llguidance's syntax), or else a GBNF/EBNF one (llama.cpp's `root ::= ...`, which vLLM
        takes too), converted to Lark by llguidance; the Lark parser's error where neither reads it."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        LLMatcher = self._llguidance.LLMatcher
        grammar = LLMatcher.grammar_from_lark(text)
        if "::=" in text and LLMatcher.validate_grammar(grammar, self._tokenizer, limits=self._limits):
            try:
                return LLMatcher.grammar_from_lark(gbnf_to_lark(text))
            except Exception:  # noqa: BLE001 - not GBNF either: the Lark parser's error is the one to show
                pass
        return grammar


def _grammar_key(params: StructuredOutputsParams) -> tuple:
    """What a grammar is compiled from: equal keys, one compiled grammar."""
    if params.grammar is not None:
        return ("grammar", params.grammar)
    if params.regex is not None:
        return ("regex", params.regex)
    if params.choice is not None:
        return ("choice", tuple(params.choice))
    return ("json", params.schema, params.whitespace_pattern)


class WaitingGrammar:
    """A matcher that applies once the output ends with `marker` (token ids of `starts_after`)."""

    def __init__(self, matcher: Any, marker: list[int]):
        assert marker
        self.matcher = matcher
        self.marker = marker

    def starts_after(self, output_token_ids: list[int], token_id: int) -> bool:
        """Whether `token_id`, drawn after `output_token_ids`, ends the marker."""
        marker = self.marker
        if token_id != marker[-1]:
            return False
        before = len(marker) - 1
        return before == 0 or output_token_ids[-before:] == marker[:-1]


def start_waiting_grammars(requests: list, token_ids: list[int]) -> None:
    """After a draw of `token_ids` (one per request, not yet appended): a request whose output now ends with its
    waiting grammar's marker is constrained from its next token on."""
    for request, token_id in zip(requests, token_ids):
        waiting = request.waiting_grammar
        if waiting is not None and waiting.starts_after(request.output_token_ids, token_id):
            request.grammar, request.waiting_grammar = waiting.matcher, None


def grammar_mask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        row = bitmask[i]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1  # bit j of word w: token 32 * w + j
    return allowed.reshape(len(matchers), words * 32)[:, :vocab_size].bool()
