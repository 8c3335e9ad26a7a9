"""Layouts as data: which ranks run a step together, and how.

A deployment's ranks form *replicas*: the units that own a KV pool (a block manager on rank 0, one
block table per request) and a persistent batch. A *layout* says how one group of replicas runs a
step: its ranks in collective order, how the step's tokens are split (`sp`), how heads and MLP
columns are split (`tp`), how layers are split (`pp`), and how the KV pool is viewed: a request
of a layout spanning d replicas keeps its KV in all d pools, each block holding d * block_size
tokens of H_kv / d heads (paper 004's KV adaptor; `kv_width` = d).

Every step a policy (torch_shift.engine.policies) binds some layouts with disjoint replicas; the
step plan names them, and each rank runs the group it belongs to.

| deployment | replicas | layouts |
| --- | --- | --- |
| one rank | (0,) | "single" |
| TP-n | all ranks | "tp" |
| SP x TP (Shift, paper 000) | all ranks | "base" (Ulysses SP x TP) and "shift" (full TP, shift-rank order) |
| DP-n x TP-k (static) | n groups of k ranks | "dp@i" (TP-k inside replica i) |
| Flying DP-n (paper 004) | n single ranks | "dp@i" and "tp{d}@{first}" for aligned groups of d = 2, 4, ... replicas |
| PP-p (static) [x DP-n] | n groups of p ranks | "pp" ("pp@i" with DP): p stages of consecutive layers |
| Seesaw PP-p -> TP-p (paper 003) [x DP-n] | n groups of p ranks | "pp" and "tp" ("pp@i", "tp@i") over each replica |

A layout's *KV view* says how a rank's pool splits the KV cache: "heads" (every layer, a range of KV
heads: single, TP, SP x TP, DP) or "layers" (a pipeline stage's layers, every head). Two layouts over
the same replicas with the same view share their requests' KV (Shift's base and shift); KV written in
one view is never read in another: it moves between views through the host tier (torch_shift.kv.tier),
which re-shards it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch_shift.config import ModelConfig
from torch_shift.parallel.groups import shift_rank_order
from torch_shift.parallel.plan import validate_mesh_for_model


@dataclass(frozen=True)
class Layout:
    name: str  # unique in its deployment
    kind: str  # "single", "tp", "sp_tp" (Ulysses SP x TP), "shift" (full TP in shift-rank order), "dp", "pp"
    ranks: tuple[int, ...]  # in collective order (pipeline stages in order)
    replicas: tuple[int, ...]  # replicas whose KV pools the layout's requests use
    sp: int = 1
    tp: int = 1
    pp: int = 1
    experts_over_sp: bool = False  # whole experts split over the SP ranks: every SP rank runs every step's layers

    @property
    def kv_width(self) -> int:
        return len(self.replicas)

    @property
    def kv_view(self) -> str:
        """How a rank's pool splits the KV cache: "layers" (a stage's layers, all heads) or "heads"."""
        return "layers" if self.pp > 1 else "heads"

    @property
    def logits_rank(self) -> int:
        """The rank whose forward returns the step's logits: the last stage of a pipeline, else the first."""
        return self.ranks[-1] if self.pp > 1 else self.ranks[0]

    def working_ranks(self, num_tokens: int) -> tuple[int, ...]:
        """The ranks that run the model's layers in a step of `num_tokens` tokens. Ulysses SP rank s holds n // SP
        tokens or one more (ShiftModule._base_step), so a step of fewer tokens than SP ranks leaves the SP ranks
        from n on without rows: they only attend with their heads (ShiftModule._attend_only), unless experts split
        over the SP ranks exchange tokens in every layer. Global rank = sp * TP + tp (parallel.groups)."""
        if self.kind != "sp_tp" or num_tokens >= self.sp or self.experts_over_sp:
            return self.ranks
        return self.ranks[:num_tokens * self.tp]

    @property
    def label(self) -> str:
        """What the layout is, without where: "tp2", "sp2xtp2", "dp", ... (stats and metrics)."""
        if self.kind == "sp_tp":
            return f"sp{self.sp}xtp{self.tp}"
        if self.kind in ("tp", "shift"):
            return f"{self.kind}{self.tp}"
        if self.kind == "pp":
            return f"pp{self.pp}"
        return self.kind


@dataclass(frozen=True)
class Deployment:
    """The replicas and every layout a deployment may run; `process_groups` lists the groups to
    create once at start-up (a communicator pool), in one order on every rank."""

    world_size: int
    replicas: tuple[tuple[int, ...], ...]
    layouts: tuple[Layout, ...]
    family: str  # what it is, for messages and stats: "single", "tp", "shift", "dp", "flying", "pp", "seesaw"
    sp: int = 1
    tp: int = 1  # inside a replica
    pp: int = 1  # pipeline stages of a replica
    config: ModelConfig | None = field(default=None, compare=False, repr=False)
    default_policy: str = "static"  # the policy that switches between its layouts (torch_shift.engine.policies)
    moves_kv_through_tier: bool = False  # every request's KV changes view through the host tier (Seesaw)
    _by_name: dict[str, Layout] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {layout.name: layout for layout in self.layouts})
        assert len(self._by_name) == len(self.layouts), "layout names must be unique"
        ranks = sorted(r for replica in self.replicas for r in replica)
        assert ranks == list(range(self.world_size)), self.replicas

    def __getitem__(self, name: str) -> Layout:
        return self._by_name[name]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def replica_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.replicas) if rank in ranks)

    def layouts_of(self, rank: int) -> list[Layout]:
        return [layout for layout in self.layouts if rank in layout.ranks]

    def alternatives(self, layout: Layout) -> list[Layout]:
        """The layouts a batch formed for `layout` may run in instead: over the same replicas, with the same
        KV view (`layout` itself included)."""
        return [other for other in self.layouts
                if other.replicas == layout.replicas and other.kv_view == layout.kv_view]

    def replica_layouts(self) -> list[Layout]:
        """The layouts of width 1, one per replica in replica order (a replica on its own)."""
        out = []
        for i in range(self.num_replicas):
            own = [layout for layout in self.layouts if layout.replicas == (i,)]
            out.append(own[0])
        return out

    def process_groups(self) -> list[tuple[int, ...]]:
        """The groups of layouts that bind several replicas (a replica's own groups come from its
        ("sp", "tp") DeviceMesh), in creation order."""
        return [layout.ranks for layout in self.layouts if layout.kv_width > 1]


def width_problems(config: ModelConfig, width: int, what: str = "TP") -> list[str]:
    """What keeps a tensor-parallel width that splits whole heads from running: it must divide the query heads, the KV
    heads and the MLP width (the KV adaptor splits whole KV heads: paper 004 needs H_kv % d == 0)."""
    h, h_kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    widths = [("num_attention_heads", h), ("num_key_value_heads", h_kv), ("intermediate_size", inter)]
    if config.is_moe:
        widths.append(("moe_intermediate_size", config.moe_intermediate_size))
    if config.shared_expert_intermediate_size:
        widths.append(("shared_expert_intermediate_size", config.shared_expert_intermediate_size))
    return [f"{name}={n} is not divisible by {what}={width}" for name, n in widths if n % width]


def check_width(config: ModelConfig, width: int, what: str = "TP") -> None:
    """A ValueError naming every width_problems."""
    problems = width_problems(config, width, what)
    if problems:
        raise ValueError(f"this model cannot run {what}={width}: " + "; ".join(problems))


def aligned_groups(num_replicas: int, width: int) -> list[tuple[int, ...]]:
    """Aligned segments of `width` consecutive replicas: {0,1}, {2,3} for width 2 of 4."""
    return [tuple(range(first, first + width)) for first in range(0, num_replicas - width + 1, width)]


def flying_widths(config: ModelConfig, num_replicas: int) -> list[int]:
    """The TP widths (powers of two up to the replica count) the model can use; paper 004 binds
    only aligned power-of-two groups, whose communicators are created at start-up."""
    widths = []
    d = 2
    while d <= num_replicas:
        if not width_problems(config, d):
            widths.append(d)
        d *= 2
    return widths


# Tokens per micro-batch above which a prefill step is cut into more than P micro-batches: at a few
# hundred tokens a stage's matmuls no longer gain from larger batches (DESIGN.md section 3), while the
# pipeline's fill and drain shrink as micro-batches are added.
MICRO_BATCH_TOKENS = 256


def micro_batch_count(pp: int, num_tokens: int) -> int:
    """Micro-batches of a pipeline step: at least one per stage (all stages work), more for large steps."""
    if pp == 1:
        return 1
    return max(1, min(num_tokens, max(pp, math.ceil(num_tokens / MICRO_BATCH_TOKENS))))


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers of pipeline stage `stage` of `pp`: consecutive, the first stages one more when
    `num_layers % pp` leaves some over."""
    per, extra = divmod(num_layers, pp)
    first = stage * per + min(stage, extra)
    return range(first, first + per + (stage < extra))


def build_deployment(config: ModelConfig, *, sp: int = 1, tp: int = 1, dp: int = 1, pp: int = 1,
                     flying: bool = False, seesaw: bool = False, shift: bool = True,
                     expert_parallel: bool = False) -> Deployment:
    """The deployment for the engine's parallel arguments (degrees checked by EngineArgs; their combination
    validated here against the model; `expert_parallel`: whole experts per rank, so their FFN width need not
    divide)."""
    assert all(isinstance(d, int) and d >= 1 for d in (sp, tp, dp, pp)), (sp, tp, dp, pp)
    if pp > 1 or seesaw:
        return _pipeline_deployment(config, dp, pp, sp, tp, flying, seesaw)
    if flying:
        if dp < 2:
            raise ValueError(f"policy 'flying' binds data-parallel replicas into TP groups: it needs dp >= 2, got dp={dp}")
        if sp != 1 or tp != 1:
            raise ValueError(f"policy 'flying' takes replicas of one rank each (dp={dp}); got sp={sp}, tp={tp}")
    if dp > 1 and sp != 1:
        raise ValueError(f"data parallelism with sequence parallelism inside each replica is not supported "
                         f"(dp={dp}, sp={sp}); use dp with tp")
    if dp == 1:
        world = sp * tp
        ranks = tuple(range(world))
        if world == 1:
            layouts = (Layout("single", "single", ranks, (0,)),)
            family = "single"
        elif sp == 1:
            validate_mesh_for_model(config, 1, tp, expert_parallel)
            layouts = (Layout("tp", "tp", ranks, (0,), tp=tp),)
            family = "tp"
        else:
            validate_mesh_for_model(config, sp, tp, expert_parallel)
            layouts = [Layout("base", "sp_tp", ranks, (0,), sp=sp, tp=tp, experts_over_sp=expert_parallel)]
            if shift:
                layouts.append(Layout("shift", "shift", tuple(shift_rank_order(sp, tp)), (0,), tp=world))
            layouts = tuple(layouts)
            family = "shift"
        return Deployment(world, (ranks,), layouts, family, sp=sp, tp=tp, config=config,
                          default_policy="shift" if family == "shift" else "static")

    if tp > 1:  # inside a replica, KV heads may be replicated as in static TP
        validate_mesh_for_model(config, 1, tp)
    world = dp * tp
    replicas = tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(dp))
    layouts = [Layout(f"dp@{i}", "dp" if tp == 1 else "tp", ranks, (i,), tp=tp) for i, ranks in enumerate(replicas)]
    if flying:
        for width in flying_widths(config, dp):
            for group in aligned_groups(dp, width):
                layouts.append(Layout(f"tp{width}@{group[0]}", "tp", group, group, tp=width))
    return Deployment(world, replicas, tuple(layouts), "flying" if flying else "dp", tp=tp, config=config,
                      default_policy="flying" if flying else "static")


def _pipeline_deployment(config: ModelConfig, dp: int, pp: int, sp: int, tp: int, flying: bool,
                         seesaw: bool) -> Deployment:
    """Static PP-p, or Seesaw's PP-p -> TP-p (paper 003), over dp replicas of p consecutive ranks."""
    if seesaw and pp < 2:
        raise ValueError(f"policy 'seesaw' prefills in pipeline parallelism and decodes in tensor parallelism over "
                         f"the same ranks: it needs pp >= 2, got pp={pp}")
    if sp != 1 or tp != 1 or flying:
        raise ValueError(f"pipeline parallelism (pp={pp}) combines only with dp; got sp={sp}, tp={tp}"
                         + (", policy 'flying'" if flying else ""))
    num_layers = config.num_hidden_layers
    if num_layers < pp:
        raise ValueError(f"pp={pp} stages need at least {pp} layers; the model has num_hidden_layers={num_layers}")
    if seesaw:
        # one KV buffer per rank, viewed as a stage's layers with every head or every layer with a head slice:
        # the same bytes per block only when both split evenly
        problems = width_problems(config, pp, "TP")
        if problems:
            raise ValueError(f"policy 'seesaw' decodes in TP={pp} over a replica's pp={pp} ranks, which must split "
                             "the heads and the MLP evenly (no KV heads replicated, as plain TP may: a rank's KV pool "
                             "holds the same bytes per block under PP and TP): " + "; ".join(problems))
        if num_layers % pp:
            raise ValueError(f"policy 'seesaw' needs num_hidden_layers={num_layers} divisible by pp={pp} (a rank's "
                             "KV pool holds as many bytes per block under PP as under TP)")
    replicas = tuple(tuple(range(i * pp, (i + 1) * pp)) for i in range(dp))
    layouts = []
    for i, ranks in enumerate(replicas):
        at = "" if dp == 1 else f"@{i}"
        layouts.append(Layout(f"pp{at}", "pp", ranks, (i,), pp=pp))
        if seesaw:
            layouts.append(Layout(f"tp{at}", "tp", ranks, (i,), tp=pp))
    return Deployment(dp * pp, replicas, tuple(layouts), "seesaw" if seesaw else "pp", tp=pp if seesaw else 1,
                      pp=pp, config=config, default_policy="seesaw" if seesaw else "static",
                      moves_kv_through_tier=seesaw)
