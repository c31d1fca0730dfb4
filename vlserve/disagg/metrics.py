"""Transfer metrics shared by both roles: transfers by state, bytes, resumes, and (where there are receive
blocks) the buffer gauges that show anyone watching /metrics that no block leaked."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from vlserve.disagg.messages import TransferState
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.metrics import LATENCY_BUCKETS, PREFIX


class _BufferGauges:
    def __init__(self, buffers: TransferBuffers, labels: dict[str, str]):
        self.buffers, self.labels = buffers, labels

    def collect(self):
        for name, value, help_text in (
                ("embedding_buffer_free_blocks", self.buffers.num_free, "Free embedding buffer blocks."),
                ("embedding_buffer_total_blocks", self.buffers.num_blocks, "All embedding buffer blocks.")):
            g = GaugeMetricFamily(PREFIX + name, help_text, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(value))
            yield g


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry, buffers: TransferBuffers | None, role: str):
        self.labels = {"role": role}
        if buffers is not None:
            registry.register(_BufferGauges(buffers, self.labels))
        self._transfers = Counter(PREFIX + "embedding_transfers", "Embedding transfers entering each state.",
                                  ["role", "state"], registry=registry)
        for state in TransferState:  # every state shows up at 0 from the start
            self._transfers.labels(role, state.value)
        self._bytes = Counter(PREFIX + "embedding_transfer_bytes", "Embedding transfer payload bytes.", ["role"],
                              registry=registry).labels(role)
        self._resumes = Counter(PREFIX + "embedding_transfer_resumes", "Transfers resumed into fresh blocks.",
                                ["role"], registry=registry).labels(role)
        self.transfer_latency = Histogram(PREFIX + "embedding_transfer_latency_seconds",
                                          "From sending an encode request to the last chunk.", ["role"],
                                          registry=registry, buckets=LATENCY_BUCKETS).labels(role)

    def state(self, state: TransferState) -> None:
        self._transfers.labels(self.labels["role"], state.value).inc()

    def bytes(self, n: int) -> None:
        self._bytes.inc(n)

    def resume(self) -> None:
        self._resumes.inc()
