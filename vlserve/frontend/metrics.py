"""Prometheus metrics with the names of the interface contract (DESIGN §4).

Gauges and counters come straight from the engine's latest stats (the engine keeps the cumulative totals, so
a collector reads them at scrape time); latency histograms are observed in the front-end, where a request's
first token and finish are seen. Each server owns its registry, so several can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vlserve.core.config import TOWER_MODALITIES
from vlserve.core.wire import EngineStats

PREFIX = "vlserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (kind, help); the value is the EngineStats field of the same name
ENGINE_METRICS = {
    "num_requests_running": ("gauge", "Requests in the running batch."),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV cache blocks in use (1 = full)."),
    "kv_cache_blocks": ("gauge", "KV cache size in blocks (what kv_cache_usage_perc is a fraction of; a "
                        "cache-aware router weighs a replica's cached blocks against it)."),
    "num_preemptions_total": ("counter", "Requests preempted (recomputed later) for lack of KV blocks."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens served from the prefix cache."),
    "state_snapshot_queries_total": ("counter", "Hybrid models: admissions that looked for a linear-attention state "
                                     "snapshot to resume a prefix hit from."),
    "state_snapshot_hits_total": ("counter", "Hybrid models: admissions that resumed from a state snapshot."),
    "state_cache_usage_perc": ("gauge", "Hybrid models: fraction of linear-attention state slots (running "
                               "requests' and snapshots) in use."),
    "encoder_cache_queries_total": ("counter", "Multimodal items looked up in the encoder cache."),
    "encoder_cache_hits_total": ("counter", "Multimodal items served from the encoder cache."),
    "prompt_tokens_total": ("counter", "Prompt tokens received."),
    "generation_tokens_total": ("counter", "Tokens generated."),
}

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


class _EngineStatsCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        stats, labels = self.metrics.stats, [self.metrics.model_name]
        for name, (kind, help_text) in ENGINE_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, help_text, labels=["model_name"])
            family.add_metric(labels, float(getattr(stats, name)))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, modalities: tuple[str, ...] = ()):
        """`modalities`: the model's media kinds, each shown (at 0) before its first item."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stats = EngineStats()
        self.registry.register(_EngineStatsCollector(self))

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(PREFIX + name, help_text, ["model_name"], registry=self.registry,
                             buckets=LATENCY_BUCKETS).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two generated tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.encoder = Histogram(PREFIX + "encoder_latency_seconds", "Media encoder time per tower call, by tower "
                                 "(vision, audio).", ["model_name", "tower"], registry=self.registry,
                                 buckets=LATENCY_BUCKETS)
        self.mm_items = Counter(PREFIX + "mm_items", "Media items in prompts sent to the engine, by modality "
                                "(image, video, audio; a video heard with its sound: one item per 2-second window "
                                "of its frames and one per window of its sound).", ["model_name", "modality"],
                                registry=self.registry)
        # every series there is from the start (a scrape before the first media item sees zeros, not nothing)
        for kind in modalities:
            self.mm_items.labels(model_name, kind)
        for tower, kinds in TOWER_MODALITIES.items():
            if set(kinds) & set(modalities):
                self.encoder.labels(model_name, tower)

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge of the front end's own state, read at scrape time."""
        Gauge(PREFIX + name, help_text, ["model_name"], registry=self.registry).labels(
            self.model_name).set_function(read)

    def count_items(self, items) -> None:
        """A prompt's media items (MultiModalItem), once per request."""
        for item in items:
            self.mm_items.labels(self.model_name, item.modality).inc()

    def on_engine_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        for tower, seconds in stats.encoder_seconds:
            self.encoder.labels(self.model_name, tower).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
