"""The engine: requests in, one scheduled step at a time, outputs out.

request -> scheduler (step plan) -> model runner -> sampler -> outputs.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import time
from dataclasses import InitVar, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_shift.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from torch_shift.engine.model_runner import ModelRunner, RunnerOutput
from torch_shift.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.sampler import Sampler, topk_logprobs
from torch_shift.engine.sampling_params import MAX_SEED, SamplingParams
from torch_shift.engine.scheduler import Scheduler, SchedulerOutput
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.cache import KVCache, available_memory_bytes, kv_bytes_per_block
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.loader import CheckpointReader, WeightSource, build_model
from torch_shift.parallel.plan import validate_mesh_for_model
from torch_shift.parallel.runtime import ParallelRuntime
from torch_shift.parallel.shift import build_shift_module
from torch_shift.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]


@dataclass(frozen=True)
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]

_CPU_KV_BUDGET_BYTES = 4 << 30  # default cap on CPU, where no device memory bounds the pool


# The same arguments under the names users of vLLM and ArcticInference arrive with.
ENGINE_ARG_ALIASES = {
    "tensor_parallel_size": "tp",
    "ulysses_sequence_parallel_size": "sp",
    "shift_parallel_threshold": "shift_threshold",
}
# vLLM's names of layouts not built yet: accepted, and refused unless 1
LAYOUTS_NOT_YET_AVAILABLE = {"data_parallel_size": "data parallelism", "pipeline_parallel_size": "pipeline parallelism"}
_NOT_GIVEN: Any = object()


@dataclass
class EngineArgs:
    """Engine arguments, named as in vLLM where the concept is the same; vLLM's and ArcticInference's
    names of the parallel degrees are accepted as aliases (ENGINE_ARG_ALIASES)."""

    model: str
    tokenizer: str | None = None  # directory with tokenizer.json; defaults to the model directory
    dtype: str = "auto"
    device: str | None = None  # default: cuda when available, else cpu
    seed: int | None = 0  # None: a fresh random seed (the CLI's default)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "sdpa"  # "sdpa": gather + SDPA (CPU and GPU); "flex": paged FlexAttention
    revision: str | None = None
    # shift parallelism (paper 000): base layout (SP, TP), full TP over SP x TP for small steps
    sp: int = 1
    tp: int = 1
    shift_threshold: int | None = 256  # steps with more tokens run in the base layout; None: base only
    shift_weights: str = "copy"  # shift-layout shards as "copy" (+1/SP weight memory) or zero-copy "view"
    compile: bool = False  # torch.compile each layout's forward (dynamic token dimension)
    distributed_timeout_s: float = 120.0  # bound on any collective: a stuck or dead rank ends the others
    tensor_parallel_size: InitVar[int] = _NOT_GIVEN
    ulysses_sequence_parallel_size: InitVar[int] = _NOT_GIVEN
    shift_parallel_threshold: InitVar[int | None] = _NOT_GIVEN
    data_parallel_size: InitVar[int] = 1
    pipeline_parallel_size: InitVar[int] = 1

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} | set(ENGINE_ARG_ALIASES) | set(LAYOUTS_NOT_YET_AVAILABLE)

    def __post_init__(self, tensor_parallel_size, ulysses_sequence_parallel_size, shift_parallel_threshold,
                      data_parallel_size, pipeline_parallel_size) -> None:
        given = {"tensor_parallel_size": tensor_parallel_size, "ulysses_sequence_parallel_size":
                 ulysses_sequence_parallel_size, "shift_parallel_threshold": shift_parallel_threshold}
        defaults = {f.name: f.default for f in fields(self)}
        for alias, value in given.items():
            name = ENGINE_ARG_ALIASES[alias]
            if value is _NOT_GIVEN:
                continue
            if getattr(self, name) not in (defaults[name], value):
                raise ValueError(f"{alias}={value!r} and {name}={getattr(self, name)!r} disagree; give one of them")
            setattr(self, name, value)
        for alias, value in (("data_parallel_size", data_parallel_size),
                             ("pipeline_parallel_size", pipeline_parallel_size)):
            if value != 1:
                raise ValueError(f"{alias}={value!r}: {LAYOUTS_NOT_YET_AVAILABLE[alias]} is not available in "
                                 "torch_shift yet; the layouts are SP x TP with shift (sp=, tp=)")
        if self.seed is None:  # a fresh seed for this engine (the CLI without --seed)
            self.seed = int.from_bytes(os.urandom(8), "little") & MAX_SEED
        for name in ("sp", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.shift_threshold is not None and (not isinstance(self.shift_threshold, int) or self.shift_threshold < 0):
            raise ValueError(f"shift_threshold must be an int >= 0 or None, got {self.shift_threshold!r}")
        if self.shift_weights not in ("copy", "view"):
            raise ValueError(f"shift_weights must be 'copy' or 'view', got {self.shift_weights!r}")
        if self.attention_backend not in ("sdpa", "flex"):
            raise ValueError(f"attention_backend must be 'sdpa' or 'flex', got {self.attention_backend!r}")


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request: sample 0 draws from `seed` itself (as with n = 1),
    the others from a hash of (seed, index), so that requests with different seeds share no sample
    (vLLM's seed + index makes seed=1 and seed=2 share n - 1 of them)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little") & MAX_SEED


@dataclass
class _ParentRequest:
    """A user request: `n` sequences sampled from one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    texts: list[str]


class LLMEngine:
    def __init__(self, args: EngineArgs, weights: WeightSource | None = None):
        """`weights`: read the model from this source (e.g. a training job's state dict, see
        torch_shift.handoff) instead of the checkpoint directory `args.model`."""
        self.args = args
        if weights is None:
            model_dir = resolve_model_dir(args.model, args.revision)
            self.model_config = ModelConfig.from_dir(model_dir)
        else:
            model_dir = None
            self.model_config = weights.config
        self.model_dir = model_dir
        mc = self.model_config
        self.dtype = resolve_dtype(args.dtype, mc.torch_dtype)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device = device

        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else model_dir
        self.tokenizer = None
        if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        eos = set(mc.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

        max_model_len = args.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={mc.max_position_embeddings}"
            )
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            policy=args.scheduling_policy,
        )
        self.cache_config = CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        )

        self.parallel: ParallelRuntime | None = None
        choose_layout = None
        num_kv_heads = mc.num_key_value_heads
        if args.sp * args.tp > 1:
            validate_mesh_for_model(mc, args.sp, args.tp)
            self.parallel = ParallelRuntime(args.sp, args.tp, _worker_main, (args,), args.distributed_timeout_s)
            try:  # started ranks must not outlive a failed construction
                self.device = device = self.parallel.device
                reader = weights or CheckpointReader(model_dir, mc)
                self.model = build_shift_module(mc, self.parallel.groups, reader, self.dtype, device,
                                                args.shift_threshold, args.shift_weights)
                reader.close()
                num_kv_heads = self.model.num_local_kv_heads
                # one block table for all ranks: the smallest pool wins
                num_blocks = self.parallel.min_over_ranks(self._num_kv_blocks(num_kv_heads))
            except BaseException:
                self.parallel.shutdown()
                raise
            choose_layout = self.model.choose_layout
        else:
            reader = weights or CheckpointReader(model_dir, mc)
            self.model = build_model(mc, reader, self.dtype, device)
            reader.close()
            num_blocks = self._num_kv_blocks(num_kv_heads)
        self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, args.block_size, num_kv_heads,
                                mc.head_dim, self.dtype, device)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, choose_layout)
        self.runner = ModelRunner(self.model, self.kv_cache, mc.sliding_window, args.attention_backend,
                                  args.compile)
        self.sampler = Sampler(mc.vocab_size, seed=args.seed)
        self.parents: dict[str, _ParentRequest] = {}
        self.child_to_parent: dict[str, tuple[_ParentRequest, int]] = {}
        self.num_steps = 0
        self.last_step_layout: str | None = None

    # -- set-up -------------------------------------------------------------------------------------------
    def _num_kv_blocks(self, num_kv_heads: int) -> int:
        cc, mc, sc = self.cache_config, self.model_config, self.scheduler_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_bytes_per_block(mc.num_hidden_layers, cc.block_size, num_kv_heads, mc.head_dim, self.dtype)
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1.0 - cc.gpu_memory_utilization) * total)
        else:
            # local ranks share the host's memory
            budget = min(_CPU_KV_BUDGET_BYTES, available_memory_bytes(self.device) // 4) // (self.args.sp * self.args.tp)
        # never more than every sequence slot filled to the context
        enough = sc.max_num_seqs * math.ceil(sc.max_model_len / cc.block_size)
        num_blocks = min(budget // per_block, enough)
        if num_blocks < math.ceil(sc.max_model_len / cc.block_size):
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {cc.block_size} tokens, "
                f"fewer than one sequence of max_model_len={sc.max_model_len} needs; lower max_model_len "
                "or raise the budget"
            )
        return num_blocks

    # -- requests -----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        """Validate a prompt (text or token ids) and tokenize it."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid Unicode text: {e.reason} {prompt[e.start]!r} at "
                                 f"character {e.start}") from None
            if self.tokenizer is None:
                where = f"{self.model_dir} has no tokenizer.json" if self.model_dir else "no tokenizer was given"
                raise ValueError(f"{where}: give the prompt as token ids")
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            text = None
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise TypeError("a token-id prompt must be a list of ints")
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        max_len = self.scheduler_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the model's context is {max_len} tokens "
                "(prompt plus at least one generated token)"
            )
        pool_tokens = self.block_manager.capacity_tokens
        if len(token_ids) >= pool_tokens:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the KV pool holds only {pool_tokens} tokens "
                f"({self.block_manager.num_blocks} KV blocks of {self.block_manager.block_size})"
            )
        return TokenizedPrompt(text, token_ids)

    def add_request(
        self, request_id: str, prompt: Prompt | TokenizedPrompt, params: SamplingParams | None = None, priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids outside the vocabulary: {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self.child_to_parent]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with a request in flight ({taken[0]!r})")
        if not isinstance(prompt, TokenizedPrompt):
            prompt = self.tokenize_prompt(prompt)
        text, token_ids = prompt.text, prompt.token_ids
        # A sequence never outgrows the context nor the whole KV pool (which would leave it
        # preempting itself forever): past either it finishes with "length".
        max_len = min(self.scheduler_config.max_model_len, self.block_manager.capacity_tokens)
        max_tokens = max_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=child_seed(params.seed, i))
            child = Request(
                child_ids[i], token_ids, child_params, max_tokens,
                self.eos_token_ids, arrival_time=arrival_time, priority=priority,
            )
            if i > 0:
                child.prompt_logprobs = None  # computed once per prompt
            children.append(child)
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens) if self.tokenizer else None
            for _ in children
        ]
        parent = _ParentRequest(request_id, text, token_ids, children, detokenizers, [""] * len(children))
        self.parents[request_id] = parent
        for i, child in enumerate(children):
            self.child_to_parent[child.request_id] = (parent, i)
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
            self.child_to_parent.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    # -- one step -----------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of every request that advanced (with
        `final_only`, of every request that finished: no per-step objects for the others)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            assert not self.scheduler.running, "running requests but nothing scheduled"
            return []
        self.num_steps += 1
        self.last_step_layout = plan.layout if self.parallel is not None else "single"
        if self.parallel is None:
            runner_output = self.runner.execute(plan)
        else:
            runner_output = self.parallel.run_step(plan, self.runner.execute)
        sampled = self._sample(plan, runner_output)
        now = time.monotonic()
        updated = self.scheduler.update_from_output(plan, sampled)
        touched: dict[str, _ParentRequest] = {}
        for request in updated:
            parent, index = self.child_to_parent[request.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            self._detokenize(parent, index, request)
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            finished = all(c.status.finished for c in parent.children)
            if finished:
                del self.parents[parent.request_id]
                for child in parent.children:
                    self.child_to_parent.pop(child.request_id, None)
            if finished or not final_only:
                outputs.append(self._make_output(parent))
        return outputs

    def _sample(self, plan: SchedulerOutput, out: RunnerOutput) -> dict[str, int]:
        requests = self.scheduler.requests
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        entry_by_id = {e.request_id: e for e in plan.scheduled}
        for request_id, first_row, num_rows in out.logits_rows:
            request = requests[request_id]
            entry = entry_by_id[request_id]
            if entry.prompt_logprobs:
                self._record_prompt_logprobs(request, entry.num_computed_tokens,
                                             out.logits[first_row:first_row + num_rows])
            if entry.sample:
                sample_rows.append(first_row + num_rows - 1)
                sample_requests.append(request)
        if not sample_requests:
            return {}
        result = self.sampler(out.logits[sample_rows], sample_requests)
        for request, token_id, lp in zip(sample_requests, result.token_ids, result.logprobs):
            if lp is not None:
                chosen_lp, rank, top_ids, top_lps = lp
                request.logprobs.append(self._position_logprobs(token_id, chosen_lp, rank, top_ids, top_lps))
                request.cumulative_logprob += chosen_lp
        return {r.request_id: t for r, t in zip(sample_requests, result.token_ids)}

    def _record_prompt_logprobs(self, request: Request, first_position: int, logits: torch.Tensor) -> None:
        """Row j of `logits` predicts the token at position first_position + j + 1."""
        recorded = request.prompt_logprobs
        start = len(recorded) - 1 - first_position  # first row not yet recorded (after a preemption)
        stop = min(logits.shape[0], request.num_prompt_tokens - 1 - first_position)
        if stop <= start:
            return
        targets = torch.tensor(request.prompt_token_ids[first_position + start + 1:first_position + stop + 1],
                               device=logits.device)
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        k = request.sampling_params.prompt_logprobs
        chosen, ranks, top_ids, top_lps = topk_logprobs(logprobs, targets, k)
        for j in range(len(chosen)):
            recorded.append(self._position_logprobs(int(targets[j]), chosen[j], ranks[j], top_ids[j], top_lps[j]))

    def _position_logprobs(self, token_id: int, logprob: float, rank: int, top_ids: list[int],
                           top_lps: list[float]) -> PositionLogprobs:
        tok = self.tokenizer
        entry = {token_id: Logprob(logprob, rank, tok.token_to_str(token_id) if tok else None)}
        for r, (t, lp) in enumerate(zip(top_ids, top_lps), start=1):
            if t not in entry:
                entry[t] = Logprob(lp, r, tok.token_to_str(t) if tok else None)
        return entry

    def _detokenize(self, parent: _ParentRequest, index: int, request: Request) -> None:
        detok = parent.detokenizers[index]
        if detok is None:
            return
        new_text = detok.step(request.output_token_ids[-1])
        if request.status.finished:
            new_text += detok.flush()  # bytes held back for an unfinished character
        if not new_text:
            return
        text = parent.texts[index] + new_text
        params = request.sampling_params
        # as in vLLM, stop strings count only once more than min_tokens tokens were generated
        if params.stop_strings and request.stop_reason is None and request.num_output_tokens > params.min_tokens:
            for stop in params.stop_strings:
                # only the new text and the tail it can complete a stop string with need looking at
                idx = text.find(stop, max(0, len(text) - len(new_text) - len(stop) + 1))
                if idx != -1:
                    text = text[: idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
                    request.stop_reason = stop
                    if request.status.finished:  # the token that ended it by length also completed the stop
                        request.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    break
        parent.texts[index] = text

    def _make_output(self, parent: _ParentRequest) -> RequestOutput:
        completions = []
        for i, child in enumerate(parent.children):
            finish = child.status.value if child.status.finished else None
            completions.append(CompletionOutput(
                index=i,
                text=parent.texts[i],
                token_ids=list(child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=child.logprobs,
                finish_reason=finish,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
            num_cached_tokens=first.num_cached_tokens,
            metrics={"arrival_time": first.arrival_time, "first_scheduled_time": first.first_scheduled_time,
                     "first_token_time": first.first_token_time},
        )

    # -- parallel ranks -----------------------------------------------------------------------------------
    @property
    def is_driver(self) -> bool:
        """Rank 0 (or the only rank): the one that schedules and samples."""
        return self.parallel is None or self.parallel.rank == 0

    def worker_loop(self) -> Any:
        """Ranks other than 0: run the steps rank 0 broadcasts. Returns the payload of an "outputs"
        message (torchrun: every rank's `generate` returns rank 0's outputs), None on "shutdown",
        and raises on "error"."""
        assert self.parallel is not None and not self.is_driver
        while True:
            kind, payload = self.parallel.broadcast()
            if kind == "step":
                self.runner.execute(payload)
            elif kind == "outputs":
                return payload
            elif kind == "error":
                raise RuntimeError(f"rank 0 failed: {payload}")
            else:
                assert kind == "shutdown", kind
                return None

    def announce(self, kind: str, payload: Any) -> None:
        """Under torchrun, tell the other ranks (waiting in `worker_loop`) how `generate` ended."""
        if self.parallel is not None and self.parallel.launched is None and dist.is_initialized():
            try:
                self.parallel.broadcast((kind, payload))
            except RuntimeError:
                if kind != "error":
                    raise

    def unresponsive_ranks(self, max_silence_s: float) -> list[int]:
        """Ranks this process started that gave no sign of life (heartbeat) for `max_silence_s` seconds,
        or died; [] for a single-device engine and under torchrun. Cheap; safe from any thread."""
        return [] if self.parallel is None else self.parallel.unresponsive_ranks(max_silence_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """End the ranks this process started and leave the process group, within about `timeout_s`.
        Safe from any thread, also while another thread is blocked in a step; a step after it raises."""
        if self.parallel is not None and self.is_driver:
            self.parallel.shutdown(timeout_s)


def _worker_main(rank: int, world_size: int, args: EngineArgs) -> None:
    """A rank started by rank 0 (launch path (b)): serve steps until rank 0 shuts down."""
    engine = LLMEngine(args)
    # This process is the library's own and everything built so far lives as long as it: keep it out of the
    # cyclic collector, whose full passes over torch's objects took ~230 ms every few hundred steps
    # (bench_engine.py).
    gc.collect()
    gc.freeze()
    while engine.worker_loop() is not None:
        pass
    dist.destroy_process_group()
