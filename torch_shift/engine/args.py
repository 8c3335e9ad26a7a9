"""Engine arguments: `EngineArgs`, flat and named as in vLLM (its and ArcticInference's names of the parallel
degrees accepted as aliases), checked once when made; `EngineConfig`, the nested frozen configuration every
part of the engine reads, derived from them and from the model's config.json (in the spirit of vLLM's
VllmConfig).

Defaults live here only: the command line (torch_shift.cli) builds its engine flags from EngineArgs' fields.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from torch_shift.attention import canonical_backend_name
from torch_shift.config import CacheConfig, ModelConfig, SchedulerConfig, context_scale, resolve_device, resolve_dtype
from torch_shift.engine.policies import POLICIES, policy_options
from torch_shift.engine.sampling_params import MAX_SEED
from torch_shift.engine.spec_decode import SpeculativeConfig
from torch_shift.parallel.layouts import Deployment, build_deployment
from torch_shift.parallel.plan import validate_expert_parallel
from torch_shift.parallel.runs import MAX_RUN_STEPS

logger = logging.getLogger(__name__)

# The same arguments under the names users of vLLM and ArcticInference arrive with.
ENGINE_ARG_ALIASES = {
    "tensor_parallel_size": "tp",
    "ulysses_sequence_parallel_size": "sp",
    "shift_parallel_threshold": "shift_threshold",
    "data_parallel_size": "dp",
    "pipeline_parallel_size": "pp",
}
_NOT_GIVEN: Any = object()


def check_alias_pairs(engine_args: dict[str, Any]) -> None:
    """Keyword arguments that give both names of one argument must agree (EngineArgs' fields cannot tell a short
    name given at its default, `tp=1`, from one left out). An alias at the `_NOT_GIVEN` sentinel was not given."""
    for alias, name in ENGINE_ARG_ALIASES.items():
        if (engine_args.get(alias, _NOT_GIVEN) is not _NOT_GIVEN and name in engine_args
                and engine_args[alias] != engine_args[name]):
            raise ValueError(f"{alias}={engine_args[alias]!r} and {name}={engine_args[name]!r} disagree; give one "
                             "of them")


COMPILE_MIN_PARAMETERS = 50_000_000  # compile=None compiles one rank's model from this size up
# num_scheduler_steps=None in offline generation on the CPU: 8 steps a plan ran two-rank batch-1 decode at 0.92-0.94x
# the TPOT of single steps (docs/performance.md, "Several decode steps per plan"), and one rank's batch-1 decode at
# 0.90-0.98x (bfloat16) and 0.96-0.98x (float32) that of asynchronous single steps, 64 requests' throughput level
# ("Runs of 8 steps at one rank too")
OFFLINE_SCHEDULER_STEPS = 8


def _arg(default: Any, help: str, *, flags: tuple[str, ...] = (), choices: tuple | None = None,
         group: str = "engine") -> Any:
    """A field of EngineArgs and its command-line option: `--field-name` plus `flags` (vLLM's names), the
    help text, the choices, and the option group (torch_shift.cli builds its engine options from these)."""
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices, "group": group})


@dataclass
class EngineArgs:
    """Engine arguments, named as in vLLM where the concept is the same; each field carries its command-line
    option (`torch-shift generate/serve --help`)."""

    model: str = _arg(None, "checkpoint directory or Hugging Face hub id (`LLM()` and the CLI take the embedded "
                            "default model when none is given)")
    tokenizer: str | None = _arg(None, "tokenizer directory (default: the model's)")
    revision: str | None = _arg(None, "hub revision of the model")
    generation_config: str = _arg("auto", "sampling defaults of requests that leave them out: 'auto' the model's "
                                          "generation_config.json (temperature, top_p, top_k, min_p, penalties, "
                                          "max_new_tokens; vLLM's default), 'vllm' none, or a directory holding one")
    dtype: str = _arg("auto", "weights and activations ('auto': the checkpoint's; also bf16, fp16, half, fp32)",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str | None = _arg(None, "cpu or cuda (default: cuda when available)")
    seed: int | None = _arg(0, "seed of the sampling of requests without a seed of their own (None: a fresh one; on "
                               "the command line the default, so that sampling differs between runs)")
    max_model_len: int | None = _arg(None, "context length: prompt plus generated tokens (default: the model's)")
    max_num_batched_tokens: int = _arg(2048, "token budget of one step")
    max_num_seqs: int = _arg(256, "requests running at once")
    max_logprobs: int = _arg(20, "the most logprobs a request may ask for, per generated or prompt token (-1: the "
                                 "whole vocabulary)")
    block_size: int = _arg(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _arg(None, "KV pool size in blocks (default: sized from memory)")
    kv_cache_memory_bytes: int | None = _arg(None, "KV cache memory per rank in bytes (default: sized from memory)")
    gpu_memory_utilization: float = _arg(0.9, "CUDA: fraction of device memory the engine may use in all")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of a shared prompt prefix")
    scheduling_policy: str = _arg("fcfs", "waiting requests in arrival order, or by priority (lower first) then "
                                          "arrival", choices=("fcfs", "priority"))
    attention_backend: str = _arg("auto", "'auto': the paged Triton kernel on a GPU, the paged CPU kernel on the "
                                          "CPU, else sdpa; cpu, sdpa (gather + SDPA, any device), flex (GPUs; on the "
                                          "CPU compiled per shape, for tests), triton "
                                          "(vLLM's names too: CPU_ATTN, TORCH_SDPA, FLEX_ATTENTION, TRITON_ATTN)")
    compile: bool | None = _arg(None, "torch.compile each layout's forward, compiled and warmed up at start-up "
                                       "(default: on where it is faster: a model of 50M parameters or more, on "
                                       "the CPU at any number of ranks, on a GPU with one rank; --enforce-eager: "
                                       "vLLM's name for --no-compile)",
                                flags=("--enforce-eager",))
    cuda_graphs: bool | None = _arg(None, "capture decode steps in CUDA graphs at start-up (default: on with one "
                                          "rank on a GPU and the triton attention backend; --enforce-eager: off)")
    async_scheduling: bool | None = _arg(None, "schedule and launch the next step while this one's tokens are still "
                                               "on the device, where the host's work would otherwise leave it idle "
                                               "(default: on with one rank, on a GPU without speculative decoding "
                                               "and on the CPU where the C++ decoder runs the small steps and "
                                               "steps run singly (num_scheduler_steps) or beside speculative "
                                               "decoding; with speculative decoding, the steps after which nothing "
                                               "is proposed, where a multi-step run does not take them)")
    num_scheduler_steps: int | None = _arg(None, "decode steps one step plan runs on every rank, where every "
                                                 "running request decodes (greedy, or sampled without penalties, "
                                                 "bias, grammar or logprobs) and nothing waits (vLLM v0's "
                                                 "multi-step scheduling: rank 0's host work and the plan's broadcast "
                                                 "once for them all; tokens reach the outputs in runs of that many; "
                                                 "a run ends early after a step that drew a request's stop token "
                                                 "or in which a request reached the server; with speculative "
                                                 "decoding, only the steps after which nothing is proposed; "
                                                 "default: 8 in offline generation (LLM, `generate`) on the CPU, "
                                                 "but for one rank given async_scheduling; else 1)")
    prepack_weights: bool = _arg(True, "linear weights in oneDNN's packed layout on the CPU (packed once at load)")
    decode_pool: bool = _arg(True, "on the CPU, steps of at most 64 tokens run their matmuls "
                                   "on threads of the GEMV kernel's own, which read the next weights while the step's "
                                   "other work runs")
    native_decode: bool = _arg(True, "on the CPU, a dense model's steps of at most 64 tokens on one rank, or on each "
                                     "rank of a tensor-parallel layout (TP, Shift's TP steps, Flying's TP groups, "
                                     "Seesaw's TP decode), and an SP rank's share of such steps (Ulysses' all-to-alls "
                                     "inside), run in one C++ call (embedding, layers, LM head; bitwise the eager "
                                     "forward) instead of its forward")
    speculative_config: dict | None = _arg(None, "speculative decoding as vLLM's speculative_config (JSON on the command "
                                                 "line), e.g. '{\"method\": \"suffix\"}' or '{\"method\": \"ngram\", "
                                                 "\"num_speculative_tokens\": 4}' (docs/speculative.md)")
    # parallel layouts (torch_shift.parallel.layouts) and the policy that switches between them
    sp: int = _arg(1, "Ulysses sequence-parallel degree of the base layout (shift parallelism, paper 000)",
                   flags=("--ulysses-sequence-parallel-size",), group="parallel")
    tp: int = _arg(1, "tensor-parallel degree (inside each data-parallel replica)",
                   flags=("--tensor-parallel-size", "-tp"), group="parallel")
    dp: int = _arg(1, "data-parallel replicas, each with its own KV pool", flags=("--data-parallel-size", "-dp"),
                   group="parallel")
    pp: int = _arg(1, "pipeline stages of each replica (with --policy seesaw: prefill in PP, decode in TP)",
                   flags=("--pipeline-parallel-size", "-pp"), group="parallel")
    policy: str | None = _arg(None, "layout switching policy (default: shift for --sp > 1, else static; flying: DP "
                                    "replicas bound into TP groups on demand, paper 004; seesaw: prefill in PP, "
                                    "decode in TP over the same ranks, paper 003)",
                              choices=("static", "shift", "flying", "seesaw", "random"), group="parallel")
    policy_config: dict | None = _arg(None, "the policy's options as JSON, e.g. '{\"dp_above\": 4}' for flying",
                                      group="parallel")
    shift_threshold: int | None = _arg(256, "steps with more tokens run the base layout, others full TP over SP x TP; "
                                            "'none': the base layout only", flags=("--shift-parallel-threshold",),
                                       group="parallel")
    shift_weights: str = _arg("copy", "shift-layout weight shards as contiguous copies (+1/SP weight memory) or "
                                      "zero-copy views (without --prepack-weights: packing copies both)",
                              choices=("copy", "view"), group="parallel")
    flying_weights: str = _arg("copy", "Flying's TP shards: packed copies (+1/width of the weights per TP width on "
                                       "each rank), or zero-copy views of each replica's weights (not packed)",
                               choices=("copy", "view"), group="parallel")
    seesaw_weights: str = _arg("resident", "Seesaw's inactive layer weights resident, or a host copy swapped in at "
                                           "each transition", choices=("resident", "host"), group="parallel")
    enable_expert_parallel: bool = _arg(False, "a mixture of experts' experts split whole across the ranks (over TP, "
                                               "or over SP with tp 1: tokens dispatched by all-to-all), instead of "
                                               "each expert's FFN split by TP (docs/moe.md)", group="parallel")
    cpu_kv_gb: float | None = _arg(None, "host tier of the KV cache in GiB, shared by the local ranks (swap space; "
                                         "seesaw buffers prefilled requests there; default: 4 for seesaw, none "
                                         "otherwise)", flags=("--swap-space",), group="parallel")
    num_cpu_kv_blocks: int | None = _arg(None, "the host tier's size in blocks instead of --cpu-kv-gb",
                                         group="parallel")
    kv_swap: str = _arg("sync", "tier copies before the step's forward (sync) or in a thread beside it (async)",
                        choices=("sync", "async"), group="parallel")
    interconnect_gbps: float | None = _arg(None, "emulate a link of this bandwidth (GB/s) on every transfer",
                                           group="parallel")
    distributed_timeout_s: float = _arg(120.0, "seconds any collective may wait: a stuck or dead rank ends the "
                                               "engine within it", flags=("--distributed-timeout",),
                                        group="parallel")
    tensor_parallel_size: InitVar[int] = _NOT_GIVEN
    ulysses_sequence_parallel_size: InitVar[int] = _NOT_GIVEN
    shift_parallel_threshold: InitVar[int | None] = _NOT_GIVEN
    data_parallel_size: InitVar[int] = _NOT_GIVEN
    pipeline_parallel_size: InitVar[int] = _NOT_GIVEN
    enforce_eager: InitVar[bool] = _NOT_GIVEN  # vLLM's: True is compile=False

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} | set(ENGINE_ARG_ALIASES) | {"enforce_eager"}

    def __post_init__(self, tensor_parallel_size, ulysses_sequence_parallel_size, shift_parallel_threshold,
                      data_parallel_size, pipeline_parallel_size, enforce_eager) -> None:
        if enforce_eager is not _NOT_GIVEN:
            if not isinstance(enforce_eager, bool):
                raise TypeError(f"enforce_eager must be a bool, got {enforce_eager!r}")
            if enforce_eager and self.compile:
                raise ValueError("enforce_eager=True and compile=True disagree; give one of them")
            if enforce_eager and self.cuda_graphs:
                raise ValueError("enforce_eager=True and cuda_graphs=True disagree; give one of them")
            if enforce_eager:
                self.compile = False
                self.cuda_graphs = False
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
        self._check()

    def _check(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"model must be a checkpoint directory or a hub id, got {self.model!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**63 - 1] or None, got {self.seed!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)) or not str(self.generation_config):
            raise TypeError(f"generation_config is 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if str(self.generation_config) not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config {str(self.generation_config)!r}: 'auto', 'vllm' or a directory "
                             "holding a generation_config.json (no such directory)")
        if self.tokenizer is not None and not (isinstance(self.tokenizer, (str, os.PathLike)) and str(self.tokenizer)):
            raise TypeError(f"tokenizer must be a directory, got {self.tokenizer!r}")
        for name in ("sp", "tp", "dp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("cpu_kv_gb", "interconnect_gbps", "distributed_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if value is not None and (not value >= 0 or value == float("inf")):
                bound = "> 0" if name == "distributed_timeout_s" else ">= 0"  # one message for every bad timeout
                raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
        if self.interconnect_gbps == 0:
            raise ValueError("interconnect_gbps must be > 0 (None: no emulated link)")
        if self.interconnect_gbps is not None and resolve_device(self.device).type == "cuda":
            # its transfers wait on a thread of their own and NCCL matches sends by posting order, not by tag
            raise ValueError("interconnect_gbps emulates a link between CPU ranks; it cannot run on a GPU (give "
                             "device='cpu')")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be a finite number > 0, got {self.distributed_timeout_s!r}")
        for name in ("num_cpu_kv_blocks", "num_kv_blocks", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value is not None and value < (0 if name == "num_cpu_kv_blocks" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'num_cpu_kv_blocks' else 1}, got {value!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, options in (("kv_swap", ("sync", "async")), ("seesaw_weights", ("resident", "host")),
                              ("shift_weights", ("copy", "view")), ("flying_weights", ("copy", "view")),
                              ("scheduling_policy", ("fcfs", "priority"))):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be {' or '.join(map(repr, options))}, got {getattr(self, name)!r}")
        for name in ("compile", "cuda_graphs", "async_scheduling", "prepack_weights", "decode_pool", "native_decode",
                     "enable_prefix_caching", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool) and not (name in ("compile", "cuda_graphs", "async_scheduling")
                                                                   and getattr(self, name) is None):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.num_scheduler_steps is not None and (isinstance(self.num_scheduler_steps, bool)
                                                     or not isinstance(self.num_scheduler_steps, int)
                                                     or not 1 <= self.num_scheduler_steps <= MAX_RUN_STEPS):
            raise ValueError(f"num_scheduler_steps must be an int from 1 to {MAX_RUN_STEPS} or None, got "
                             f"{self.num_scheduler_steps!r}")
        if (self.num_scheduler_steps or 1) > 1 and self.async_scheduling and self.speculative_config is None:
            raise ValueError("num_scheduler_steps > 1 runs its steps synchronously: leave async_scheduling unset or "
                             "False (with speculative decoding both may be given: runs take the steps after which "
                             "nothing is proposed, and single steps run ahead of the host elsewhere)")
        if self.shift_threshold is not None and (isinstance(self.shift_threshold, bool)
                                                 or not isinstance(self.shift_threshold, int)
                                                 or self.shift_threshold < 0):
            raise ValueError(f"shift_threshold must be an int >= 0 or None, got {self.shift_threshold!r}")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {self.policy!r}")
        if self.policy_config is not None and not isinstance(self.policy_config, dict):
            raise TypeError(f"policy_config must be a dict of the policy's options, got "
                            f"{type(self.policy_config).__name__}")
        self.attention_backend = canonical_backend_name(self.attention_backend)
        resolve_dtype(self.dtype)  # the name is known
        SpeculativeConfig.from_user(self.speculative_config)  # its options are checked now

    def policy_options(self, deployment: Deployment) -> Any:
        """The options dataclass of the policy that will run `deployment`."""
        name = self.policy or deployment.default_policy
        config = dict(self.policy_config or {})
        if name == "shift":  # its threshold is an engine argument (ArcticInference's shift_parallel_threshold)
            if config:
                raise ValueError(f"policy 'shift' takes no policy_config (its threshold is shift_threshold), got "
                                 f"{sorted(config)}")
            config["threshold"] = self.shift_threshold
        if name == "random":
            config.setdefault("seed", self.seed)
        return policy_options(name, config)

    def _compiles(self, model_config: ModelConfig, deployment: Deployment) -> bool:
        """compile=None: on where it is faster. Measured (bench_peers.py, bench_gpu.py, docs/performance.md): one
        rank on the CPU gains 7-8% of throughput with a 106M model; two ranks of one core each, the compiled and
        eager forwards alternating in one engine, take 0.89x the batch-1 decode step under TP-2, 0.93x under
        Shift and Flying, 0.97x under DP-2, for 15-30 s more at start-up, and bench_moe.py's Mixtral under TP-2
        0.87x since its experts run in C++ (1.03-1.05x before, when each layer's routing ran in Python either way);
        a small model's compile time (20-40 s on 2 cores) outweighs what it saves in any run shorter than hours. On
        a GPU (H200, a 1.1B model, with CUDA graphs) one rank's decode steps take 0.71x the time, a 2k prompt 0.83x,
        for 20 s more at start-up; several ranks on GPUs are not measured."""
        if self.compile is not None:
            return self.compile
        if model_config.num_parameters < COMPILE_MIN_PARAMETERS:
            return False
        if resolve_device(self.device).type == "cuda":
            from torch_shift.attention import _has_triton

            return deployment.world_size == 1 and _has_triton()  # inductor's GPU kernels are Triton's
        from torch_shift.kernels import compiler

        return resolve_device(self.device).type == "cpu" and compiler() is not None

    def _captures(self, deployment: Deployment) -> bool:
        """cuda_graphs=None: on wherever they can be (one rank on a GPU, the Triton attention backend)."""
        from torch_shift.attention import attention_backend

        device = resolve_device(self.device)
        possible = device.type == "cuda" and deployment.world_size == 1 and len(deployment.layouts) == 1
        if possible:
            try:
                possible = attention_backend(self.attention_backend, device, torch.bfloat16).name == "triton"
            except ValueError:
                possible = False
        if self.cuda_graphs and not possible:
            raise ValueError("cuda_graphs=True needs one rank on a GPU (device='cuda') with the 'triton' attention "
                             "backend")
        return possible if self.cuda_graphs is None else self.cuda_graphs

    def _schedules_async(self, deployment: Deployment, num_scheduler_steps: int) -> bool | None:
        """async_scheduling=None: on with one rank on a GPU and no speculative decoding; on the CPU, None: the
        engine turns it on where its runner launches the C++ decoder's small steps on a thread of their own
        (torch_shift.engine.model_runner), since elsewhere a CPU step runs in the calling thread and there is nothing
        to overlap (True is allowed there, as a test of the path). With speculative decoding only the steps after
        which nothing is proposed run ahead (torch_shift.engine.core); on a GPU that is asked for (True), not
        measured there yet. Beside multi-step runs (`num_scheduler_steps`, as _scheduler_steps resolved it) only with
        speculative decoding, whose quiet steps the runs take where they run two or more (EngineCore.step)."""
        possible = deployment.world_size == 1 and (num_scheduler_steps == 1 or self.speculative_config is not None)
        if self.async_scheduling and deployment.world_size > 1:
            raise ValueError("async_scheduling=True needs one rank (tp, sp, dp and pp 1)")
        if self.async_scheduling and num_scheduler_steps > 1 and resolve_device(self.device).type != "cpu":
            raise ValueError("async_scheduling=True beside num_scheduler_steps > 1 (speculative decoding) runs on the "
                             "CPU only")
        if self.async_scheduling is None:
            if not possible:
                return False
            if resolve_device(self.device).type == "cuda":
                return self.speculative_config is None
            return None
        return self.async_scheduling

    def _scheduler_steps(self, deployment: Deployment, offline: bool) -> int:
        """num_scheduler_steps=None: OFFLINE_SCHEDULER_STEPS in offline generation (`offline`: LLM, where no request
        arrives while a run computes) on the CPU: several ranks' host work and plan broadcast nothing overlaps
        (asynchronous scheduling needs one rank), and one rank's, which its asynchronous steps overlap, takes a
        share of the cores the decode pool's GEMVs stream on. With speculative decoding runs take the steps after
        which nothing is proposed (EngineCore), at one rank beside single steps that run ahead of the host (a batch at
        `disable_by_batch_size` in single steps made 0.97x the plain engine's throughput, in runs 1.01x:
        docs/performance.md). 1 elsewhere: requests that arrive between steps (serve, LLMEngine) would wait for a run,
        a GPU's steps are not measured with runs, and one rank given `async_scheduling` steps as asked."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        if (offline and resolve_device(self.device).type == "cpu"
                and (deployment.world_size > 1 or self.async_scheduling is None)):
            return OFFLINE_SCHEDULER_STEPS
        return 1

    def create_engine_config(self, model_config: ModelConfig, model_dir: Path | None = None,
                             dtype: torch.dtype | None = None, offline: bool = False) -> EngineConfig:
        """The engine's configuration for a model (`dtype`: that of a model already built, which holds; `offline`:
        for LLM's offline generation, see _scheduler_steps)."""
        if dtype is None:
            dtype = resolve_dtype(self.dtype, model_config.torch_dtype)
            if dtype == torch.float16 and self.dtype in (None, "auto") and resolve_device(self.device).type == "cpu":
                logger.warning("the checkpoint's dtype is float16, which a CPU computes at a fraction of float32's "
                               "rate (a 512-token prompt 10x slower on a Xeon without AMX-FP16): dtype='float32' "
                               "holds float16 weights exactly, dtype='bfloat16' in half their memory")
        if self.attention_backend == "flex" and resolve_device(self.device).type == "cpu":
            logger.warning("attention_backend 'flex' on the CPU compiles FlexAttention again for each new shape of a "
                           "step's queries and context (inductor's CPU kernel takes no dynamic shapes) and runs it "
                           "uncompiled past torch's recompile limit: minutes where the paged CPU kernel takes seconds. "
                           "It is there to test the GPU's path; serve with 'auto' (the paged CPU kernel) or 'sdpa'")
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            rope = model_config.rope
            scale = context_scale(rope, model_config.family)
            yarn_context = (round(rope.original_max_position_embeddings * rope.factor) if rope.rope_type == "yarn"
                            else 0)
            remedy = (f": YaRN's factor {rope.factor:g} over {rope.original_max_position_embeddings} tokens reaches "
                      f"{yarn_context}, and transformers and vLLM 0.32 take max_position_embeddings as YaRN's whole "
                      f"context, so set max_position_embeddings to {yarn_context} in config.json to serve that"
                      if yarn_context > model_config.max_position_embeddings else "")
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of "
                             f"{model_config.max_position_embeddings} tokens (config.json's max_position_embeddings"
                             + (f" x its linear rope factor {scale:g}" if scale != 1.0 else "") + f"){remedy}")
        model_config = model_config.for_context(max_model_len)
        deployment = build_deployment(
            model_config, sp=self.sp, tp=self.tp, dp=self.dp, pp=self.pp,
            flying=self.policy in ("flying", "random") and self.dp > 1, seesaw=self.policy == "seesaw",
            shift=self.shift_threshold is not None, expert_parallel=self.enable_expert_parallel)
        if self.enable_expert_parallel:
            if self.dp > 1 or self.pp > 1:
                raise ValueError("enable_expert_parallel splits the experts over one replica's TP or SP ranks; "
                                 f"not with dp={self.dp} or pp={self.pp} (DP, Flying, PP, Seesaw)")
            validate_expert_parallel(model_config, self.sp, self.tp)
        tokenizer_dir = Path(self.tokenizer) if self.tokenizer else model_dir
        if self.tokenizer and not (tokenizer_dir / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer={self.tokenizer!r}: no tokenizer.json there")
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        if speculative is not None:
            speculative.check_context(max_model_len)
        num_scheduler_steps = self._scheduler_steps(deployment, offline)
        return EngineConfig(
            model=model_config, model_dir=model_dir, tokenizer_dir=tokenizer_dir, seed=self.seed,
            deployment=deployment, policy=self.policy or deployment.default_policy,
            policy_options=self.policy_options(deployment),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
                                      policy=self.scheduling_policy, max_logprobs=self.max_logprobs,
                                      async_scheduling=self._schedules_async(deployment, num_scheduler_steps),
                                      num_scheduler_steps=num_scheduler_steps),
            parallel=ParallelConfig(shift_threshold=self.shift_threshold, shift_weights=self.shift_weights,
                                    flying_weights=self.flying_weights,
                                    seesaw_weights=self.seesaw_weights, expert_parallel=self.enable_expert_parallel,
                                    timeout_s=self.distributed_timeout_s,
                                    interconnect_gbps=self.interconnect_gbps),
            runner=RunnerConfig(dtype=dtype, device=self.device, attention_backend=self.attention_backend,
                                compile=self._compiles(model_config, deployment), prepack_weights=self.prepack_weights,
                                decode_pool=self.decode_pool, native_decode=self.native_decode,
                                cuda_graphs=self._captures(deployment)),
            tier=TierConfig(cpu_kv_gb=self.cpu_kv_gb, num_blocks=self.num_cpu_kv_blocks, kv_swap=self.kv_swap),
            speculative=speculative,
        )


def _refusing_disagreeing_aliases(dataclass_init):
    """EngineArgs' generated __init__, first checking its keywords' alias pairs: `tp=1, tensor_parallel_size=2`
    passed directly would otherwise read as tp left at its default. A call naming every field is
    `dataclasses.replace`'s, whose fields carry the old values: an alias given there replaces its field, as in
    vLLM, where `replace(args, tensor_parallel_size=2)` is the way to change it."""
    field_names = {f.name for f in fields(EngineArgs) if f.init}

    @functools.wraps(dataclass_init)
    def __init__(self, *args, **kwargs):
        if not field_names <= kwargs.keys():
            check_alias_pairs(kwargs)
        dataclass_init(self, *args, **kwargs)

    return __init__


EngineArgs.__init__ = _refusing_disagreeing_aliases(EngineArgs.__init__)


@dataclass(frozen=True)
class ParallelConfig:
    """How each rank builds its layouts' weights, and the bounds of its collectives."""

    shift_threshold: int | None = 256  # a ShiftModule's own forward picks its layout by it (the engine: the policy)
    shift_weights: str = "copy"
    flying_weights: str = "copy"
    seesaw_weights: str = "resident"
    expert_parallel: bool = False
    timeout_s: float = 120.0
    interconnect_gbps: float | None = None


@dataclass(frozen=True)
class RunnerConfig:
    """How each rank runs its model."""

    dtype: torch.dtype = torch.float32
    device: str | None = None  # None: cuda when available, else cpu
    attention_backend: str = "auto"
    compile: bool = False
    prepack_weights: bool = True
    decode_pool: bool = True  # ModelRunner.decode_pool
    native_decode: bool = True  # ModelRunner.native_decode
    cuda_graphs: bool = False


@dataclass(frozen=True)
class TierConfig:
    """The host tier of the KV cache: its size asked for (None: the deployment's default) and its copies."""

    cpu_kv_gb: float | None = None
    num_blocks: int | None = None
    kv_swap: str = "sync"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    model_dir: Path | None  # None: a model known by its config or built in memory
    tokenizer_dir: Path | None
    seed: int
    deployment: Deployment  # the replicas and every layout the engine may run
    policy: str  # the policy that switches between them
    policy_options: Any  # its options (a dataclass of torch_shift.engine.policies, or None)
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    speculative: SpeculativeConfig | None = None
    draft: Any = None  # the draft model's checkpoint (spec_decode.draft.DraftCheckpoint) for method "draft_model"

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def rank_fingerprint(self) -> dict[str, Any]:
        """What every rank of one program (torchrun) must build alike, by the options' names: the model's config,
        the deployment's shape and every engine option; not the directories (each rank may read its own copy) nor
        a CUDA device's index (each rank has its own)."""
        d = self.deployment
        fingerprint = {
            "model": self.model, "deployment": {"family": d.family, "sp": d.sp, "tp": d.tp, "pp": d.pp,
                                                "dp": d.num_replicas, "layouts": [layout.name for layout in d.layouts]},
            "seed": self.seed, "policy": self.policy, "policy_options": self.policy_options,
            "speculative_config": self.speculative, "draft model": None if self.draft is None else self.draft.config,
        }
        renamed = {"policy": "scheduling_policy", "expert_parallel": "enable_expert_parallel",
                   "timeout_s": "distributed_timeout_s", "num_blocks": "num_cpu_kv_blocks"}
        for section in (self.cache, self.scheduler, self.parallel, self.runner, self.tier):
            for f in fields(section):
                fingerprint[renamed.get(f.name, f.name)] = getattr(section, f.name)
        fingerprint["device"] = resolve_device(self.runner.device).type
        return fingerprint
