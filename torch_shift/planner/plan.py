"""`torch-shift plan`: simulate every candidate deployment on a request stream and recommend one.

Candidates for a world of W devices: static layouts (DP x TP for each TP width dividing W, SP-W, PP-W),
Shift (SP-W base, TP-W for steps of at most a threshold of tokens) over a sweep of thresholds, Flying
(DP-W replicas merged into TP groups, split into DP under load) over a sweep of that load, and Seesaw (PP-W
prefill, TP-W decode through the host tier). Each runs through the real engine's scheduler and policy with the
cost model's step times (`torch_shift.planner.simulate`); a candidate that cannot run (the model does not split
that way, its weights do not fit) is reported with the reason.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch_shift.bench.traffic import RequestSpec, read_trace
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs
from torch_shift.engine.worker import cpu_kv_budget_bytes
from torch_shift.planner.cost import Layout, memory_per_rank
from torch_shift.planner.hardware import HardwareProfile
from torch_shift.planner.shape import ModelShape
from torch_shift.planner.simulate import CostModelTimer, SimulatedEngine, SimulationResult, simulate

POLICIES = ("dp", "tp", "sp", "pp", "shift", "flying", "seesaw")
DEFAULT_THRESHOLDS = (32, 64, 128, 256, 512, 1024, 2048)
# Flying's `dp_above` (requests per replica at which its TP groups split into DP replicas; None: never on load). Its
# default (4) split a 2-core CPU's TP-2 into one-core replicas that served 15% fewer requests a second and tripled
# the bursts' TPOT (docs/performance.md, 2026-12-03): where DP pays depends on the machine.
DEFAULT_DP_ABOVE = (2.0, 4.0, 8.0, 16.0, None)
SLO_METRICS = {"ttft": "ttft_p90_ms", "tpot": "tpot_p90_ms", "e2e": "e2e_p50_ms"}


@dataclass
class Candidate:
    policy: str  # "dp", "tp", "sp", "pp" (static layouts) or "shift", "flying", "seesaw"
    params: dict
    engine_args: dict  # EngineArgs fields
    weights: tuple[Layout, ...] = ()  # the layouts whose weights a rank holds; () derives them from policy and params

    @property
    def label(self) -> str:
        p = self.params
        ep = "+EP" if self.engine_args.get("enable_expert_parallel") else ""
        if self.policy == "dp":
            return f"DP{p['dp']}" + (f"xTP{p['tp']}" if p["tp"] > 1 else "")
        if self.policy == "tp":
            return f"TP{p['tp']}" + ep
        if self.policy == "sp":
            return f"SP{p['sp']}" + (f"xTP{p['tp']}" if p["tp"] > 1 else "") + ep
        if self.policy == "pp":
            return f"PP{p['pp']}"
        if self.policy == "shift":
            return f"Shift SP{p['sp']}->TP{p['sp'] * p['tp']}{ep} @{p['threshold']}"
        if self.policy == "flying":
            return f"Flying DP{p['dp']} ({_dp_above_text(p['dp_above'])})"
        return f"Seesaw P{p['pp']}->T{p['pp']} ({p['cpu_kv_gb']:g} GiB tier)"


def _dp_above_text(dp_above: float | None) -> str:
    return "never DP on load" if dp_above is None else f"dp_above {dp_above:g}"


@dataclass
class CandidateResult:
    candidate: Candidate
    metrics: dict | None = None
    memory: dict | None = None  # per rank: weight and KV bytes
    error: str | None = None  # why it cannot run
    simulation: SimulationResult | None = field(default=None, repr=False)  # every request and step

    def to_json(self) -> dict:
        out = {"policy": self.candidate.policy, "params": self.candidate.params, "label": self.candidate.label}
        if self.error is not None:
            out["error"] = self.error
        else:
            out.update(self.metrics)
            out.update(self.memory)
        return out


def load_model_config(path: str | Path) -> ModelConfig:
    """A model directory (weights optional) or a config.json file."""
    return ModelConfig.from_dir(path)


def candidates(world: int, policies: Sequence[str] = POLICIES, thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
               cpu_kv_gb: float = 64.0, dp_above: Sequence[float | None] = DEFAULT_DP_ABOVE,
               num_experts: int = 0) -> list[Candidate]:
    """The configurations `plan` simulates (Shift at each of `thresholds`, Flying at each of `dp_above`); for a
    mixture of experts whose `num_experts` the world divides, TP, SP and Shift also with the experts split whole
    over the ranks (`enable_expert_parallel`)."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    out: list[Candidate] = []
    for policy in policies:
        if policy == "dp":
            for tp in (t for t in range(1, world) if world % t == 0):
                out.append(Candidate("dp", {"dp": world // tp, "tp": tp}, {"dp": world // tp, "tp": tp}))
        elif policy == "tp":
            out.append(Candidate("tp", {"tp": world}, {"tp": world}))
        elif policy == "sp" and world > 1:
            out.append(Candidate("sp", {"sp": world, "tp": 1}, {"sp": world, "shift_threshold": None}))
        elif policy == "pp" and world > 1:
            out.append(Candidate("pp", {"pp": world}, {"pp": world}))
        elif policy == "shift" and world > 1:
            for threshold in thresholds:
                out.append(Candidate("shift", {"sp": world, "tp": 1, "threshold": threshold},
                                     {"sp": world, "shift_threshold": threshold, "shift_weights": "view"}))
        elif policy == "flying" and world > 1:
            for value in dp_above:
                out.append(Candidate("flying", {"dp": world, "dp_above": value},
                                     {"dp": world, "policy": "flying", "policy_config": {"dp_above": value},
                                      "flying_weights": "view"}))
        elif policy == "seesaw" and world > 1:
            out.append(Candidate("seesaw", {"pp": world, "cpu_kv_gb": cpu_kv_gb},
                                 {"pp": world, "policy": "seesaw"}))
    if world > 1 and num_experts and num_experts % world == 0:
        out += [Candidate(c.policy, c.params, {**c.engine_args, "enable_expert_parallel": True})
                for c in out if c.policy in ("tp", "sp", "shift")]
    return out


def weight_layout(candidate: Candidate) -> list[Layout]:
    """The cost model's layouts whose weights a rank of the candidate holds (Seesaw: a stage and a TP shard)."""
    if candidate.weights:
        return list(candidate.weights)
    p = candidate.params
    ep = bool(candidate.engine_args.get("enable_expert_parallel"))
    if candidate.policy in ("dp", "tp"):
        return [Layout("tp", tp=p["tp"], expert_parallel=ep and p["tp"] > 1)]
    if candidate.policy in ("sp", "shift"):  # shift weights are views (shift_weights="view")
        return [Layout("sp_tp", sp=p["sp"], tp=p["tp"], expert_parallel=ep)]
    if candidate.policy == "flying":
        return [Layout("tp", tp=1)]  # TP groups are views of every replica's full weights
    if candidate.policy == "pp":
        return [Layout("pp", pp=p["pp"])]
    return [Layout("pp", pp=p["pp"]), Layout("tp", tp=p["pp"])]


def pool_blocks(shape: ModelShape, hw: HardwareProfile, candidate: Candidate, block_size: int,
                memory_utilization: float, max_num_seqs: int, max_model_len: int) -> tuple[int, dict]:
    """KV blocks of one replica's pool (per rank: device memory x utilization less the weights, and on CPU
    ranks less their share of Seesaw's host tier), capped as the engine caps them (every sequence slot filled
    to max_model_len), and the memory per rank."""
    layouts = weight_layout(candidate)
    mems = [memory_per_rank(shape, layout) for layout in layouts]
    weights = sum(m.weight_bytes for m in mems)
    kv_per_token = mems[0].kv_bytes_per_token  # the same bytes per block under every view of a pool
    usable = hw.device_memory_bytes * memory_utilization
    free = usable - weights
    if free <= 0:
        raise ValueError(f"weights of {weights / 2**30:.1f} GiB per rank do not fit in {usable / 2**30:.1f} GiB")
    tier_gb = candidate.params.get("cpu_kv_gb", 0.0) if candidate.policy == "seesaw" else 0.0
    if tier_gb and hw.memory_is_host:
        free -= tier_gb * 2**30 / candidate.params["pp"]  # the local ranks share one tier
        if free <= 0:
            raise ValueError(f"a host KV tier of {tier_gb:g} GiB and weights of {weights / 2**30:.1f} GiB per rank "
                             f"do not fit in {usable * candidate.params['pp'] / 2**30:.1f} GiB: these ranks' memory "
                             "is the host's, which the tier shares (--cpu-kv-gb)")
    blocks = int(free // (kv_per_token * block_size))
    blocks = min(blocks, max_num_seqs * math.ceil(max_model_len / block_size))
    return blocks, {"weight_bytes_per_rank": weights, "kv_bytes_per_rank": blocks * block_size * kv_per_token}


def default_tier_gb(hw: HardwareProfile) -> float:
    """Seesaw's host tier when none is given: 64 GiB beside GPUs (a GPU server's host memory is several
    times its devices'); on CPU ranks what the engine takes there, a quarter of the memory up to 4 GiB."""
    if not hw.memory_is_host:
        return 64.0
    return cpu_kv_budget_bytes(hw.device_memory_bytes * hw.num_devices) / 2**30


def tier_blocks(shape: ModelShape, cpu_kv_gb: float, block_size: int) -> int:
    per_block = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.kv_bytes * block_size
    return int(cpu_kv_gb * 2**30 // per_block)


def run_candidate(candidate: Candidate, config: ModelConfig, shape: ModelShape, hw: HardwareProfile,
                  requests: Sequence[RequestSpec], *, concurrency: int | None = None, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 2048, block_size: int = 16, max_model_len: int | None = None,
                  memory_utilization: float = 0.9, seed: int = 0) -> CandidateResult:
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    max_model_len = max_model_len or max(longest, min(config.max_position_embeddings, 8192))
    try:
        num_blocks, memory = pool_blocks(shape, hw, candidate, block_size, memory_utilization, max_num_seqs,
                                         max_model_len)
        extra = dict(candidate.engine_args)
        if candidate.policy == "seesaw":
            extra["num_cpu_kv_blocks"] = tier_blocks(shape, candidate.params["cpu_kv_gb"], block_size)
        args = EngineArgs("config-only", seed=seed, max_num_seqs=max_num_seqs, block_size=block_size,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, **extra)
        timer = CostModelTimer(shape, hw, block_size, async_swaps=args.kv_swap == "async",
                               expert_parallel=args.enable_expert_parallel)
        engine = SimulatedEngine.simulated(args, config, num_blocks, timer)
        if engine.max_request_tokens < longest:
            raise ValueError(f"the longest request ({longest} tokens) does not fit in the KV cache of the widest "
                             f"group ({engine.max_request_tokens} tokens)")
    except ValueError as e:
        return CandidateResult(candidate, error=str(e))
    result = simulate(engine, requests, concurrency=concurrency)
    return CandidateResult(candidate, result.metrics(), memory, simulation=result)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms' -> {"ttft": 500.0, "tpot": 50.0} (ms; 's' suffix for seconds): bounds on the
    90th percentile of TTFT and TPOT (e2e: on the median end-to-end latency)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name, value = name.strip().lower(), value.strip().lower()
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--slo takes NAME=VALUE pairs with NAME in {', '.join(SLO_METRICS)}, got {part!r}")
        scale = 1.0
        if value.endswith("ms"):
            value = value[:-2]
        elif value.endswith("s"):
            value, scale = value[:-1], 1e3
        try:
            slo[name] = float(value) * scale
        except ValueError:
            raise ValueError(f"--slo {part!r}: {value!r} is not a number of ms or s") from None
        if slo[name] <= 0:
            raise ValueError(f"--slo {part!r}: the bound must be positive")
    return slo


def parse_dp_above(text: str, flag: str = "--dp-above") -> list[float | None]:
    """'2,4,never' -> [2.0, 4.0, None]: Flying's loads to sweep (requests per replica; 'never': no split on load)."""
    values: list[float | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "never":
            values.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 1:  # Flying's default tp_below is 1
            raise ValueError(f"{flag} takes a comma list of loads >= 1 (requests per replica) or 'never', "
                             f"got {part!r}")
        values.append(value)
    return values


@dataclass
class Recommendation:
    result: CandidateResult
    reason: str
    best_threshold: int | None = None  # Shift's best threshold in the sweep
    flying_policy_config: dict | None = None  # the best `policy_config` of Flying's sweep (its `dp_above`)


# Throughputs this close count as a tie, which the median TTFT breaks: under an open-loop stream every candidate that
# keeps up serves the arrival rate, and what is left between them is when the last requests finish.
THROUGHPUT_TIE = 0.01


def recommend(results: Sequence[CandidateResult], slo: dict[str, float]) -> Recommendation:
    """The candidate with the highest throughput among those that meet the SLO (its TTFT p50 breaks ties, and
    throughputs within THROUGHPUT_TIE of the highest tie); when none meets it, the one that misses it by the
    smallest factor; without an SLO, by throughput."""
    ran = [r for r in results if r.error is None and r.metrics["num_finished"] == r.metrics["num_requests"]]
    if not ran:
        by_error: dict[str, list[str]] = {}  # one line per reason, not one per candidate
        for r in results:
            if r.error:
                by_error.setdefault(r.error, []).append(r.candidate.label)
        raise ValueError("no candidate could serve the workload: " + "; ".join(
            f"{error} ({', '.join(labels)})" for error, labels in by_error.items()))

    def miss(r: CandidateResult) -> float:
        return max([r.metrics[SLO_METRICS[k]] / bound for k, bound in slo.items()
                    if r.metrics[SLO_METRICS[k]] is not None] + [0.0])

    def fastest(pool: list[CandidateResult]) -> CandidateResult:
        top = max(r.metrics["throughput_tok_s"] for r in pool)
        tied = [r for r in pool if r.metrics["throughput_tok_s"] >= top * (1 - THROUGHPUT_TIE)]
        return min(tied, key=lambda r: (r.metrics["ttft_p50_ms"], -r.metrics["throughput_tok_s"]))

    def best_of(policy: str) -> CandidateResult | None:
        """The best of a policy's sweep (Shift's thresholds, Flying's dp_above)"""
        swept = [r for r in ran if r.candidate.policy == policy]
        if not swept:
            return None
        return fastest(([r for r in swept if miss(r) <= 1.0] if slo else swept) or swept)

    meeting = [r for r in ran if miss(r) <= 1.0]
    best_shift, best_flying = best_of("shift"), best_of("flying")
    bounds = ", ".join(f"{k.upper()} {'p90' if k != 'e2e' else 'p50'} <= {v:g} ms" for k, v in slo.items())
    if slo and meeting:
        best = fastest(meeting)
        reason = (f"the highest throughput ({best.metrics['throughput_tok_s']:.1f} tok/s, ties within "
                  f"{THROUGHPUT_TIE:.0%} broken by the median TTFT) of the {len(meeting)} of {len(ran)} candidates "
                  f"that meet {bounds}")
    elif slo:
        best = min(ran, key=miss)
        reason = f"no candidate meets {bounds}; this one misses it by the smallest factor ({miss(best):.2f}x)"
    else:
        best = fastest(ran)
        rate = f"{best.metrics['throughput_tok_s']:.1f} tok/s"
        if len(results) == 1:
            reason = f"the only candidate simulated ({rate})"
        elif len(ran) == 1:
            reason = f"the only one of {len(results)} candidates that served the whole workload ({rate})"
        else:
            reason = (f"the highest throughput ({rate}, ties within {THROUGHPUT_TIE:.0%}) of {len(ran)} candidates, "
                      f"then the lowest median TTFT ({best.metrics['ttft_p50_ms']:.1f} ms)")
    threshold = best_shift.candidate.params["threshold"] if best_shift else None
    if best_shift is not None:
        reason += (f"; Shift's sweep found threshold {threshold} best (TTFT p50 "
                   f"{best_shift.metrics['ttft_p50_ms']:.1f} ms, {best_shift.metrics['throughput_tok_s']:.1f} tok/s)")
    flying_config = None
    if best_flying is not None:
        flying_config = best_flying.candidate.engine_args["policy_config"]
        reason += (f"; Flying's sweep found {_dp_above_text(flying_config['dp_above'])} best (--policy-config "
                   f"'{json.dumps(flying_config)}': TTFT p50 {best_flying.metrics['ttft_p50_ms']:.1f} ms, "
                   f"{best_flying.metrics['throughput_tok_s']:.1f} tok/s)")
    return Recommendation(best, reason, threshold, flying_config)


# -- workloads --------------------------------------------------------------------------------------------
def trace_requests(path: Path, num: int | None, time_scale: float, rate: float | None, vocab_size: int,
                   seed: int = 0, max_prompt: int | None = None, max_output: int | None = None) -> list[RequestSpec]:
    """Requests with a trace's lengths (clipped to `max_prompt` and `max_output` where given): at its own arrival
    times divided by `time_scale` (all at once when it has none), or Poisson arrivals at `rate` per second."""
    rows = read_trace(path)
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    rows = rows[:num] if num else rows
    rng = random.Random(seed)
    if rate is not None:
        t, arrivals = 0.0, []
        for _ in rows:
            t += rng.expovariate(rate)
            arrivals.append(t)
    else:
        t0 = rows[0][0]
        arrivals = [(row[0] - t0) / time_scale for row in rows]
    rows = [(at, max(1, min(p, max_prompt or p)), max(1, min(o, max_output or o))) for at, p, o in rows]
    return [RequestSpec(f"r{i}", at, [rng.randrange(8, vocab_size) for _ in range(p)], o)
            for i, (at, (_, p, o)) in enumerate(zip(arrivals, rows))]


def synthetic_requests(prompt_len: int, output_len: int, num: int, rate: float | None, vocab_size: int,
                       seed: int = 0) -> list[RequestSpec]:
    """`num` requests of fixed lengths, Poisson at `rate` per second (all at once without a rate)."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(num):
        if rate is not None:
            t += rng.expovariate(rate)
        specs.append(RequestSpec(f"r{i}", t, [rng.randrange(8, vocab_size) for _ in range(prompt_len)], output_len))
    return specs


@dataclass
class PlanReport:
    results: list[CandidateResult]
    recommendation: Recommendation
    workload: str
    hardware: str
    model: str
    world: int
    slo: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        rec = self.recommendation
        return {"model": self.model, "hardware": self.hardware, "world": self.world, "workload": self.workload,
                "slo_ms": self.slo, "candidates": [r.to_json() for r in self.results],
                "recommended": {**rec.result.to_json(), "reason": rec.reason, "shift_threshold": rec.best_threshold,
                                "flying_policy_config": rec.flying_policy_config}}

    def table(self) -> str:
        head = (f"{'candidate':34} {'TTFT p50':>9} {'p90':>9} {'TPOT p50':>9} {'p90':>8} {'queue p50':>9} "
                f"{'tok/s':>9} {'weights/rank':>12} {'KV/rank':>9} {'switches':>8}")
        lines = [f"model {self.model} on {self.hardware}, world {self.world}; {self.workload}",
                 "latencies in ms; throughput: output tokens per second", head, "-" * len(head)]
        reasons: dict[str, int] = {}  # each reason a candidate cannot run, once, below the table
        for r in self.results:
            name = r.candidate.label + (" *" if r is self.recommendation.result else "")
            if r.error:
                note = reasons.setdefault(r.error, len(reasons) + 1)
                lines.append(f"{name:34} cannot run [{note}]")
                continue
            m = r.metrics

            def f(v, w=9, d=1):
                return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"
            unfinished = "" if m["num_finished"] == m["num_requests"] else f"  ({m['num_finished']} finished)"
            lines.append(f"{name:34} {f(m['ttft_p50_ms'])} {f(m['ttft_p90_ms'])} {f(m['tpot_p50_ms'])} "
                         f"{f(m['tpot_p90_ms'], 8)} {f(m['queue_p50_ms'])} {f(m['throughput_tok_s'])} "
                         f"{_size(r.memory['weight_bytes_per_rank']):>12} {_size(r.memory['kv_bytes_per_rank']):>9} "
                         f"{m['num_switches']:>8}{unfinished}")
        lines.append("")
        lines += [f"[{note}] {reason}" for reason, note in reasons.items()] + ([""] if reasons else [])
        lines.append(f"recommended: {self.recommendation.result.candidate.label}: {self.recommendation.reason}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ran = [r for r in self.results if r.error is None]
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in ran:
            marker = "*" if r is self.recommendation.result else "o"
            ax.scatter(r.metrics["throughput_tok_s"], r.metrics["ttft_p50_ms"], marker=marker, s=80)
            ax.annotate(r.candidate.label, (r.metrics["throughput_tok_s"], r.metrics["ttft_p50_ms"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_ylabel("median TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{self.model} on {self.hardware} (world {self.world}): {self.workload}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def plan(config: ModelConfig, shape: ModelShape, hw: HardwareProfile, requests: Sequence[RequestSpec], *,
         world: int, workload: str, model_name: str, policies: Sequence[str] = POLICIES,
         thresholds: Sequence[int] = DEFAULT_THRESHOLDS, dp_above: Sequence[float | None] = DEFAULT_DP_ABOVE,
         cpu_kv_gb: float | None = None, slo: dict | None = None, concurrency: int | None = None, log=None,
         **engine) -> PlanReport:
    """`cpu_kv_gb`: Seesaw's host tier (default: `default_tier_gb`)."""
    results = []
    cpu_kv_gb = default_tier_gb(hw) if cpu_kv_gb is None else cpu_kv_gb
    chosen = candidates(world, policies, thresholds, cpu_kv_gb, dp_above,
                        num_experts=config.num_experts if config.is_moe else 0)
    if log is not None:  # each one is a whole simulated serving run: seconds to minutes
        log(f"simulating {len(chosen)} candidates over {len(requests)} requests, one after another")
    for i, candidate in enumerate(chosen):
        result = run_candidate(candidate, config, shape, hw, requests, concurrency=concurrency, **engine)
        if log is not None:
            if result.error is None:
                log(f"[{i + 1}/{len(chosen)}] {candidate.label}: TTFT p50 {result.metrics['ttft_p50_ms']:.1f} ms, "
                    f"{result.metrics['throughput_tok_s']:.1f} tok/s")
            else:  # a reason said once (a model that does not split three ways stops every such candidate)
                said = any(r.error == result.error for r in results)
                log(f"[{i + 1}/{len(chosen)}] {candidate.label}: cannot run"
                    + (" (as above)" if said else f": {result.error}"))
        results.append(result)
    return PlanReport(results, recommend(results, slo or {}), workload, hw.name, model_name, world, slo or {})


def _size(num_bytes: float) -> str:
    """Bytes as GiB, or as MiB below a tenth of one (a small model's weights read 0.00Gi)."""
    return f"{num_bytes / 2**30:.2f}Gi" if num_bytes >= 2**30 / 10 else f"{num_bytes / 2**20:.1f}Mi"
