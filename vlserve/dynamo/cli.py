"""`vlserve dynamo-worker` (also `python -m vlserve.dynamo`): a vlserve engine serving a model behind NVIDIA
Dynamo's frontend. The engine's and media's flags are `vlserve serve`'s; Dynamo's runtime flags follow its own
backends' names (and its DYN_* environment variables keep working: the runtime reads them itself)."""

from __future__ import annotations

import argparse
import os

from vlserve.core.config import DYNAMO
from vlserve.core.errors import ConfigurationError
from vlserve.core.options import add_options, options_from

INSTALL_HINT = "the Dynamo runtime is not installed: `make install-dynamo` (ai-dynamo and ai-dynamo-runtime 1.6.1)"


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


def parse_worker_args(argv: list[str] | None = None, log_level: str = "INFO"):
    """(VlserveEngine, WorkerConfig) from a command line, as Dynamo's `from_args` contract has it."""
    parser = argparse.ArgumentParser(prog="vlserve dynamo-worker")
    add_worker_flags(parser)
    return build_worker(parser.parse_args(argv), log_level)


def build_worker(ns: argparse.Namespace, log_level: str = "INFO"):
    opts = options_from(ns, DYNAMO)
    from vlserve.server.cli import check_cheap_flags, use_demo_checkpoint

    check_cheap_flags(opts)
    use_demo_checkpoint(opts)
    try:
        from dynamo.common.backend import WorkerConfig

        from vlserve.dynamo.worker import VlserveEngine
    except ImportError as e:
        raise ConfigurationError(f"{INSTALL_HINT} ({e})") from None
    worker = WorkerConfig(namespace=ns.namespace, component=ns.component, endpoint=ns.endpoint,
                          endpoint_types=ns.endpoint_types, discovery_backend=ns.discovery_backend,
                          request_plane=ns.request_plane, event_plane=ns.event_plane,
                          enable_kv_routing=not ns.disable_kv_routing)
    if opts.server.chat_template is not None:
        from vlserve.frontend.tokenizer import load_chat_template

        worker.custom_jinja_template = os.path.abspath(opts.server.chat_template) \
            if os.path.isfile(opts.server.chat_template) else None
        if worker.custom_jinja_template is None:
            raise ConfigurationError("--chat-template for a Dynamo worker must be a file (its frontend reads it)")
        load_chat_template(opts.server.chat_template)
    return VlserveEngine(opts, worker, log_level), worker


def run_worker(ns: argparse.Namespace) -> int:
    from vlserve.server.cli import tensor_parallel_worker

    opts = options_from(ns, DYNAMO)
    if (code := tensor_parallel_worker(opts.engine)) is not None:
        return code
    engine, worker = build_worker(ns, ns.log_level)
    from dynamo.common.backend.run import run

    async def factory(_argv):
        return engine, worker

    run(type(engine), engine_factory=factory)
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("dynamo-worker", help="serve a model as a backend of NVIDIA Dynamo's frontend",
                       description=__doc__)
    add_worker_flags(p)
    p.set_defaults(func=run_worker)
