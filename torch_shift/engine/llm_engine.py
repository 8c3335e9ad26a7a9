"""The engine: requests in, one scheduled step at a time, outputs out. A thin facade over the data path:

    add_request: InputProcessor (prompts checked and tokenized; n > 1 fan-out) -> EngineCore's scheduler
    step:        EngineCore (schedule -> step plan -> Worker on every rank -> sample -> advance)
                 -> OutputProcessor (detokenization, stop strings) -> RequestOutput

Every rank builds a `Worker` (torch_shift.engine.worker); rank 0 (the driver) also the rest. Under torchrun
every rank runs the user's program: the ranks other than 0 follow rank 0 inside each public call of `LLM`.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from torch_shift.config import CacheConfig, ModelConfig, SchedulerConfig, check_device_present, resolve_device
from torch_shift.engine.args import ENGINE_ARG_ALIASES, EngineArgs, EngineConfig
from torch_shift.engine.core import CoreStep, EngineCore
from torch_shift.engine.input_processor import Capacity, InputProcessor, Prompt, TokenizedPrompt, child_seed
from torch_shift.engine.model_runner import StepResult
from torch_shift.engine.output_processor import OutputProcessor
from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.policies import Policy, build_policy
from torch_shift.engine.request import RequestStatus
from torch_shift.engine.sampler import Sampler
from torch_shift.engine.sampling_params import generation_config_defaults
from torch_shift.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from torch_shift.engine.spec_decode import Speculator, build_proposer
from torch_shift.engine.spec_decode.draft import (
    DraftCheckpoint,
    DraftModelProposer,
    SuffixBesideDraftProposer,
    load_draft_proposer,
)
from torch_shift.engine.spec_decode.suffix import SuffixProposer
from torch_shift.engine.stats import EngineStats
from torch_shift.engine.step_plan import PlanBuilder, StepPlan
from torch_shift.engine.worker import Worker, copies_global_tree, num_tier_blocks
from torch_shift.kernels import cpu_kernels
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.cache import KVCache, check_fits
from torch_shift.kv.tier import TierAllocator
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.loader import WeightSource
from torch_shift.parallel.layouts import Deployment
from torch_shift.parallel.runtime import ParallelRuntime, check_timeout
from torch_shift.parallel.shift import ShiftModule
from torch_shift.tokenizer import Tokenizer, model_eos_token_ids

__all__ = ["ENGINE_ARG_ALIASES", "EngineArgs", "LLMEngine", "Prompt", "TokenizedPrompt", "child_seed"]

logger = logging.getLogger("torch_shift.engine")


def engine_config(args: EngineArgs, weights: WeightSource | None = None,
                  model: torch.nn.Module | None = None, offline: bool = False) -> EngineConfig:
    """The engine's configuration: the model's config from `model`, `weights` or the checkpoint (a directory
    or a hub id), the dtype of a model already built (`offline`: EngineArgs.create_engine_config's)."""
    if model is not None:
        config = args.create_engine_config(model.config, dtype=next(model.parameters()).dtype, offline=offline)
    elif weights is not None:
        config = args.create_engine_config(weights.config, offline=offline)
    else:
        model_dir = resolve_model_dir(args.model, args.revision)
        config = args.create_engine_config(ModelConfig.from_dir(model_dir), model_dir, offline=offline)
        check_weights_fit(config)
    if config.speculative is not None and config.speculative.method == "draft_model":
        config = replace(config, draft=DraftCheckpoint.resolve(config.speculative.model, config.model,
                                                               config.tokenizer_dir))
    return config


def check_weights_fit(config: EngineConfig) -> None:
    """A ValueError, before a tensor is read, where the weights cannot fit the device's whole memory: each replica
    holds the whole model at least once (its ranks share one host's memory on the CPU, a GPU holds its share), so an
    engine whose weights alone exceed it would be killed while loading (the OOM killer) instead."""
    device = resolve_device(config.runner.device)
    check_device_present(device)  # a CUDA device named where there is none: that error first
    replicas, world = config.deployment.num_replicas, config.deployment.world_size
    nbytes = config.model.num_parameters * config.dtype.itemsize * replicas
    what = f"the model's weights in {str(config.dtype).removeprefix('torch.')}"
    if replicas > 1:
        what += f" for {replicas} replicas"
    check_fits(nbytes if device.type == "cpu" else nbytes // world, device,
               what if device.type == "cpu" else what + f", a GPU's share of {world}")


class LLMEngine:
    def __init__(self, args: EngineArgs, weights: WeightSource | None = None,
                 model: ShiftModule | DecoderLM | None = None, *, offline: bool = False):
        """`weights`: read the model from this source (e.g. a training job's state dict, see
        torch_shift.handoff) instead of the checkpoint directory `args.model`. `model`: serve this
        model as built: a ShiftModule from `torch_shift.parallelize` (on the ranks that built it, every
        one of them running this, as under torchrun) or a DecoderLM; its layout, dtype and device hold.
        `offline`: the engine of LLM's offline generation, whose requests never arrive while a step runs
        (EngineArgs.num_scheduler_steps' default)."""
        if isinstance(model, ShiftModule):
            args = replace(args, sp=model.groups.sp, tp=model.groups.tp, shift_threshold=model.shift_threshold,
                           shift_weights=model.shift_weights)
        if model is not None:  # a module's parameters place the engine: one on the CPU stays there beside a GPU
            args = replace(args, device=str(next(model.parameters()).device))
        self.args = args
        self.config = engine_config(args, weights, model, offline)
        # the policy checks its options against the deployment before a rank starts or a weight loads (flying over
        # dp=2 with tp=2 was refused only after both)
        policy = build_policy(self.config.policy, self.config.deployment, self.config.policy_options)
        self._holding_threads = 0  # steps_in_a_row blocks open
        with _torch_import_side_effects_undone():
            self.worker: Worker | None = Worker.create(self.config, weights, model)
        self.tokenizer = _load_tokenizer(self.config)
        if self.is_driver:
            try:
                self._init_driver(self.worker.runner.kv_cache.num_blocks, self.worker.num_tier_blocks, policy)
            except BaseException:
                self.shutdown()
                raise
        if self.parallel is not None:  # built on rank 0's share of the cores; its runner steps on it
            self.parallel.give_threads_back()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor of an engine from its arguments."""
        return cls(engine_args)

    @classmethod
    def driver_only(cls, args: EngineArgs, config: ModelConfig,
                    num_kv_blocks: int | Callable[[Deployment], int]) -> LLMEngine:
        """Rank 0's half of an engine (requests, scheduler, policy, plan builder, output processing) with no
        model, runner or ranks, for a model known only by its config: what a simulator drives
        (torch_shift.planner), giving `core.executor` modelled steps. `num_kv_blocks`: blocks of each
        replica's pool, or a function of the deployment that gives them."""
        engine = cls.__new__(cls)
        engine._holding_threads = 0
        engine.args = args
        engine.config = args.create_engine_config(config)
        engine.worker = None
        engine.tokenizer = None
        if callable(num_kv_blocks):
            num_kv_blocks = num_kv_blocks(engine.config.deployment)
        engine._init_driver(num_kv_blocks, num_tier_blocks(engine.config),
                            build_policy(engine.config.policy, engine.config.deployment, engine.config.policy_options))
        return engine

    def _init_driver(self, num_kv_blocks: int, tier_blocks: int, policy: Policy) -> None:
        if self.config.scheduler.async_scheduling is None:  # on the CPU: where the runner launches the decoder's steps
            launches = self.worker is not None and self.worker.runner.launch_steps
            self.config = replace(self.config, scheduler=replace(self.config.scheduler, async_scheduling=launches))
        config, mc = self.config, self.config.model
        source = str(self.args.generation_config)
        # the sampling defaults of requests that leave them out (vLLM's --generation-config)
        self.default_sampling_fields = generation_config_defaults(
            config.model_dir if source == "auto" else None if source == "vllm" else Path(source))
        eos = set(mc.eos_token_id if config.model_dir is None else model_eos_token_ids(config.model_dir))
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        pools = [BlockManager(num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
                 for _ in config.deployment.replicas]
        tier = None
        if tier_blocks:
            tier = TierAllocator(tier_blocks, config.cache.block_size, async_copies=config.tier.kv_swap == "async")
        scheduler = Scheduler(config.scheduler, pools, policy, tier)
        self.stats_recorder = EngineStats(config.deployment)
        speculator = None
        if config.speculative is not None:
            speculator = Speculator(config.speculative, config.scheduler.max_model_len, self._draft_proposer(),
                                    self.worker.runner.native_step_tokens if self.worker is not None else 0)
            if self.worker is not None:  # a batch-1 check in two stages on the C++ decoder
                staged = self.worker.runner.staged_check_tokens
                if hasattr(policy, "threshold"):  # Shift's: a step of more tokens runs the base layout (None: all)
                    staged = min(staged, policy.threshold or 0)
                speculator.staged_check_tokens = staged
                # where its runs are single steps or beside steps ahead of the host (synchronous runs not measured)
                speculator.redraft_from_token_alone = config.deployment.world_size == 1 and (
                    config.scheduler.num_scheduler_steps == 1 or bool(config.scheduler.async_scheduling))
                if isinstance(speculator.proposer, SuffixProposer):
                    tree = self.worker.runner.suffix_global_tree = speculator.proposer.global_tree
                    if any(copies_global_tree(config, rank) for rank in range(config.deployment.world_size)):
                        tree.additions = []  # for the plans (EngineCore._step)
            self.stats_recorder.spec_method = config.speculative.label
            self.stats_recorder.accepted_per_position = [0] * config.speculative.max_proposal_tokens
            self.stats_recorder.stages_by_rows = speculator.stages_by_rows  # the speculator's tally, read as it grows
        self.output_processor = OutputProcessor(self.tokenizer, Sampler(mc.vocab_size, seed=config.seed),
                                                config.scheduler.max_model_len)
        # the executor is the Worker's (no reference back to the engine: dropping it frees its process groups)
        executor = self.worker.execute if self.worker is not None else _no_forward
        sample_on_device = draws = None
        if config.scheduler.async_scheduling and self.worker is not None:  # a simulator's steps are modelled
            sample_on_device = self.output_processor.sample_on_device
            if self.worker.runner.launch_steps:
                draws = self.output_processor.draws
        run_draws = None
        # a multi-step run's requests sample where every rank draws them with the CPU kernel, as the sampler would
        if (config.scheduler.num_scheduler_steps > 1 and self.worker is not None
                and self.worker.runner.device.type == "cpu" and config.dtype in (torch.float32, torch.bfloat16)
                and cpu_kernels() is not None):
            run_draws = self.output_processor.run_draws
        self.core = EngineCore(scheduler, PlanBuilder(config.deployment, config.scheduler.max_num_seqs), executor,
                               self.output_processor.sample, self.stats_recorder, speculator, sample_on_device, draws,
                               run_draws)
        widest = max(layout.kv_width for layout in config.deployment.layouts)  # pools a sequence may span
        capacity = Capacity(
            pool_tokens=pools[0].capacity_tokens, widest=widest, pool_blocks=pools[0].num_blocks,
            block_size=config.cache.block_size,
            tier_tokens=tier.capacity_tokens if tier is not None and config.deployment.moves_kv_through_tier else None,
            tier_blocks=tier.num_blocks if tier is not None else 0,
            static_replicas=config.deployment.num_replicas > 1 and widest == 1)
        self.input_processor = InputProcessor(config, self.tokenizer, self.eos_token_ids, capacity,
                                              policy.uses_priority, policy.name)
        # the planner's simulated engines (no worker) refuse a candidate whose context is too short instead
        if self.worker is not None and self.max_context_tokens < config.scheduler.max_model_len:
            logger.warning("the KV cache holds %d tokens a request, fewer than max_model_len=%d: a request ends "
                           "('length') at %d tokens, and `serve` takes that as its context (give the cache more "
                           "memory or lower max_model_len)", self.max_context_tokens,
                           config.scheduler.max_model_len, self.max_context_tokens)
        self.last_core_step: CoreStep | None = None  # what the last step did (None: it ran nothing)

    def _draft_proposer(self) -> DraftModelProposer | SuffixBesideDraftProposer | None:
        """The draft model on rank 0's device, for method "draft_model", with suffix decoding beside it where the
        config enables it (None: a method without a model)."""
        config = self.config
        if config.speculative.method != "draft_model":
            return None
        if self.worker is None or config.draft is None:
            raise ValueError("speculative_config: method 'draft_model' needs the draft's checkpoint and a model to run "
                             "it (a simulator prices 'ngram' and 'suffix' proposals; a draft's forwards are not "
                             "modelled)")
        draft = load_draft_proposer(config.draft, config.dtype, self.worker.runner.device, config.cache.block_size,
                                    config.scheduler.max_num_seqs, config.scheduler.max_model_len,
                                    config.scheduler.max_num_batched_tokens, config.runner.attention_backend,
                                    config.runner.prepack_weights, config.runner.decode_pool,
                                    config.runner.native_decode)
        spec = config.speculative
        if not spec.suffix_beside_draft:
            return draft
        return SuffixBesideDraftProposer(build_proposer(replace(spec, method="suffix")), draft,
                                         spec.num_speculative_tokens)

    # -- what the engine is made of ------------------------------------------------------------------------
    @property
    def is_driver(self) -> bool:
        """Rank 0 (or the only rank): the one that schedules and samples."""
        return self.worker is None or self.worker.rank == 0

    @property
    def parallel(self) -> ParallelRuntime | None:
        return None if self.worker is None else self.worker.runtime

    @property
    def runner(self):
        return None if self.worker is None else self.worker.runner

    @property
    def model(self):
        return None if self.worker is None else self.worker.runner.model

    @property
    def kv_cache(self) -> KVCache:
        return self.worker.runner.kv_cache

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.worker is None else self.worker.runner.device

    @property
    def deployment(self) -> Deployment:
        return self.config.deployment

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def model_dir(self) -> Path | None:
        return self.config.model_dir

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler

    @property
    def cache_config(self) -> CacheConfig:
        return self.config.cache

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def policy(self) -> Policy:
        return self.core.scheduler.policy

    @property
    def pools(self) -> list[BlockManager]:
        return self.core.scheduler.pools

    @property
    def tier(self) -> TierAllocator | None:
        return self.core.scheduler.tier

    @property
    def block_manager(self) -> BlockManager:
        """The KV pool of the first replica (the only one without data parallelism)."""
        return self.pools[0]

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use over every replica's pool."""
        return sum(p.num_blocks - p.num_free_blocks for p in self.pools) / sum(p.num_blocks for p in self.pools)

    @property
    def max_request_tokens(self) -> int:
        """Tokens (prompt and output) the widest group of replicas can hold: no sequence grows past it
        (nor past the host tier when every request passes through it, as under Seesaw)."""
        return self.input_processor.capacity.max_request_tokens

    @property
    def max_context_tokens(self) -> int:
        """Tokens (prompt and output) a request may reach: max_model_len, or less where the KV memory holds less."""
        return self.input_processor.capacity.context_tokens(self.config.scheduler.max_model_len)

    # -- statistics -------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.stats_recorder.num_steps

    @property
    def last_step_layout(self) -> str | None:
        return self.stats_recorder.last_step_layout

    @property
    def last_step_switched(self) -> bool:
        return self.stats_recorder.last_step_switched

    @property
    def last_step_seconds(self) -> float:
        return self.stats_recorder.last_step_seconds

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed over the engine's life (recomputation included)."""
        return self.stats_recorder.num_scheduled_tokens

    def stats(self) -> dict:
        """Which layouts ran (steps by layout, layout switches, the wall time of switching steps beside the
        others'), where rank 0's time went, preemptions and swaps, and the policy's own figures (rank 0;
        under torchrun `LLM.stats()` gives every rank rank 0's)."""
        if not self.is_driver:
            raise RuntimeError("the engine's statistics live on rank 0; under torchrun call LLM.stats() on every "
                               "rank, which returns rank 0's")
        scheduler, policy = self.scheduler, self.policy
        return {**self.stats_recorder.as_dict(), "num_preemptions": scheduler.num_preemptions,
                "num_swap_outs": scheduler.num_swap_outs, "num_swap_ins": scheduler.num_swap_ins,
                "policy": policy.name, **policy.stats()}

    # -- requests -----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        """Check a prompt (text or token ids) and tokenize it."""
        return self.input_processor.tokenize_prompt(prompt)

    def add_request(self, request_id: str, prompt: Prompt | TokenizedPrompt, params=None,
                    arrival_time: float | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                    trace_headers=None, priority: int = 0) -> str:
        """Queue a request (vLLM's order of arguments); returns its id. `lora_request`, `tokenization_kwargs` and
        `trace_headers` are vLLM's and must be None here (no LoRA adapters, no tokenizer options, no tracing)."""
        refuse_vllm_options(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                            trace_headers=trace_headers)
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = self.input_processor.process(request_id, prompt, params, priority, arrival_time)
        taken = [c.request_id for c in parent.children if c.request_id in self.output_processor.sample_of]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with a request in flight ({taken[0]!r})")
        self.output_processor.add(parent)
        for child in parent.children:
            self.core.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End requests by id (one, or vLLM's list); an id not in flight is ignored."""
        try:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        except TypeError:
            ids = None
        if ids is None or not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_ids must be a request id (str) or an iterable of them, got {request_ids!r}")
        for request_id in ids:
            parent = self.output_processor.remove(request_id)
            if parent is None:
                continue
            for child in parent.children:
                self.core.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the unfinished sequences, each sample of a request of several counting as one (vLLM's child
        requests)."""
        return sum(not child.status.finished for tracked in self.output_processor.requests.values()
                   for child in tracked.parent.children)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix of every replica's pool (after the weights changed, or before a
        benchmark), where no request holds blocks; False, and nothing forgotten, while requests are unfinished."""
        if self.has_unfinished_requests():
            return False
        for pool in self.pools:
            pool.reset_prefix_cache()
        return True

    # -- one step -----------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of every request that advanced (with `final_only`, of
        every request that finished: no per-step objects for the others)."""
        start = time.perf_counter()
        try:
            with self._torch_state():  # the sampler's and the proposer's work too
                step = self.last_core_step = self.core.step()
        finally:  # the caller's thread gets its threads back from the decode pool (engine/decode_pool.py)
            if not self.core.has_unfinished_requests():
                self.idle()
            elif self.worker is not None and not self._holding_threads:
                self.worker.runner.end_step()
        if step is None:
            return []
        for request in self.output_processor.detokenize(step.updated):  # a stop string ended them
            self.core.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        outputs = self.output_processor.make_outputs(step.updated, final_only)
        self.stats_recorder.record_step(step.entries, time.perf_counter() - start, step.swap_seconds,
                                        step.reshard_seconds)
        return outputs

    @contextmanager
    def steps_in_a_row(self):
        """Steps run one after another by a loop that runs nothing else of the caller's (`LLM.generate`, the
        server's engine thread): the thread keeps a pooled step's one OpenMP thread between them and gets its
        threads back once, when the block ends, instead of after every step (giving them back and taking them again
        took three foreign calls a step, 30-60 us after a step's weights went through the caches)."""
        self._holding_threads += 1
        try:
            yield
        finally:
            self._holding_threads -= 1
            if not self._holding_threads and self.worker is not None:
                self.worker.runner.end_step()

    def interrupt_run(self) -> None:
        """From any thread: a multi-step run in progress (num_scheduler_steps) ends after its current step, so that
        a request added or aborted meanwhile waits for no more than that; until `clear_run_interrupt`, which the
        loop that adds requests between steps calls before it adds them (torch_shift.serve.async_engine)."""
        if self.worker is not None:
            self.worker.runner.interrupt_runs()

    def clear_run_interrupt(self) -> None:
        if self.worker is not None:
            self.worker.runner.clear_run_interrupt()

    def _torch_state(self):
        """A block of the engine's own work under torch's settings of its construction (engine/torch_state.py)."""
        return self.worker.runner.torch_state.applied() if self.worker is not None else nullcontext()

    def idle(self) -> None:
        """Out of work: the decode pool's threads sleep (engine/decode_pool.py)."""
        if self.worker is not None:
            self.worker.runner.idle()

    def execute(self, output: SchedulerOutput) -> tuple[list[list[ScheduledRequest]], list]:
        """Run a scheduled step on every rank (outside `step`: tests and tools that drive the scheduler
        themselves). Returns per group its entries in plan order and its logits (None: no logits rows)."""
        plan = self.core.plan_builder.build(output)
        self.stats_recorder.record_plan(plan)
        with self._torch_state():
            result = self.core.executor(plan)
        return [group.entries for group in output.groups if group.entries], result.logits

    # -- ranks ----------------------------------------------------------------------------------------------
    @property
    def every_rank_runs_the_program(self) -> bool:
        """Ranks of one program (torchrun), each making the public calls rank 0 makes."""
        return self.worker is not None and self.worker.every_rank_runs_the_program

    def begin_call(self, digest: str) -> None:
        """Rank 0 under torchrun, as a public call begins: check that every rank makes this call (`digest`: its
        name and arguments); a ValueError on every rank where one differs."""
        if self.worker is not None:
            self.worker.begin_call(digest)

    def follow(self, digest: str | None = None):
        """A rank other than 0 under torchrun: run the steps rank 0 sends until it ends the current public
        call; returns rank 0's result (see torch_shift.engine.worker). `digest`: this rank's call."""
        assert not self.is_driver
        return self.worker.follow(digest)

    def send_result(self, kind: str, payload) -> None:
        """Rank 0 under torchrun: end the public call every rank made with rank 0's "result" or "error"."""
        if self.worker is not None:
            self.worker.send_result(kind, payload)

    def unresponsive_ranks(self, max_silence_s: float) -> list[int]:
        """Ranks this process started that gave no sign of life (heartbeat) for `max_silence_s` seconds,
        or died; [] for a single-device engine and under torchrun. Cheap; safe from any thread."""
        runtime = self.parallel
        return [] if runtime is None else runtime.unresponsive_ranks(max_silence_s)

    def unresponsive_reason(self, max_silence_s: float) -> str | None:
        """`unresponsive_ranks` in words: each one's exit code, or its silence; None where every rank answers."""
        runtime = self.parallel
        return None if runtime is None else runtime.unresponsive_reason(max_silence_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """End the ranks this process started and leave the process group, within about `timeout_s`.
        Safe from any thread, also while another thread is blocked in a step; a step after it raises."""
        check_timeout(timeout_s)
        worker = getattr(self, "worker", None)  # None: driver_only, or a construction that failed
        if worker is not None:
            worker.close(timeout_s)


@contextmanager
def _torch_import_side_effects_undone():
    """Building a model on the meta device (and compiling it) imports torch._dynamo, which sets
    TORCHINDUCTOR_CACHE_DIR to its default and, through sympy, adds a warnings filter: the user's process gets both
    back as they were (inductor computes the same default again where it needs it)."""
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    filters = list(warnings.filters)
    try:
        yield
    finally:
        if cache_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        added = [f for f in warnings.filters if f not in filters]  # another thread's own filters stay
        if added:
            warnings.filters[:] = [f for f in warnings.filters if f not in added]
            mutated = getattr(warnings, "_filters_mutated", None)  # the C module's cache of the list (3.11-3.13)
            if mutated is not None:
                mutated()


def refuse_vllm_options(**options) -> None:
    """vLLM's options torch_shift has no counterpart for: None (what vLLM's callers pass by default) or an error
    that names them."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: not supported by torch_shift (no LoRA adapters, multi-modal inputs, "
                         "tokenizer options or request tracing); leave it out or pass None")


def _no_forward(plan: StepPlan) -> StepResult:
    raise RuntimeError("this engine has no model (LLMEngine.driver_only): give core.executor a forward")


def _load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    directory = config.tokenizer_dir
    if directory is not None and (directory / "tokenizer.json").is_file():
        return Tokenizer.from_dir(directory)
    return None
