"""The flags of `vlserve dynamo-worker`: `vlserve serve`'s engine and media options (the derived role DYNAMO)
and Dynamo's runtime flags, named as its own backends name them."""

from __future__ import annotations

import argparse
import os

from vlserve.core.config import DYNAMO, LANGUAGE, SERVE
from vlserve.core.errors import ConfigurationError
from vlserve.core.options import add_options, options_from


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    add_options(parser, DYNAMO)
    group = parser.add_argument_group("dynamo")
    env = os.environ.get
    group.add_argument("--namespace", default=env("DYN_NAMESPACE", "dynamo"),
                       help="Dynamo namespace the worker registers in (default: $DYN_NAMESPACE or dynamo)")
    group.add_argument("--component", default="backend", help="component name (default: backend)")
    group.add_argument("--endpoint", default="generate", help="endpoint name (default: generate)")
    group.add_argument("--endpoint-types", default="chat,completions",
                       help="OpenAI endpoints the frontend serves for this model (default: chat,completions)")
    group.add_argument("--discovery-backend", default=env("DYN_DISCOVERY_BACKEND", "etcd"),
                       choices=("etcd", "file", "kubernetes", "mem"),
                       help="where workers and frontends find each other (default: $DYN_DISCOVERY_BACKEND or etcd; "
                            "file: $DYN_FILE_KV names the folder)")
    group.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"), choices=("tcp", "nats"),
                       help="how requests reach the worker (default: $DYN_REQUEST_PLANE or tcp)")
    group.add_argument("--event-plane", default=env("DYN_EVENT_PLANE"), choices=("nats", "zmq"),
                       help="how KV events reach the router (default: $DYN_EVENT_PLANE, else Dynamo's choice)")
    group.add_argument("--disable-kv-routing", action="store_true",
                       help="publish no KV events or load to Dynamo's router")
    group.add_argument("--disaggregation-mode", default="agg", choices=("agg", "encode"),
                       help="agg: the model (default); encode: a vlserve encoder that Dynamo's frontend sends media to "
                            "first (needs --registry or --bootstrap, where language workers find it)")
    group.add_argument("--route-to-encoder", action="store_true",
                       help="media go to an encode worker first (Dynamo's E->PD); the rows come from the encoder it "
                            "names (needs --registry or --bootstrap)")


class FromFlags:
    """Dynamo's `from_args(argv)` contract, for an engine class with `from_namespace(ns)`."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        parser = argparse.ArgumentParser(prog="vlserve dynamo-worker")
        add_worker_flags(parser)
        return cls.from_namespace(parser.parse_args(argv))


def worker_setup(ns: argparse.Namespace):
    """(Options, Dynamo's WorkerConfig, role) from the flags: LANGUAGE with --registry or --bootstrap (media go to
    vlserve encoders found there: E->PD), else SERVE. Cheap checks first (before torch loads)."""
    from dynamo.common.backend import WorkerConfig

    from vlserve.server.cli import check_cheap_flags, use_demo_checkpoint

    opts = options_from(ns, DYNAMO)
    check_cheap_flags(opts)
    use_demo_checkpoint(opts)
    role = LANGUAGE if ns.registry is not None or ns.bootstrap is not None else SERVE
    if (ns.disaggregation_mode == "encode" or ns.route_to_encoder) and role != LANGUAGE:
        raise ConfigurationError("--disaggregation-mode encode and --route-to-encoder need --registry (or "
                                 "--bootstrap): the language workers find the encoders there")
    if ns.host is not None and role != LANGUAGE:  # (Dynamo's runtime listens where DYN_TCP_RPC_HOST says)
        raise ConfigurationError("--host is where an E->PD worker's vlserve sockets listen (the rows encoders "
                                 "write, an encode worker's data socket): it needs --registry or --bootstrap")
    worker = WorkerConfig(namespace=ns.namespace, component=ns.component, endpoint=ns.endpoint,
                          endpoint_types=ns.endpoint_types, discovery_backend=ns.discovery_backend,
                          request_plane=ns.request_plane, event_plane=ns.event_plane,
                          enable_kv_routing=not ns.disable_kv_routing)
    if opts.server.chat_template is not None:
        if not os.path.isfile(opts.server.chat_template):
            raise ConfigurationError("--chat-template for a Dynamo worker must be a file (its frontend reads it)")
        from vlserve.frontend.tokenizer import load_chat_template

        load_chat_template(opts.server.chat_template)
        worker.custom_jinja_template = os.path.abspath(opts.server.chat_template)
    return opts, worker, role
