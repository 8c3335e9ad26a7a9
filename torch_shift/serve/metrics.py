"""Prometheus metrics. What vLLM measures is served under vLLM's own names (`vllm:*`), so that clients and
dashboards built for vLLM (aiperf's server-metrics tables, Grafana boards) read them unchanged; what only
torch_shift has (steps by parallel layout, layout switches, step wall time) is `torch_shift:*`."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from torch_shift.engine.outputs import RequestOutput
from torch_shift.engine.request import RequestStatus

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def latency(name: str, doc: str, prefix: str = "vllm") -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(f"vllm:{name}", doc, labels, buckets=_TOKEN_BUCKETS, registry=r)

        # vLLM's metrics, under vLLM's names and meanings
        self.requests = Counter("vllm:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels,
                              registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                         labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (requests that lost their KV blocks)",
                                   labels, registry=r)
        self.ttft = latency("time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = latency("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.tpot = latency("request_time_per_output_token_seconds", "Mean time per output token after the first")
        self.e2e = latency("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue_time = latency("request_queue_time_seconds", "Time from arrival to first scheduling")
        self.inference_time = latency("request_inference_time_seconds", "Time from first scheduling to the last token")
        self.prefill_time = latency("request_prefill_time_seconds", "Time from first scheduling to the first token")
        self.decode_time = latency("request_decode_time_seconds", "Time from the first token to the last")
        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens of each finished request")
        self.request_generation_tokens = tokens("request_generation_tokens",
                                                "Tokens generated for each finished request (all its samples)")
        self.iteration_tokens = tokens("iteration_tokens_total", "Tokens scheduled in each engine step")
        # speculative decoding, as vLLM's SpecDecodingProm (a draft: a request's proposed tokens checked in a step)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Requests' proposals checked", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens checked", labels,
                                         registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                            labels, registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in the proposal",
                                             labels + ["position"], registry=r)
        # torch_shift's own
        self.steps = Counter("torch_shift:steps", "Engine steps by parallel layout (each layout a step bound)",
                             labels + ["layout"], registry=r)
        self.layout_switches = Counter("torch_shift:layout_switches",
                                       "Steps in which a replica runs under another layout than the last time",
                                       labels, registry=r)
        self.step_duration = latency("step_duration_seconds", "Wall time of an engine step on rank 0", "torch_shift")
        self.switch_latency = latency("layout_switch_latency_seconds",
                                      "Wall time of the steps at which the layouts changed (the switch and its first "
                                      "step)", "torch_shift")
        self.model_name = model_name
        self._seen_tokens: dict[str, int] = {}  # request id -> output tokens already counted
        self._last_token_time: dict[str, float] = {}
        self._preemptions = 0
        self._scheduled_tokens = 0
        self._spec_seen = (0, 0, 0, [])  # the engine's spec counters at the last step

    def declare(self, engine) -> None:
        """Every series the engine can move, at 0 before it moves (as vLLM's logger makes them at start-up): a
        dashboard's first scrape sees them all, and a rate over a window that starts before a series' first count
        is right."""
        m = self.model_name
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.preemptions, self.ttft, self.itl, self.tpot, self.e2e, self.queue_time,
                       self.inference_time, self.prefill_time, self.decode_time, self.request_prompt_tokens,
                       self.request_generation_tokens, self.iteration_tokens, self.layout_switches,
                       self.step_duration, self.switch_latency):
            metric.labels(m)
        for status in RequestStatus:
            if status.finished:
                self.requests.labels(m, status.value)
        for layout in engine.deployment.layouts:
            self.steps.labels(m, layout.name)
        if engine.stats_recorder.spec_method is not None:
            for metric in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
                metric.labels(m)
            for position in range(len(engine.stats_recorder.accepted_per_position)):
                self.spec_accepted_per_pos.labels(m, str(position))
        self.update_gauges(engine)

    def on_step(self, engine) -> None:
        m = self.model_name
        for layout in engine.last_step_layout.split("+"):
            self.steps.labels(m, layout).inc()
        self.step_duration.labels(m).observe(engine.last_step_seconds)
        if engine.last_step_switched:
            self.layout_switches.labels(m).inc()
            self.switch_latency.labels(m).observe(engine.last_step_seconds)
        preemptions = engine.scheduler.num_preemptions
        self.preemptions.labels(m).inc(preemptions - self._preemptions)
        self._preemptions = preemptions
        scheduled = engine.num_scheduled_tokens
        if scheduled > self._scheduled_tokens:
            self.iteration_tokens.labels(m).observe(scheduled - self._scheduled_tokens)
        self._scheduled_tokens = scheduled
        self._count_spec(engine.stats_recorder)
        self.update_gauges(engine)

    def _count_spec(self, stats) -> None:
        if stats.spec_method is None:
            return
        m = self.model_name
        drafts, draft_tokens, accepted, per_pos = self._spec_seen
        self.spec_drafts.labels(m).inc(stats.num_drafts - drafts)
        self.spec_draft_tokens.labels(m).inc(stats.num_draft_tokens - draft_tokens)
        self.spec_accepted_tokens.labels(m).inc(stats.num_accepted_tokens - accepted)
        for position, count in enumerate(stats.accepted_per_position):  # every position, at 0 until one counts
            seen = per_pos[position] if position < len(per_pos) else 0
            self.spec_accepted_per_pos.labels(m, str(position)).inc(count - seen)
        self._spec_seen = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_position))

    def update_gauges(self, engine) -> None:
        """Running, waiting and KV usage as they are now (after a step, an addition or an abort)."""
        m = self.model_name
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        self.kv_usage.labels(m).set(engine.kv_usage)

    def on_output(self, out: RequestOutput) -> None:
        """A request's output after a step, all its samples in it (the server merges a step's outputs per request)."""
        m, now = self.model_name, time.monotonic()
        rid, times = out.request_id, out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        seen = self._seen_tokens.get(rid, 0)
        scheduled = times.scheduled_ts or None
        if seen == 0:
            num_prompt = len(out.prompt_token_ids)
            self.prompt_tokens.labels(m).inc(num_prompt)
            self.prefix_cache_queries.labels(m).inc(num_prompt)
            self.prefix_cache_hits.labels(m).inc(out.num_cached_tokens)
            self.ttft.labels(m).observe(now - times.queued_ts)
            if scheduled is not None:
                self.queue_time.labels(m).observe(scheduled - times.queued_ts)
                self.prefill_time.labels(m).observe(now - scheduled)
        else:
            self.itl.labels(m).observe(now - self._last_token_time[rid])
        self.generation_tokens.labels(m).inc(tokens - seen)
        self._seen_tokens[rid] = tokens
        self._last_token_time[rid] = now
        if out.finished:
            first = times.first_token_ts or now
            self.e2e.labels(m).observe(now - times.queued_ts)
            self.decode_time.labels(m).observe(now - first)
            if scheduled is not None:
                self.inference_time.labels(m).observe(now - scheduled)
            per_seq = max(len(c.token_ids) for c in out.outputs)
            if per_seq > 1:
                self.tpot.labels(m).observe((now - first) / (per_seq - 1))
            self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
            self.request_generation_tokens.labels(m).observe(tokens)
            for c in out.outputs:
                self.requests.labels(m, c.finish_reason or "abort").inc()
            del self._seen_tokens[rid], self._last_token_time[rid]

    def on_finished(self, reason: str, request_id: str | None = None) -> None:
        self.requests.labels(self.model_name, reason).inc()
        if request_id is not None:
            self._seen_tokens.pop(request_id, None)
            self._last_token_time.pop(request_id, None)
