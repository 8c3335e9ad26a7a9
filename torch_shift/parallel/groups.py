"""Process groups of a shift-parallel deployment, from a 2-D DeviceMesh ("sp", "tp").

Global rank = sp * TP + tp (row-major, as `init_device_mesh` lays it out). After the Ulysses
all-to-all, rank (sp, tp) holds head chunk tp * SP + sp of P = SP * TP chunks: its *shift
rank* (paper 000, Fig. 7). The shift layout is full TP over all P ranks in shift-rank order,
so every rank attends to the same heads in both layouts and one KV cache serves both.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("sp", "tp")
CONTROL_TIMEOUT = timedelta(days=365)


def shift_rank_order(sp: int, tp: int) -> list[int]:
    """Global ranks listed by shift rank: entry r is the global rank of (sp=r % SP, tp=r // SP)."""
    return [(r % sp) * tp + r // sp for r in range(sp * tp)]


def new_group_in_order(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over `ranks` whose group rank i is global rank ranks[i]: `new_group` sorts its ranks unless
    told not to (`sort_ranks=False`, which torch 2.11 lacks). Every rank of the world calls it, as new_group."""
    if ranks == sorted(ranks):
        return dist.new_group(ranks)
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        return dist.new_group(ranks, sort_ranks=False)
    return _new_group_unsorted(ranks)


def _new_group_unsorted(ranks: list[int]) -> dist.ProcessGroup:
    """torch 2.11's new_group (`_new_group_with_tag`) without its `ranks = sorted(ranks)`: the steps that later
    versions take with sort_ranks=False (their private helpers have the same signatures)."""
    from torch.distributed import distributed_c10d as c10d

    if len(set(ranks)) != len(ranks) or not all(0 <= r < dist.get_world_size() for r in ranks):
        raise ValueError(f"a group's ranks must be distinct ranks of the world, got {ranks}")
    default_group = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default_group]
    global_rank = default_group.rank()
    group_rank = ranks.index(global_rank) if global_rank in ranks else None
    group, _ = c10d._new_process_group_helper(
        len(ranks), group_rank, ranks, dist.Backend(backend), store, c10d._process_group_name(ranks, False),
        timeout=c10d._get_default_timeout(dist.Backend(backend)), device_id=default_group.bound_device_id)
    c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(ranks)}
    return group


@dataclass
class ShiftGroups:
    """The groups of one (SP, TP) replica; its ranks are `first + sp * TP + tp`."""

    mesh: DeviceMesh  # ("sp", "tp")
    shift_mesh: DeviceMesh  # ("shift",), ranks in shift-rank order
    sp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    shift_group: dist.ProcessGroup

    @property
    def sp(self) -> int:
        return self.mesh.size(0)

    @property
    def tp(self) -> int:
        return self.mesh.size(1)

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def shift_rank(self) -> int:
        return self.tp_rank * self.sp + self.sp_rank

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ShiftGroups:
        """Groups of a 2-D ("sp", "tp") mesh or a 1-D ("tp",) one (SP = 1) over every rank, or of a
        replica's 2-D submesh with SP = 1 (its ranks `first + tp`)."""
        sp, tp = mesh_shape(mesh)
        ranks = mesh.mesh.cpu().flatten()
        if dist.get_rank() not in ranks.tolist():  # torch's get_group fails with an IndexError on such a rank
            raise ValueError(f"rank {dist.get_rank()} is not in the mesh (it holds ranks {ranks.tolist()} of a world "
                             f"of {dist.get_world_size()}): every rank that calls parallelize must be in its mesh")
        first = int(ranks.min())
        if not torch.equal(ranks, first + torch.arange(sp * tp)):
            raise ValueError(f"the mesh must lay global ranks out row-major (rank = sp * TP + tp), got {mesh.mesh}")
        if (sp > 1 or mesh.ndim == 1) and sp * tp != dist.get_world_size():
            raise ValueError(f"SP x TP = {sp} x {tp} = {sp * tp} differs from the world size {dist.get_world_size()}")
        if mesh.ndim == 1:
            mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(1, tp), mesh_dim_names=MESH_AXES)
        order = [first + r for r in shift_rank_order(sp, tp)]
        if sp == 1:  # the shift layout is the TP layout itself
            shift_group = mesh.get_group("tp")
        else:
            shift_group = new_group_in_order(order)
        shift_mesh = DeviceMesh.from_group(shift_group, mesh.device_type, mesh=torch.tensor(order),
                                           mesh_dim_names=("shift",))
        return cls(mesh, shift_mesh, mesh.get_group("sp"), mesh.get_group("tp"), shift_group)


def mesh_shape(mesh: DeviceMesh) -> tuple[int, int]:
    """(SP, TP) of a 2-D ("sp", "tp") mesh or a 1-D ("tp",) mesh; ValueError for any other mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    if names == MESH_AXES:
        return tuple(mesh.shape)
    if names == ("tp",):
        return 1, mesh.size()
    raise ValueError(f"a shift mesh is 2-D with axes {MESH_AXES} or 1-D with axis ('tp',), got axes "
                     f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}")


def build_shift_groups(sp: int, tp: int, device_type: str | None = None) -> ShiftGroups:
    """Groups over the initialised default process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    if sp < 1 or tp < 1:
        raise ValueError(f"sp and tp must be >= 1, got sp={sp}, tp={tp}")
    world = dist.get_world_size()
    if sp * tp != world:
        raise ValueError(f"SP x TP = {sp} x {tp} = {sp * tp} differs from the world size {world}")
    device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    mesh = init_device_mesh(device_type, (sp, tp), mesh_dim_names=MESH_AXES)
    return ShiftGroups.from_mesh(mesh)


@dataclass
class DeploymentGroups:
    """Every process group a deployment uses, created once at start-up in one order on every rank
    (paper 004's communicator pool): the control group of step plans, this rank's replica groups
    (SP x TP inside a replica), and the groups that bind several replicas, by rank tuple."""

    control_group: dist.ProcessGroup  # CPU (gloo): step plans and outputs
    replica: ShiftGroups | None  # None: the replica is this one rank
    pool: dict[tuple[int, ...], tuple[dist.ProcessGroup, DeviceMesh]]  # this rank's groups binding replicas

    @classmethod
    def build(cls, deployment, timeout: timedelta, replica: ShiftGroups | None = None) -> DeploymentGroups:
        """`replica`: this rank's replica groups as already built (a module from `parallelize`); `timeout`: the
        bound of the forward's collectives, which the control group is made under."""
        world = dist.get_world_size()
        if world != deployment.world_size:
            # a pipeline replica's ranks are its stages (and, under Seesaw, its TP group too)
            per_replica = (("PP", deployment.pp),) if deployment.pp > 1 else (("SP", deployment.sp),
                                                                               ("TP", deployment.tp))
            sizes = [(name, n) for name, n in (("DP", deployment.num_replicas),) + per_replica
                     if n > 1 or name != "DP"]
            raise ValueError(f"{' x '.join(n for n, _ in sizes)} = {' x '.join(str(v) for _, v in sizes)} = "
                             f"{deployment.world_size} differs from the world size {world}")
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        # Ranks wait on the control group between requests, for as long as the server idles: no
        # timeout there; the forward's collectives keep the process group's bound. It is made under that bound,
        # then lifted: made with no bound, a rank that died before it joined left the others waiting for it forever
        # (gloo's rendezvous waits out the group's timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        dist.distributed_c10d._set_pg_timeout(CONTROL_TIMEOUT, control)
        per_replica = world // deployment.num_replicas
        # a replica's ("sp", "tp") submesh: every replica has one unless its ranks only pipeline (static PP,
        # whose stages talk point to point)
        if replica is None and per_replica > 1 and deployment.sp * deployment.tp == per_replica:
            mesh = init_device_mesh(device_type, (deployment.num_replicas, deployment.sp, deployment.tp),
                                    mesh_dim_names=("dp",) + MESH_AXES)
            replica = ShiftGroups.from_mesh(mesh[MESH_AXES])
        rank = dist.get_rank()
        pool = {}
        for ranks in deployment.process_groups():
            group = dist.new_group(list(ranks))  # collective: every rank creates every group
            if rank in ranks:
                pool[ranks] = (group, DeviceMesh.from_group(group, device_type, mesh=torch.tensor(ranks),
                                                            mesh_dim_names=("tp",)))
        return cls(control, replica, pool)

    def forward_groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank's layouts run collectives on, in an order every rank agrees on (each group's
        members list it at the same place relative to their other groups)."""
        groups = []
        if self.replica is not None:
            groups += [self.replica.sp_group, self.replica.tp_group, self.replica.shift_group]
        groups += [group for group, _ in self.pool.values()]
        return list(dict.fromkeys(groups))
