"""OpenAI request bodies (pydantic), with vLLM's common extensions, and their SamplingParams.

Every model forbids fields it does not know: a field the server cannot honour is a 400 that names it,
never a 200 that ignores it. Numbers are strict (no strings, no booleans) except that an integral float
such as 2.0 is taken for an integer field, as vLLM does; floats must be finite.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from torch_shift.engine.errors import ParameterError
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.engine.structured_output import StructuredOutputsParams
from torch_shift.serve.tools import TEMPLATE_CALL_ARGUMENTS, null_content_error
from torch_shift.tokenizer import lone_surrogate_error

_MAX_SEED = 2**63 - 1  # torch.Generator takes a 64-bit seed; vLLM bounds it to int64 as well


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
# OpenAI's `n` where a client writes out its unset fields as null (vLLM's default too)
N = Annotated[int, BeforeValidator(lambda value: 1 if value is None else _integral(value))]


def _check_text(value: Any) -> None:
    """Refuse lone surrogates (JSON allows "\\ud800"; no tokenizer can encode it, and a chat template renders any
    field into the prompt) in every string of `value`, keys included, naming the field (`messages[1].name`). An
    explicit stack, not recursion: a body nested as deep as the JSON parser allows is walked without a
    RecursionError."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                _check_string(key, path, is_key=True)
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
        else:
            _check_string(item, path)


def _check_string(value: Any, path: tuple, is_key: bool = False) -> None:
    if not isinstance(value, str) or lone_surrogate_error(value, "") is None:
        return
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).removeprefix(".") or None
    raise ParameterError(where, lone_surrogate_error(value, f"a key of {where or 'the body'}" if is_key
                                                     else where or "the text"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Body(_Strict):
    """A request's whole body: every string in it valid Unicode, whichever field holds it."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):  # anything else is refused as not an object
            _check_text(data)
        return data


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk (guidellm asks for it)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1)  # required by OpenAI and vLLM
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # an object (llguidance refuses true/false)
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only read with type 'json_schema', not {self.type!r}")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=json.dumps(self.json_schema.schema_))
        return None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # (`json` is a BaseModel method)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # refused by name (StructuredOutputsParams)

    def params(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude_none=True, by_alias=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        return StructuredOutputsParams(**fields)


class _SamplingRequest(_Body):
    model: str | None = None
    n: N = Field(default=1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=0, le=_MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # None: the model's default (generation_config.json), else vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's: json, json_object, regex, choice, grammar
    # accepted and without effect on the output: an end-user id and tags for OpenAI's stored completions
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM extensions
    priority: Int = 0  # lower is more urgent; needs scheduling_policy "priority" or a policy that uses it
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("store")
    @classmethod
    def _no_storage(cls, value):
        if value:
            raise ValueError("torch_shift does not store completions; send store=false or leave it out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):  # int() reads other scripts' digits too
                raise ValueError(f"keys are token ids (non-negative integers written as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} is {bias}; biases must be in [-100, 100]")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):  # a field's check: its error names it
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be given with stream=true")
        return value

    @property
    def grammar_field(self) -> str:
        """The request field a constrained output comes from (what its errors name), a forced tool call aside."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`structured_outputs`: what a forced tool call constrains the output to (instead of response_format);
        `defaults`: the model's sampling defaults (LLMEngine.default_sampling_fields) for the fields the request
        leaves out, over vLLM's."""
        defaults = defaults or {}

        def default(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        if self.response_format is not None:
            if structured_outputs is not None and self.response_format.type != "text":
                raise ParameterError("response_format", "response_format: the output of tool_choice 'required' or "
                                                        "a named function is the call; it cannot also follow "
                                                        "response_format")
            structured_outputs = structured_outputs or self.response_format.structured_outputs()
        if self.structured_outputs is not None:
            if structured_outputs is not None:
                raise ParameterError("structured_outputs", "structured_outputs: the output already follows "
                                                           "response_format or a forced tool call; give one")
            structured_outputs = self.structured_outputs.params()

        return SamplingParams(
            n=self.n, temperature=default("temperature", 1.0), top_p=default("top_p", 1.0),
            top_k=default("top_k", 0), min_p=default("min_p", 0.0),
            presence_penalty=default("presence_penalty", 0.0), frequency_penalty=default("frequency_penalty", 0.0),
            repetition_penalty=default("repetition_penalty", 1.0), seed=self.seed,
            max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_outputs=structured_outputs,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    # at most the engine's max_logprobs (vLLM's); -1 the whole vocabulary's, where max_logprobs is -1
    logprobs: Int | None = Field(default=None, ge=-1)
    echo: bool | None = False
    best_of: Int | None = None
    suffix: str | None = None
    prompt_logprobs: Int | None = None  # vLLM's: the prompt's logprobs in the choice (-1: the whole vocabulary's)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_as_vllm(cls, value, info: ValidationInfo):  # vLLM's rules
        if value is not None and value < -1:
            raise ValueError("prompt_logprobs must be >= 0, or -1 for the whole vocabulary")
        if value is not None and value != 0 and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream=true")
        return value

    @field_validator("prompt")
    @classmethod
    def _a_text_prompt_has_text(cls, value):  # vLLM's rule and words; "" in a list of prompts is a prompt of a bos
        if value == "":
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:  # vLLM refuses it too: inserting text needs a fill-in-the-middle model and template
            raise ValueError("suffix (insertion) is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):  # a field's check, so that the error names it
        n = info.data.get("n", 1)
        if value is not None and value < n:  # OpenAI's rule
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        if value is not None and value != n:
            raise ValueError(f"best_of={value} is not supported: torch_shift returns all n samples (best_of must "
                             "equal n)")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class ToolCallFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI sends JSON text; templates read an object


class MessageToolCall(_Strict):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: Int | None = None  # what a client that assembled the call from a stream may leave in it


class ChatMessage(_Strict):
    # OpenAI's roles, or another the chat template knows (vLLM's custom roles: Llama 3.1's "ipython")
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # earlier turns of a conversation with tools, rendered by the chat template
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier turn's reasoning, as this server sent it (templates of reasoning models may read it)
    reasoning_content: str | None = None
    reasoning: str | None = None
    # the rest of OpenAI's assistant message, as its client sends a reply back (`message.model_dump()`): a refusal
    # is the turn's text where content is null; annotations (citations of the reply) are not rendered, as OpenAI's
    # own; audio and the deprecated function_call only as null
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("audio", "function_call")
    @classmethod
    def _only_null(cls, value, info: ValidationInfo):
        if value is not None:
            raise ValueError({
                "audio": "an earlier turn's audio is not supported: this model reads text (send null)",
                "function_call": "function_call (deprecated by OpenAI) is not supported: send the call in tool_calls",
            }[info.field_name])
        return value

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        if value == []:  # OpenAI refuses it too
            raise ValueError("an empty list of content parts: send text, or parts of type 'text'")
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text "
                                     "only (parts of type 'text')")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError("a text content part is {'type': 'text', 'text': str}")
        return value

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"a refusal belongs to an assistant message, not to role {self.role!r}")
        if self.content is None and self.refusal is not None:
            self.content = self.refusal
        error = null_content_error(self.role, self.content, self.tool_calls)
        if error is not None:
            raise ValueError(error)
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to role {self.role!r}")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ: give one (two names of the same field)")
        return self

    def template_message(self) -> dict[str, Any]:
        message = {"role": self.role, "content": self.content or ""}  # text parts: joined by template_messages
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # templates read either name (Qwen3's reads reasoning_content)
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        return message


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type "object"
    # the call held to `parameters`: always under tool_choice "required" or a named function; under "auto" with
    # the hermes and llama3_json parsers (structural tags), as vLLM; refused with a parser that cannot
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# OpenAI's chat fields that torch_shift cannot honour: a client that writes out its unset fields sends them as null,
# which asks for nothing; any other value is refused as an unknown field
_UNSUPPORTED_WHEN_SET = ("functions", "function_call", "modalities", "prediction", "service_tier", "audio",
                         "web_search_options", "verbosity")
# and the values of them that ask for what the server does anyway: text out, the one tier it has
_ASKING_NOTHING = {"modalities": (["text"],), "service_tier": ("auto", "default")}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(default=None, ge=-1)  # as CompletionRequest.logprobs
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, given to the chat template as `reasoning_effort` (GPT-OSS's template reads it), as vLLM does
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} for Qwen3
    include_reasoning: bool = True  # with a reasoning parser: send reasoning (and reasoning_content)
    continue_final_message: bool = False  # the output continues the last (assistant) message
    # OpenAI's, accepted without effect on the output, as `user`: a key for its prompt cache (prefixes are cached
    # whatever the key) and an end-user id
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unset_fields(cls, data: Any) -> Any:
        def asks_nothing(name: str, value: Any) -> bool:
            return name in _UNSUPPORTED_WHEN_SET and (value is None or value in _ASKING_NOTHING.get(name, ()))

        if isinstance(data, dict) and any(asks_nothing(k, v) for k, v in data.items()):
            data = {k: v for k, v in data.items() if not asks_nothing(k, v)}
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_variables(cls, value):
        taken = sorted(set(value or {}) & TEMPLATE_CALL_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: the template call's own arguments (set by the request's fields), "
                             "not chat_template_kwargs")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @model_validator(mode="after")
    def _template_fields_agree(self):
        _continue_or_open(self.continue_final_message, self.add_generation_prompt)
        if self.reasoning_effort is not None and "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise ValueError("reasoning_effort is given twice (and in chat_template_kwargs): give it once")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables beyond the messages and tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as plain dicts, as the chat template and the tool checks read them."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def template_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


def _continue_or_open(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ParameterError("continue_final_message", "continue_final_message needs add_generation_prompt=false "
                                                       "(the first continues the last message, the second opens a "
                                                       "new one)")


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # with messages, rendered as a chat request renders them (to count a tool request's prompt)
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    _own_template_variables = field_validator("chat_template_kwargs")(
        ChatCompletionRequest._own_template_variables.__func__)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise ValueError("tools and chat_template_kwargs are rendered with messages, not with a prompt")
        if self.messages is not None:
            _continue_or_open(self.continue_final_message, self.add_generation_prompt)
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int]
