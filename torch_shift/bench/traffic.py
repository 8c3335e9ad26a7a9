"""Request streams for the serving benchmark: lengths (fixed, or sampled from a trace) and arrival
times (Poisson, gamma with a burstiness knob, alternating low/high phases, or trace replay)."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

# the first 2,000 requests of the Azure LLM inference trace 2023, conversation service (CC-BY-4.0; attribution
# and how it was cut: traces/README.md)
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "azure_conv_2023_first2000.csv"


@dataclass(frozen=True)
class RequestSpec:
    id: str
    arrival_s: float  # when to send it, from the start of the run
    prompt: list[int]
    max_tokens: int
    priority: int = 0  # lower is more urgent (vLLM's extension; the server must schedule by priority)


@dataclass(frozen=True)
class LengthSource:
    """Fixed lengths, or rows of a trace CSV (num_prefill_tokens, num_decode_tokens) scaled and clipped:
    length = clip(round(trace length x scale), 1 (2 for outputs), cap)."""

    prompt_len: int = 128
    output_len: int = 32
    trace: Path | None = None
    scale: float = 1.0
    max_prompt: int = 1024
    max_output: int = 256

    def describe(self) -> str:
        if self.trace is None:
            return f"fixed lengths: prompt {self.prompt_len}, output {self.output_len} tokens"
        return (f"lengths from {self.trace} x{self.scale}, prompts clipped to [1, {self.max_prompt}], "
                f"outputs to [2, {self.max_output}]")

    def sample(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        if self.trace is None:
            return [(self.prompt_len, self.output_len)] * n
        rows = read_trace(self.trace)
        return [self._clip(*rng.choice(rows)[1:]) for _ in range(n)]

    def _clip(self, prompt: int, output: int) -> tuple[int, int]:
        return (max(1, min(self.max_prompt, round(prompt * self.scale))),
                max(2, min(self.max_output, round(output * self.scale))))


def read_trace(path: Path) -> list[tuple[float, int, int]]:
    """(arrived_at, prompt tokens, output tokens) rows of an Azure-style trace CSV."""
    with open(path) as f:
        return [(float(r.get("arrived_at", 0.0) or 0.0), int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                for r in csv.DictReader(f)]


def poisson_arrivals(n: int, rate: float, rng: random.Random, start: float = 0.0) -> list[float]:
    return gamma_arrivals(n, rate, 1.0, rng, start)


def gamma_arrivals(n: int, rate: float, cv: float, rng: random.Random, start: float = 0.0) -> list[float]:
    """Gaps ~ Gamma with mean 1/rate and coefficient of variation `cv` (1: Poisson; > 1: burstier)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got {rate}, {cv}")
    shape = 1.0 / cv**2
    t, times = start, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        times.append(t)
    return times


def phase_arrivals(phases: list[tuple[float, float]], rng: random.Random) -> list[float]:
    """Poisson arrivals through consecutive (duration_s, rate) phases, e.g. low/high/low load."""
    times, start = [], 0.0
    for duration, rate in phases:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + duration:
                break
            times.append(t)
        start += duration
    return times


def workload(arrivals: list[float], lengths: LengthSource, vocab_size: int, seed: int = 0) -> list[RequestSpec]:
    """Requests at `arrivals` with random prompt token ids (ids 8.. avoid special tokens)."""
    rng = random.Random(seed)
    sizes = lengths.sample(len(arrivals), rng)
    return [RequestSpec(f"r{i}", t, [rng.randrange(8, vocab_size) for _ in range(p)], o)
            for i, (t, (p, o)) in enumerate(zip(arrivals, sizes))]


def trace_replay(path: Path, num: int, time_compression: float, lengths: LengthSource, vocab_size: int,
                 seed: int = 0) -> list[RequestSpec]:
    """The first `num` requests of a trace at their own arrival times divided by `time_compression`,
    with the trace's own lengths scaled and clipped by `lengths`."""
    rows = read_trace(path)[:num]
    rng = random.Random(seed)
    t0 = rows[0][0] if rows else 0.0
    specs = []
    for i, (arrived, prompt, output) in enumerate(rows):
        p, o = lengths._clip(prompt, output)
        specs.append(RequestSpec(f"r{i}", (arrived - t0) / time_compression,
                                 [rng.randrange(8, vocab_size) for _ in range(p)], o))
    return specs
