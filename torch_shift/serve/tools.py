"""OpenAI `tools` and `tool_choice` in chat completions: the tools checked (each a function with a name and a JSON
Schema of its parameters), rendered by the checkpoint's chat template (transformers' `tools=` argument), and the
output read as the `tool_choice` says:

- "none": the tools are in the prompt, the output is plain content;
- "auto" (the default with tools): the output is parsed by the server's tool-call parser (`--tool-call-parser`);
- "required" and a named function: decoding is constrained to a JSON schema, as vLLM does it, so that the call
  matches the function's parameters whatever the model: for "required" an array of one call or more
  (`[{"name": ..., "parameters": {...}}]`), for a named function its arguments object.

Every problem is a ParameterError naming the request field (`tools[1].function.parameters`, `tool_choice`), which
the server answers with a 400. Nothing here imports FastAPI: `LLM.chat(messages, tools=...)` uses it too.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch_shift.engine.errors import ParameterError
from torch_shift.engine.structured_output import StructuredOutputsParams

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_SCHEMA_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
_SCHEMA_NUMBERS = ("minimum", "maximum", "multipleOf")
_SCHEMA_STRINGS = ("pattern", "format", "$ref", "$id", "$schema", "$anchor", "title", "description")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def check_json_schema(schema: Any, where: str) -> None:
    """Raise ValueError (naming the place, e.g. `tools[0].function.parameters.properties.city.type`) where `schema`
    is not a JSON Schema: the standard keywords must have their types; unknown keywords are allowed, as JSON
    Schema allows them."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: a JSON Schema is an object or a boolean, got {json.dumps(schema)[:80]}")
    if "type" in schema:
        kinds = schema["type"]
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"{where}.type: a type name or a list of them, got {json.dumps(schema['type'])[:80]}")
        unknown = [k for k in kinds if k not in _SCHEMA_TYPES]
        if unknown:
            raise ValueError(f"{where}.type: {unknown[0]!r} is not a JSON Schema type (one of "
                             f"{', '.join(sorted(_SCHEMA_TYPES))})")
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], Mapping):
                raise ValueError(f"{where}.{key}: an object of schemas, got {json.dumps(schema[key])[:80]}")
            for name, sub in schema[key].items():
                check_json_schema(sub, f"{where}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or (key != "prefixItems" and not schema[key]):
                raise ValueError(f"{where}.{key}: a non-empty list of schemas, got {json.dumps(schema[key])[:80]}")
            for i, sub in enumerate(schema[key]):
                check_json_schema(sub, f"{where}.{key}[{i}]")
    for key in _SCHEMA_ONE:
        if key in schema:
            check_json_schema(schema[key], f"{where}.{key}")
    if "items" in schema:  # a schema, or (drafts 4 to 7) a list of them
        items = schema["items"]
        for i, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            check_json_schema(sub, f"{where}.items" + ("" if i is None else f"[{i}]"))
    for key in _SCHEMA_COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{where}.{key}: a non-negative integer, got {json.dumps(value)}")
    for key in _SCHEMA_NUMBERS + ("exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in schema and not (numeric or (isinstance(value, bool) and key.startswith("exclusive"))):
            raise ValueError(f"{where}.{key}: a number, got {json.dumps(value)}")
    for key in _SCHEMA_STRINGS:
        if key in schema and not isinstance(schema[key], str):
            raise ValueError(f"{where}.{key}: a string, got {json.dumps(schema[key])[:80]}")
    if "required" in schema:
        required = schema["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"{where}.required: a list of property names, got {json.dumps(required)[:80]}")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}.enum: a list of values, got {json.dumps(schema['enum'])[:80]}")
    if "uniqueItems" in schema and not isinstance(schema["uniqueItems"], bool):
        raise ValueError(f"{where}.uniqueItems: true or false, got {json.dumps(schema['uniqueItems'])}")


def _function(tool: Any, index: int) -> Mapping:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                          Mapping):
        raise ParameterError(where, f"{where}: a tool is {{'type': 'function', 'function': {{'name': ..., "
                                    "'parameters': {...}}}")
    return tool["function"]


def check_tools(tools: Sequence[Any]) -> dict[str, Mapping]:
    """The functions of OpenAI-style `tools` by name; ParameterError for a malformed tool, a name OpenAI would
    refuse, a name given twice, or parameters that are not a JSON Schema of an object."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ParameterError("tools", f"tools: a list of tools, got {type(tools).__name__}")
    functions: dict[str, Mapping] = {}
    first_index: dict[str, int] = {}
    for i, tool in enumerate(tools):
        function = _function(tool, i)
        name = function.get("name")
        where = f"tools[{i}].function.name"
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise ParameterError(where, f"{where}: a function name is 1 to 64 letters, digits, '_' or '-', got "
                                        f"{json.dumps(name)}")
        if name in functions:
            raise ParameterError("tools", f"tools: the function name {name!r} is given twice (tools[{first_index[name]}]"
                                          f" and tools[{i}]); names must be unique")
        parameters = function.get("parameters")
        where = f"tools[{i}].function.parameters"
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise ParameterError(where, f"{where}: a JSON Schema object, got {json.dumps(parameters)[:80]}")
            if parameters.get("type", "object") != "object":
                raise ParameterError(where, f"{where}: the parameters of a function are a JSON Schema of type "
                                            f"'object', got type {json.dumps(parameters.get('type'))}")
            try:
                check_json_schema(parameters, where)
            except ValueError as e:
                raise ParameterError(where, f"{e} (not a JSON Schema)") from None
        functions[name] = function
        first_index[name] = i
    return functions


@dataclass(frozen=True)
class ToolChoice:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask of the output."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None = None  # for the chat template
    function: str | None = None  # the named function
    schema: dict | None = None  # the JSON schema the output is constrained to ("required", "named")
    parallel: bool = True  # several calls may be made
    grammar: str | None = None  # under "auto" with strict functions: the calls held to their schemas

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.grammar is not None:
            return StructuredOutputsParams(grammar=self.grammar)
        return StructuredOutputsParams(json=self.schema) if self.schema is not None else None


def tool_choice(tools: Sequence[Any] | None, choice: str | Mapping | None, parallel_tool_calls: bool | None,
                auto_parser: str | None) -> ToolChoice:
    """Check a request's tools and tool_choice. `auto_parser`: the server's tool-call parser when it was started
    with --enable-auto-tool-choice (None: "auto" cannot be honoured)."""
    parallel = parallel_tool_calls is not False
    if tools is not None and not isinstance(tools, (str, bytes, Mapping)) and len(tools) == 0:
        raise ParameterError("tools", "tools: an empty list; give at least one tool or leave the field out (as OpenAI "
                                      "and vLLM)")
    if not tools:
        if choice in (None, "none"):  # nothing to call: the output is plain content
            return ToolChoice("none", parallel=parallel)
        raise ParameterError("tool_choice", f"tool_choice {json.dumps(choice)[:80]} needs `tools`, and the request "
                                            "gives none")
    functions = check_tools(tools)
    rendered = [copy.deepcopy(dict(tool)) for tool in tools]
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolChoice("none", rendered, parallel=parallel)
    if choice == "auto":
        if auto_parser is None:
            raise ParameterError("tool_choice", 'tool_choice: "auto" (the default when tools are given) needs the '
                                                "server started with --enable-auto-tool-choice and --tool-call-parser;"
                                                ' this one has no tool-call parser (use "required", a named function,'
                                                ' or "none")')
        return ToolChoice("auto", rendered, parallel=parallel, grammar=_strict_calls_grammar(functions, auto_parser))
    if choice == "required":
        return ToolChoice("required", rendered, schema=_required_schema(functions, parallel), parallel=parallel)
    if isinstance(choice, Mapping):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise ParameterError("tool_choice", "tool_choice: 'none', 'auto', 'required' or {'type': 'function', "
                                                "'function': {'name': ...}}")
        if name not in functions:
            raise ParameterError("tool_choice", f"tool_choice: the function {name!r} is not among the tools "
                                                f"({', '.join(functions)})")
        parameters = functions[name].get("parameters") or _EMPTY_PARAMETERS
        return ToolChoice("named", rendered, function=name, schema=dict(parameters), parallel=parallel)
    raise ParameterError("tool_choice", f"tool_choice: 'none', 'auto', 'required' or a named function, got "
                                        f"{json.dumps(choice)[:80]}")


def _strict_calls_grammar(functions: Mapping[str, Mapping], auto_parser: str) -> str | None:
    """Under "auto", where a function is `strict`: a grammar of free text in which every call the model opens is
    held to its function's parameters (llguidance's structural tags, as vLLM enforces strict tools), in the
    server's call format; None where no function is strict. A format without structural tags (mistral) cannot
    enforce it: ParameterError naming the field."""
    strict = [name for name, function in functions.items() if function.get("strict")]
    if not strict:
        return None
    from torch_shift.serve.tool_parsers import TOOL_PARSERS

    parser = TOOL_PARSERS[auto_parser]
    parameters = {name: dict(function.get("parameters") or _EMPTY_PARAMETERS) for name, function in functions.items()}
    # every function is a tag (a call to one without one would be refused); only the strict ones' schemas hold
    grammar = parser.calls_grammar({name: schema if name in strict else {"type": "object"}
                                    for name, schema in parameters.items()})
    if grammar is None:
        where = f"tools[{list(functions).index(strict[0])}].function.strict"
        enforcing = [name for name, p in TOOL_PARSERS.items() if p.call_tags({"f": _EMPTY_PARAMETERS}) is not None]
        raise ParameterError(where, f"{where}: strict calls under tool_choice 'auto' are enforced in the "
                                    f"{' and '.join(enforcing)} formats, and this server parses {auto_parser} (send "
                                    "strict: false, or tool_choice 'required' or a named function, which always "
                                    "hold a call to its schema)")
    return grammar


def _required_schema(functions: Mapping[str, Mapping], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": an array of calls, each a function's name and parameters; the
    functions' `$defs` (and `definitions`) move to the root, where their `$ref`s point."""
    hoisted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    calls = []
    for name, function in functions.items():
        parameters = copy.deepcopy(dict(function.get("parameters") or _EMPTY_PARAMETERS))
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                if hoisted[key].get(def_name, definition) != definition:
                    raise ParameterError("tools", f"tools: two functions define {key}.{def_name} differently; "
                                                  f"tool_choice 'required' needs one definition per name")
                hoisted[key][def_name] = definition
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: value for key, value in hoisted.items() if value})
    return schema


def null_content_error(role: Any, content: Any, tool_calls: Any) -> str | None:
    """OpenAI's rule, for the server's messages and `LLM.chat`'s alike: only an assistant turn that carries
    tool calls may leave its content null. What is wrong, or None."""
    if content is None and not (role == "assistant" and tool_calls):
        return (f"a message of role {role!r} needs content (a string or a list of text parts); only an assistant "
                "message with tool_calls may have content null")
    return None


# names a chat template call takes itself (Tokenizer.apply_chat_template's and the request's own fields): never
# template variables from chat_template_kwargs
TEMPLATE_CALL_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "tokenize", "return_dict", "self", "chat_template"})


def template_messages(messages: Sequence[Mapping[str, Any]], content_parts: bool = False) -> list[dict[str, Any]]:
    """Messages as chat templates read them: content given as OpenAI's text parts joined with newlines, or as the
    parts where the template walks them (`content_parts`, `Tokenizer.reads_content_parts`: vLLM's content formats
    "string" and "openai"), the arguments of earlier tool calls as objects, not JSON text (as transformers'
    templates expect, and vLLM passes them); ParameterError for a role that is not a name, parts other than text,
    or arguments that are not JSON (a role the template does not know is the template's error, as in vLLM)."""
    prepared = []
    for i, message in enumerate(messages):
        message = dict(message)
        if not isinstance(message.get("role"), str) or not message.get("role"):
            raise ParameterError(f"messages[{i}].role", f"messages[{i}].role: a role name (OpenAI's, or one the chat "
                                                        f"template knows), got {message.get('role')!r}")
        calls = message.get("tool_calls")
        error = null_content_error(message.get("role"), message.get("content"), calls)
        if error is not None:
            raise ParameterError(f"messages[{i}].content", f"messages[{i}]: {error}")
        if isinstance(message.get("content"), list):
            text = _text_of_parts(message["content"], f"messages[{i}].content")
            message["content"] = [{"type": "text", "text": part["text"]} for part in message["content"]] \
                if content_parts else text
        if calls is not None and not isinstance(calls, (list, tuple)):
            raise ParameterError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: a list of calls, got "
                                                              f"{type(calls).__name__}")
        if calls:
            message["content"] = message.get("content") or ""  # null beside tool calls: no text
            message["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(calls)]
        prepared.append(message)
    return prepared


def _text_of_parts(parts: list, where: str) -> str:
    for j, part in enumerate(parts):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ParameterError(where, f"{where}[{j}]: this model reads text only, parts of the form "
                                        f"{{'type': 'text', 'text': ...}}; got {str(part)[:60]!r}")
    return "\n".join(part["text"] for part in parts)


def _template_tool_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    call = copy.deepcopy(dict(call)) if isinstance(call, Mapping) else {}
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ParameterError(where, f"{where}: a tool call is {{'id': ..., 'type': 'function', 'function': "
                                    "{'name': ..., 'arguments': ...}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ParameterError(f"{where}.function.arguments", f"{where}.function.arguments: not JSON ({e})") from None
    function["arguments"] = {} if arguments is None else arguments
    return call
