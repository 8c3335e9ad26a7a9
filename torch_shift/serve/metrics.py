"""Prometheus metrics, named as vLLM names them where the concept is the same (prefix `torch_shift:`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from torch_shift.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"torch_shift:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.requests = Counter("torch_shift:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("torch_shift:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("torch_shift:generation_tokens", "Tokens generated", labels, registry=r)
        self.running = Gauge("torch_shift:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("torch_shift:num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.kv_usage = Gauge("torch_shift:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels,
                              registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output token after the first")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first scheduling")
        self.steps = Counter("torch_shift:steps", "Engine steps by parallel layout (each layout a step bound)",
                             labels + ["layout"], registry=r)
        self.layout_switches = Counter("torch_shift:layout_switches",
                                       "Steps in which a replica runs under another layout than the last time",
                                       labels, registry=r)
        self.step_duration = hist("step_duration_seconds", "Wall time of an engine step on rank 0")
        self.switch_latency = hist("layout_switch_latency_seconds",
                                   "Wall time of the steps at which the layouts changed (the switch and its first step)")
        self.model_name = model_name
        self._seen_tokens: dict[str, int] = {}  # request id -> output tokens already counted
        self._last_token_time: dict[str, float] = {}

    def on_step(self, engine) -> None:
        m = self.model_name
        for layout in engine.last_step_layout.split("+"):
            self.steps.labels(m, layout).inc()
        self.step_duration.labels(m).observe(engine.last_step_seconds)
        if engine.last_step_switched:
            self.layout_switches.labels(m).inc()
            self.switch_latency.labels(m).observe(engine.last_step_seconds)
        self.update_gauges(engine)

    def update_gauges(self, engine) -> None:
        """Running, waiting and KV usage as they are now (after a step, an addition or an abort)."""
        m = self.model_name
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        self.kv_usage.labels(m).set(engine.kv_usage)

    def on_output(self, out: RequestOutput) -> None:
        m, now = self.model_name, time.monotonic()
        rid = out.request_id
        tokens = sum(len(c.token_ids) for c in out.outputs)
        seen = self._seen_tokens.get(rid, 0)
        arrival = out.metrics.get("arrival_time", now)
        if seen == 0:
            self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
            self.ttft.labels(m).observe(now - arrival)
            scheduled = out.metrics.get("first_scheduled_time")
            if scheduled is not None:
                self.queue_time.labels(m).observe(scheduled - arrival)
        else:
            self.itl.labels(m).observe(now - self._last_token_time[rid])
        self.generation_tokens.labels(m).inc(tokens - seen)
        self._seen_tokens[rid] = tokens
        self._last_token_time[rid] = now
        if out.finished:
            first = out.metrics.get("first_token_time") or now
            self.e2e.labels(m).observe(now - arrival)
            per_seq = max(len(c.token_ids) for c in out.outputs)
            if per_seq > 1:
                self.tpot.labels(m).observe((now - first) / (per_seq - 1))
            for c in out.outputs:
                self.requests.labels(m, c.finish_reason or "abort").inc()
            del self._seen_tokens[rid], self._last_token_time[rid]

    def on_finished(self, reason: str, request_id: str | None = None) -> None:
        self.requests.labels(self.model_name, reason).inc()
        if request_id is not None:
            self._seen_tokens.pop(request_id, None)
            self._last_token_time.pop(request_id, None)
