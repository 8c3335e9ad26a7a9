"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence

from torch import nn
from tqdm.auto import tqdm

from torch_shift.engine.args import EngineArgs
from torch_shift.engine.input_processor import PROMPT_KINDS, TokenizedPrompt, unwrap_prompt
from torch_shift.engine.llm_engine import LLMEngine, Prompt, refuse_vllm_options
from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.default import default_model_dir
from torch_shift.models.loader import WeightSource
from torch_shift.parallel.agreement import value_digest
from torch_shift.parallel.shift import ShiftModule
from torch_shift.tokenizer import lone_surrogate_error, template_reads_content_parts

# What a module passed to LLM fixes by itself (its mesh, parallelize's arguments, its parameters).
_SET_BY_MODULE = ("sp", "tp", "shift_threshold", "shift_weights", "dtype", "device", "revision")


class LLM:
    def __init__(self, model: str | nn.Module | None = None, *, weights: WeightSource | None = None, **engine_args):
        """`model`: a checkpoint directory or hub id (default: the embedded default model); or a module
        already built: a ShiftModule from `torch_shift.parallelize` (every rank that built it calls LLM, as
        under torchrun: rank 0 schedules, the others follow in `generate`) or a DecoderLM; or `weights`: an
        in-memory weight source (see torch_shift.handoff), with `model` then only a name. Engine arguments:
        see EngineArgs (vLLM's names of the parallel degrees are accepted too)."""
        engine_args = _without_vllm_only_arguments(engine_args)
        unknown = set(engine_args) - EngineArgs.names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        module = None
        if isinstance(model, nn.Module):
            if not isinstance(model, (ShiftModule, DecoderLM)):
                raise TypeError(f"LLM serves a module from torch_shift.parallelize or a DecoderLM, got "
                                f"{type(model).__name__}: call torch_shift.parallelize(model, mesh) first")
            fixed = sorted(set(engine_args) & set(_SET_BY_MODULE))
            if fixed:
                raise ValueError(f"{', '.join(fixed)}: set by the module itself (its mesh, parallelize's "
                                 "arguments, its parameters); leave them out")
            module, model = model, "in-memory"
        if model is None:
            model = "in-memory" if weights is not None else default_model_dir()
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args), weights, module, offline=True)
        self._ids = itertools.count()
        # one public call at a time: another thread's call waits for it (two threads' generate calls shared the
        # engine's requests, and the second raised a ValueError about requests it never added)
        self._calls = threading.RLock()
        # the ranks this process started end when this object is collected (`del llm`) or at exit
        weakref.finalize(self, self.engine.shutdown)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """End the local ranks this process started, within about `timeout_s` (a no-op otherwise, and under
        torchrun, whose ranks end with the program)."""
        self.engine.shutdown(timeout_s)

    def stats(self) -> dict:
        """Which layouts ran and how often they switched (see LLMEngine.stats). Under torchrun every rank
        calls this and gets rank 0's."""
        return self._on_every_rank(self.engine.stats, "stats")

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses, as vLLM's: the model's generation_config.json defaults
        (`generation_config="auto"`), over SamplingParams' own."""
        return SamplingParams(**self.engine.default_sampling_fields)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: the KV cache forgets every cached prefix (after the weights changed, or between benchmark runs);
        True once done. No request runs between calls of this object's own methods; one added through `engine` and
        unfinished makes it False, with nothing forgotten (`reset_running_requests`, which would preempt such
        requests first, is refused)."""
        if reset_running_requests:
            raise ValueError("reset_prefix_cache(reset_running_requests=True) is not supported: finish or abort "
                             "the engine's requests first")
        return self._on_every_rank(self.engine.reset_prefix_cache, "reset_prefix_cache")

    def get_metrics(self) -> list:
        """vLLM's `LLM.get_metrics()`: the engine's counters and gauges under vLLM's names
        (`torch_shift.engine.metrics`: Counter, Gauge, Vector); under torchrun every rank gets rank 0's."""
        from torch_shift.engine.metrics import engine_metrics

        return self._on_every_rank(lambda: engine_metrics(self.engine), "get_metrics")

    @property
    def tokenizer(self):
        """The model's tokenizer (None without a tokenizer.json), loaded on every rank."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer, as vLLM's `LLM.get_tokenizer()`."""
        return self.engine.tokenizer

    def _on_every_rank(self, call, name: str, *arguments):
        """Run `call` on rank 0; under torchrun the other ranks, which call the same method (`name`) with the
        same `arguments`, follow rank 0's steps meanwhile and return its result (or raise its error); a rank whose
        call differs makes every rank raise a ValueError. A call from another thread waits for this one."""
        with self._calls:
            return self._call_on_every_rank(call, name, *arguments)

    def _call_on_every_rank(self, call, name: str, *arguments):
        engine = self.engine
        digest = value_digest((name, arguments)) if engine.every_rank_runs_the_program else None
        if not engine.is_driver:
            return engine.follow(digest)
        engine.begin_call(digest)
        try:
            result = call()
        except BaseException as e:
            # a user's mistake is raised as the same ValueError or TypeError on every rank
            kind = next((k for k in (ValueError, TypeError) if isinstance(e, k)), None)  # ParameterError too
            engine.send_result("error", (kind.__name__ if kind else None, str(e) if kind
                                         else f"{type(e).__name__}: {e}"))
            raise
        engine.send_result("result", result)
        return result

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request=None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is a string or a list of token ids. `priority`: one for
        every prompt, or one each. `use_tqdm`: a progress bar (for two prompts or more), or a function that makes
        one, as vLLM's (`functools.partial(tqdm, leave=False)`). `lora_request` and `tokenization_kwargs` are
        vLLM's and must be None here.

        Under torchrun every rank calls this; rank 0 schedules and all ranks return its outputs.
        """
        refuse_vllm_options(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        # use_tqdm may differ (a bar on rank 0 only)
        return self._on_every_rank(lambda: self._generate(prompts, sampling_params, use_tqdm, priority), "generate",
                                   prompts, sampling_params, priority)

    def _generate(self, prompts, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}; "
                            f"{PROMPT_KINDS}")
        prompts = [_prompt_of(p, i) for i, p in enumerate(prompts)]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            hint = " (make one with SamplingParams(**the_dict))" if isinstance(sampling_params, dict) else ""
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                            f"{type(sampling_params).__name__}{hint}")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        elif isinstance(priority, (list, tuple)):
            priorities = list(priority)
        else:
            raise TypeError(f"priority must be an int or a list of ints, one per prompt; got {type(priority).__name__}")
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        tokenized = []
        for i, prompt in enumerate(prompts):  # every prompt is checked before any is queued
            try:
                tokenized.append(self.engine.tokenize_prompt(prompt))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None

        if self.engine.has_unfinished_requests():  # their outputs would end in this call's steps, unseen
            held = list(self.engine.output_processor.requests)
            raise ValueError(f"the engine holds requests added through llm.engine ({', '.join(held[:3])}"
                             f"{', ...' if len(held) > 3 else ''}): step them to their end or abort them before "
                             "generate")
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, prio in zip(request_ids, tokenized, params, priorities):
                self.engine.add_request(rid, prompt, p, priority=prio)
            return self._run(request_ids, use_tqdm)
        finally:
            # every id is this call's (the engine held none before it); nothing stays queued after an error or an
            # interrupt, also one inside add_request, and an id never added is ignored
            self.engine.abort_request(request_ids)
            if not self.engine.has_unfinished_requests():
                self.engine.idle()

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        if use_tqdm and len(request_ids) > 1:
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(request_ids), desc="Processed prompts")
        else:  # no tqdm made: its first bar takes a multiprocessing lock, which fixes the process's start method
            bar = contextlib.nullcontext(_NoBar())
        wanted = set(request_ids)
        with bar as bar, self.engine.steps_in_a_row():
            while len(finished) < len(request_ids):
                if not self.engine.has_unfinished_requests():
                    gone = [rid for rid in request_ids if rid not in finished]
                    raise RuntimeError(f"requests {gone[:3]} of this generate call were aborted while it ran "
                                       "(llm.engine.abort_request)")
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template and generate, as vLLM's `LLM.chat` (under
        torchrun on every rank, as `generate`).

        `tools`: OpenAI-style tools (`{"type": "function", "function": {"name", "description", "parameters"}}`),
        checked as the server checks them and given to the template (transformers' `tools=`); the arguments of
        earlier calls in `messages` may be JSON text, as OpenAI clients send them. To read calls out of the
        output: `torch_shift.serve.tool_parsers.TOOL_PARSERS["hermes"].parse(text)` (or the model's format).
        `chat_template_kwargs`: further template variables (e.g. `{"enable_thinking": False}` for Qwen3).
        `continue_final_message` (with `add_generation_prompt=False`): the output continues the last message, as
        vLLM's (an assistant turn begun by the caller). `chat_template`: a Jinja template instead of the model's.
        vLLM's parameters in vLLM's order; `lora_request` and `mm_processor_kwargs` must be None;
        `chat_template_content_format`: "auto" (as the template reads a message's content), "string" (text parts
        joined) or "openai" (the parts as given), as vLLM's."""
        from torch_shift.serve.tools import TEMPLATE_CALL_ARGUMENTS, check_tools, template_messages

        def chat():
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer, so no chat template")
            refuse_vllm_options(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
            if chat_template_content_format not in ("auto", "string", "openai"):
                raise ValueError(f"chat_template_content_format is 'auto', 'string' or 'openai' (vLLM's), got "
                                 f"{chat_template_content_format!r}")
            if chat_template is not None and not isinstance(chat_template, str):
                raise TypeError(f"chat_template is a Jinja template (a str), got {type(chat_template).__name__}")
            if tools is not None:
                check_tools(tools)
            conversations = messages
            if isinstance(messages, list) and messages and isinstance(messages[0], dict):
                conversations = [messages]
            if not (isinstance(conversations, list) and conversations and all(
                    isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in conversations)):
                raise TypeError("messages must be a conversation, a list of {'role': ..., 'content': ...} dicts, or "
                                f"a list of conversations; got {type(messages).__name__} {str(messages)[:60]!r}")
            if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
                raise TypeError("add_generation_prompt and continue_final_message must be True or False")
            reserved = sorted(set(chat_template_kwargs or {}) & TEMPLATE_CALL_ARGUMENTS)
            if reserved:
                raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are the template call's own arguments "
                                 "(chat's parameters), not template variables")
            # vLLM's content formats: "string" joins a message's text parts, "openai" gives the template the parts,
            # "auto" does what the template reads
            if chat_template_content_format != "auto":
                reads_parts = chat_template_content_format == "openai"
            elif chat_template is not None:
                reads_parts = template_reads_content_parts(chat_template)
            else:
                reads_parts = self.tokenizer.reads_content_parts(tools)
            texts = [
                self.tokenizer.apply_chat_template(template_messages(c, reads_parts),
                                                   add_generation_prompt=add_generation_prompt, tools=tools,
                                                   continue_final_message=continue_final_message,
                                                   chat_template=chat_template, **(chat_template_kwargs or {}))
                for c in conversations
            ]
            for i, text in enumerate(texts):  # a lone surrogate in any field the template renders
                error = lone_surrogate_error(text, f"conversation {i}: the text its messages render to")
                if error is not None:
                    raise ValueError(error)
            outputs = self._generate([self.tokenizer.encode(text, add_special_tokens=False) for text in texts],
                                     sampling_params, use_tqdm, None)
            for output, text in zip(outputs, texts):
                output.prompt = text  # the rendered conversation, as vLLM's
            return outputs

        return self._on_every_rank(chat, "chat", messages, sampling_params, chat_template, add_generation_prompt,
                                   continue_final_message, tools, chat_template_kwargs)


# vLLM's LLM arguments without a torch_shift engine argument: the values that ask for what torch_shift does anyway
# (taken, and dropped), and what the others would ask for (refused, saying so)
_VLLM_ONLY_ARGUMENTS = {
    "trust_remote_code": ((True, False), "torch_shift runs no code from a checkpoint: its model classes are its own"),
    "disable_log_stats": ((True, False), "an LLM logs no periodic statistics (LLM.stats() returns them)"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype"),
    "quantization": ((None,), "a checkpoint's quantization is read from its config.json (GPTQ, AWQ, FP8 and "
                              "compressed-tensors, dequantized as they load)"),
    "tokenizer_mode": (("auto", "hf"), "the tokenizer is the checkpoint's tokenizer.json, read by `tokenizers`"),
    "swap_space": ((), "torch_shift's host tier of the KV cache is cpu_kv_gb (GiB; --swap-space on the command line)"),
}


def _without_vllm_only_arguments(engine_args: dict) -> dict:
    """`engine_args` without vLLM's arguments that ask for what torch_shift does anyway; a ValueError for one that asks
    for more, naming what it would take."""
    for name in sorted(set(engine_args) & set(_VLLM_ONLY_ARGUMENTS)):
        taken, why = _VLLM_ONLY_ARGUMENTS[name]
        value = engine_args[name]
        if not any(value is t or (type(value) is type(t) and value == t) for t in taken):
            accepted = f" (taken: {' or '.join(map(repr, taken))})" if taken else ""
            raise ValueError(f"{name}={value!r}: vLLM's argument; {why}{accepted}")
    return {name: value for name, value in engine_args.items() if name not in _VLLM_ONLY_ARGUMENTS}


def _prompt_of(prompt, index: int) -> Prompt:
    """A prompt as the engine takes it (text or token ids); vLLM's prompt dicts are unwrapped."""
    try:
        prompt = unwrap_prompt(prompt)
    except (TypeError, ValueError) as e:
        raise type(e)(f"prompt {index}: {e}") from None
    if not isinstance(prompt, (str, list, tuple, TokenizedPrompt)):
        raise TypeError(f"prompt {index}: got {type(prompt).__name__}; {PROMPT_KINDS}")
    return prompt


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass
