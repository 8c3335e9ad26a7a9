"""Process groups of a shift-parallel deployment, from a 2-D DeviceMesh ("sp", "tp").

Global rank = sp * TP + tp (row-major, as `init_device_mesh` lays it out). After the Ulysses
all-to-all, rank (sp, tp) holds head chunk tp * SP + sp of P = SP * TP chunks: its *shift
rank* (paper 000, Fig. 7). The shift layout is full TP over all P ranks in shift-rank order,
so every rank attends to the same heads in both layouts and one KV cache serves both.
"""

from __future__ import annotations

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


@dataclass
class ShiftGroups:
    mesh: DeviceMesh  # ("sp", "tp")
    shift_mesh: DeviceMesh  # ("shift",), ranks in shift-rank order
    sp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    shift_group: dist.ProcessGroup
    control_group: dist.ProcessGroup  # CPU (gloo) group for step plans and outputs

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
        """Groups of a 2-D ("sp", "tp") mesh, or of a 1-D ("tp",) one (SP = 1)."""
        sp, tp = mesh_shape(mesh)
        if not torch.equal(mesh.mesh.cpu().flatten(), torch.arange(sp * tp)):
            raise ValueError(f"the mesh must lay global ranks out row-major (rank = sp * TP + tp), got {mesh.mesh}")
        if sp * tp != dist.get_world_size():
            raise ValueError(f"SP x TP = {sp} x {tp} = {sp * tp} differs from the world size {dist.get_world_size()}")
        if mesh.ndim == 1:
            mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(1, tp), mesh_dim_names=MESH_AXES)
        order = shift_rank_order(sp, tp)
        # new_group sorts its ranks unless told not to; the shift group must keep shift-rank order.
        shift_group = dist.new_group(order, sort_ranks=False)
        shift_mesh = DeviceMesh.from_group(shift_group, mesh.device_type, mesh=torch.tensor(order),
                                           mesh_dim_names=("shift",))
        # Ranks wait on the control group between requests, for as long as the server idles: no
        # timeout there; the forward's collectives keep the process group's bound.
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(mesh, shift_mesh, mesh.get_group("sp"), mesh.get_group("tp"), shift_group, control)


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
