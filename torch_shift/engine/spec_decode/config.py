"""`SpeculativeConfig`: vLLM's `speculative_config` (a dict, or its JSON on the command line), with vLLM's and
ArcticInference's option names, checked once; an option that a method cannot honour is refused by name."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
_METHOD_ALIASES = {"[ngram]": "ngram", "suffix_decoding": "suffix", "draft": "draft_model"}
_SUFFIX_OPTIONS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                   "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# options each method reads (the shared ones: method, num_speculative_tokens, disable_by_batch_size); a draft model
# reads the suffix options where `enable_suffix_decoding` puts suffix decoding beside it
_OPTIONS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": _SUFFIX_OPTIONS,
    "draft_model": ("model", "enable_suffix_decoding") + _SUFFIX_OPTIONS,
}
_SHARED = ("method", "num_speculative_tokens", "disable_by_batch_size", "goodput_budget")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # at most this many proposed tokens per request and step (the draft model's, where suffix decoding beside it
    # may propose longer suffix drafts: max_proposal_tokens)
    num_speculative_tokens: int
    # no proposals in a step that has this many running requests or more (ArcticInference's option; vLLM 0.6's
    # speculative_disable_by_batch_size): proposed tokens inflate the step, which the policies read
    disable_by_batch_size: int | None = None
    # torch_shift's: each step checks only the proposed tokens whose chance of acceptance pays for their share of
    # the step's time, both measured while serving (budget.py); False checks every proposal whole
    goodput_budget: bool = True
    prompt_lookup_min: int = 5  # n-gram: the shortest suffix of the context that is looked up earlier in it
    prompt_lookup_max: int = 5  # ... and the longest
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest pattern matched, and tree depth
    suffix_decoding_max_cached_requests: int = 10000  # finished requests' outputs kept in the global tree
    suffix_decoding_max_spec_factor: float = 1.0  # tokens proposed <= this times the length of the match
    suffix_decoding_min_token_prob: float = 0.1  # a path ends at a token whose estimated probability is below this
    model: str | None = None  # draft_model: the draft's checkpoint
    # draft_model: suffix decoding beside the draft, as ArcticInference's option of that name (paper 002): a request
    # whose suffix draft is expected to keep (its score) what the draft model's proposal is expected to keep
    # (draft.SuffixBesideDraftProposer) proposes it, up to max_suffix_tokens; the others the draft model's tokens
    enable_suffix_decoding: bool = False

    @classmethod
    def from_user(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """`value`: a dict as vLLM's `speculative_config`, its JSON text (`--speculative-config`), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e.msg} at character {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config: a dict (or its JSON), got {type(value).__name__}")
        options = {name: option for name, option in value.items() if option is not None}  # null: unset (vLLM)
        method, model = options.get("method"), options.get("model")
        if method is None:  # vLLM infers it from the model: "ngram", else a draft's checkpoint
            if model is None:
                raise ValueError(f"speculative_config: 'method' is required: one of {', '.join(METHODS)} (or "
                                 "'model': a draft's checkpoint)")
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if not isinstance(method, str):
            raise ValueError(f"speculative_config: method is a name ({', '.join(METHODS)}), got {method!r}")
        method = _METHOD_ALIASES.get(method, method)
        if method != "draft_model" and model in (method, f"[{method}]"):
            del options["model"]  # vLLM's model field names the proposer for methods without a draft
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported here; one of {', '.join(METHODS)}"
                             " (EAGLE, MTP and Medusa need heads this engine does not load)")
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                raise ValueError(f"speculative_config: unknown option {name!r}")
            if name not in _SHARED and name not in _OPTIONS[method]:
                raise ValueError(f"speculative_config: option {name!r} does not apply to method {method!r}")
        options["method"] = method
        if not isinstance(options.get("enable_suffix_decoding", False), bool):
            raise ValueError("speculative_config: enable_suffix_decoding="
                             f"{options['enable_suffix_decoding']!r} must be true or false")
        if method == "draft_model" and not options.get("enable_suffix_decoding"):
            for name in _SUFFIX_OPTIONS:
                if name in options:
                    raise ValueError(f"speculative_config: option {name!r} applies to method 'draft_model' only with "
                                     "'enable_suffix_decoding': true")
        if method == "ngram":  # vLLM: either bound gives the other (checked first, so an error names the one given)
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                bound = options.get(name)
                if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
                    raise ValueError(f"speculative_config: {name}={bound!r} must be an integer >= 1")
            lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
            if lo is None and hi is not None:
                options["prompt_lookup_min"] = hi
            if hi is None and lo is not None:
                options["prompt_lookup_max"] = lo
        if "num_speculative_tokens" not in options:
            if method != "suffix":
                raise ValueError(f"speculative_config: method {method!r} needs 'num_speculative_tokens'")
            options["num_speculative_tokens"] = options.get("suffix_decoding_max_tree_depth", 24)
        config = cls(**options)
        config._check()
        if config.suffix_beside_draft and config.max_suffix_tokens < config.num_speculative_tokens:
            # a suffix draft is taken where its score reaches k, and it scores at most its length
            raise ValueError(f"speculative_config: with enable_suffix_decoding, no suffix draft can reach "
                             f"num_speculative_tokens={config.num_speculative_tokens} tokens: at most "
                             f"{config.max_suffix_tokens} with suffix_decoding_max_tree_depth="
                             f"{config.suffix_decoding_max_tree_depth} and suffix_decoding_max_spec_factor="
                             f"{config.suffix_decoding_max_spec_factor}")
        return config

    def _check(self) -> None:
        def require(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {name}={getattr(self, name)!r} {what}")

        # the depth first: suffix decoding's num_speculative_tokens is the depth where not given
        for name in ("suffix_decoding_max_tree_depth", "num_speculative_tokens", "prompt_lookup_min",
                     "prompt_lookup_max", "suffix_decoding_max_cached_requests"):
            require(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool), name,
                    "must be an integer")
        require(self.suffix_decoding_max_tree_depth >= 2, "suffix_decoding_max_tree_depth",
                "must be >= 2 (a match of L tokens leaves depth - L to propose)")
        require(self.num_speculative_tokens >= 1, "num_speculative_tokens", "must be >= 1")
        require(isinstance(self.goodput_budget, bool), "goodput_budget", "must be true or false")
        require(isinstance(self.enable_suffix_decoding, bool), "enable_suffix_decoding", "must be true or false")
        require(self.disable_by_batch_size is None or (isinstance(self.disable_by_batch_size, int)
                                                       and not isinstance(self.disable_by_batch_size, bool)
                                                       and self.disable_by_batch_size >= 1),
                "disable_by_batch_size", "must be an integer >= 1")
        require(self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be >= 1")
        require(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
                f"must be >= prompt_lookup_min={self.prompt_lookup_min}")
        require(self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests", "must be >= 0")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            number = getattr(self, name)
            require(isinstance(number, (int, float)) and not isinstance(number, bool), name, "must be a number")
        require(math.isfinite(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor >= 0,
                "suffix_decoding_max_spec_factor", "must be a finite number >= 0")
        require(0 <= self.suffix_decoding_min_token_prob <= 1, "suffix_decoding_min_token_prob", "must be in [0, 1]")
        if self.method == "draft_model":
            require(isinstance(self.model, str) and bool(self.model), "model", "must name the draft's checkpoint")

    def check_context(self, max_model_len: int) -> None:
        """No proposal longer than the context can hold: beyond it a check's work and the per-position metrics grow
        with the option, never its tokens."""
        names = ["num_speculative_tokens"]
        if self.method == "suffix" or self.suffix_beside_draft:  # the depth first: a suffix k defaults to it
            names.insert(0, "suffix_decoding_max_tree_depth")
        for name in names:
            if getattr(self, name) >= max_model_len:
                raise ValueError(f"speculative_config: {name}={getattr(self, name)} must be below the context, "
                                 f"max_model_len={max_model_len}")

    @property
    def suffix_beside_draft(self) -> bool:
        return self.method == "draft_model" and self.enable_suffix_decoding

    @property
    def label(self) -> str:
        """What proposes: the method, or "draft_model+suffix" (stats)."""
        return "draft_model+suffix" if self.suffix_beside_draft else self.method

    @cached_property  # read by every propose call (max_proposal_tokens)
    def max_suffix_tokens(self) -> int:
        """The longest suffix draft the tree's depth and the spec factor allow (over every match length)."""
        from torch_shift.engine.spec_decode.suffix import path_limit

        depth, factor = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_spec_factor
        return max((path_limit(n, depth, depth, factor) for n in range(1, depth)), default=0)

    @property
    def max_proposal_tokens(self) -> int:
        """The most tokens a request proposes in a step: a suffix draft beside a draft model may be longer than the
        draft's."""
        if self.suffix_beside_draft:
            return max(self.num_speculative_tokens, self.max_suffix_tokens)
        return self.num_speculative_tokens

    def as_dict(self) -> dict[str, Any]:
        """The options that apply to the method, as a user would write them."""
        names = _SHARED + _OPTIONS[self.method]
        if self.method == "draft_model" and not self.enable_suffix_decoding:
            names = _SHARED + ("model",)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
