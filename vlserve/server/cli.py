"""`vlserve serve` (the OpenAI-compatible server; a random demo checkpoint without --model; `--disagg` starts
every role here), `vlserve language` (the same server fed by encoder services) and `vlserve decode` (the same
server whose prompts are prefilled by `vlserve prefill` instances)."""

from __future__ import annotations

import argparse
import logging
import os

from vlserve.core.allocator import return_large_blocks
from vlserve.core.config import DECODE, LANGUAGE, SERVE, EngineArgs
from vlserve.core.errors import ConfigurationError, InvalidInputError
from vlserve.core.http_protocol import run as run_loop
from vlserve.core.options import add_options, options_from
from vlserve.server.listen import bind_socket
from vlserve.tools.demo_checkpoint import DEMO_NAME

logger = logging.getLogger("vlserve.server")


def tensor_parallel_worker(engine: EngineArgs) -> int | None:
    """Under torchrun every rank runs the same command: the ranks other than 0 only run their share of the
    model (their exit code is returned); None for the process that serves."""
    if engine.tensor_parallel_size == 1 or os.environ.get("RANK", "0") == "0":
        return None
    from vlserve.engine.tp.worker import run_if_worker

    if engine.model is None:
        from vlserve.tools.demo_checkpoint import demo_checkpoint

        engine.model = str(demo_checkpoint())
    return run_if_worker(engine)


def check_cheap_flags(opts) -> None:
    """Flags that need no model, checked before torch and the model load (seconds): a mistake is reported at once."""
    if opts.server.chat_template is not None:
        from vlserve.frontend.tokenizer import load_chat_template

        load_chat_template(opts.server.chat_template)
    check_lora_dirs(opts.server)


def check_lora_dirs(server) -> None:
    """--allow-runtime-lora loads only from --lora-dir: without one every load would be refused, so the start is;
    and each --lora-dir is an existing folder."""
    if server.allow_runtime_lora and not server.lora_dir:
        raise ConfigurationError("--allow-runtime-lora needs --lora-dir DIR ...: the folders runtime loads may read "
                                 "adapters from (without one every load would be refused)")
    for folder in server.lora_dir:
        if not os.path.isdir(folder):
            raise ConfigurationError(f"--lora-dir {folder}: not a folder" if os.path.exists(folder)
                                     else f"--lora-dir {folder}: no such folder")


def run_serve(ns: argparse.Namespace) -> int:
    opts = options_from(ns, SERVE)
    check_cheap_flags(opts)
    if (code := tensor_parallel_worker(opts.engine)) is not None:
        return code
    sock = bind_socket(opts.server.host, opts.server.port)  # a taken port is reported before anything loads
    if (opts.disagg.num_prefill or opts.disagg.num_decode) and not opts.disagg.disagg:
        sock.close()
        raise InvalidInputError("--num-prefill/--num-decode start an E->P->D deployment: add --disagg")
    # (--registry without --disagg registers this server as a replica for `vlserve router`: server/announce.py)
    if opts.disagg.disagg:
        from vlserve.disagg.launcher import run_roles

        use_demo_checkpoint(opts)
        sock.close()  # free now, as checked: the language server's own process listens on it
        return run_roles(opts, ns.log_level)
    start_front_end(sock)
    use_demo_checkpoint(opts)  # (building it runs torch: after the fork)
    from vlserve.server.api_server import serve

    return run_loop(serve(opts, ns.log_level, sock=sock))


def start_front_end(sock=None, imports: tuple[str, ...] = ("vlserve.server.api_server",)) -> None:
    """What a front end does before it works: fork its engine process's zygote once `imports` (its own heavy
    modules) are loaded (engine/zygote.py; before any thread or kernel), then fix its allocator's threshold for
    large blocks (after the fork: the engine keeps glibc's default)."""
    from vlserve.engine.zygote import prefork

    prefork(imports, close=() if sock is None else (sock,))
    return_large_blocks()  # uploads of tens of MB must not stay in the allocator's arenas


def use_demo_checkpoint(opts) -> None:
    """Without --model: the demo checkpoint (built at its first use), under its own name."""
    if opts.engine.model is not None:
        return
    from vlserve.tools.demo_checkpoint import demo_checkpoint

    opts.engine.model = str(demo_checkpoint())
    opts.server.served_model_name = opts.server.served_model_name or DEMO_NAME
    logger.warning("no --model given: using a RANDOM demo checkpoint (%s) as %r; its answers are random text. "
                   "For a real model give --model, a hub id (Qwen/Qwen2-VL-2B-Instruct) or a local folder",
                   opts.engine.model, opts.server.served_model_name)


def run_language(ns: argparse.Namespace, role: str = LANGUAGE) -> int:
    opts = options_from(ns, role)
    check_cheap_flags(opts)  # before torch is imported
    opts.engine.load_vision = False
    if (code := tensor_parallel_worker(opts.engine)) is not None:
        return code
    sock = bind_socket(opts.server.host, opts.server.port)
    start_front_end(sock, ("vlserve.disagg.transports", "vlserve.server.api_server"))
    from vlserve.disagg.transports import require_backend

    require_backend(opts.disagg.transfer_backend)
    from vlserve.server.api_server import serve

    return run_loop(serve(opts, ns.log_level, role=role, sock=sock))


def run_decode(ns: argparse.Namespace) -> int:
    return run_language(ns, DECODE)


def register_cli(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                                  description="Serve a model over the OpenAI API. Without --model: a small random "
                                  "demo checkpoint. With --disagg: a bootstrap, encoders and a language server, "
                                  "each its own process.")
    add_options(serve, SERVE)
    serve.set_defaults(func=run_serve)

    lang = subparsers.add_parser("language", help="OpenAI-compatible server whose pictures are encoded by "
                                 "`vlserve encode` services (disaggregated serving)")
    add_options(lang, LANGUAGE, model_required=True)
    lang.set_defaults(func=run_language)

    dec = subparsers.add_parser("decode", help="OpenAI-compatible server whose prompts are prefilled by `vlserve "
                                "prefill` instances (E->P->D disaggregation)",
                                description="Answers the OpenAI API; each prompt is prefilled by a prefill instance "
                                "found through the bootstrap, whose KV lands in this server's receive blocks; "
                                "decoding happens here.")
    add_options(dec, DECODE, model_required=True)
    dec.set_defaults(func=run_decode)
