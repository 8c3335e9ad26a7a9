"""Input processing: a user's prompt and sampling parameters, checked, into the `Request`s the scheduler runs
(one per sample of an n > 1 request, each with its own seed), capped to what the context and the KV pools
hold."""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, replace

from torch_shift.engine.args import EngineConfig
from torch_shift.engine.errors import ParameterError
from torch_shift.engine.request import Request
from torch_shift.engine.sampling_params import MAX_SEED, SamplingParams
from torch_shift.engine.structured_output import GrammarCompiler, WaitingGrammar
from torch_shift.tokenizer import Tokenizer, lone_surrogate_error

Prompt = str | list[int]  # or vLLM's {"prompt": text} / {"prompt_token_ids": ids}, unwrapped by `unwrap_prompt`
PROMPT_KINDS = ("a prompt is a string or a list of token ids, or vLLM's {'prompt': text} or "
                "{'prompt_token_ids': [ids]}")


# vLLM's prompt dicts' optional fields, each taken as None only: torch_shift reads text, and salts no cache
_NONE_ONLY_PROMPT_FIELDS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "cache_salt")


def unwrap_prompt(prompt):
    """vLLM's prompt dicts as the text or token ids they hold (token ids beside their text, vLLM's TokensPrompt with
    `prompt`, as a TokenizedPrompt); anything else as it is."""
    if isinstance(prompt, dict):
        given = [name for name in _NONE_ONLY_PROMPT_FIELDS if prompt.get(name) is not None]
        if given:
            raise ValueError(f"a prompt's {', '.join(given)}: torch_shift reads text only and salts no cache "
                             "(leave it out or give None)")
        keys = set(prompt) - set(_NONE_ONLY_PROMPT_FIELDS)
        if keys == {"prompt_token_ids", "prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"a prompt dict's 'prompt' beside its 'prompt_token_ids' is their text, got "
                                f"{type(prompt['prompt']).__name__}")
            token_ids = unwrap_prompt({"prompt_token_ids": prompt["prompt_token_ids"]})
            return TokenizedPrompt(prompt["prompt"], list(token_ids))
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{{'prompt': ...}} holds text, got {type(prompt['prompt']).__name__} (token ids go "
                                "in {'prompt_token_ids': [...]})")
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            if not isinstance(prompt["prompt_token_ids"], (list, tuple)):
                raise TypeError(f"{{'prompt_token_ids': ...}} holds a list of token ids, got "
                                f"{type(prompt['prompt_token_ids']).__name__}")
            return prompt["prompt_token_ids"]
        raise TypeError(f"a dict with keys {sorted(keys)}; {PROMPT_KINDS}")
    return prompt


@dataclass(frozen=True)
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ParentRequest:
    """A user request: `n` sequences sampled from one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]


@dataclass(frozen=True)
class Capacity:
    """What the engine's KV memory holds: tokens of one replica's pool, replicas the widest group spans, and
    tokens of the host tier when every request passes through it (Seesaw), else None."""

    pool_tokens: int
    widest: int
    pool_blocks: int
    block_size: int
    tier_tokens: int | None = None
    tier_blocks: int = 0
    static_replicas: bool = False  # several replicas, none bound with another (static DP)

    @property
    def max_request_tokens(self) -> int:
        """Tokens (prompt and output) the widest group can hold: no sequence grows past it (nor past the
        tier when every request passes through it)."""
        tokens = self.widest * self.pool_tokens
        return tokens if self.tier_tokens is None else min(tokens, self.tier_tokens)

    def context_tokens(self, max_model_len: int) -> int:
        """Tokens a request may reach: the context, or less where the KV memory holds less."""
        return min(max_model_len, self.max_request_tokens)


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request: sample 0 draws from `seed` itself (as with n = 1),
    the others from a hash of (seed, index), so that requests with different seeds share no sample
    (vLLM's seed + index makes seed=1 and seed=2 share n - 1 of them)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little") & MAX_SEED


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int],
                 capacity: Capacity, uses_priority: bool, policy_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # the end id whose stop gives no stop_reason (Request): the tokenizer's eos, as vLLM's
        self.primary_eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self.capacity = capacity
        self.uses_priority = uses_priority  # the layout policy reads priorities (Flying)
        self.policy_name = policy_name
        self._grammars: GrammarCompiler | None = None  # built at the first structured-output request
        # the tokens that may complete a request's stop strings end its runs and redrafting checks while it runs alone
        # (Request.lone_stop_token_ids): found where the engine has either (the vocabulary's bytes read now)
        self._finds_stop_string_tokens = tokenizer is not None and (
            config.scheduler.num_scheduler_steps > 1 or config.speculative is not None)
        if self._finds_stop_string_tokens:
            tokenizer.stop_string_token_ids(())
        self._grammars_lock = threading.Lock()

    def tokenize_prompt(self, prompt: Prompt | TokenizedPrompt) -> TokenizedPrompt:
        """Check a prompt (text, token ids, vLLM's prompt dict, or one tokenized before: its ids checked again, as
        another engine or the caller may have made it) and tokenize it."""
        if not isinstance(prompt, TokenizedPrompt):
            prompt = unwrap_prompt(prompt)
        if isinstance(prompt, TokenizedPrompt):
            text, prompt = prompt.text, prompt.token_ids
        else:
            text = prompt
        if isinstance(prompt, str):  # "" too: a tokenizer that adds a BOS makes a prompt of it (vLLM's)
            if (error := lone_surrogate_error(prompt, "the prompt")) is not None:
                raise ValueError(error)
            if self.tokenizer is None:
                model_dir = self.config.model_dir
                where = f"{model_dir} has no tokenizer.json" if model_dir else "no tokenizer was given"
                raise ValueError(f"{where}: give the prompt as token ids")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            text = text if isinstance(text, str) else None
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise TypeError("a token-id prompt must be a list of ints")
        else:
            raise TypeError(f"got {type(prompt).__name__}; {PROMPT_KINDS}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        max_len = self.config.scheduler.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the model's context is {max_len} tokens "
                "(prompt plus at least one generated token)"
            )
        cap = self.capacity
        pool_tokens = cap.max_request_tokens
        if len(token_ids) >= pool_tokens and pool_tokens < cap.pool_tokens:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; the host KV tier, through which policy "
                             f"'seesaw' moves every request, holds only {pool_tokens} tokens "
                             f"({cap.tier_blocks} blocks of {cap.block_size}): raise "
                             + ("num_cpu_kv_blocks" if self.config.tier.num_blocks is not None else "cpu_kv_gb"))
        if len(token_ids) >= pool_tokens:
            widest = pool_tokens // cap.pool_tokens
            where = "the KV pool holds" if widest == 1 else f"the KV pools of {widest} replicas hold"
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; {where} only {pool_tokens} tokens "
                f"({widest} x {cap.pool_blocks} KV blocks of {cap.block_size})"
                + (" (policy 'flying' binds replicas whose pools together hold more)" if cap.static_replicas else "")
            )
        return TokenizedPrompt(text, token_ids)

    def check_params(self, params: SamplingParams | None, priority: int) -> SamplingParams:
        """The sampling parameters against this engine's model and scheduler."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = replace(params)  # checked again, on a copy: its fields may have changed since it was made
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        scheduling = self.config.scheduler.policy
        if priority != 0 and scheduling != "priority" and not self.uses_priority:
            raise ParameterError("priority", f"priority={priority} needs scheduling_policy='priority' (or a layout "
                                             f"policy that uses priorities, such as 'flying'); this engine schedules "
                                             f"{scheduling!r} under policy {self.policy_name!r}")
        vocab = self.config.model.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ParameterError("stop_token_ids", f"stop_token_ids outside the vocabulary: {bad}")
        max_logprobs = self.config.scheduler.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k == -1:  # vLLM's: the whole vocabulary's
                k = vocab
                params = replace(params, **{name: vocab})
            if k is not None and k > vocab:
                raise ParameterError(name, f"{name}={k} exceeds the vocabulary size {vocab}")
            if k is not None and max_logprobs != -1 and k > max_logprobs:  # vLLM's check and words
                what = "sample" if name == "logprobs" else "prompt"
                raise ParameterError(name, f"Requested {what} logprobs of {k}, which is greater than max allowed: "
                                           f"{max_logprobs} (raise max_logprobs, --max-logprobs, up to -1 for the "
                                           f"whole vocabulary)")
        if params.stop_strings and self.tokenizer is None:
            raise ParameterError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ParameterError("logit_bias", f"logit_bias has token ids outside the vocabulary [0, {vocab}): "
                                               f"{bad[:5]}")
        return params

    def process(self, request_id: str, prompt: Prompt | TokenizedPrompt, params: SamplingParams | None = None,
                priority: int = 0, arrival_time: float | None = None) -> ParentRequest:
        """The request's sequences, ready for the scheduler (nothing is queued yet)."""
        params = self.check_params(params, priority)
        if arrival_time is not None:
            if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
                raise TypeError(f"arrival_time must be a number of seconds on time.monotonic()'s clock, or None; got "
                                f"{arrival_time!r}")
            if not math.isfinite(arrival_time):
                raise ValueError(f"arrival_time must be finite, got {arrival_time}")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._grammar_compiler().prototype(params.structured_outputs)
            if params.structured_outputs.starts_after is not None:
                grammar_marker = self.tokenizer.encode(params.structured_outputs.starts_after,
                                                       add_special_tokens=False)
        prompt = self.tokenize_prompt(prompt)
        token_ids = prompt.token_ids
        # A sequence never outgrows the context nor the whole KV pool (which would leave it
        # preempting itself forever): past either it finishes with "length".
        max_len = self.capacity.context_tokens(self.config.scheduler.max_model_len)
        max_tokens = max_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if params.min_tokens > max_tokens:
            raise ParameterError("min_tokens", f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens "
                                               f"that a prompt of {len(token_ids)} tokens leaves in this engine's "
                                               f"context of {max_len}")
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=child_seed(params.seed, i))
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, token_ids, child_params, max_tokens, self.eos_token_ids,
                            arrival_time=arrival_time, priority=priority,
                            primary_eos_token_id=self.primary_eos_token_id)
            if i > 0:
                child.prompt_logprobs = None  # computed once per prompt
            if params.stop_strings and self._finds_stop_string_tokens:
                child.stop_string_token_ids = self.tokenizer.stop_string_token_ids(params.stop_strings)
            if grammar is not None:
                matcher = grammar.deep_copy()
                if params.structured_outputs.starts_after is None:
                    child.grammar = matcher
                else:
                    child.waiting_grammar = WaitingGrammar(matcher, grammar_marker)
            children.append(child)
        return ParentRequest(request_id, prompt.text, token_ids, params, children)

    def compile_grammars(self, params: list[SamplingParams]) -> None:
        """Compile the grammars of `params` that ask for structured outputs, as `process` would (ParameterError where
        one cannot be used), so that `process` finds them compiled: a server calls this off the engine's thread."""
        for p in params:
            if p.structured_outputs is not None:
                self._grammar_compiler().prototype(p.structured_outputs)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        with self._grammars_lock:  # one compiler, whichever thread asks first
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.config.model.vocab_size,
                                                 self.eos_token_ids)
        return self._grammars
