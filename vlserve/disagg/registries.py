"""The registry implementations by the kind a registry URL names, and the one way a role opens its registry."""

from __future__ import annotations

from collections.abc import Callable

from vlserve.disagg.registry import InstanceInfo, Registry, lease_ttl, registry_namespace, registry_target


def _bootstrap(opts, endpoints, info, model, load_fn, auth) -> Registry:
    from vlserve.disagg.bootstrap import BootstrapClient

    return BootstrapClient(endpoints[0], info, opts.heartbeat_interval, load_fn=load_fn, auth=auth)


def _etcd(opts, endpoints, info, model, load_fn, auth) -> Registry:
    # (the data path keeps its own authentication: `auth` signs nothing in etcd, which has users or certificates)
    from vlserve.disagg.etcd_client import EtcdClient, EtcdCredentials
    from vlserve.disagg.etcd_registry import EtcdRegistry

    creds = EtcdCredentials(opts.registry_user, opts.registry_password, opts.registry_ca, opts.registry_cert,
                            opts.registry_key)
    client = EtcdClient(list(endpoints), creds, timeout=max(2.0, 2 * opts.heartbeat_interval))
    return EtcdRegistry(client, info, registry_namespace(opts, model), lease_ttl(opts), opts.heartbeat_interval,
                        load_fn=load_fn)


REGISTRY_KINDS: dict[str, Callable[..., Registry]] = {"bootstrap": _bootstrap, "etcd": _etcd}


def open_registry(opts, info: InstanceInfo, model: str, load_fn: Callable[[], int] | None = None,
                  auth=None) -> Registry:
    """The registry client a role's DisaggArgs ask for, not yet started (start() registers). `model`: the model as
    the roles name it (etcd's default namespace); `auth`: the peers' shared secret (the bootstrap signs with it)."""
    target = registry_target(opts)
    return REGISTRY_KINDS[target.kind](opts, target.endpoints, info, model, load_fn, auth)
