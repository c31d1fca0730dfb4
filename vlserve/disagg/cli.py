"""`vlserve encode` (a vision-encoder service), `vlserve prefill` (a prefill instance) and `vlserve bootstrap`
(the registry where roles meet)."""

from __future__ import annotations

import argparse
import logging
import os

from vlserve.core.config import BOOTSTRAP, ENCODE, PREFILL
from vlserve.core.errors import InvalidInputError
from vlserve.core.http_protocol import http_protocol, run as run_loop
from vlserve.core.options import add_options, options_from

logger = logging.getLogger("vlserve.disagg")


def run_encode(ns: argparse.Namespace) -> int:
    from vlserve.disagg.encode_service import run_encoder
    from vlserve.disagg.transports import require_backend

    opts = options_from(ns, ENCODE)
    require_backend(opts.disagg.transfer_backend)
    opts.engine.load_language = False  # the media towers only (--towers: some of them)
    # Precomputed embeddings reach an encoder only from a language server whose own --enable-mm-embeds let them in.
    opts.engine.enable_mm_embeds = True
    if opts.engine.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0":
        from vlserve.engine.tp.worker import run_if_worker  # under torchrun: ranks other than 0 run their share

        code = run_if_worker(opts.engine)
        if code is not None:
            return code
    return run_loop(run_encoder(opts, ns.log_level))


def run_prefill(ns: argparse.Namespace) -> int:
    from vlserve.engine.zygote import prefork

    opts = options_from(ns, PREFILL)
    prefork(("vlserve.disagg.prefill_service",))  # its engine process, forked before any work (engine/zygote.py)
    from vlserve.disagg.prefill_service import run_prefill as run
    from vlserve.disagg.transports import require_backend

    require_backend(opts.disagg.transfer_backend)
    opts.engine.load_vision = False  # media go to encoder services
    # Embedding entries reach a prefill instance only from a decode instance whose own --enable-mm-embeds let
    # them in.
    opts.engine.enable_mm_embeds = True
    return run_loop(run(opts, ns.log_level))


def run_bootstrap(ns: argparse.Namespace) -> int:
    import uvicorn

    from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
    from vlserve.disagg.bootstrap import build_bootstrap_app

    opts = options_from(ns, BOOTSTRAP)
    d, server = opts.disagg, opts.server
    if d.heartbeat_interval <= 0 or d.heartbeat_failure_threshold < 1:
        raise InvalidInputError("--heartbeat-interval must be > 0 and --heartbeat-failure-threshold >= 1")
    auth = PeerAuth(d.disagg_secret)
    require_secret_off_loopback(auth, server.host, "the bootstrap registry")
    app = build_bootstrap_app(d.heartbeat_interval, d.heartbeat_failure_threshold, auth=auth)
    logger.info("bootstrap registry on http://%s:%d (drop after %.1fs without heartbeat)", server.host, server.port,
                d.heartbeat_interval * d.heartbeat_failure_threshold)
    # log_config=None: keep the logging set up by vlserve.cli instead of uvicorn's own.
    uvicorn.run(app, host=server.host, port=server.port, access_log=False, log_config=None,
                http=http_protocol(None))
    return 0


def register_cli(subparsers) -> None:
    enc = subparsers.add_parser("encode", help="a media-encoder service (disaggregated serving)",
                                description="Fetches and preprocesses media, runs the model's vision and audio "
                                "towers (--towers: some of them) and writes the embeddings into a language server's "
                                "blocks. Serves HTTP /health and /metrics on "
                                "--port and ZeroMQ on --data-port.")
    add_options(enc, ENCODE, model_required=True)
    enc.set_defaults(func=run_encode)

    pre = subparsers.add_parser("prefill", help="a prefill instance (E->P->D disaggregation)",
                                description="Prefills prompts for `vlserve decode` instances: media encoded by "
                                "`vlserve encode` services, the prompt's KV and first token written into the decode "
                                "instance's blocks. Serves HTTP /health and /metrics on --port and ZeroMQ on "
                                "--data-port.")
    add_options(pre, PREFILL, model_required=True)
    pre.set_defaults(func=run_prefill)

    boot = subparsers.add_parser("bootstrap", help="the registry where encode and language instances meet")
    add_options(boot, BOOTSTRAP)
    boot.set_defaults(func=run_bootstrap)
