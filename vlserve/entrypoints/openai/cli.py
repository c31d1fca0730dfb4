"""`vlserve serve`: the OpenAI-compatible server (a random demo checkpoint when no --model is given)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from pathlib import Path

from vlserve.entrypoints.cli_args import add_engine_args, engine_args_from
from vlserve.entrypoints.openai.api_server import ServerArgs

logger = logging.getLogger("vlserve.server")
DEMO_NAME = "vlserve-demo"


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--api-key", default=os.environ.get("VLSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (or env VLSERVE_API_KEY)")
    p.add_argument("--allowed-local-media-path", type=Path, default=None,
                   help="directory file:// media URLs may read from (file:// is refused without it)")
    p.add_argument("--allowed-media-domains", nargs="+", default=(),
                   help="only fetch media from these domains (and their subdomains); default: any")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="allow media URLs that resolve to private, loopback or link-local addresses (SSRF risk)")
    p.add_argument("--max-media-bytes", type=int, default=d.max_media_bytes, help="largest picture download")
    p.add_argument("--max-video-bytes", type=int, default=d.max_video_bytes, help="largest video download")
    p.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout, help="seconds per fetch")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="largest decoded picture (width x height); bigger ones are refused before decoding")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 when this many requests are already waiting (default: no limit)")
    p.add_argument("--media-threads", type=int, default=d.media_threads,
                   help="threads that decode and preprocess media")
    p.add_argument("--disable-log-requests", action="store_true", help="no info log line per request")


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})


def run(ns: argparse.Namespace) -> int:
    from vlserve.entrypoints.demo import demo_checkpoint
    from vlserve.entrypoints.openai.api_server import serve

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per media fetch is noise
    server = server_args_from(ns)
    model = ns.model
    if model is None:
        model = str(demo_checkpoint())
        server.served_model_name = server.served_model_name or DEMO_NAME
        logger.warning("no --model given: serving a RANDOM demo checkpoint (%s) as %r; it answers with random "
                       "text. To serve a real model: vlserve serve --model Qwen/Qwen2-VL-2B-Instruct (hub id or "
                       "local folder)", model, server.served_model_name)
    if ns.disagg:
        from vlserve.disagg.cli import run_all_roles

        return run_all_roles(ns, model)
    asyncio.run(serve(engine_args_from(ns, model=model), server))
    return 0


def register_cli(subparsers) -> None:
    from vlserve.disagg.cli import add_disagg_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p, model_required=False)
    add_server_args(p)
    p.add_argument("--disagg", action="store_true",
                   help="run a bootstrap, --num-encoders encoders and a language server here, as separate processes")
    p.add_argument("--num-encoders", type=int, default=1)
    add_disagg_args(p)
    p.set_defaults(func=run)
