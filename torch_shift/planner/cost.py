"""The time of one engine step under a parallel layout: per-op roofline, alpha-beta collectives, the
pipeline's bubble and the engine's per-step overhead; and the memory a layout needs per rank.

A layout here is a small description of how one step runs (sizes only), for the planner to price;
the layouts the engine runs live in `torch_shift.parallel` and map onto these:
  - "tp":    Megatron TP over `tp` ranks (torch_shift's shift layout over P ranks is tp=P);
  - "sp_tp": Ulysses SP over `sp` x Megatron TP over `tp` (Shift's base layout);
  - "pp":    `pp` pipeline stages of `tp`-way TP each, a step cut into micro-batches (Seesaw's prefill);
  - "dp":    groups side by side, each a TP group of its own width (`group_tp`): static DP is
             (1, 1, ...), DP x TP (tp, tp, ...), Flying's mix e.g. (2, 1, 1).
Each rank of a group does the same work, so a group is priced by one of its ranks; under "dp" the step
lasts as long as its slowest group.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch_shift.planner import shape as ops
from torch_shift.planner.collectives import wire_bytes
from torch_shift.planner.hardware import HardwareProfile
from torch_shift.planner.shape import ModelShape, Op, Seq

LAYOUT_KINDS = ("tp", "sp_tp", "pp", "dp")


@dataclass(frozen=True)
class Layout:
    kind: str
    tp: int = 1
    sp: int = 1
    pp: int = 1
    group_tp: tuple[int, ...] = ()  # "dp": the TP width of each group
    num_microbatches: int | None = None  # "pp": micro-batches per step (default: pp, at most one per sequence)
    # whole experts split over the ranks ("tp", or "sp_tp" with tp 1: tokens dispatched by all-to-all), instead
    # of each expert's FFN split by TP (torch_shift.parallel.expert_parallel)
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"layout kind {self.kind!r} is unknown; known: {', '.join(LAYOUT_KINDS)}")
        for name in ("tp", "sp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        used = {"tp": ("tp",), "sp_tp": ("sp", "tp"), "pp": ("pp", "tp"), "dp": ()}[self.kind]
        extra = [n for n in ("tp", "sp", "pp") if n not in used and getattr(self, n) != 1]
        if extra:
            raise ValueError(f"a {self.kind!r} layout has no {extra[0]} (got {getattr(self, extra[0])})")
        if (self.kind == "dp") != bool(self.group_tp):
            raise ValueError("group_tp is given for, and only for, a 'dp' layout")
        if any(w < 1 for w in self.group_tp):
            raise ValueError(f"group widths must be >= 1, got {self.group_tp}")
        if self.num_microbatches is not None and (self.kind != "pp" or self.num_microbatches < 1):
            raise ValueError("num_microbatches is a positive count, for a 'pp' layout only")
        if self.expert_parallel and (self.kind not in ("tp", "sp_tp") or (self.sp > 1 and self.tp > 1)):
            raise ValueError("expert parallelism splits the experts over TP, or over SP with tp 1")

    @classmethod
    def dp_groups(cls, *widths: int) -> Layout:
        return cls("dp", group_tp=tuple(widths))

    @property
    def num_ranks(self) -> int:
        if self.kind == "dp":
            return sum(self.group_tp)
        return self.tp * self.sp * self.pp

    @property
    def name(self) -> str:
        if self.kind == "dp":
            widths = sorted(set(self.group_tp), reverse=True)
            return "+".join(f"{self.group_tp.count(w)}xTP{w}" if w > 1 else f"DP{self.group_tp.count(w)}"
                            for w in widths)
        name = {"tp": f"TP{self.tp}", "sp_tp": f"SP{self.sp}xTP{self.tp}", "pp": f"PP{self.pp}xTP{self.tp}"}[self.kind]
        return name + "+EP" if self.expert_parallel else name


# -- results ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpCost:
    """One kind of operation summed over the layers and micro-batches of the priced rank."""

    name: str
    flops: float
    bytes: float
    compute_s: float  # flops / achievable FLOP/s
    memory_s: float  # bytes / achievable bandwidth
    time_s: float  # sum of max(compute, memory) per call


@dataclass(frozen=True)
class CollectiveCost:
    name: str  # where it runs, e.g. "tp_all_reduce", "sp_all_to_all_qkv", "lm_head_all_gather"
    op: str  # all_reduce, all_to_all, all_gather, send_recv
    group_size: int
    calls: int
    wire_bytes: int  # sent by one rank over all calls (comm.py's ledger count)
    time_s: float


@dataclass(frozen=True)
class StepCost:
    """One step: `total_s = compute_s + memory_s + communication_s + bubble_s + overhead_s`, where compute
    and memory are the times of the compute-bound and of the memory-bound ops of the priced rank (the
    slowest group's rank under "dp", the busiest stage's under "pp")."""

    layout: Layout
    ops: tuple[OpCost, ...]
    collectives: tuple[CollectiveCost, ...]
    compute_s: float
    memory_s: float
    communication_s: float
    bubble_s: float
    overhead_s: float
    group_s: tuple[float, ...] = ()  # "dp": each group's time (without the engine overhead)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.communication_s + self.bubble_s + self.overhead_s

    def breakdown(self) -> dict[str, float]:
        """Seconds by op name and collective, plus "bubble" and "overhead"; they sum to total_s."""
        out: dict[str, float] = defaultdict(float)
        for o in self.ops:
            out[o.name] += o.time_s
        for c in self.collectives:
            out[c.name] += c.time_s
        out["bubble"] += self.bubble_s
        out["overhead"] += self.overhead_s
        return dict(out)


# -- per-rank shards --------------------------------------------------------------------------------------
def _heads_per_rank(shape: ModelShape, chunks: int) -> tuple[int, int]:
    """(query heads, KV heads) of one of `chunks` head chunks; KV heads replicated past their count."""
    return shape.num_heads // chunks, max(1, shape.num_kv_heads // chunks)


def validate_layout(shape: ModelShape, layout: Layout) -> None:
    """The layout must divide the heads (KV heads may be replicated) and the MLP, as the engine requires."""
    h, h_kv = shape.num_heads, shape.num_kv_heads
    checks = {"tp": [(layout.tp, "TP")], "sp_tp": [(layout.tp, "TP"), (layout.sp * layout.tp, "SP x TP")],
              "pp": [(layout.tp, "TP")], "dp": [(w, f"TP{w} group") for w in set(layout.group_tp)]}[layout.kind]
    problems = []
    for chunks, what in checks:
        if h % chunks:
            problems.append(f"num_heads={h} is not divisible by {what}={chunks}")
        if chunks % h_kv and h_kv % chunks:
            problems.append(f"num_kv_heads={h_kv} and {what}={chunks}: neither divides the other")
        if shape.num_dense_layers and shape.intermediate_size % chunks:
            problems.append(f"intermediate_size={shape.intermediate_size} is not divisible by {what}={chunks}")
        if shape.is_moe and not layout.expert_parallel and shape.expert_intermediate_size % chunks:
            problems.append(f"expert_intermediate_size={shape.expert_intermediate_size} is not divisible by "
                            f"{what}={chunks}")
        if shape.num_sparse_layers and shape.shared_expert_intermediate_size % chunks:
            problems.append(f"shared_expert_intermediate_size={shape.shared_expert_intermediate_size} is not "
                            f"divisible by {what}={chunks}")
    if layout.kind == "pp" and layout.pp > shape.num_layers:
        problems.append(f"PP={layout.pp} is more stages than the model's {shape.num_layers} layers")
    if layout.expert_parallel and (not shape.is_moe or shape.num_experts % layout.num_ranks):
        problems.append(f"expert parallelism needs num_experts={shape.num_experts} divisible by the "
                        f"{layout.num_ranks} ranks")
    if problems:
        raise ValueError(f"layout {layout.name} does not fit {shape.name}: " + "; ".join(problems))


def _stage_layers(shape: ModelShape, pp: int) -> list[int]:
    base, extra = divmod(shape.num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _sparse_layers(shape: ModelShape, num_layers: int) -> int:
    """Sparse layers among `num_layers` of the model's (a pipeline stage's): in proportion, exact when every
    layer is sparse (Mixtral, Qwen3-MoE's released models) or none."""
    return round(num_layers * shape.num_sparse_layers / shape.num_layers)


def _busiest_rank_rows(seqs: Sequence[Seq], sp: int) -> int:
    """The LM head's rows on the SP rank that holds the most of them: each rank holds a contiguous share of the step's
    tokens (ShiftModule._base_step: n // sp each, one more on the first n % sp), a sequence's rows are its last
    tokens."""
    if sp == 1:
        return sum(s.logits_rows for s in seqs)
    tokens = sum(s.num_new_tokens for s in seqs)
    ends = list(itertools.accumulate(tokens // sp + (r < tokens % sp) for r in range(sp)))
    per_rank = [0] * sp
    end = 0
    for s in seqs:
        end += s.num_new_tokens
        for position in range(end - s.logits_rows, end):
            per_rank[bisect.bisect_right(ends, position)] += 1
    return max(per_rank)


def _group_ops(shape: ModelShape, seqs: Sequence[Seq], *, tp: int, sp: int, num_layers: int,
               first_stage: bool, last_stage: bool, expert_parallel: bool = False) -> list[Op]:
    """The ops of one rank of an (SP x) TP group running `num_layers` layers of one (micro-)batch. A sparse
    layer's experts are split by TP as the engine runs them (each rank a slice of every expert's FFN, the
    router replicated): every rank computes its slice for every routed token, so no rank waits on another's
    busier experts."""
    tokens = sum(s.num_new_tokens for s in seqs)
    local = -(-tokens // sp)  # tokens on the busiest SP rank (ShiftModule._base_step)
    rows = sum(s.logits_rows for s in seqs)
    last_rows = _busiest_rank_rows(seqs, sp)  # the LM head's rows on this rank: the last layer's after its attention
    q_lin, kv_lin = _heads_per_rank(shape, tp)  # heads in the rank's q/k/v and o shards
    q_att, kv_att = _heads_per_rank(shape, sp * tp)  # heads it attends (after the all-to-all)
    d, h = shape.head_dim, shape.hidden_size
    layer = [ops.linear("qkv", shape, local, h, (q_lin + 2 * kv_lin) * d, bias=shape.attention_bias)]
    prefill = [s for s in seqs if s.num_new_tokens > 1]
    decode = [s for s in seqs if s.num_new_tokens == 1]
    per_kind = []  # (ops of one layer of the kind, how many layers)
    # GPT-OSS: windowed and full layers alternate (in proportion among a stage's layers)
    windowed = round(num_layers * shape.num_window_layers / shape.num_layers) if shape.num_window_layers else 0
    for window, count in ((True, num_layers - windowed), (shape.sliding_window, windowed)):
        if windowed and window is True:
            window = None  # the full layers of a model whose window is only on some
        attention_ops = []
        if prefill:
            attention_ops.append(ops.attention(shape, prefill, q_att, kv_att, "attention_prefill", window))
        if decode:
            attention_ops.append(ops.attention(shape, decode, q_att, kv_att, "attention_decode", window))
        if count and attention_ops:
            per_kind.append((attention_ops, count))

    def after_attention(n: int, step_rows: int, sparse_layer: bool) -> list[Op]:
        """One layer's output projection and MLP on `n` rows of the `step_rows` over the SP ranks (none read a weight
        for no rows)."""
        if not n:
            return []
        out = [ops.linear("o_proj", shape, n, q_lin * d, h)]
        if not sparse_layer:
            inter = shape.intermediate_size // tp
            return out + [ops.linear("gate_up", shape, n, h, 2 * inter), ops.linear("down", shape, n, inter, h)]
        if shape.shared_expert_intermediate_size:  # split as a dense MLP, whole on an SP rank of EP's base
            shared = shape.shared_expert_intermediate_size // tp
            out += [ops.linear("shared_expert_gate_up", shape, n, h, 2 * shared + 1),
                    ops.linear("shared_expert_down", shape, n, shared, h)]
        out.append(ops.linear("router", shape, n, h, shape.num_experts))
        if expert_parallel:  # E / n whole experts per rank: 1/n of the step's token-expert pairs
            return out + [ops.experts(shape, step_rows, shape.expert_intermediate_size, ranks=sp * tp)]
        return out + [ops.experts(shape, n, shape.expert_intermediate_size // tp)]

    sparse = _sparse_layers(shape, num_layers)
    # the last stage's last layer (sparse where any is) runs its projection and MLP on the LM head's rows alone
    # (DecoderLM.forward's logits_indices): on an SP rank, on those among its own tokens
    last = last_stage and num_layers > 0
    for sparse_layer, count in ((False, num_layers - sparse), (True, sparse)):
        last_here = last and sparse_layer == (sparse > 0)
        if count - last_here:
            per_kind.append((after_attention(local, tokens, sparse_layer), count - last_here))
        if count and last_here:
            per_kind.append((after_attention(last_rows, rows, sparse_layer), 1))
    if num_layers - sparse:
        per_kind.append(([ops.layer_elementwise(shape, local, q_lin, kv_lin, shape.intermediate_size // tp)],
                         num_layers - sparse))
    if sparse:
        columns = (shape.experts_per_token * shape.expert_intermediate_size // (sp * tp) if expert_parallel
                   else shape.experts_per_token * (shape.expert_intermediate_size // tp))
        per_kind.append(([ops.layer_elementwise(shape, local, q_lin, kv_lin,
                                                columns + shape.shared_expert_intermediate_size // tp)], sparse))
    result = [Op(o.name, o.flops * num_layers, o.bytes * num_layers, o.rate, o.dtype, o.rows) for o in layer]
    for kind_ops, count in per_kind:
        result += [Op(o.name, o.flops * count, o.bytes * count, o.rate, o.dtype, o.rows) for o in kind_ops]
    if first_stage:
        result.append(ops.embedding(shape, local))
    if last_stage:
        result.append(ops.final_norm(shape, last_rows))
        if rows:
            result.append(ops.lm_head(shape, rows, -(-shape.vocab_size // (sp * tp))))
            result.append(ops.sampling(shape, rows))
    return result


def _group_collectives(shape: ModelShape, seqs: Sequence[Seq], *, tp: int, sp: int, num_layers: int,
                       last_stage: bool, expert_parallel: bool = False) -> list[tuple[str, str, int, int, int]]:
    """(name, op, group size, calls, tensor bytes per call) of one rank: what torch_shift.parallel runs."""
    a = shape.activation_bytes
    tokens = sum(s.num_new_tokens for s in seqs)
    local = -(-tokens // sp)
    rows = sum(s.logits_rows for s in seqs)
    h, d = shape.hidden_size, shape.head_dim
    q_att, kv_att = _heads_per_rank(shape, sp * tp)
    out = []
    sparse = _sparse_layers(shape, num_layers) if expert_parallel else 0
    # the last stage's last layer (sparse where any is) sums and exchanges the LM head's rows alone (_group_ops)
    last = int(last_stage and num_layers > 0)
    last_sparse = int(last and sparse > 0)
    last_rows = _busiest_rank_rows(seqs, sp)

    def per_layer(name: str, op: str, size: int, calls: int, row_bytes: int, last_calls: int) -> None:
        """`calls` collectives of the rank's rows, `last_calls` of them the last layer's, of its rows alone."""
        if last_calls:
            out.append((name, op, size, calls - last_calls, local * row_bytes))
            out.append((name, op, size, last_calls, last_rows * row_bytes))
        else:
            out.append((name, op, size, calls, local * row_bytes))

    if tp > 1:  # o_proj and down_proj are row-parallel (layers.RowParallelLinear)
        per_layer("tp_all_reduce", "all_reduce", tp, 2 * num_layers - sparse, h * a, (1 if last_sparse else 2) * last)
    if sparse and tp > 1:  # expert_parallel: the experts' outputs summed in float32
        per_layer("ep_all_reduce", "all_reduce", tp, sparse, h * 4, last_sparse)
    if sparse and tp > 1 and shape.shared_expert_intermediate_size:  # expert_parallel: a shared expert's own sum
        per_layer("shared_expert_all_reduce", "all_reduce", tp, sparse, h * a, last_sparse)
    if sparse and sp > 1:  # expert_parallel: the pair counts, the pairs' rows and expert ids to their experts'
        k = shape.experts_per_token  # ranks, the outputs back: four all-to-alls (expert_parallel.py)
        out.append(("ep_all_to_all_counts", "all_to_all", sp, sparse, sp * 8))
        per_layer("ep_all_to_all_dispatch", "all_to_all", sp, sparse, k * h * a, last_sparse)
        per_layer("ep_all_to_all_expert_ids", "all_to_all", sp, sparse, k * 8, last_sparse)
        per_layer("ep_all_to_all_combine", "all_to_all", sp, sparse, k * h * a, last_sparse)
    if sp > 1:  # ulysses.UlyssesAttention: one fused q/k/v all-to-all, one for the output
        out.append(("sp_all_to_all_qkv", "all_to_all", sp, num_layers, sp * local * (q_att + 2 * kv_att) * d * a))
        out.append(("sp_all_to_all_out", "all_to_all", sp, num_layers, sp * local * q_att * d * a))
    if last_stage and rows:
        if sp > 1:  # shift.ShiftModule._base_step: the sampled rows summed over "sp"
            out.append(("sp_all_reduce_rows", "all_reduce", sp, 1, rows * h * a))
        if sp * tp > 1:  # layers.VocabParallelLMHead
            out.append(("lm_head_all_gather", "all_gather", sp * tp, 1, rows * -(-shape.vocab_size // (sp * tp)) * a))
    return out


def _price(hw: HardwareProfile, op_list: Sequence[Op], active: int,
           attention_hw: HardwareProfile | None = None) -> list[OpCost]:
    """Each op at `hw`'s rates, attention at `attention_hw`'s where given."""
    costs = []
    for o in op_list:
        rates = attention_hw if attention_hw is not None and o.rate == "attention" else hw
        compute = o.flops / rates.flops(o.rate, o.dtype) if o.flops else 0.0
        memory = o.bytes / rates.bandwidth(o.rate, o.dtype, active, o.rows)
        costs.append(OpCost(o.name, o.flops, o.bytes, compute, memory, max(compute, memory)))
    return costs


def _price_collectives(hw: HardwareProfile, entries) -> list[CollectiveCost]:
    return [CollectiveCost(name, op, n, calls, calls * wire_bytes(op, n, nbytes),
                           calls * hw.collectives.time(op, n, nbytes))
            for name, op, n, calls, nbytes in entries]


def _merge(op_costs: Sequence[OpCost]) -> tuple[OpCost, ...]:
    merged: dict[str, list[float]] = {}
    for c in op_costs:
        acc = merged.setdefault(c.name, [0.0] * 5)
        for i, v in enumerate((c.flops, c.bytes, c.compute_s, c.memory_s, c.time_s)):
            acc[i] += v
    return tuple(OpCost(name, *values) for name, values in merged.items())


def _merge_collectives(costs: Sequence[CollectiveCost]) -> tuple[CollectiveCost, ...]:
    merged: dict[tuple[str, str, int], list] = {}
    for c in costs:
        acc = merged.setdefault((c.name, c.op, c.group_size), [0, 0, 0.0])
        acc[0] += c.calls
        acc[1] += c.wire_bytes
        acc[2] += c.time_s
    return tuple(CollectiveCost(name, op, n, *acc) for (name, op, n), acc in merged.items())


def _split_compute_memory(op_costs: Sequence[OpCost]) -> tuple[float, float]:
    compute = sum(c.time_s for c in op_costs if c.compute_s >= c.memory_s)
    memory = sum(c.time_s for c in op_costs if c.compute_s < c.memory_s)
    return compute, memory


# -- the step ---------------------------------------------------------------------------------------------
def _microbatches(seqs: Sequence[Seq], count: int) -> list[list[Seq]]:
    """Whole sequences into `count` micro-batches of about equal tokens (longest first, each to the
    lightest micro-batch)."""
    bins: list[list[Seq]] = [[] for _ in range(min(count, len(seqs)))]
    load = [0] * len(bins)
    for s in sorted(seqs, key=lambda s: -s.num_new_tokens):
        i = load.index(min(load))
        bins[i].append(s)
        load[i] += s.num_new_tokens
    return bins


def _pipeline(shape: ModelShape, hw: HardwareProfile, layout: Layout, seqs: Sequence[Seq], active: int,
              micro_batches: Sequence[Sequence[Seq]] | None = None):
    """Stages x micro-batches; each stage passes [tokens, hidden] on with a send/recv, the last stage its
    logits to rank 0. Makespan by the flow-shop recurrence (micro-batches in order through the stages)."""
    p, tp = layout.pp, layout.tp
    layers = _stage_layers(shape, p)
    batches = micro_batches or _microbatches(seqs, layout.num_microbatches or p)
    a = shape.activation_bytes
    stage_ops: list[list[OpCost]] = [[] for _ in range(p)]
    stage_comm: list[list[CollectiveCost]] = [[] for _ in range(p)]
    finish = [0.0] * p  # when each stage finished its previous micro-batch
    for mb in batches:
        tokens, rows = sum(s.num_new_tokens for s in mb), sum(s.logits_rows for s in mb)
        ready = 0.0
        for k in range(p):
            last = k == p - 1
            op_costs = _price(hw, _group_ops(shape, mb, tp=tp, sp=1, num_layers=layers[k], first_stage=k == 0,
                                             last_stage=last), active)
            comm = _group_collectives(shape, mb, tp=tp, sp=1, num_layers=layers[k], last_stage=last)
            if not last:
                comm.append(("pp_send_activations", "send_recv", 2, 1, tokens * shape.hidden_size * a))
            elif rows and p > 1:
                comm.append(("pp_send_logits", "send_recv", 2, 1, rows * shape.vocab_size * a))
            comm_costs = _price_collectives(hw, comm)
            stage_ops[k] += op_costs
            stage_comm[k] += comm_costs
            busy = sum(c.time_s for c in op_costs) + sum(c.time_s for c in comm_costs)
            finish[k] = max(finish[k], ready) + busy
            ready = finish[k]
    makespan = finish[-1]
    busy = [sum(c.time_s for c in stage_ops[k]) + sum(c.time_s for c in stage_comm[k]) for k in range(p)]
    k = max(range(p), key=busy.__getitem__)
    return _merge(stage_ops[k]), _merge_collectives(stage_comm[k]), makespan - busy[k]


def _price_group(shape: ModelShape, hw: HardwareProfile, seqs: Sequence[Seq], *, tp: int, sp: int, active: int,
                 expert_parallel: bool = False, attention_hw: HardwareProfile | None = None):
    """(ops, collectives, seconds) of one rank of an (SP x) TP group running the whole model (its attention at
    `attention_hw`'s rates where given)."""
    op_costs = _merge(_price(hw, _group_ops(shape, seqs, tp=tp, sp=sp, num_layers=shape.num_layers,
                                            first_stage=True, last_stage=True, expert_parallel=expert_parallel),
                             active, attention_hw))
    comm = _merge_collectives(_price_collectives(hw, _group_collectives(
        shape, seqs, tp=tp, sp=sp, num_layers=shape.num_layers, last_stage=True, expert_parallel=expert_parallel)))
    return op_costs, comm, sum(c.time_s for c in op_costs) + sum(c.time_s for c in comm)


def lone_multiple(num_ranks: int, group_ranks: int) -> int:
    """How many times its own threads each rank of a group of `group_ranks` of `num_ranks` CPU ranks runs in a step
    where the group alone has work (`torch_shift.engine.model_runner.step_threads`, in whole multiples)."""
    return max(1, num_ranks // group_ranks)


def step_cost(shape: ModelShape, hw: HardwareProfile, layout: Layout, seqs: Sequence[Seq],
              groups: Sequence[int] | None = None, micro_batches: Sequence[Sequence[Seq]] | None = None) -> StepCost:
    """The time of one step that computes `seqs` under `layout` on `hw`.

    Under a "dp" layout `groups[i]` is the group (index into layout.group_tp) that runs seqs[i] (the
    scheduler's assignment); elsewhere `groups` is not given. Under "pp", `micro_batches` gives the
    step's micro-batches as the engine cut them (`torch_shift.engine.step_plan.split_micro_batches`, which
    may cut a prompt chunk); by default whole sequences are dealt into `num_microbatches` of them. Every rank that
    has work in the step counts as active for a shared memory bandwidth (hw.node_bandwidth); a "dp" group alone with
    work is priced on the idle groups' cores too (`hw.borrowing`), as are the SP ranks that hold a step of fewer
    tokens than SP ranks (on CPU ranks a step of one token as SP rank 0's TP group's alone: the shared KV)."""
    validate_layout(shape, layout)
    if not seqs:
        raise ValueError("a step has at least one sequence")
    if (layout.kind == "dp") != (groups is not None):
        raise ValueError("a 'dp' layout needs groups (the group index of each sequence); other layouts take none")
    overhead = hw.overhead.time(len(seqs), layout.num_ranks)
    bubble, group_s = 0.0, ()
    if layout.kind == "dp":
        if len(groups) != len(seqs) or not all(0 <= g < len(layout.group_tp) for g in groups):
            raise ValueError(f"groups must give each sequence a group index in [0, {len(layout.group_tp)})")
        by_group: dict[int, list[Seq]] = defaultdict(list)
        for s, g in zip(seqs, groups):
            by_group[g].append(s)
        active = sum(layout.group_tp[g] for g in by_group)
        if len(by_group) == 1:  # a group alone with work runs on the idle groups' cores too
            hw = hw.borrowing(lone_multiple(layout.num_ranks, layout.group_tp[next(iter(by_group))]))
        priced = {g: _price_group(shape, hw, group_seqs, tp=layout.group_tp[g], sp=1, active=active)
                  for g, group_seqs in by_group.items()}
        op_costs, comm, _ = max(priced.values(), key=lambda p: p[2])
        group_s = tuple(priced[g][2] if g in priced else 0.0 for g in range(len(layout.group_tp)))
    elif layout.kind == "pp":
        op_costs, comm, bubble = _pipeline(shape, hw, layout, seqs, layout.num_ranks, micro_batches)
    else:
        # a step of fewer tokens than SP ranks leaves the last SP ranks no rows: they read no weights and only attend
        # (on one thread), and the ranks with rows run their other ops on those ranks' cores too (step_threads);
        # not where experts split over the SP ranks keep every rank computing
        tokens = sum(s.num_new_tokens for s in seqs)
        active = layout.tp * min(layout.sp, tokens)
        attention_hw, sp = None, layout.sp
        if active < layout.num_ranks and not layout.expert_parallel:
            hw, attention_hw = hw.borrowing(lone_multiple(layout.num_ranks, active)), hw
            if tokens == 1 and hw.host_link_bandwidth is None:
                # CPU ranks of one host share their SP group's KV (torch_shift.parallel.shared_kv): SP rank 0's TP
                # group attends every head chunk on the borrowed cores, and nothing goes through Ulysses
                attention_hw, sp = None, 1
        op_costs, comm, _ = _price_group(shape, hw, seqs, tp=layout.tp, sp=sp, active=active,
                                         expert_parallel=layout.expert_parallel, attention_hw=attention_hw)
    compute, memory = _split_compute_memory(op_costs)
    return StepCost(layout, op_costs, comm, compute, memory, sum(c.time_s for c in comm), bubble, overhead, group_s)


# -- memory -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankMemory:
    weight_bytes: int  # parameters one rank holds
    kv_bytes_per_token: int  # KV cache one rank holds per token of a sequence it serves


def memory_per_rank(shape: ModelShape, layout: Layout, group: int = 0) -> RankMemory:
    """The largest rank's weights and KV bytes per token under a static layout (under "dp", a rank of
    group `group`). As torch_shift places them: the embedding replicated on every rank (first stage under
    PP), the LM head vocab-parallel over the group (a separate shard even when tied, except on one rank),
    q/k/v/o and the MLP sharded over TP with KV heads replicated past their count.

    A switching policy holds what its layouts need together: Shift with copied shift weights adds the
    TP-(sp x tp) shards of the sharded weights to its SP x TP ones; Flying's TP groups are views of the
    full weights every DP rank holds (its weights are the all-DP layout's); Seesaw keeps a PP stage and a
    TP shard resident."""
    validate_layout(shape, layout)
    if layout.kind == "dp":
        if not 0 <= group < len(layout.group_tp):
            raise ValueError(f"group {group} is not in [0, {len(layout.group_tp)})")
        tp, sp, stages = layout.group_tp[group], 1, [shape.num_layers]
    elif layout.kind == "pp":
        tp, sp, stages = layout.tp, 1, _stage_layers(shape, layout.pp)
    else:
        tp, sp, stages = layout.tp, layout.sp, [shape.num_layers]
    h, d = shape.hidden_size, shape.head_dim
    q_lin, kv_lin = _heads_per_rank(shape, tp)
    _, kv_att = _heads_per_rank(shape, sp * tp)
    attention = (h * (q_lin + 2 * kv_lin) * d + q_lin * d * h + 2 * h
                 + ((q_lin + 2 * kv_lin) * d if shape.attention_bias else 0) + (2 * d if shape.qk_norm else 0)
                 + (h if shape.o_proj_bias else 0) + (q_lin if shape.attention_sinks else 0))
    dense_mlp = 3 * h * (shape.intermediate_size // tp)
    # every expert's FFN split by TP (gate/up biases with their rows, the down bias whole), the router replicated;
    # under expert parallelism E / n whole experts per rank
    columns = shape.expert_intermediate_size // tp
    held = shape.num_experts
    if layout.expert_parallel:
        columns, held = shape.expert_intermediate_size, shape.num_experts // (sp * tp)
    sparse_mlp = ((h + (1 if shape.router_bias else 0)) * shape.num_experts
                  + held * (3 * h * columns + (2 * columns + h if shape.expert_bias else 0)))
    if shape.shared_expert_intermediate_size:  # split over TP as a dense MLP, its gate replicated
        sparse_mlp += 3 * h * (shape.shared_expert_intermediate_size // tp) + h

    def stage_layers(layers: int) -> int:
        sparse = _sparse_layers(shape, layers)
        return layers * attention + (layers - sparse) * dense_mlp + sparse * sparse_mlp
    vocab_ranks = sp * tp
    embed = shape.vocab_size * h
    head = embed if vocab_ranks == 1 and not shape.tie_word_embeddings else 0
    if vocab_ranks > 1:
        head = -(-shape.vocab_size // vocab_ranks) * h
    weights = []
    for k, layers in enumerate(stages):
        count = stage_layers(layers)
        if k == 0:
            count += embed
        if k == len(stages) - 1:
            count += head + h
        weights.append(count)
    kv = [2 * layers * kv_att * d * shape.kv_bytes for layers in stages]
    return RankMemory(max(weights) * shape.weight_bytes, max(kv))


def kv_capacity_tokens(shape: ModelShape, hw: HardwareProfile, layout: Layout, group: int = 0,
                       memory_utilization: float = 0.9, reserved_bytes: float = 0.0) -> int:
    """Tokens of KV cache a rank's pool holds after its weights (also the longest sequence it can serve):
    `memory_utilization` of the device as vLLM's gpu_memory_utilization, less `reserved_bytes` for
    activations; 0 when the weights do not fit."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    mem = memory_per_rank(shape, layout, group)
    free = hw.device_memory_bytes * memory_utilization - mem.weight_bytes - reserved_bytes
    return max(0, math.floor(free / mem.kv_bytes_per_token))
