"""Transfer metrics shared by both roles: transfers by state, bytes, resumes, and (where there are receive
blocks) the buffer gauges that show anyone watching /metrics that no block leaked."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from vlserve.disagg.messages import TransferState
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.metrics import LATENCY_BUCKETS, PREFIX


class _BufferGauges:
    def __init__(self, buffers: TransferBuffers, labels: dict[str, str], kind: str):
        self.buffers, self.labels, self.kind = buffers, labels, kind

    def collect(self):
        kind = self.kind
        for name, value, help_text in (
                (f"{kind}_buffer_free_blocks", self.buffers.num_free, f"Free {kind} receive buffer blocks."),
                (f"{kind}_buffer_total_blocks", self.buffers.num_blocks, f"All {kind} receive buffer blocks.")):
            g = GaugeMetricFamily(PREFIX + name, help_text, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(value))
            yield g


class ScrapeTimeGauges:
    """Gauges read from the live objects at scrape time: `read()` gives (name, value, help) triples."""

    def __init__(self, read):
        self.read = read

    def collect(self):
        for name, value, help_text in self.read():
            g = GaugeMetricFamily(PREFIX + name, help_text)
            g.add_metric([], float(value))
            yield g


class TransferMetrics:
    """`kind`: what moves, "embedding" (encoder -> language or prefill) or "kv" (prefill -> decode)."""

    def __init__(self, registry: CollectorRegistry, buffers: TransferBuffers | None, role: str,
                 kind: str = "embedding"):
        self.labels = {"role": role}
        if buffers is not None:
            registry.register(_BufferGauges(buffers, self.labels, kind))
        self._transfers = Counter(PREFIX + f"{kind}_transfers", f"{kind.capitalize()} transfers entering each state.",
                                  ["role", "state"], registry=registry)
        for state in TransferState:  # every state shows up at 0 from the start
            self._transfers.labels(role, state.value)
        self._bytes = Counter(PREFIX + f"{kind}_transfer_bytes", f"{kind.capitalize()} transfer payload bytes.",
                              ["role"], registry=registry).labels(role)
        self._resumes = Counter(PREFIX + f"{kind}_transfer_resumes", "Transfers that took more blocks than their "
                                "first run (an encoder's resumed; a prefill instance's asked for once it knew its "
                                "prompt's length).", ["role"], registry=registry).labels(role)
        self.transfer_latency = Histogram(PREFIX + f"{kind}_transfer_latency_seconds",
                                          "From sending a request to its last chunk.", ["role"],
                                          registry=registry, buckets=LATENCY_BUCKETS).labels(role)

    def state(self, state: TransferState) -> None:
        self._transfers.labels(self.labels["role"], state.value).inc()

    def bytes(self, n: int) -> None:
        self._bytes.inc(n)

    def resume(self) -> None:
        self._resumes.inc()
