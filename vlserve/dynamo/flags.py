"""The flags of `vlserve dynamo-worker`: `vlserve serve`'s engine and media options (the derived role DYNAMO)
and Dynamo's runtime flags, named as its own backends name them."""

from __future__ import annotations

import argparse
import os

from vlserve.core.config import DYNAMO
from vlserve.core.options import add_options


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
