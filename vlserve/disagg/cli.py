"""`vlserve encode`, `vlserve language`, and `vlserve serve --disagg` (all roles on this machine)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import sys
import time

from vlserve.disagg.bootstrap import BootstrapClient, InstanceInfo, new_instance_id
from vlserve.disagg.encode_server import EncodeOptions
from vlserve.disagg.language_client import DisaggOptions
from vlserve.entrypoints.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("vlserve.disagg")


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    d = DisaggOptions()
    g = p.add_argument_group("disaggregation")
    g.add_argument("--bootstrap", default=d.bootstrap, help="host:port of `vlserve bootstrap`")
    g.add_argument("--embedding-default-allocate-tokens", type=int, default=d.default_allocate_tokens,
                   help="receive blocks pre-allocated per request, in tokens (longer outputs resume into more)")
    g.add_argument("--embedding-buffer-blocks", type=int, default=d.buffer_blocks, help="blocks in the buffer pool")
    g.add_argument("--embedding-block-tokens", type=int, default=d.block_tokens, help="tokens per buffer block")
    g.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval, help="seconds")
    g.add_argument("--heartbeat-failure-threshold", type=int, default=d.failure_threshold,
                   help="missed heartbeats before an encoder is dropped")
    g.add_argument("--transfer-timeout", type=float, default=d.transfer_timeout, help="seconds per transfer")
    g.add_argument("--transfer-backend", default=d.transport, choices=["zmq"], help="how embeddings move")


def disagg_options_from(ns: argparse.Namespace) -> DisaggOptions:
    return DisaggOptions(bootstrap=ns.bootstrap, default_allocate_tokens=ns.embedding_default_allocate_tokens,
                         buffer_blocks=ns.embedding_buffer_blocks, block_tokens=ns.embedding_block_tokens,
                         heartbeat_interval=ns.heartbeat_interval, failure_threshold=ns.heartbeat_failure_threshold,
                         transfer_timeout=ns.transfer_timeout, transport=ns.transfer_backend)


# ---- vlserve encode ------------------------------------------------------------------------------------------
def run_encode(ns: argparse.Namespace) -> int:
    from vlserve.entrypoints.openai.cli import server_args_from

    server = server_args_from(ns)
    opts = EncodeOptions(host=ns.host, port=ns.port, data_port=ns.data_port, bootstrap=ns.bootstrap,
                         buffer_blocks=ns.embedding_buffer_blocks, block_tokens=ns.embedding_block_tokens,
                         transfer_failure_prob=ns.transfer_failure_prob, transport=ns.transfer_backend,
                         heartbeat_interval=ns.heartbeat_interval, media_policy=server.media_policy(),
                         video_policy=server.media_policy(max_bytes=server.max_video_bytes))
    asyncio.run(_encode_main(engine_args_from(ns, enable_mm_embeds=True), opts, ns.log_level))
    return 0


async def _encode_main(engine_args, opts: EncodeOptions, log_level: str) -> None:
    import uvicorn

    from vlserve.disagg.encode_server import EncodeServer
    from vlserve.disagg.encoder_worker import EncoderWorker

    server = EncodeServer(EncoderWorker(engine_args), opts)
    server.bind()
    info = InstanceInfo(new_instance_id(), "encode", f"{opts.host}:{opts.zmq_port}", f"{opts.host}:{opts.port}")
    boot = BootstrapClient(opts.bootstrap, info, opts.heartbeat_interval, load_fn=lambda: server.in_flight)
    zmq_task = asyncio.create_task(server.serve_zmq())
    await boot.start()
    logger.info("encoder ready: data tcp://%s, http://%s", info.address, info.http_address)
    http = uvicorn.Server(uvicorn.Config(server.http_app(), host=opts.host, port=opts.port,
                                         log_level=log_level.lower(), access_log=False))
    try:
        await http.serve()
    finally:
        zmq_task.cancel()
        await boot.stop()


# ---- vlserve language ----------------------------------------------------------------------------------------
def run_language(ns: argparse.Namespace) -> int:
    from vlserve.entrypoints.openai.api_server import serve
    from vlserve.entrypoints.openai.cli import server_args_from

    asyncio.run(serve(engine_args_from(ns, load_vision=False), server_args_from(ns), disagg_options_from(ns)))
    return 0


# ---- vlserve serve --disagg ----------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without(argv: list[str], flag: str, takes_value: bool) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = takes_value
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def run_all_roles(ns: argparse.Namespace, model: str) -> int:
    """A bootstrap, N encoders and one language server as child processes; Ctrl-C stops them all.

    Each child gets the same engine/server flags the user gave `serve`; each role reads what concerns it.
    """
    head, rest = ns.argv[:ns.argv.index("serve")], ns.argv[ns.argv.index("serve") + 1:]
    rest = _without(_without(_without(rest, "--disagg", False), "--num-encoders", True), "--bootstrap", True)
    rest = _without(rest, "--model", True) + ["--model", model]
    vlserve = [sys.executable, "-m", "vlserve", *head]
    boot = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([*vlserve, "bootstrap", "--port", boot.split(":")[1],
                               "--heartbeat-interval", str(ns.heartbeat_interval)])]
    try:
        for _ in range(ns.num_encoders):
            port = _free_port()
            procs.append(subprocess.Popen([*vlserve, "encode", *rest, "--host", "127.0.0.1", "--port", str(port),
                                           "--data-port", str(_free_port()), "--bootstrap", boot]))
        procs.append(subprocess.Popen([*vlserve, "language", *rest, "--bootstrap", boot]))
        logger.info("started a bootstrap at %s, %d encoder(s) and a language server on %s:%d (Ctrl-C stops all)",
                    boot, ns.num_encoders, ns.host, ns.port)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        failed = [p for p in procs if p.poll() not in (None, 0)]
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):  # language first, so it stops taking requests before its encoders go
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def register_cli(subparsers) -> None:
    from vlserve.entrypoints.openai.cli import add_server_args

    enc = subparsers.add_parser("encode", help="a vision-encoder service (disaggregated serving)")
    add_engine_args(enc, model_required=True)
    add_server_args(enc)
    enc.set_defaults(port=8100)
    enc.add_argument("--data-port", type=int, default=None, help="ZeroMQ port for language servers (default: port+1)")
    enc.add_argument("--transfer-failure-prob", type=float, default=0.0,
                     help="fail this share of transfers on purpose (fault-injection tests)")
    add_disagg_args(enc)
    enc.set_defaults(func=run_encode)

    lang = subparsers.add_parser("language", help="an OpenAI-compatible language server fed by encoders")
    add_engine_args(lang, model_required=True)
    add_server_args(lang)
    add_disagg_args(lang)
    lang.set_defaults(func=run_language)
