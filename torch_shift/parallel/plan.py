"""Parallel plans as data: parameter name -> (mesh, DTensor placements).

The base plan shards every weight over "tp" exactly as Megatron TP (q/k/v/gate/up by output
rows, o/down by input columns; each expert of a sparse layer as the dense MLP, the router replicated) and
replicates it over "sp"; tokens are split over "sp". The
shift plan shards the same weights over all P ranks of the shift mesh (full TP in shift-rank
order). The LM head is vocab-parallel over the shift mesh in both plans.

Placements declare the layout; `shard_bounds` turns one into the slice a rank holds. Fused
parameters are sharded part by part (q, k, v; gate, up), and attention weights in whole heads.
With more head chunks than KV heads, the KV heads are replicated: chunk c of C holds KV head
c // (C / h_kv) (the GQA rule, DESIGN.md section 2), which no plain `Shard` placement expresses.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

from torch_shift.config import ModelConfig
from torch_shift.parallel.groups import ShiftGroups


@dataclass(frozen=True)
class ParallelPlan:
    layout: str  # "base" or "shift"
    placements: dict[str, tuple[DeviceMesh, tuple[Placement, ...]]]  # name pattern -> (mesh, placements)

    def lookup(self, param_name: str) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        for pattern, entry in self.placements.items():
            if fnmatch.fnmatchcase(param_name, pattern):
                return entry
        raise KeyError(param_name)

    def shard_dim_and_axis(self, param_name: str) -> tuple[int, str] | None:
        """(tensor dim, mesh axis) of the parameter's single Shard placement, or None if replicated."""
        from torch.distributed.tensor import Shard

        mesh, placements = self.lookup(param_name)
        sharded = [(p.dim, mesh.mesh_dim_names[i]) for i, p in enumerate(placements) if isinstance(p, Shard)]
        assert len(sharded) <= 1, f"{param_name}: one sharded mesh axis at most, got {placements}"
        return sharded[0] if sharded else None


def _megatron_entries(mesh: DeviceMesh, placements_for) -> dict:
    return {
        "layers.*.attn.qkv_proj.*": (mesh, placements_for(0)),
        "layers.*.attn.o_proj.weight": (mesh, placements_for(1)),
        "layers.*.attn.sinks": (mesh, placements_for(0)),  # one per query head, sharded with them
        "layers.*.mlp.gate_up_proj.weight": (mesh, placements_for(0)),
        "layers.*.mlp.down_proj.weight": (mesh, placements_for(1)),
        # a sparse layer's shared expert (Qwen2-MoE) as the dense MLP; its gate replicated, as the router
        "layers.*.mlp.shared_expert.gate_up_proj.weight": (mesh, placements_for(0)),
        "layers.*.mlp.shared_expert.down_proj.weight": (mesh, placements_for(1)),
        # a sparse layer's experts, stacked [E, 2I, H] and [E, H, I]: every expert's FFN split as the dense one
        "layers.*.mlp.experts.gate_up_proj": (mesh, placements_for(1)),
        "layers.*.mlp.experts.down_proj": (mesh, placements_for(2)),
        "layers.*.mlp.experts.gate_up_bias": (mesh, placements_for(1)),
        # row-parallel biases (o_proj's, the experts' down_bias) stay whole: added once, after the sum
    }


EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def _expert_parallel(entries: dict, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
    """Every sparse layer's experts split whole across `placements`' sharded axis (Shard(0) of the stacked
    experts), in place of TP inside each expert."""
    for name in EXPERT_PARAMETERS:
        entries[f"layers.*.mlp.experts.{name}"] = (mesh, placements)


def base_plan(groups: ShiftGroups, expert_parallel: bool = False) -> ParallelPlan:
    """`expert_parallel`: the experts split over the SP ranks (TP = 1 then), or over TP when SP = 1."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = groups.mesh
    entries = _megatron_entries(mesh, lambda dim: (Replicate(), Shard(dim)))
    if expert_parallel:
        assert groups.sp == 1 or groups.tp == 1, (groups.sp, groups.tp)
        _expert_parallel(entries, mesh, (Shard(0), Replicate()) if groups.sp > 1 else (Replicate(), Shard(0)))
    entries["lm_head.weight"] = (groups.shift_mesh, (Shard(0),))
    entries["*"] = (mesh, (Replicate(), Replicate()))
    return ParallelPlan("base", entries)


def tp_plan(mesh: DeviceMesh, layout: str = "tp", expert_parallel: bool = False) -> ParallelPlan:
    """Megatron TP over a 1-D mesh, the LM head vocab-parallel; the experts split whole over the ranks with
    `expert_parallel`."""
    from torch.distributed.tensor import Replicate, Shard

    entries = _megatron_entries(mesh, lambda dim: (Shard(dim),))
    if expert_parallel:
        _expert_parallel(entries, mesh, (Shard(0),))
    entries["lm_head.weight"] = (mesh, (Shard(0),))
    entries["*"] = (mesh, (Replicate(),))
    return ParallelPlan(layout, entries)


def shift_plan(groups: ShiftGroups) -> ParallelPlan:
    return tp_plan(groups.shift_mesh, "shift")


def shard_bounds(num_units: int, num_chunks: int, chunk: int) -> tuple[int, int]:
    """(first unit, unit count) of `chunk` of `num_chunks`; more chunks than units replicate units."""
    if num_chunks <= num_units:
        assert num_units % num_chunks == 0, (num_units, num_chunks)
        per = num_units // num_chunks
        return chunk * per, per
    assert num_chunks % num_units == 0, (num_units, num_chunks)
    return chunk // (num_chunks // num_units), 1


def padded_vocab(vocab_size: int, num_chunks: int) -> int:
    return -(-vocab_size // num_chunks) * num_chunks


@dataclass(frozen=True)
class PartSlice:
    """Where one part of a parameter comes from: `length` rows/columns from `start` along `dim`
    of the full (Hugging Face) tensor."""

    dim: int
    start: int
    length: int


def part_units(config: ModelConfig, param_name: str, part: str | None) -> tuple[int, int]:
    """(number of units, unit size) along the sharded dim of one part of a parameter."""
    leaf = param_name.split(".")[-2]
    if param_name.endswith(".attn.sinks"):
        return config.num_attention_heads, 1
    if leaf == "qkv_proj":
        heads = config.num_attention_heads if part == "q" else config.num_key_value_heads
        return heads, config.head_dim
    if leaf == "o_proj":
        return config.num_attention_heads, config.head_dim
    if leaf in ("gate_up_proj", "down_proj"):
        shared = param_name.split(".")[-3] == "shared_expert"
        return config.shared_expert_intermediate_size if shared else config.intermediate_size, 1
    if leaf == "experts":
        return config.moe_intermediate_size, 1
    if leaf == "lm_head":
        return config.vocab_size, 1
    raise KeyError(param_name)


def local_part_slice(
    plan: ParallelPlan, config: ModelConfig, param_name: str, part: str | None
) -> PartSlice | None:
    """The slice of the full tensor (one part of a fused one) this rank holds; None: the whole."""
    sharded = plan.shard_dim_and_axis(param_name)
    if sharded is None:
        return None
    dim, axis = sharded
    mesh, _ = plan.lookup(param_name)
    num_chunks, chunk = mesh.size(mesh.mesh_dim_names.index(axis)), mesh.get_local_rank(axis)
    if param_name == "lm_head.weight":
        rows = padded_vocab(config.vocab_size, num_chunks) // num_chunks
        start = chunk * rows
        return PartSlice(0, start, max(0, min(rows, config.vocab_size - start)))
    if param_name.split(".")[-2] == "experts" and dim == 0:
        return None  # expert parallelism: a rank holds whole experts (expert_shard says which)
    num_units, unit = part_units(config, param_name, part)
    first, count = shard_bounds(num_units, num_chunks, chunk)
    if param_name.split(".")[-2] == "experts":
        dim -= 1  # a part is one expert's [rows, cols]: the stacked parameter's dims without the expert's
    return PartSlice(dim, first * unit, count * unit)


def expert_shard(plan: ParallelPlan, config: ModelConfig, param_name: str) -> tuple[int, int] | None:
    """(first expert, count) this rank holds of a sparse layer's experts under expert parallelism, else None."""
    sharded = plan.shard_dim_and_axis(param_name)
    if sharded is None or sharded[0] != 0:
        return None
    mesh, _ = plan.lookup(param_name)
    axis = sharded[1]
    n, rank = mesh.size(mesh.mesh_dim_names.index(axis)), mesh.get_local_rank(axis)
    assert config.num_experts % n == 0, (config.num_experts, n)
    count = config.num_experts // n
    return rank * count, count


def validate_expert_parallel(config: ModelConfig, sp: int, tp: int) -> None:
    """Expert parallelism over the SP ranks (TP = 1) or the TP ranks (SP = 1): whole experts per rank."""
    if not config.is_moe:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
    if sp * tp == 1:
        raise ValueError("enable_expert_parallel splits the experts over several ranks; give tp or sp > 1")
    if sp > 1 and tp > 1:
        raise ValueError(f"expert parallelism splits the experts over the SP ranks (tp=1) or the TP ranks (sp=1); "
                         f"got sp={sp}, tp={tp}")
    if config.num_experts % (sp * tp):
        raise ValueError(f"num_experts={config.num_experts} is not divisible by the {sp * tp} ranks that split them")


def validate_mesh_for_model(config: ModelConfig, sp: int, tp: int, expert_parallel: bool = False) -> None:
    """A mesh must divide the heads (KV heads may be replicated) and the MLP width (and each expert's, unless
    `expert_parallel` keeps the experts whole, and a shared expert's)."""
    p = sp * tp
    h, h_kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if h % p:
        problems.append(f"num_attention_heads={h} is not divisible by SP x TP = {sp} x {tp} = {p}")
    for chunks, name in ((tp, "TP"), (p, "SP x TP")):
        if chunks % h_kv and h_kv % chunks:
            problems.append(f"num_key_value_heads={h_kv} and {name}={chunks}: neither divides the other")
    if config.intermediate_size % p:
        problems.append(f"intermediate_size={config.intermediate_size} is not divisible by SP x TP = {p}")
    if config.is_moe and not expert_parallel and config.moe_intermediate_size % p:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size} (each expert's FFN) is not divisible "
                        f"by SP x TP = {p}")
    if config.shared_expert_intermediate_size % p:
        problems.append(f"shared_expert_intermediate_size={config.shared_expert_intermediate_size} is not divisible "
                        f"by SP x TP = {p}")
    if problems:
        raise ValueError("this mesh does not fit the model: " + "; ".join(problems))
