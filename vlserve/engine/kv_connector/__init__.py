"""KV connectors by engine role (see base.py): the prefill role exports the KV it computed, the decode role loads
KV computed elsewhere. An engine without one (aggregated, language, offline) computes all of its KV."""

from __future__ import annotations

from vlserve.core.config import DECODE, PREFILL
from vlserve.core.errors import ConfigurationError
from vlserve.engine.kv_connector.base import ExportedKV, KVConnector, KVTransfer, MovedKV, PendingKV, RowWriter
from vlserve.engine.kv_connector.decode import DecodeConnector
from vlserve.engine.kv_connector.prefill import PrefillConnector

KV_CONNECTORS: dict[str, type[KVConnector]] = {PREFILL: PrefillConnector, DECODE: DecodeConnector}


def make_connector(role: str | None, cfg, writer: RowWriter | None = None) -> KVConnector | None:
    """The connector of an engine serving `role`, or None for roles whose engine computes all its KV. `writer`: a
    prefill engine's way to write its KV rows into receivers itself (else they go to the front end)."""
    if writer is not None and role != PREFILL:
        raise ConfigurationError(f"only a prefill engine writes KV rows to other instances, not {role!r}")
    connector = KV_CONNECTORS.get(role) if role is not None else None
    if connector is None:
        return None
    return connector(cfg, writer=writer) if writer is not None else connector(cfg)


__all__ = ["KV_CONNECTORS", "DecodeConnector", "ExportedKV", "KVConnector", "KVTransfer", "MovedKV", "PendingKV",
           "PrefillConnector", "RowWriter", "make_connector"]
