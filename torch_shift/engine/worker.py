"""Every rank's half of the engine: the `Worker` (its runtime, its model runner, and the loop that runs what
rank 0 sends), built the same way on every launch path.

Launch paths: one rank (no runtime); local ranks that rank 0 starts from an ordinary process (they run
`Worker.serve_forever`); torchrun, `torch_shift.parallelize` and `torch_shift.handoff`, where every rank runs
the user's program and builds its own Worker (ranks other than 0 follow rank 0 inside each public call of
`LLM`, see `Worker.follow`). Rank 0 sends messages on the control channel: ("step", plan) runs a step on
every rank; ("result", payload) ends a public call that every rank of a torchrun program made, giving them
rank 0's answer; ("error", (kind, text)) ends it with rank 0's error (a ValueError or TypeError raised
as itself); ("shutdown", None) ends the started ranks.
"""

from __future__ import annotations

import copy
import gc
import math
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torch_shift.attention import attention_backend
from torch_shift.config import ModelConfig, check_device_present, resolve_device
from torch_shift.engine.args import EngineConfig
from torch_shift.engine.model_runner import ModelRunner, StepResult, run_without_kv
from torch_shift.engine.spec_decode.suffix import GlobalTree
from torch_shift.engine.step_plan import StepPlan
from torch_shift.kernels import cpu_kernels
from torch_shift.kv.cache import KVCache, available_memory_bytes, check_fits, kv_bytes_per_block
from torch_shift.kv.host_tier import create_host_tier, map_host_tier, tier_shape
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.loader import CheckpointReader, WeightSource
from torch_shift.models.rope import RotaryEmbedding
from torch_shift.parallel.layout_model import LayoutModel
from torch_shift.parallel.replicas import ReplicaModel, build_layout_model
from torch_shift.parallel.runtime import ParallelRuntime
from torch_shift.parallel.shared_kv import share_kv_caches
from torch_shift.parallel.shift import ShiftModule

# a rank without work looks for the next plan this often: a step that needs it again starts up to this much late
_IDLE_NAP_S = 1e-3
_CPU_KV_BUDGET_BYTES = 4 << 30  # default cap on CPU, where no device memory bounds the pool


def cpu_kv_budget_bytes(memory_bytes: int | float) -> int:
    """KV memory an engine takes on CPU ranks when not told (its pools, or its host tier): a quarter of the
    host's memory, up to 4 GiB."""
    return int(min(_CPU_KV_BUDGET_BYTES, memory_bytes // 4))


def num_tier_blocks(config: EngineConfig) -> int:
    """Blocks of the host tier of the KV cache (0: none); a block holds every layer's and head's KV of
    block_size tokens."""
    mc, tier, block_size = config.model, config.tier, config.cache.block_size
    per_block = kv_bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim,
                                   config.dtype)
    if tier.num_blocks is not None:
        num_blocks = tier.num_blocks
    elif tier.cpu_kv_gb is not None:
        num_blocks = int(tier.cpu_kv_gb * (1 << 30)) // per_block
        if tier.cpu_kv_gb > 0 and num_blocks == 0:
            raise ValueError(f"cpu_kv_gb={tier.cpu_kv_gb} holds no KV block of {per_block} bytes")
    elif config.deployment.moves_kv_through_tier:
        num_blocks = cpu_kv_budget_bytes(available_memory_bytes(torch.device("cpu"))) // per_block
    else:
        num_blocks = 0
    if config.deployment.moves_kv_through_tier and num_blocks == 0:
        raise ValueError("policy 'seesaw' moves every request's KV through the host tier: give it a size "
                         "(cpu_kv_gb > 0)")
    return num_blocks


def _tier_shape(config: EngineConfig, num_blocks: int) -> tuple[int, ...]:
    mc = config.model
    return tier_shape(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, num_blocks, config.cache.block_size)


def create_local_tier(config: EngineConfig, num_blocks: int) -> torch.Tensor | None:
    """The host tier's memory in this process, before local ranks start (forked ranks inherit it, spawned ones
    get it as shared memory); None without a tier, or under torchrun, where every rank maps a file instead."""
    world = config.deployment.world_size
    if num_blocks:  # (here, where the tier is made: the planner sizes tiers for other machines)
        tier = config.tier
        asked = (f"num_cpu_kv_blocks={tier.num_blocks}" if tier.num_blocks is not None
                 else f"cpu_kv_gb={tier.cpu_kv_gb}" if tier.cpu_kv_gb is not None else "its default")
        check_fits(math.prod(_tier_shape(config, num_blocks)) * config.dtype.itemsize, torch.device("cpu"),
                   f"the host KV tier ({asked})")
    if not num_blocks or (world > 1 and "RANK" in os.environ):
        return None
    return create_host_tier(_tier_shape(config, num_blocks), config.dtype, shared=world > 1)


def copies_global_tree(config: EngineConfig, rank: int) -> bool:
    """Whether `rank` keeps a copy of rank 0's suffix global tree of earlier outputs, which the first rank of its
    layout searches as rank 0 does its own when the C++ decoder drafts a redrafting check's later stages
    (ModelRunner._redraft): a rank of a replica without rank 0, in an engine that speculates with suffix decoding.
    The copy adds what rank 0's took, in order, before each step (StepPlan.global_tree_outputs)."""
    deployment = config.deployment
    return (config.speculative is not None and config.speculative.method == "suffix"
            and deployment.replica_of(rank) != deployment.replica_of(0))


class Worker:
    """One rank's runtime (None for a single rank), model runner and loop."""

    def __init__(self, config: EngineConfig, runtime: ParallelRuntime | None, runner: ModelRunner,
                 num_tier_blocks: int):
        self.config = config
        self.runtime = runtime
        self.runner = runner
        self.num_tier_blocks = num_tier_blocks  # the tier this rank maps (the same on every rank)

    @classmethod
    def create(cls, config: EngineConfig, weights: WeightSource | None = None,
               model: ShiftModule | torch.nn.Module | None = None) -> Worker:
        """This rank's Worker. On rank 0 of an ordinary process this starts the other local ranks, which
        build theirs in `_started_rank_main`; under torchrun (or with a `model` every rank built) every rank
        calls this. `weights`: read the model from this source instead of the checkpoint; `model`: serve it
        as built (a ShiftModule from torch_shift.parallelize, on every rank that built it, or a DecoderLM)."""
        tier_blocks = num_tier_blocks(config)
        host_tier = create_local_tier(config, tier_blocks)  # before local ranks start, so that they share it
        runtime = None
        timeout = config.parallel.timeout_s
        if isinstance(model, ShiftModule):  # every rank built it and runs this: nothing to start
            runtime = ParallelRuntime.over(config.deployment, model.groups, timeout, config.rank_fingerprint())
        elif config.deployment.world_size > 1:
            runtime = ParallelRuntime(config.deployment, _started_rank_main, (config, host_tier), timeout,
                                      _device(config).type, config.rank_fingerprint())
        try:
            return cls.build(config, runtime, weights, model, host_tier, tier_blocks)
        except BaseException:
            if runtime is not None:
                runtime.shutdown(timeout_s=2.0)  # started ranks must not outlive a failed construction
            raise

    @classmethod
    def build(cls, config: EngineConfig, runtime: ParallelRuntime | None, weights: WeightSource | None = None,
              model: torch.nn.Module | None = None, host_tier: torch.Tensor | None = None,
              tier_blocks: int = 0) -> Worker:
        """This rank's model (only its shards read, or `model` as built), its KV cache and its runner."""
        mc, runner_config, parallel = config.model, config.runner, config.parallel
        if runtime is not None:
            rank, groups, device = runtime.rank, runtime.groups, runtime.device
        else:
            rank, groups = 0, None
            device = _device(config)
        given = model is not None
        if given:
            device = next(model.parameters()).device
            model = _for_context(model, mc, device)
            model = model if isinstance(model, ShiftModule) else ReplicaModel(model)
        else:
            reader = weights or CheckpointReader(config.model_dir, mc)
            try:
                model = build_layout_model(config.deployment, groups, rank, mc, reader, config.dtype, device,
                                           parallel.shift_threshold, parallel.shift_weights, parallel.flying_weights,
                                           parallel.seesaw_weights, parallel.expert_parallel)
            finally:
                reader.close()
        if runner_config.prepack_weights:  # a model the user handed over keeps its dense weights (they may use it)
            model.prepare_weights(drop_dense=not given)
        num_blocks = _num_kv_blocks(config, model, device, rank)
        if runtime is not None:  # every pool gets the size of the smallest
            num_blocks = runtime.min_over_ranks(num_blocks)
        kv_shape = (model.num_kv_layers, num_blocks, config.cache.block_size, model.num_local_kv_heads, mc.head_dim,
                    config.dtype)
        shared = None
        if runtime is not None and isinstance(model, ShiftModule) and model.groups.sp > 1:
            # one-token steps on SP rank 0 alone: its paged attention steps over the SP peers' caches (`over`), no
            # link emulated between the ranks (which would not share memory)
            possible = (device.type == "cpu" and parallel.interconnect_gbps is None and not model.experts_over_sp
                        and attention_backend(runner_config.attention_backend, device, config.dtype).name == "cpu")
            shared = share_kv_caches(model.groups, runtime.min_over_ranks, possible, *kv_shape)
        kv_cache = shared.own if shared is not None else KVCache(*kv_shape, device)
        if shared is not None:
            model.share_kv(shared.peers)
        elif isinstance(model, ShiftModule):  # every rank of the replica agreed: no one-token steps on SP rank 0 alone
            model.drop_solo_head()
        if tier_blocks and host_tier is None and runtime is not None:
            tier_blocks, host_tier = _map_host_tier(config, runtime, tier_blocks)
        runner = ModelRunner(model, kv_cache, config.deployment, rank, config.scheduler.max_num_seqs,
                             config.scheduler.max_model_len, mc.vocab_size, mc.sliding_window,
                             runner_config.attention_backend, runner_config.compile, host_tier,
                             config.tier.kv_swap, parallel.interconnect_gbps,
                             runtime.barrier if runtime is not None else None, runner_config.cuda_graphs,
                             runtime.host_cores if runtime is not None else None, runner_config.decode_pool,
                             runner_config.native_decode, config.scheduler.async_scheduling is not False,
                             runtime.control.words if runtime is not None and runtime.control is not None else None)
        if runner.native_decode and copies_global_tree(config, rank) and (kernels := cpu_kernels()) is not None:
            spec = config.speculative
            runner.suffix_global_tree = GlobalTree(spec.suffix_decoding_max_tree_depth,
                                                   spec.suffix_decoding_max_cached_requests, kernels)
            runner.copies_global_tree = True
        return cls(config, runtime, runner, tier_blocks)

    # -- the control channel ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return 0 if self.runtime is None else self.runtime.rank

    @property
    def started_ranks(self) -> bool:
        """Whether this process started the other ranks (they loop in `serve_forever`), rather than every
        rank running the same program (torchrun)."""
        return self.runtime is not None and self.runtime.launched is not None

    def execute(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None, launch: bool = False,
                draws: np.ndarray | None = None) -> StepResult:
        """Rank 0: the step on every rank; returns rank 0's result (logits per group). `previous_tokens`: the
        last step's sampled tokens on the device; `launch`: the step may return before its logits are written
        (asynchronous scheduling: one rank; ModelRunner.execute), its tokens drawn with `draws`."""
        if self.runtime is None:
            return self.runner.execute(plan, previous_tokens, launch, draws)
        if previous_tokens is None and not launch:
            return self.runtime.run_step(plan, self.runner.execute)
        assert self.config.deployment.world_size == 1, "asynchronous scheduling runs one rank"
        return self.runtime.run_step(plan, lambda p: self.runner.execute(p, previous_tokens, launch, draws))

    @property
    def every_rank_runs_the_program(self) -> bool:
        """Ranks of one program (torchrun): each makes the public calls that rank 0 makes."""
        return self.runtime is not None and not self.started_ranks and dist.is_initialized()

    def begin_call(self, digest: str) -> None:
        """Rank 0 under torchrun, as a public call begins: the call's digest (its name and arguments) to every
        rank, which compares it with its own in `follow`; all raise the same ValueError where one differs."""
        if not self.every_rank_runs_the_program:
            return
        self.runtime.broadcast(("call", digest))
        self._agree_on_call(True)

    def _agree_on_call(self, same: bool) -> None:
        if self.runtime.min_over_ranks(int(same)) == 0:
            which = "" if same else f" (this rank's, rank {self.rank}, does)"
            raise ValueError(f"the ranks made different calls: a rank's call or its arguments differ from rank 0's"
                             f"{which}. Under torchrun every rank runs the same program and makes the same calls "
                             "with the same prompts and sampling params; rank 0 schedules and every rank returns "
                             "its outputs")

    def send_result(self, kind: str, payload: Any) -> None:
        """Rank 0 under torchrun: end the public call every rank made, with rank 0's answer ("result") or
        error ("error"). Nothing to do for one rank or for ranks this process started."""
        if not self.every_rank_runs_the_program:
            return
        try:
            self.runtime.broadcast((kind, payload))
        except RuntimeError:
            if kind != "error":
                raise

    def follow(self, digest: str | None = None) -> Any:
        """A rank other than 0: run the steps rank 0 sends until it ends the current public call; returns the
        call's result, None after "shutdown", and raises rank 0's error. `digest`: this rank's call (see
        `begin_call`), under torchrun."""
        assert self.runtime is not None and self.rank != 0
        with self.runner.torch_state.applied():  # torchrun's ranks: the user's settings may have changed since
            return self._follow(digest)

    def _follow(self, digest: str | None) -> Any:
        while True:
            # a rank without work in the last step (another replica's request, SP rank 0's one-token steps) waits
            # for the next plan in naps: asleep on the futex instead, it had rank 0 wake it at each plan, a system
            # call of 60-1,240 us in the middle of rank 0's step that ran this rank on rank 0's core
            # (docs/performance.md)
            kind, payload = self.runtime.broadcast(nap_s=_IDLE_NAP_S if self.runner.had_no_work else None)
            if kind == "step":
                self.runner.execute(payload)
                continue
            if kind == "call":
                self._agree_on_call(payload == digest)
                continue
            self.runner.idle()  # the call ends: the user's program (torchrun) runs on this process's threads
            if kind == "result":
                return payload
            elif kind == "error":
                mistake, message = payload
                if mistake is not None:
                    raise {"ValueError": ValueError, "TypeError": TypeError}[mistake](message)
                raise RuntimeError(f"rank 0 failed: {message}")
            else:
                assert kind == "shutdown", kind
                return None

    def serve_forever(self) -> None:
        """A rank started by rank 0: run steps until rank 0 shuts down."""
        while self.follow() is not None:
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """End the ranks this process started and leave the process group (rank 0 of started ranks); stop
        the tier's copy thread."""
        self.runner.close()  # before the runtime gives the user's thread count back
        if isinstance(self.runner.model, ShiftModule):
            self.runner.model.unshare_kv()
        if self.runtime is not None and self.rank == 0:
            self.runtime.shutdown(timeout_s)
        if self.runner.swapper is not None:
            self.runner.swapper.close()


def _device(config: EngineConfig) -> torch.device:
    """The device the engine was asked for (default: CUDA where there is a GPU)."""
    device = resolve_device(config.runner.device)
    check_device_present(device)
    return device


def _map_host_tier(config: EngineConfig, runtime: ParallelRuntime, num_blocks: int) -> tuple[int, torch.Tensor]:
    """Under torchrun: the tier as a shared-memory file every rank maps (one host only: the tier is host
    memory)."""
    world = config.deployment.world_size
    if int(os.environ.get("LOCAL_WORLD_SIZE", -1)) != world:
        raise ValueError("the host KV tier is shared memory of one host: run every rank on one node "
                         f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')}, world size {world})")
    # each rank sized the tier from the memory it saw when it started: all take the smallest, or the tier's
    # blocks would lie at different offsets on different ranks
    num_blocks = runtime.min_over_ranks(num_blocks)
    return num_blocks, map_host_tier(_tier_shape(config, num_blocks), config.dtype, runtime.rank, runtime.broadcast,
                                     lambda: runtime.min_over_ranks(0))


def _step_peak_bytes(config: EngineConfig, model: LayoutModel, device: torch.device, rank: int) -> int:
    """The profiling pass: device memory a step holds beyond the weights, measured on the largest step the
    scheduler may send (max_num_batched_tokens tokens, a logits row each for up to max_num_seqs of them) and,
    where decode steps are captured in CUDA graphs, once more for the graphs' own pool (a step of max_num_seqs
    tokens). Attention holds its output, the size of q, and for a decode step split over a long context its
    chunks' partial sums (the Triton backend), added here for the largest decode step."""
    sc, mc = config.scheduler, config.model
    num_tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * sc.max_model_len)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        run_without_kv(model, config.deployment, rank, device, num_tokens, min(num_tokens, sc.max_num_seqs),
                       sc.max_model_len)
    peak = torch.cuda.max_memory_allocated(device) - before
    if config.runner.cuda_graphs:
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            run_without_kv(model, config.deployment, rank, device, sc.max_num_seqs, sc.max_num_seqs, sc.max_model_len)
        peak += torch.cuda.max_memory_allocated(device) - before
    if attention_backend(config.runner.attention_backend, device, config.dtype).name == "triton":
        from torch_shift.attention.triton_paged import split_decode_bytes

        # an eager step's and, with graphs, the largest graph's (their pool keeps it)
        group = mc.num_attention_heads // mc.num_key_value_heads
        capacity = -(-sc.max_model_len // config.cache.block_size) * config.cache.block_size
        peak += (1 + config.runner.cuda_graphs) * split_decode_bytes(
            sc.max_num_seqs, model.num_local_kv_heads * group, mc.head_dim, capacity)
    torch.cuda.empty_cache()  # the pass's blocks go back to the device, where mem_get_info sees them free
    model.reset_counters()
    return peak


def _for_context(model: torch.nn.Module, config: ModelConfig, device: torch.device) -> torch.nn.Module:
    """A handed-over model with the rotary tables of the engine's context (LongRoPE's factors depend on
    max_model_len: ModelConfig.for_context): itself, or a shallow copy with tables of its own, so that the user's
    module (which another engine may serve) stays as it was."""
    if not isinstance(model, DecoderLM) or model.rotary.rope == config.rope:
        if any(isinstance(m, RotaryEmbedding) and m.rope != config.rope for m in model.modules()):
            raise ValueError(
                "this model's rotary tables were built for another context length (LongRoPE's long or short factors: "
                f"the long ones above {config.rope.original_max_position_embeddings} tokens); build it from "
                "load_model(path, config=ModelConfig.from_dir(path).for_context(max_model_len)), or hand over the "
                "DecoderLM itself")
        return model
    copied = copy.copy(model)
    copied._modules = dict(model._modules)
    copied.config = config
    copied.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, config.local_rope)
    copied.rotary.materialize(device)
    return copied


def _num_kv_blocks(config: EngineConfig, model: LayoutModel, device: torch.device, rank: int) -> int:
    cc, mc, sc = config.cache, config.model, config.scheduler
    per_block = kv_bytes_per_block(model.num_kv_layers, cc.block_size, model.num_local_kv_heads, mc.head_dim,
                                   config.dtype)
    if cc.num_kv_blocks is not None:
        check_fits(cc.num_kv_blocks * per_block, device, f"num_kv_blocks={cc.num_kv_blocks} on each rank")
        return cc.num_kv_blocks
    if cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    elif device.type == "cuda":
        peak = _step_peak_bytes(config, model, device, rank)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1.0 - cc.gpu_memory_utilization) * total) - peak
    else:
        # local ranks share the host's memory
        budget = cpu_kv_budget_bytes(available_memory_bytes(device)) // config.deployment.world_size
    # never more than every sequence slot filled to the context
    enough = sc.max_num_seqs * math.ceil(sc.max_model_len / cc.block_size)
    num_blocks = min(budget // per_block, enough)
    widest = max(layout.kv_width for layout in config.deployment.layouts)  # pools a sequence may span
    if num_blocks * widest < math.ceil(sc.max_model_len / cc.block_size):
        where = "" if widest == 1 else f" even over the {widest} pools of the widest group"
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {cc.block_size} tokens, "
            f"fewer than one sequence of max_model_len={sc.max_model_len} needs{where}; lower max_model_len "
            "or raise the budget"
        )
    return num_blocks


def _started_rank_main(rank: int, world_size: int, config: EngineConfig, host_tier: torch.Tensor | None) -> None:
    """A rank started by rank 0: build this rank's Worker, serve steps until rank 0 shuts down.
    `host_tier`: the tier rank 0 created in shared memory before starting this rank."""
    runtime = ParallelRuntime(config.deployment, _started_rank_main, (config, host_tier), config.parallel.timeout_s,
                              _device(config).type)
    worker = Worker.build(config, runtime, host_tier=host_tier, tier_blocks=num_tier_blocks(config))
    # This process is the library's own and everything built so far lives as long as it: keep it out of the
    # cyclic collector, whose full passes over torch's objects took ~230 ms every few hundred steps
    # (bench_engine.py).
    gc.collect()
    gc.freeze()
    worker.serve_forever()
    runtime.close_local()
