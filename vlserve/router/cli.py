"""`vlserve router`: its flags (core/config.py, role "router"); the app loads only when it runs."""

from __future__ import annotations

import argparse

from vlserve.core.config import ROUTER
from vlserve.core.options import add_options, options_from


def run_router(ns: argparse.Namespace) -> int:
    opts = options_from(ns, ROUTER)
    from vlserve.server.listen import bind_socket

    sock = bind_socket(opts.server.host, opts.server.port)  # a taken port is reported before anything loads
    from vlserve.router.app import main

    return main(opts, ns.log_level, sock)


def register_cli(subparsers) -> None:
    router = subparsers.add_parser(
        "router", help="OpenAI-compatible front of several replicas, routing by cached prefix",
        description="Finds replicas (serve --registry, language, decode) through the registry, follows their KV "
        "cache events (--kv-events-endpoint on each replica) and sends each request to the replica that holds "
        "most of its prompt's prefix, pictures included, weighed against load.")
    add_options(router, ROUTER, model_required=True)
    router.set_defaults(func=run_router)
