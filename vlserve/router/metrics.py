"""The router's own Prometheus metrics (its replicas' are on their /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

OVERLAP_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class RouterMetrics:
    def __init__(self, replicas):
        self.registry = CollectorRegistry()
        self.requests = Counter("vlserve:router_requests", "Requests forwarded, by replica and by what decided the "
                                "choice (cache-hit, load, round-robin).", ["replica", "decision"],
                                registry=self.registry)
        self.overlap = Histogram("vlserve:router_prefix_overlap_ratio", "Share of a request's full prompt blocks "
                                 "cached on the replica it was sent to (as the router's view had it).",
                                 buckets=OVERLAP_BUCKETS, registry=self.registry)
        self.overlap_blocks = Counter("vlserve:router_prefix_overlap_blocks", "Leading prompt blocks cached on the "
                                      "chosen replica, summed over requests.", registry=self.registry)
        self.retries = Counter("vlserve:router_retries", "Requests tried again on another replica after a refused "
                               "connection.", registry=self.registry)
        self.registry.register(_ReplicaGauge(replicas))

    def routed(self, replica: str, decision: str, overlap: int, blocks: int) -> None:
        self.requests.labels(replica, decision).inc()
        self.overlap_blocks.inc(overlap)
        if blocks:
            self.overlap.observe(overlap / blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaGauge:
    def __init__(self, replicas):
        self.replicas = replicas

    def collect(self):
        g = GaugeMetricFamily("vlserve:router_replicas", "Replicas the router knows, by state.", labels=["state"])
        known = list(self.replicas.replicas.values())
        cold = sum(self.replicas.index.is_cold(r.name) for r in known if r.name in self.replicas.index.replicas)
        g.add_metric(["known"], float(len(known)))
        g.add_metric(["answering"], float(sum(r.answering for r in known)))
        g.add_metric(["cache_cold"], float(cold))
        yield g
