"""Hardware profiles: achievable rates of one device and of the links between devices.

A profile comes from a data sheet (`get_profile("h200x8")`: peak figures times the achievable
fractions below) or from a measurement of a real machine (`torch-shift calibrate --out FILE`, then
`get_profile(FILE)`). Both are `HardwareProfile`s and share the JSON format of `to_json`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from torch_shift.planner.collectives import CollectiveModel

PROFILE_FORMAT = "torch_shift.hardware/1"

# The fractions of a data-sheet peak assumed achievable (the one place they are set; docs/planner.md
# states them). matmul: large cuBLAS GEMMs reach 70-80% of dense tensor peak; attention:
# FlashAttention-2/3 reach 50-75% of it; memory: streaming kernels reach 80-90% of HBM bandwidth;
# links: NCCL's all-reduce bus bandwidth on NVLink reaches ~80% of the per-direction link rate, on
# PCIe ~70%.
ACHIEVABLE_FRACTION = {"matmul": 0.70, "attention": 0.50, "memory": 0.80, "nvlink": 0.80, "pcie": 0.70}
# Collective latency (alpha) on data-sheet profiles: a launch plus one hop per ring step.
LINK_LATENCY_S = {"nvlink": (8e-6, 1e-6), "pcie": (10e-6, 3e-6)}
# torch_shift's own per-step engine cost (bench/bench_engine.py measured ~0.1 ms + 5 us per running
# request on a 2-core VM), with each step's kernels assumed launched as one CUDA graph, as in vLLM.
GPU_ENGINE_OVERHEAD = {"step_s": 0.5e-3, "seq_s": 5e-6, "parallel_step_s": 0.1e-3, "parallel_seq_s": 1e-6}


@dataclass(frozen=True)
class DataSheet:
    """Peak figures of one GPU as its vendor states them (dense, no sparsity)."""

    name: str
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    peak_flops: Mapping[str, float]  # dtype -> FLOP/s (fp32: CUDA cores, PyTorch's default without TF32)
    interconnect: str  # "nvlink" or "pcie"
    link_bandwidth: float  # bytes/s per direction per GPU
    source: str
    host_link_bandwidth: float = 32e9  # bytes/s per direction between a GPU and host memory (PCIe Gen4 x16)


TB = 1e12
DATASHEETS = {
    "h100": DataSheet("NVIDIA H100 SXM5 80GB", 80e9, 3.35 * TB,
                      {"fp32": 67e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}, "nvlink", 450e9,
                      "NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 900 GB/s bidirectional, PCIe Gen5", 64e9),
    "h200": DataSheet("NVIDIA H200 SXM 141GB", 141e9, 4.8 * TB,
                      {"fp32": 67e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}, "nvlink", 450e9,
                      "NVIDIA H200 Tensor Core GPU datasheet (SXM): NVLink 900 GB/s bidirectional, PCIe Gen5", 64e9),
    "a100": DataSheet("NVIDIA A100 SXM4 80GB", 80e9, 2.039 * TB,
                      {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, "nvlink", 300e9,
                      "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): NVLink 600 GB/s bidirectional"),
    "a100-pcie": DataSheet("NVIDIA A100 PCIe 80GB", 80e9, 1.935 * TB,
                           {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, "pcie", 32e9,
                           "NVIDIA A100 Tensor Core GPU datasheet (PCIe 80GB): PCIe Gen4 64 GB/s bidirectional"),
    "a100-pcie-40gb": DataSheet("NVIDIA A100 PCIe 40GB", 40e9, 1.555 * TB,
                                {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, "pcie", 32e9,
                                "NVIDIA A100 datasheet (PCIe 40GB; the Seesaw paper's A100 machine)"),
    "l4": DataSheet("NVIDIA L4 24GB", 24e9, 300e9,
                    {"fp32": 30.3e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242e12}, "pcie", 32e9,
                    "NVIDIA L4 Tensor Core GPU datasheet: PCIe Gen4 x16 64 GB/s bidirectional"),
    "a10": DataSheet("NVIDIA A10 24GB", 24e9, 600e9,
                     {"fp32": 31.2e12, "bf16": 125e12, "fp16": 125e12}, "pcie", 32e9,
                     "NVIDIA A10 Tensor Core GPU datasheet: PCIe Gen4 x16 64 GB/s bidirectional"),
}

# dtype -> the dtypes whose rate stands in when a profile has no figure for it
_RATE_FALLBACK = {"fp8": ("bf16", "fp16"), "bf16": ("fp16",), "fp16": ("bf16",), "fp32": ()}


@dataclass(frozen=True)
class EngineOverhead:
    """Per-step engine time outside the model: `step_s + seq_s * sequences`, plus, when the step runs on
    more than one rank, the step plan's broadcast `parallel_step_s + parallel_seq_s * sequences`."""

    step_s: float
    seq_s: float
    parallel_step_s: float = 0.0
    parallel_seq_s: float = 0.0

    def time(self, num_seqs: int, num_ranks: int) -> float:
        t = self.step_s + self.seq_s * num_seqs
        if num_ranks > 1:
            t += self.parallel_step_s + self.parallel_seq_s * num_seqs
        return t


@dataclass(frozen=True)
class HardwareProfile:
    """Achievable rates of one device (a GPU, or a CPU rank with its threads) of a machine.

    Rates are against the ideal FLOP and byte counts of `torch_shift.planner.shape`: `matmul_flops` and
    `matmul_bandwidth` (weights streamed through a matmul) for the linears, `attention_flops` and
    `attention_bandwidth` (the KV cache read) for attention, all by dtype; `copy_bandwidth` for the
    elementwise rest. A matmul bandwidth is one figure, or (rows, bytes/s) points measured with that many
    rows of input (a CPU GEMM with a few rows packs its weights and streams them at a fraction of the
    1-row rate), interpolated in log(rows) and held constant past both ends.
    `node_bandwidth` is what all devices of the machine stream together (host memory shared by CPU
    ranks): with `a` devices busy, each rate of each is scaled by min(1, node_bandwidth / (a x the 1-row
    matmul bandwidth)). None where each device has its own memory.
    `borrowed` (CPU ranks the engine started): per multiple of a rank's threads, the rates it measured running that
    many times its own threads, as a rank whose layout is alone with work in a step runs
    (`torch_shift.engine.model_runner.step_threads`); `borrowing` prices such a step. Empty where not measured."""

    name: str
    num_devices: int
    device_memory_bytes: float
    matmul_flops: Mapping[str, float]
    attention_flops: Mapping[str, float]
    matmul_bandwidth: Mapping[str, float | Sequence[tuple[int, float]]]
    attention_bandwidth: Mapping[str, float]
    copy_bandwidth: float
    collectives: CollectiveModel
    overhead: EngineOverhead
    node_bandwidth: float | None = None
    # device <-> host memory (the KV tier); None: CPU ranks, whose memory is the host's: the tier's copies run at
    # copy_bandwidth and the tier takes from the ranks' own memory
    host_link_bandwidth: float | None = None
    source: str = ""
    measurements: Mapping = field(default_factory=dict, compare=False)  # raw figures of a calibration
    borrowed: Mapping[int, Mapping] = field(default_factory=dict)  # multiple -> rates, keys as BORROWED_RATES

    def flops(self, rate: str, dtype: str) -> float:
        table = self.matmul_flops if rate == "matmul" else self.attention_flops
        for candidate in (dtype, *_RATE_FALLBACK[dtype]):
            if candidate in table:
                return table[candidate]
        raise ValueError(f"profile {self.name!r} has no {rate} rate for {dtype} (it has {', '.join(table)})")

    def bandwidth(self, rate: str, dtype: str, active_devices: int = 1, rows: int = 1) -> float:
        """Bytes/s of one device for `rate` ("matmul" with `rows` rows of input, "attention", "copy") while
        `active_devices` devices of the machine stream at once."""
        if rate == "copy":
            bw = self.copy_bandwidth
        else:
            table = self.matmul_bandwidth if rate == "matmul" else self.attention_bandwidth
            key = next((c for c in (dtype, *_RATE_FALLBACK[dtype], "fp32") if c in table), None)
            if key is None:
                raise ValueError(f"profile {self.name!r} has no {rate} bandwidth for {dtype}")
            bw = _at_rows(table[key], rows)
        if self.node_bandwidth is not None and active_devices > 1:
            solo = _at_rows(self.matmul_bandwidth.get("fp32", next(iter(self.matmul_bandwidth.values()))), 1)
            bw *= min(1.0, self.node_bandwidth / (active_devices * solo))
        return bw

    def borrowing(self, multiple: int) -> HardwareProfile:
        """The profile of a device that runs `multiple` times its own threads: the rates of the largest measured
        multiple up to `multiple` (a CPU rank whose layout is alone with work borrows the idle ranks' cores);
        this profile where none was measured (GPUs, profiles calibrated before the measurement, multiple 1)."""
        measured = [m for m in self.borrowed if m <= multiple]
        if not measured:
            return self
        return replace(self, **self.borrowed[max(measured)], borrowed={})

    @property
    def memory_is_host(self) -> bool:
        """The devices are CPU ranks: their memory is the host's, which a host KV tier shares with them."""
        return self.host_link_bandwidth is None

    @property
    def host_bandwidth(self) -> float:
        """Bytes/s one device copies to or from host memory (the host KV tier's swaps)."""
        return self.copy_bandwidth if self.host_link_bandwidth is None else self.host_link_bandwidth

    # -- JSON ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": PROFILE_FORMAT, "name": self.name, "source": self.source,
            "num_devices": self.num_devices, "device_memory_bytes": self.device_memory_bytes,
            "matmul_flops": dict(self.matmul_flops), "attention_flops": dict(self.attention_flops),
            "matmul_bandwidth": _rates_json(self.matmul_bandwidth),
            "attention_bandwidth": dict(self.attention_bandwidth),
            "copy_bandwidth": self.copy_bandwidth, "node_bandwidth": self.node_bandwidth,
            "host_link_bandwidth": self.host_link_bandwidth,
            "collectives": self.collectives.to_json(),
            "overhead": {"step_s": self.overhead.step_s, "seq_s": self.overhead.seq_s,
                         "parallel_step_s": self.overhead.parallel_step_s,
                         "parallel_seq_s": self.overhead.parallel_seq_s},
            "measurements": dict(self.measurements),
            "borrowed": {str(m): {k: _rates_json(v) if k != "copy_bandwidth" else v for k, v in rates.items()}
                         for m, rates in self.borrowed.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping) -> HardwareProfile:
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a torch_shift hardware profile (format {data.get('format')!r}, "
                             f"expected {PROFILE_FORMAT!r})")
        try:
            profile = cls(
                name=str(data["name"]), num_devices=int(data["num_devices"]),
                device_memory_bytes=float(data["device_memory_bytes"]),
                matmul_flops=_rates(data["matmul_flops"]), attention_flops=_rates(data["attention_flops"]),
                matmul_bandwidth=_rates(data["matmul_bandwidth"]),
                attention_bandwidth=_rates(data["attention_bandwidth"]), copy_bandwidth=float(data["copy_bandwidth"]),
                node_bandwidth=None if data.get("node_bandwidth") is None else float(data["node_bandwidth"]),
                host_link_bandwidth=(None if data.get("host_link_bandwidth") is None
                                     else float(data["host_link_bandwidth"])),
                collectives=CollectiveModel.from_json(data["collectives"]),
                overhead=EngineOverhead(**{k: float(v) for k, v in data["overhead"].items()}),
                source=str(data.get("source", "")), measurements=data.get("measurements", {}),
                borrowed={int(m): _borrowed_rates(rates) for m, rates in data.get("borrowed", {}).items()},
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"hardware profile {data.get('name')!r} is missing or has a bad field: {e}") from None
        if (profile.num_devices < 1 or profile.copy_bandwidth <= 0 or profile.device_memory_bytes <= 0
                or any(m < 2 or rates["copy_bandwidth"] <= 0 for m, rates in profile.borrowed.items())):
            raise ValueError(f"hardware profile {profile.name!r} has non-positive figures")
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _at_rows(rate: float | Sequence[tuple[int, float]], rows: int) -> float:
    """A rate, or (rows, rate) points interpolated in log(rows), constant past both ends."""
    if isinstance(rate, (int, float)):
        return float(rate)
    points = sorted(rate)
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if rows <= r1:
            w = math.log(rows / r0) / math.log(r1 / r0)
            return v0 + w * (v1 - v0)
    return points[-1][1]


def _rates_json(table: Mapping) -> dict:
    return {d: v if isinstance(v, (int, float)) else [list(p) for p in v] for d, v in table.items()}


# the rates a device measures, each of them again at a multiple of its threads (HardwareProfile.borrowed)
BORROWED_RATES = ("matmul_flops", "attention_flops", "matmul_bandwidth", "attention_bandwidth", "copy_bandwidth")


def _borrowed_rates(data: Mapping) -> dict:
    return {k: float(data[k]) if k == "copy_bandwidth" else _rates(data[k]) for k in BORROWED_RATES}


def _rates(table: Mapping) -> dict:
    """dtype -> a positive rate, or a list of (rows >= 1, positive rate) points."""
    rates: dict = {}
    for dtype, value in table.items():
        if isinstance(value, (list, tuple)):
            value = tuple((int(r), float(v)) for r, v in value)
            ok = bool(value) and all(r >= 1 and v > 0 for r, v in value)
        else:
            value = float(value)
            ok = value > 0
        if not ok:
            raise ValueError(f"rates must be positive, got {dtype}: {table[dtype]}")
        rates[str(dtype)] = value
    if not rates:
        raise ValueError("a rate table is empty")
    return rates


def datasheet_profile(gpu: str, num_devices: int = 1) -> HardwareProfile:
    """A node of `num_devices` GPUs of a data-sheet kind, at ACHIEVABLE_FRACTION of its peaks."""
    if gpu not in DATASHEETS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(DATASHEETS)}")
    sheet, f = DATASHEETS[gpu], ACHIEVABLE_FRACTION
    memory_bw = sheet.memory_bandwidth * f["memory"]
    base, per_step = LINK_LATENCY_S[sheet.interconnect]
    sizes = [n for n in (2, 4, 8) if n <= max(num_devices, 2)]
    return HardwareProfile(
        name=f"{gpu}x{num_devices}" if num_devices > 1 else gpu,
        num_devices=num_devices,
        device_memory_bytes=sheet.memory_bytes,
        matmul_flops={d: r * f["matmul"] for d, r in sheet.peak_flops.items()},
        attention_flops={d: r * f["attention"] for d, r in sheet.peak_flops.items() if d != "fp8"},
        matmul_bandwidth={d: memory_bw for d in sheet.peak_flops},
        attention_bandwidth={d: memory_bw for d in sheet.peak_flops},
        copy_bandwidth=memory_bw,
        host_link_bandwidth=sheet.host_link_bandwidth * f["pcie"],
        collectives=CollectiveModel.from_link(sheet.link_bandwidth * f[sheet.interconnect], base, per_step, sizes),
        overhead=EngineOverhead(**GPU_ENGINE_OVERHEAD),
        source=f"data sheet: {sheet.source}; achievable fractions {f}",
    )


def get_profile(spec: str | Path) -> HardwareProfile:
    """'h200' (one GPU), 'h200x8' (a node of 8), or the path of a JSON profile (`torch-shift calibrate`)."""
    text = str(spec)
    match = re.fullmatch(r"([a-z0-9-]+?)(?:x(\d+))?", text.lower())
    if match and match.group(1) in DATASHEETS:
        return datasheet_profile(match.group(1), int(match.group(2) or 1))
    path = Path(text)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return HardwareProfile.from_json(data)
    raise ValueError(f"unknown hardware {text!r}: give a JSON profile (torch-shift calibrate --out FILE) or one "
                     f"of {', '.join(DATASHEETS)}, optionally with a GPU count (e.g. h200x8)")
