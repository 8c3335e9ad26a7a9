"""The engine's counters as vLLM's `LLM.get_metrics()` returns them (`vllm.v1.metrics.reader`'s Counter, Gauge
and Vector, under the names the server's `/metrics` uses): code written against vLLM's offline metrics, such as
its speculative decoding example, reads them unchanged. The per-request latency histograms are the server's
(they time requests as a client sees them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per position (vLLM's reader: one list instead of a label per position)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(engine) -> list[Metric]:
    """What `engine` (an LLMEngine on rank 0) has counted so far, and its queues and KV use now."""
    stats = engine.stats_recorder
    scheduler = engine.scheduler
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", value=len(scheduler.running)),
        Gauge("vllm:num_requests_waiting", value=len(scheduler.waiting)),
        Gauge("vllm:kv_cache_usage_perc", value=engine.kv_usage),
        Counter("vllm:num_preemptions", value=scheduler.num_preemptions),
    ]
    if stats.spec_method is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", value=stats.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", value=stats.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", value=stats.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(stats.accepted_per_position)),
        ]
    metrics += [Counter("torch_shift:steps", {"layout": layout}, count)
                for layout, count in sorted(stats.steps_by_layout.items())]
    metrics.append(Counter("torch_shift:layout_switches", value=stats.num_switches))
    return metrics
