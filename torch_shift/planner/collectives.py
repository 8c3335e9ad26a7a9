"""Collectives by an alpha-beta model: time = alpha(op, n) + bytes on the wire / beta(op, n).

"Bytes on the wire" is what one rank sends in one call, counted exactly as the communication ledger
of `torch_shift.parallel.comm` counts it (ring all-reduce 2(n-1)/n of the tensor, all-to-all (n-1)/n,
all-gather (n-1) times the local input, send/recv the tensor). With that convention beta is NCCL's
"bus bandwidth", so a data-sheet link speed and a measured fit plug in alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COLLECTIVE_OPS = ("all_reduce", "all_to_all", "all_gather", "send_recv")


def wire_bytes(op: str, group_size: int, tensor_bytes: int) -> int:
    """Bytes one rank sends in one call on a group of `group_size` ranks (comm.py's ledger formula);
    `tensor_bytes` is the input tensor (for all-gather: the local shard)."""
    n = group_size
    if n == 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * tensor_bytes // n
    if op == "all_to_all":
        return (n - 1) * tensor_bytes // n
    if op == "all_gather":
        return (n - 1) * tensor_bytes
    if op == "send_recv":
        return tensor_bytes
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVE_OPS)}")


def ring_steps(op: str, group_size: int) -> int:
    """Sequential message rounds of the algorithm (what the latency term grows with)."""
    n = group_size
    return {"all_reduce": 2 * (n - 1), "all_to_all": n - 1, "all_gather": n - 1, "send_recv": 1}[op]


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float  # latency of one call
    beta_bytes_per_s: float  # bandwidth for the bytes on the wire

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s


def fit_alpha_beta(nbytes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least squares of t = alpha + bytes / beta in relative error (each point weighs 1/t, so that the
    microsecond latencies of small messages count as much as the milliseconds of large ones); alpha and
    1/beta are kept >= 0."""
    if len(nbytes) != len(times) or len(times) < 2 or min(times) <= 0:
        raise ValueError("a fit needs at least two (bytes, positive time) points")
    # minimise sum ((alpha + b * g - t) / t)^2 over alpha, g = 1 / beta: the 2 x 2 normal equations
    rows = [(1.0 / t, b / t) for b, t in zip(nbytes, times)]
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1 = sum(x for x, _ in rows)
    r2 = sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    alpha, g = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if alpha < 0:  # bandwidth alone
        alpha, g = 0.0, r2 / s22
    if g <= 0:  # latency alone
        alpha, g = r1 / s11, 1e-18
    return AlphaBeta(alpha, 1.0 / g)


@dataclass(frozen=True)
class CollectiveModel:
    """op -> group size -> AlphaBeta. A group size not in the table takes the nearest one below (else
    above) with alpha scaled by the ratio of ring steps and the same beta (bus bandwidth is roughly
    independent of the group size on one switch); say so when you plan beyond what was measured."""

    table: Mapping[str, Mapping[int, AlphaBeta]]

    def lookup(self, op: str, group_size: int) -> AlphaBeta:
        sizes = self.table.get(op)
        if not sizes:
            raise ValueError(f"this profile has no {op!r} figures; it has {', '.join(self.table)}")
        if group_size in sizes:
            return sizes[group_size]
        below = [n for n in sizes if n < group_size]
        near = max(below) if below else min(sizes)
        ab = sizes[near]
        return AlphaBeta(ab.alpha_s * ring_steps(op, group_size) / ring_steps(op, near), ab.beta_bytes_per_s)

    def time(self, op: str, group_size: int, tensor_bytes: int) -> float:
        if group_size == 1:
            return 0.0
        return self.lookup(op, group_size).time(wire_bytes(op, group_size, tensor_bytes))

    @classmethod
    def from_link(cls, bandwidth: float, base_latency_s: float, step_latency_s: float,
                  group_sizes: Sequence[int]) -> CollectiveModel:
        """A data-sheet model: beta = the link's achievable bus bandwidth for every op; alpha = a launch
        latency plus one link latency per ring step."""
        return cls({op: {n: AlphaBeta(base_latency_s + step_latency_s * ring_steps(op, n), bandwidth)
                         for n in group_sizes if n > 1} for op in COLLECTIVE_OPS})

    def to_json(self) -> dict:
        return {op: {str(n): {"alpha_s": ab.alpha_s, "beta_bytes_per_s": ab.beta_bytes_per_s}
                     for n, ab in sorted(sizes.items())} for op, sizes in self.table.items()}

    @classmethod
    def from_json(cls, data: Mapping) -> CollectiveModel:
        table = {}
        for op, sizes in data.items():
            if op not in COLLECTIVE_OPS:
                raise ValueError(f"unknown collective {op!r} in the profile; known: {', '.join(COLLECTIVE_OPS)}")
            table[op] = {}
            for n, ab in sizes.items():
                alpha, beta = float(ab["alpha_s"]), float(ab["beta_bytes_per_s"])
                if int(n) < 2 or alpha < 0 or not beta > 0 or math.isinf(alpha):
                    raise ValueError(f"bad {op} figures for group size {n}: {ab}")
                table[op][int(n)] = AlphaBeta(alpha, beta)
        return cls(table)
