"""The engine: requests in, one scheduled step at a time, outputs out.

request -> scheduler (step plan) -> model runner -> sampler -> outputs.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import InitVar, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_shift.attention import canonical_backend_name
from torch_shift.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from torch_shift.engine.errors import ParameterError
from torch_shift.engine.model_runner import ModelRunner
from torch_shift.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from torch_shift.engine.policies import build_policy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.sampler import Sampler, topk_logprobs
from torch_shift.engine.sampling_params import MAX_SEED, SamplingParams
from torch_shift.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from torch_shift.engine.step_plan import PlanBuilder, StepPlan
from torch_shift.engine.structured_output import GrammarCompiler
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.cache import KVCache, available_memory_bytes, kv_bytes_per_block
from torch_shift.kv.host_tier import create_host_tier, map_host_tier, tier_shape
from torch_shift.kv.tier import TierAllocator
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.loader import CheckpointReader, WeightSource
from torch_shift.parallel.layouts import Deployment, build_deployment
from torch_shift.parallel.pipeline import micro_batch_count
from torch_shift.parallel.replicas import ReplicaModel, build_layout_model
from torch_shift.parallel.runtime import ParallelRuntime
from torch_shift.parallel.shift import ShiftModule
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
    "data_parallel_size": "dp",
    "pipeline_parallel_size": "pp",
}
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
    # "auto": the paged CPU kernel on the CPU, else "sdpa"; "cpu", "sdpa" (gather + SDPA, any device), "flex"
    attention_backend: str = "auto"
    revision: str | None = None
    # parallel layouts (torch_shift.parallel.layouts) and the policy that switches between them
    sp: int = 1  # Ulysses sequence parallelism of the base layout (shift parallelism, paper 000)
    tp: int = 1  # tensor parallelism (inside each data-parallel replica)
    dp: int = 1  # data-parallel replicas, each with its own KV pool
    pp: int = 1  # pipeline stages of each replica (static PP; with policy "seesaw" the same ranks decode in TP)
    policy: str | None = None  # None: the deployment's own ("shift" for sp > 1, else "static"); "flying"
    # (paper 004, dp > 1); "seesaw" (paper 003, pp > 1: prefill in PP, decode in TP); "random" (tests)
    policy_config: dict | None = None  # the policy's options, e.g. {"dp_above": 4.0} (torch_shift.engine.flying)
    shift_threshold: int | None = 256  # steps with more tokens run in the base layout; None: base only
    shift_weights: str = "copy"  # shift-layout shards as "copy" (+1/SP weight memory) or zero-copy "view"
    flying_weights: str = "view"  # Flying's TP shards: zero-copy "view"s of each replica's weights, or "copy"
    seesaw_weights: str = "resident"  # Seesaw's two sets of layer weights both "resident", or the inactive one
    # as a "host" copy swapped in at each transition (docs/performance.md: Seesaw)
    # the host tier of the KV cache (swap space, shared by the local ranks): its size in GiB (vLLM's
    # swap_space), or in blocks; default: 4 GiB (at most a quarter of free memory) for seesaw, none otherwise
    cpu_kv_gb: float | None = None
    num_cpu_kv_blocks: int | None = None
    kv_swap: str = "sync"  # tier copies before the step's forward ("sync") or in a thread beside it ("async")
    interconnect_gbps: float | None = None  # emulate a link of this bandwidth (GB/s) on every transfer; None: off
    compile: bool = False  # torch.compile each layout's forward (dynamic token dimension)
    prepack_weights: bool = True  # linear weights in oneDNN's packed layout on the CPU (torch_shift.models.linear)
    distributed_timeout_s: float = 120.0  # bound on any collective: a stuck or dead rank ends the others
    tensor_parallel_size: InitVar[int] = _NOT_GIVEN
    ulysses_sequence_parallel_size: InitVar[int] = _NOT_GIVEN
    shift_parallel_threshold: InitVar[int | None] = _NOT_GIVEN
    data_parallel_size: InitVar[int] = _NOT_GIVEN
    pipeline_parallel_size: InitVar[int] = _NOT_GIVEN

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} | set(ENGINE_ARG_ALIASES)

    def __post_init__(self, tensor_parallel_size, ulysses_sequence_parallel_size, shift_parallel_threshold,
                      data_parallel_size, pipeline_parallel_size) -> None:
        given = {"tensor_parallel_size": tensor_parallel_size, "ulysses_sequence_parallel_size":
                 ulysses_sequence_parallel_size, "shift_parallel_threshold": shift_parallel_threshold,
                 "data_parallel_size": data_parallel_size, "pipeline_parallel_size": pipeline_parallel_size}
        defaults = {f.name: f.default for f in fields(self)}
        for alias, value in given.items():
            name = ENGINE_ARG_ALIASES[alias]
            if value is _NOT_GIVEN:
                continue
            if getattr(self, name) not in (defaults[name], value):
                raise ValueError(f"{alias}={value!r} and {name}={getattr(self, name)!r} disagree; give one of them")
            setattr(self, name, value)
        if self.seed is None:  # a fresh seed for this engine (the CLI without --seed)
            self.seed = int.from_bytes(os.urandom(8), "little") & MAX_SEED
        for name in ("sp", "tp", "dp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("cpu_kv_gb", "interconnect_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if value is not None and (not value >= 0 or value == float("inf")):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.interconnect_gbps == 0:
            raise ValueError("interconnect_gbps must be > 0 (None: no emulated link)")
        if self.num_cpu_kv_blocks is not None and (isinstance(self.num_cpu_kv_blocks, bool)
                                                   or not isinstance(self.num_cpu_kv_blocks, int)):
            raise TypeError(f"num_cpu_kv_blocks must be an int, got {type(self.num_cpu_kv_blocks).__name__}")
        if self.num_cpu_kv_blocks is not None and self.num_cpu_kv_blocks < 0:
            raise ValueError(f"num_cpu_kv_blocks must be >= 0, got {self.num_cpu_kv_blocks!r}")
        if self.kv_swap not in ("sync", "async"):
            raise ValueError(f"kv_swap must be 'sync' or 'async', got {self.kv_swap!r}")
        if self.seesaw_weights not in ("resident", "host"):
            raise ValueError(f"seesaw_weights must be 'resident' or 'host', got {self.seesaw_weights!r}")
        if self.compile and self.pp > 1:
            raise ValueError("compile=True is not available with pipeline parallelism (pp > 1): its stages run "
                             "eagerly")
        if self.shift_threshold is not None and (not isinstance(self.shift_threshold, int) or self.shift_threshold < 0):
            raise ValueError(f"shift_threshold must be an int >= 0 or None, got {self.shift_threshold!r}")
        for name in ("shift_weights", "flying_weights"):
            if getattr(self, name) not in ("copy", "view"):
                raise ValueError(f"{name} must be 'copy' or 'view', got {getattr(self, name)!r}")
        if self.policy not in (None, "static", "shift", "flying", "seesaw", "random"):
            raise ValueError(f"policy must be 'static', 'shift', 'flying', 'seesaw' or 'random', got {self.policy!r}")
        self.attention_backend = canonical_backend_name(self.attention_backend)


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
    def __init__(self, args: EngineArgs, weights: WeightSource | None = None,
                 model: ShiftModule | DecoderLM | None = None):
        """`weights`: read the model from this source (e.g. a training job's state dict, see
        torch_shift.handoff) instead of the checkpoint directory `args.model`. `model`: serve this
        model as built: a ShiftModule from `torch_shift.parallelize` (on the ranks that built it, every
        one of them running this, as under torchrun) or a DecoderLM; its layout, dtype and device hold.

        On rank 0 (or the only rank) the engine schedules, samples and detokenizes; on the other
        ranks of a torchrun job it holds only this rank's model runner (see `worker_loop`)."""
        if isinstance(model, ShiftModule):
            args = replace(args, sp=model.groups.sp, tp=model.groups.tp, shift_threshold=model.shift_threshold,
                           shift_weights=model.shift_weights)
        self.args = args
        setup = _Setup(args, weights, model)
        self.model_dir, self.model_config, self.dtype = setup.model_dir, setup.model_config, setup.dtype
        self.scheduler_config, self.cache_config = setup.scheduler_config, setup.cache_config
        self.deployment = setup.deployment
        mc = self.model_config

        self.parallel: ParallelRuntime | None = None
        # the host tier exists before local ranks start, so that they share it (torchrun ranks map a file)
        host_tier = setup.create_host_tier(shared=self.deployment.world_size > 1)
        if isinstance(model, ShiftModule):  # every rank built it and runs this: nothing to start
            self.parallel = ParallelRuntime.over(self.deployment, model.groups, args.distributed_timeout_s)
        elif self.deployment.world_size > 1:
            self.parallel = ParallelRuntime(self.deployment, _worker_main, (args, host_tier),
                                            args.distributed_timeout_s)
        try:
            self.runner = setup.build_runner(self.parallel, weights, model, host_tier)
        except BaseException:
            self.shutdown()  # started ranks must not outlive a failed construction
            raise
        self.model = self.runner.model
        self.device = self.runner.device
        if self.is_driver:
            self._init_driver(self.runner.kv_cache.num_blocks, setup.num_tier_blocks)

    @classmethod
    def driver_only(cls, args: EngineArgs, config: ModelConfig,
                    num_kv_blocks: int | Callable[[Deployment], int]) -> LLMEngine:
        """Rank 0's half of an engine (requests, scheduler, policy, plan builder, detokenizer) with no
        model, runner or ranks, for a model known only by its config: what a simulator drives
        (torch_shift.planner), replacing `run_plan` with modelled steps. `num_kv_blocks`: blocks of each
        replica's pool, or a function of the deployment that gives them."""
        engine = cls.__new__(cls)
        engine.args = args
        setup = _Setup(args, None, config=config)
        engine.model_dir, engine.model_config, engine.dtype = None, config, setup.dtype
        engine.scheduler_config, engine.cache_config = setup.scheduler_config, setup.cache_config
        engine.deployment = setup.deployment
        engine.parallel = engine.runner = engine.model = None
        engine.device = torch.device("cpu")
        if callable(num_kv_blocks):
            num_kv_blocks = num_kv_blocks(setup.deployment)
        engine._init_driver(num_kv_blocks, setup.num_tier_blocks)
        return engine

    def _init_driver(self, num_kv_blocks: int, num_tier_blocks: int) -> None:
        args, mc = self.args, self.model_config
        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else self.model_dir
        self.tokenizer = None
        if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        eos = set(mc.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

        self.pools = [BlockManager(num_kv_blocks, args.block_size, args.enable_prefix_caching)
                      for _ in self.deployment.replicas]
        self.policy = build_policy(args.policy, self.deployment, args.shift_threshold, seed=args.seed,
                                   **(args.policy_config or {}))
        self.tier = None
        if num_tier_blocks:
            self.tier = TierAllocator(num_tier_blocks, args.block_size, async_copies=args.kv_swap == "async")
        self.scheduler = Scheduler(self.scheduler_config, self.pools, self.policy, self.tier)
        pp_of = {layout.name: layout.pp for layout in self.deployment.layouts}

        def micro_batches(layout: str, num_tokens: int) -> int:  # how a pipeline layout cuts a step's batch
            return micro_batch_count(pp_of[layout], num_tokens)

        self.plan_builder = PlanBuilder(self.deployment.num_replicas, self.scheduler_config.max_num_seqs,
                                        micro_batches if self.deployment.pp > 1 else None)
        self._layout_replicas = {layout.name: layout.replicas for layout in self.deployment.layouts}.__getitem__
        self.sampler = Sampler(mc.vocab_size, seed=args.seed)
        self.parents: dict[str, _ParentRequest] = {}
        self.child_to_parent: dict[str, tuple[_ParentRequest, int]] = {}
        self._grammars: GrammarCompiler | None = None  # built at the first structured-output request
        self.num_steps = 0
        self.last_step_layout: str | None = None  # the layouts of the last step, '+'-joined
        self.last_step_switched = False  # a replica of it ran under another layout the last time
        self._replica_layouts: dict[int, str] = {}  # replica -> the layout it last ran under
        self.last_step_seconds = 0.0  # its wall time on rank 0, from scheduling to outputs
        self.steps_by_layout: Counter[str] = Counter()
        self.num_switches = 0
        self._step_seconds = [0.0, 0]  # sum and count over steps that kept their layouts
        self._switch_seconds = [0.0, 0]  # the same over steps that switched
        self.num_scheduled_tokens = 0  # tokens computed over the engine's life (recomputation included)
        # rank 0's wall time by what its steps did (prefill, decode, mixed; less the time in tier copies
        # and weight switches, counted apart), and the decode-only steps' batch sizes
        self.time_s: Counter[str] = Counter()
        self._decode_batches = [0, 0]  # requests and steps of decode-only steps

    @property
    def block_manager(self) -> BlockManager:
        """The KV pool of the first replica (the only one without data parallelism)."""
        return self.pools[0]

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use over every replica's pool."""
        return sum(p.num_blocks - p.num_free_blocks for p in self.pools) / sum(p.num_blocks for p in self.pools)

    @property
    def max_request_tokens(self) -> int:
        """Tokens (prompt and output) the widest group of replicas can hold: no sequence grows past it
        (nor past the host tier when every request passes through it, as under Seesaw)."""
        widest = max(layout.kv_width for layout in self.deployment.layouts)
        tokens = widest * self.block_manager.capacity_tokens
        if self.deployment.family == "seesaw":
            tokens = min(tokens, self.tier.capacity_tokens)
        return tokens

    def stats(self) -> dict:
        """Which layouts ran: steps by layout name, layout switches (steps in which some replica runs under
        another layout than the last time it ran) and the mean wall time of switching steps beside that of
        the others (a switch is a change of step plan: its cost is what the first step in the new layouts
        costs), and the policy's own figures."""
        def mean(totals):
            return totals[0] / totals[1] if totals[1] else None

        decode_requests, decode_steps = self._decode_batches
        return {"num_steps": self.num_steps, "steps_by_layout": dict(self.steps_by_layout),
                "num_switches": self.num_switches, "mean_step_s": mean(self._step_seconds),
                "mean_switch_step_s": mean(self._switch_seconds),
                "num_preemptions": self.scheduler.num_preemptions, "num_scheduled_tokens": self.num_scheduled_tokens,
                "num_swap_outs": self.scheduler.num_swap_outs, "num_swap_ins": self.scheduler.num_swap_ins,
                "time_s": {k: self.time_s[k] for k in ("prefill", "decode", "mixed", "resharding", "swapping")},
                "num_decode_steps": decode_steps,
                "mean_decode_batch": decode_requests / decode_steps if decode_steps else None,
                "policy": self.policy.name, **self.policy.stats()}

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
        pool_tokens = self.max_request_tokens
        if len(token_ids) >= pool_tokens and pool_tokens < self.block_manager.capacity_tokens:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; the host KV tier, through which policy "
                             f"'seesaw' moves every request, holds only {pool_tokens} tokens "
                             f"({self.tier.num_blocks} blocks of {self.tier.block_size}): raise cpu_kv_gb")
        if len(token_ids) >= pool_tokens:
            widest = pool_tokens // self.block_manager.capacity_tokens
            where = "the KV pool holds" if widest == 1 else f"the KV pools of {widest} replicas hold"
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; {where} only {pool_tokens} tokens "
                f"({widest} x {self.block_manager.num_blocks} KV blocks of {self.block_manager.block_size})"
                + (" (policy 'flying' binds replicas whose pools together hold more)"
                   if self.deployment.family == "dp" else "")
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
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if priority != 0 and self.scheduler_config.policy != "priority" and not self.policy.uses_priority:
            raise ParameterError("priority", f"priority={priority} needs scheduling_policy='priority' (or a layout "
                                             f"policy that uses priorities, such as 'flying'); this engine schedules "
                                             f"{self.scheduler_config.policy!r} under policy {self.policy.name!r}")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ParameterError("stop_token_ids", f"stop_token_ids outside the vocabulary: {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ParameterError(name, f"{name}={k} exceeds the vocabulary size {vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ParameterError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ParameterError("logit_bias", f"logit_bias has token ids outside the vocabulary [0, {vocab}): "
                                               f"{bad[:5]}")
        grammar_compiler = self._grammar_compiler() if params.structured_outputs is not None else None
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [c for c in child_ids if c in self.child_to_parent]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with a request in flight ({taken[0]!r})")
        if not isinstance(prompt, TokenizedPrompt):
            prompt = self.tokenize_prompt(prompt)
        text, token_ids = prompt.text, prompt.token_ids
        # A sequence never outgrows the context nor the whole KV pool (which would leave it
        # preempting itself forever): past either it finishes with "length".
        max_len = min(self.scheduler_config.max_model_len, self.max_request_tokens)
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
            if grammar_compiler is not None:
                child.grammar = grammar_compiler.matcher(params.structured_outputs)
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

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                             self.eos_token_ids)
        return self._grammars

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
        start = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty and not output.has_swaps:
            return []
        resharded_before = getattr(self.model, "reshard_seconds", 0.0)  # pipeline models switch weights
        entries, logits = self.execute(output)
        swap_s = self.runner.last_swap_seconds if self.runner is not None else 0.0
        reshard_s = getattr(self.model, "reshard_seconds", 0.0) - resharded_before
        sampled = self._sample(entries, logits)
        now = time.monotonic()
        updated = self.scheduler.update_from_output(output, sampled)
        touched: dict[str, _ParentRequest] = {}  # parents that advanced (or, with final_only, that may be done)
        for request in updated:
            parent, index = self.child_to_parent[request.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            if parent.detokenizers[index] is not None:
                self._detokenize(parent, index, request)  # may finish it on a stop string
            if not final_only or request.status.finished:
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
        self.last_step_seconds = elapsed = time.perf_counter() - start
        totals = self._switch_seconds if self.last_step_switched else self._step_seconds
        totals[0] += elapsed
        totals[1] += 1
        self._account(entries, elapsed, swap_s, reshard_s)
        return outputs

    def _account(self, entries: list[list[ScheduledRequest]], elapsed: float, swap_s: float,
                 reshard_s: float) -> None:
        num_requests = sum(len(group) for group in entries)
        num_decodes = sum(1 for group in entries for e in group if e.num_tokens == 1)
        kind = "decode" if num_decodes == num_requests else "prefill" if num_decodes == 0 else "mixed"
        if num_requests:
            self.time_s[kind] += elapsed - swap_s - reshard_s
        self.time_s["swapping"] += swap_s
        self.time_s["resharding"] += reshard_s
        if kind == "decode" and num_requests:
            self._decode_batches[0] += num_requests
            self._decode_batches[1] += 1

    def execute(self, output: SchedulerOutput) -> tuple[list[list[ScheduledRequest]], list]:
        """Run a scheduled step on every rank: the plan (deltas) to all, the forward of each group.
        Returns per group its entries in plan order and its logits (None: no logits rows)."""
        plan, entries = self.plan_builder.build(self.scheduler, output, self._layout_replicas)
        self._count_layouts(plan)
        return entries, self.run_plan(plan)

    def run_plan(self, plan: StepPlan) -> list:
        """The step on every rank; rank 0's logits per group (None: no logits rows). A simulator of the
        engine replaces this with modelled steps (see `driver_only`)."""
        if self.parallel is None:
            return self.runner.execute(plan)
        return self.parallel.run_step(plan, self.runner.execute)

    def _count_layouts(self, plan: StepPlan) -> None:
        if not plan.groups:
            return  # only tier copies this step
        names = [g.layout for g in plan.groups]
        # a switch: some replica runs under another layout than the last time it ran (replicas of data
        # parallelism that idle or rejoin under their own layout do not switch)
        switched = False
        for name in names:
            for replica in self._layout_replicas(name):
                switched |= self._replica_layouts.get(replica, name) != name
                self._replica_layouts[replica] = name
        self.last_step_switched = switched
        self.num_switches += switched
        self.last_step_layout = "+".join(names)
        self.num_steps += 1
        for name in names:
            self.steps_by_layout[name] += 1
        self.num_scheduled_tokens += sum(int(g.num_scheduled.sum()) for g in plan.groups)

    def _sample(self, entries_by_group: list[list[ScheduledRequest]], logits_by_group: list) -> dict[str, int]:
        rows: list[torch.Tensor] = []
        sample_requests: list[Request] = []
        for entries, logits in zip(entries_by_group, logits_by_group):
            if logits is None:
                continue
            if not any(e.prompt_logprobs for e in entries):  # one logits row per sampled request
                rows.append(logits)
                sample_requests.extend(e.request for e in entries if e.sample)
                continue
            row = 0
            for e in entries:
                n = e.num_tokens if e.prompt_logprobs else int(e.sample)
                if e.prompt_logprobs:
                    self._record_prompt_logprobs(e.request, e.num_computed_tokens, logits[row:row + n])
                if e.sample:
                    rows.append(logits[row + n - 1:row + n])
                    sample_requests.append(e.request)
                row += n
        if not sample_requests:
            return {}
        result = self.sampler(rows[0] if len(rows) == 1 else torch.cat(rows), sample_requests)
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
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        # as in vLLM, the eos or stop token id that ended the request adds no text (unless include_stop_str_in_output)
        ended_by_token = (request.status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
                          and (token_id in request.eos_token_ids or token_id == request.stop_reason))
        new_text = "" if ended_by_token else detok.step(token_id)
        if request.status.finished:
            new_text += detok.flush()  # bytes held back for an unfinished character
        if not new_text:
            return
        text = parent.texts[index] + new_text
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
        """Ranks other than 0 under torchrun: run the steps rank 0 broadcasts (see `worker_loop`)."""
        assert self.parallel is not None and not self.is_driver
        return worker_loop(self.parallel, self.runner)

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
        runner = getattr(self, "runner", None)  # None: driver_only, or a construction that failed
        if runner is not None and runner.swapper is not None:
            runner.swapper.close()  # the prefetch thread, if any, ends with the engine


def worker_loop(parallel: ParallelRuntime, runner: ModelRunner) -> Any:
    """A rank other than 0: run the steps rank 0 broadcasts. Returns the payload of an "outputs"
    message (torchrun: every rank's `generate` returns rank 0's outputs), None on "shutdown", and
    raises on "error"."""
    while True:
        kind, payload = parallel.broadcast()
        if kind == "step":
            runner.execute(payload)
        elif kind == "outputs":
            return payload
        elif kind == "error":
            raise RuntimeError(f"rank 0 failed: {payload}")
        else:
            assert kind == "shutdown", kind
            return None


class _Setup:
    """What every rank derives from the engine arguments, and how it builds its model runner."""

    def __init__(self, args: EngineArgs, weights: WeightSource | None, model: torch.nn.Module | None = None,
                 config: ModelConfig | None = None):
        self.args = args
        self.model_dir = None
        if config is not None:
            self.model_config = config
        elif model is not None:
            self.model_config = model.config
        elif weights is not None:
            self.model_config = weights.config
        else:
            self.model_dir = resolve_model_dir(args.model, args.revision)
            self.model_config = ModelConfig.from_dir(self.model_dir)
        mc = self.model_config
        if model is not None:
            self.dtype = next(model.parameters()).dtype
        else:
            self.dtype = resolve_dtype(args.dtype, mc.torch_dtype)
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
        self.deployment: Deployment = build_deployment(
            mc, sp=args.sp, tp=args.tp, dp=args.dp, pp=args.pp,
            flying=args.policy in ("flying", "random") and args.dp > 1, seesaw=args.policy == "seesaw",
            shift=args.shift_threshold is not None)
        self.num_tier_blocks = self._num_tier_blocks()

    def _num_tier_blocks(self) -> int:
        """Blocks of the host tier of the KV cache (0: none); a block holds every layer's and head's KV of
        block_size tokens."""
        args, mc = self.args, self.model_config
        per_block = kv_bytes_per_block(mc.num_hidden_layers, args.block_size, mc.num_key_value_heads, mc.head_dim,
                                       self.dtype)
        if args.num_cpu_kv_blocks is not None:
            num_blocks = args.num_cpu_kv_blocks
        elif args.cpu_kv_gb is not None:
            num_blocks = int(args.cpu_kv_gb * (1 << 30)) // per_block
            if args.cpu_kv_gb > 0 and num_blocks == 0:
                raise ValueError(f"cpu_kv_gb={args.cpu_kv_gb} holds no KV block of {per_block} bytes")
        elif self.deployment.family == "seesaw":
            num_blocks = min(_CPU_KV_BUDGET_BYTES, available_memory_bytes(torch.device("cpu")) // 4) // per_block
        else:
            num_blocks = 0
        if self.deployment.family == "seesaw" and num_blocks == 0:
            raise ValueError("policy 'seesaw' moves every request's KV through the host tier: give it a size "
                             "(cpu_kv_gb > 0)")
        return num_blocks

    def create_host_tier(self, shared: bool) -> torch.Tensor | None:
        """The host tier's memory in this process, before local ranks start (None under torchrun, where
        every rank maps it in `build_runner`, or without a tier)."""
        if not self.num_tier_blocks or (shared and "RANK" in os.environ):
            return None
        return create_host_tier(self._tier_shape(), self.dtype, shared)

    def _tier_shape(self) -> tuple[int, ...]:
        mc = self.model_config
        return tier_shape(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.num_tier_blocks,
                          self.args.block_size)

    def build_runner(self, parallel: ParallelRuntime | None, weights: WeightSource | None,
                     model: torch.nn.Module | None = None, host_tier: torch.Tensor | None = None) -> ModelRunner:
        """This rank's model (only its shards read, or `model` as built), its KV cache and its runner."""
        args, mc = self.args, self.model_config
        if parallel is not None:
            rank, groups, device = parallel.rank, parallel.groups, parallel.device
        else:
            rank, groups = 0, None
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        given = model is not None
        if given:
            device = next(model.parameters()).device
            model = model if isinstance(model, ShiftModule) else ReplicaModel(model)
        else:
            reader = weights or CheckpointReader(self.model_dir, mc)
            try:
                model = build_layout_model(self.deployment, groups, rank, mc, reader, self.dtype, device,
                                           args.shift_threshold, args.shift_weights, args.flying_weights,
                                           args.seesaw_weights)
            finally:
                reader.close()
        if args.prepack_weights:  # a model the user handed over keeps its dense weights (they may still use it)
            model.prepare_weights(drop_dense=not given)
        num_blocks = self._num_kv_blocks(model.num_kv_layers, model.num_local_kv_heads, device)
        if parallel is not None:  # every pool gets the size of the smallest
            num_blocks = parallel.min_over_ranks(num_blocks)
        kv_cache = KVCache(model.num_kv_layers, num_blocks, args.block_size, model.num_local_kv_heads,
                           mc.head_dim, self.dtype, device)
        if self.num_tier_blocks and host_tier is None and parallel is not None:
            host_tier = self._map_host_tier(parallel)
        return ModelRunner(model, kv_cache, self.deployment, rank, self.scheduler_config.max_num_seqs,
                           self.scheduler_config.max_model_len, mc.vocab_size, mc.sliding_window,
                           args.attention_backend, args.compile, host_tier, args.kv_swap, args.interconnect_gbps)

    def _map_host_tier(self, parallel: ParallelRuntime) -> torch.Tensor:
        """Under torchrun: the tier as a shared-memory file every rank maps (one host only: the tier is
        host memory)."""
        if int(os.environ.get("LOCAL_WORLD_SIZE", -1)) != self.deployment.world_size:
            raise ValueError("the host KV tier is shared memory of one host: run every rank on one node "
                             f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')}, "
                             f"world size {self.deployment.world_size})")
        # each rank sized the tier from the memory it saw when it started: all take the smallest, or the
        # tier's blocks would lie at different offsets on different ranks
        self.num_tier_blocks = parallel.min_over_ranks(self.num_tier_blocks)
        return map_host_tier(self._tier_shape(), self.dtype, parallel.rank, parallel.broadcast,
                             lambda: parallel.min_over_ranks(0))

    def _num_kv_blocks(self, num_layers: int, num_kv_heads: int, device: torch.device) -> int:
        cc, mc, sc = self.cache_config, self.model_config, self.scheduler_config
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_bytes_per_block(num_layers, cc.block_size, num_kv_heads, mc.head_dim, self.dtype)
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - (1.0 - cc.gpu_memory_utilization) * total)
        else:
            # local ranks share the host's memory
            budget = min(_CPU_KV_BUDGET_BYTES, available_memory_bytes(device) // 4) // self.deployment.world_size
        # never more than every sequence slot filled to the context
        enough = sc.max_num_seqs * math.ceil(sc.max_model_len / cc.block_size)
        num_blocks = min(budget // per_block, enough)
        widest = max(layout.kv_width for layout in self.deployment.layouts)  # pools a sequence may span
        if num_blocks * widest < math.ceil(sc.max_model_len / cc.block_size):
            where = "" if widest == 1 else f" even over the {widest} pools of the widest group"
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {cc.block_size} tokens, "
                f"fewer than one sequence of max_model_len={sc.max_model_len} needs{where}; lower max_model_len "
                "or raise the budget"
            )
        return num_blocks


def _worker_main(rank: int, world_size: int, args: EngineArgs, host_tier: torch.Tensor | None) -> None:
    """A rank started by rank 0 (launch path (b)): build this rank's runner, serve steps until rank 0
    shuts down. `host_tier`: the tier rank 0 created in shared memory before starting this rank."""
    setup = _Setup(args, None)
    parallel = ParallelRuntime(setup.deployment, _worker_main, (args, host_tier), args.distributed_timeout_s)
    runner = setup.build_runner(parallel, None, host_tier=host_tier)
    # This process is the library's own and everything built so far lives as long as it: keep it out of the
    # cyclic collector, whose full passes over torch's objects took ~230 ms every few hundred steps
    # (bench_engine.py).
    gc.collect()
    gc.freeze()
    while worker_loop(parallel, runner) is not None:
        pass
    dist.destroy_process_group()
