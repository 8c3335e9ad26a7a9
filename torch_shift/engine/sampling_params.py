"""SamplingParams, named and defaulted as in vLLM."""

from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch_shift.engine.errors import ParameterError
from torch_shift.engine.structured_output import StructuredOutputsParams
from torch_shift.tokenizer import lone_surrogate_error

logger = logging.getLogger(__name__)

# a model's generation_config.json fields that vLLM (--generation-config auto) takes as sampling defaults
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                             "frequency_penalty", "max_new_tokens")

# vLLM's fields (0.32's, and older ones offline code still passes) that torch_shift does not honour, at vLLM's defaults
_UNSUPPORTED_VLLM_FIELDS = {"detokenize": True, "spaces_between_special_tokens": True, "allowed_token_ids": None,
                            "bad_words": None, "logits_processors": None, "truncate_prompt_tokens": None,
                            "extra_args": None, "watermarking": None, "logprob_token_ids": None,
                            "prompt_logprob_token_ids": None, "prompt_logprob_start": None, "flat_logprobs": False,
                            "stream_interval": None, "skip_reading_prefix_cache": None, "thinking_token_budget": None,
                            "repetition_detection": None, "routed_experts_prompt_start": 0,
                            "trace_decode_token_ids": None}


class RequestOutputKind(enum.IntEnum):
    """vLLM's: which outputs `LLMEngine.step` returns for a request (`LLM.generate` returns the final ones)."""

    CUMULATIVE = 0  # all of its output so far, at every step it advances
    DELTA = 1  # what each step added (not supported)
    FINAL_ONLY = 2  # its output once, when it finishes

# vLLM's _SAMPLING_EPS: a temperature below it samples greedily (only 0 once MIN_TEMPERATURE raised the rest)
GREEDY_TEMPERATURE = 1e-5
# vLLM's _MAX_TEMP: a temperature in (0, MIN_TEMPERATURE) is raised to it, where softmax(logits / T) stays finite
MIN_TEMPERATURE = 1e-2
MAX_SEED = 2**63 - 1  # an int64, as OpenAI's `seed` and torch.Generator take it


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a JSON schema
    # vLLM's fields torch_shift does not honour: accepted at vLLM's defaults only, refused by name otherwise
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    extra_args: dict | None = None
    watermarking: Any = None
    logprob_token_ids: list[int] | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    flat_logprobs: bool = False
    stream_interval: int | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_clone: bool = False  # vLLM's hint that the params need not be copied: nothing to honour here
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    output_text_buffer_length: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def check_int(name: str, value, low: int, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ParameterError(name, f"{name} must be >= {low}, got {value}")

        def check_float(name: str, value) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ParameterError(name, f"{name} must be a finite number, got {value}")
            return float(value)

        def check_range(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ParameterError(name, f"{name} must be {rule}, got {getattr(self, name)}")

        for name, default in _UNSUPPORTED_VLLM_FIELDS.items():
            if getattr(self, name) != default:
                raise ParameterError(name, f"{name}={getattr(self, name)!r} is not supported by torch_shift (a "
                                           f"field of vLLM's SamplingParams); leave it at {default!r}")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ParameterError("output_kind", f"output_kind={self.output_kind!r} is not supported by torch_shift "
                                                "(CUMULATIVE or FINAL_ONLY)")
        self.output_kind = RequestOutputKind(self.output_kind)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "skip_clone"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # vLLM's: True is 1
        self.logprobs = 1 if self.logprobs is True else self.logprobs
        self.prompt_logprobs = 1 if self.prompt_logprobs is True else self.prompt_logprobs
        check_int("n", self.n, 1)
        check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        check_int("min_tokens", self.min_tokens, 0)
        check_int("logprobs", self.logprobs, -1, allow_none=True)  # -1: every token's (vLLM's)
        check_int("prompt_logprobs", self.prompt_logprobs, -1, allow_none=True)
        check_int("top_k", self.top_k, -1)
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's: no seed
            self.seed = None
        if self.seed is not None:
            check_int("seed", self.seed, 0)
            check_range("seed", self.seed <= MAX_SEED, "an int in [0, 2**63 - 1]")
        self.temperature = check_float("temperature", self.temperature)
        self.top_p = check_float("top_p", self.top_p)
        self.min_p = check_float("min_p", self.min_p)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty)
        check_range("temperature", 0.0 <= self.temperature <= 2.0, "in [0, 2]")  # vLLM's and OpenAI's range
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's: raised, with its warning
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors; "
                           "raised to %s (vLLM's rule)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.temperature < GREEDY_TEMPERATURE and self.n > 1:  # vLLM's: n identical copies
            raise ParameterError("n", f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        check_range("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]")
        check_range("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        check_range("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]")
        check_range("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]")
        check_range("repetition_penalty", self.repetition_penalty > 0.0, "> 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                               f"({self.max_tokens})")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        for s in stop:  # no text the model writes could ever match a lone surrogate
            if (error := lone_surrogate_error(s, f"stop string {s!r}")) is not None:
                raise ParameterError("stop", error)
        self.stop, self.stop_strings = stop, tuple(stop)  # vLLM's normal form: a list, [] for None
        # characters of an unfinished output's text held back, the start of a stop string that may still be cut
        # (vLLM's field and rule)
        self.output_text_buffer_length = (max(map(len, stop)) - 1 if stop and not self.include_stop_str_in_output
                                          else 0)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
        stop_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be non-negative ints, got "
                                                   f"{self.stop_token_ids!r}")
        self.stop_token_ids = stop_ids
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                    raise ParameterError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got "
                                                       f"{token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    raise ParameterError("logit_bias", f"logit_bias[{token_id}] must be a number in [-100, 100], "
                                                       f"got {bias!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos or self.min_tokens:
                raise ParameterError("ignore_eos" if self.ignore_eos else "min_tokens",
                                     "structured outputs end at the end-of-sequence token: they cannot be combined "
                                     "with ignore_eos or min_tokens")

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """vLLM's: the fields given as None take their defaults (logit_bias keys may be strings, as JSON writes
        them, and biases are clamped to [-100, 100], as vLLM clamps them)."""
        fields = {name: value for name, value in fields.items() if value is not None}
        if isinstance(fields.get("logit_bias"), dict):
            bias = {}
            for token, value in fields["logit_bias"].items():
                try:
                    token = int(token)
                except (TypeError, ValueError):
                    raise ParameterError("logit_bias", f"logit_bias keys must be token ids, got {token!r}") from None
                clamps = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
                bias[token] = min(100.0, max(-100.0, value)) if clamps else value  # NaN and the rest refused below
            fields["logit_bias"] = bias
        return cls(**fields)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's), checked again."""
        return replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def generation_config_defaults(directory: Path | None) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json in `directory` sets (SamplingParams fields:
    `max_new_tokens` is `max_tokens`), as vLLM 0.32 reads them (with transformers 5, whose generation config has no
    defaults of its own: a top_k of 50 written there is a top_k of 50); `do_sample` is not read (vLLM's rule:
    temperature says it). {} without the file."""
    path = None if directory is None else Path(directory) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    defaults = {}
    for name in _GENERATION_CONFIG_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        defaults["max_tokens" if name == "max_new_tokens" else name] = value
    try:
        SamplingParams(**defaults)  # the model's values are valid sampling parameters
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e} (generation_config='vllm' leaves the file out)") from None
    return defaults
