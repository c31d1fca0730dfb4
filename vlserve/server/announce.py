"""`vlserve serve --registry URL`: the aggregated server registers as a replica (role "serve") so that
`vlserve router` finds it, with its HTTP address and, under --kv-events-endpoint, where its cache events are
published. It pairs with no peer: the registry is only how routers discover it."""

from __future__ import annotations

import logging

from vlserve.core.config import Options
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.registries import open_registry
from vlserve.disagg.registry import (InstanceInfo, Registry, advertised_events_endpoint, advertised_host,
                                     new_instance_id, registry_target)

logger = logging.getLogger("vlserve.server")
REPLICA_ROLE = "serve"


def replica_info(opts: Options) -> InstanceInfo:
    public = advertised_host(opts.disagg, opts.server.host)
    http = f"[{public}]:{opts.server.port}" if ":" in public else f"{public}:{opts.server.port}"
    return InstanceInfo(new_instance_id(), REPLICA_ROLE, http, http,
                        kv_events=advertised_events_endpoint(opts.engine.kv_events_endpoint, public))


async def announce_replica(opts: Options, engine) -> Registry | None:
    """Registers this server (retrying until the registry answers) when --registry is given; None otherwise.
    The load it reports is the engine's running + waiting requests."""
    if not opts.disagg.registry:
        return None
    auth = PeerAuth(opts.disagg.disagg_secret)
    require_secret_off_loopback(auth, registry_target(opts.disagg).host, "this server's registry")
    info = replica_info(opts)
    registry = open_registry(opts.disagg, info, opts.engine.model,
                             load_fn=lambda: engine.stats.num_requests_running + engine.stats.num_requests_waiting,
                             auth=auth)
    await registry.start()
    logger.info("registered as replica %s (%s, kv events %s) at %s", info.instance_id, info.http_address,
                info.kv_events or "off", registry.address)
    return registry
