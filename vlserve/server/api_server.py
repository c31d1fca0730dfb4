"""The FastAPI app: OpenAI routes, health, metrics, version; and `serve`, which runs it.

Start-up order: the port is bound first (a taken port is reported at once, before any model loads), then the
engine process starts (a model that fails to load exits non-zero before anything is served), then uvicorn
serves on the socket already bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import vlserve
from vlserve.core.config import DECODE, DISAGG_ROLES, KV_ROLES, SERVE, Options, ServerArgs
from vlserve.core.cpu_budget import size_default_executor
from vlserve.core.http_protocol import http_protocol, parser_name
from vlserve.core.processes import SigtermStop, finish, freeze_startup_heap, read_degraded
from vlserve.core.prompt import MEDIA_KINDS
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import CONTENT_TYPE
from vlserve.frontend.prompt_encoder import LocalPromptEncoder
from vlserve.frontend.tokenizer import load_chat_template
from vlserve.server.api_key import install_api_key_check
from vlserve.server.drain import UVICORN_BACKSTOP_S, Drain, DrainGate, graceful_server
from vlserve.server.errors import error_response, install_error_handlers
from vlserve.server.announce import announce_replica
from vlserve.server.hosts import HostCheck, HostPolicy, relative_slash_redirects
from vlserve.server.listen import bind_socket
from vlserve.server.playground.routes import add_playground, playground_config
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.server.responses_protocol import ResponsesRequest
from vlserve.server.serving import LoadLoRAAdapterRequest, OpenAIServingLoRA, UnloadLoRAAdapterRequest
from vlserve.server.serving_chat import OpenAIServingChat
from vlserve.server.serving_completion import OpenAIServingCompletion
from vlserve.server.serving_responses import OpenAIServingResponses
from vlserve.server.serving_transcription import add_audio_routes

logger = logging.getLogger("vlserve.server")


def local_prompt_encoder(server: ServerArgs):
    """The aggregated server's prompt encoder: media fetched here under the server's policy."""
    def build(engine: AsyncLLM) -> LocalPromptEncoder:
        fetchers = {kind: MediaFetcher(MediaPolicy.from_args(server, kind)) for kind in MEDIA_KINDS}
        return LocalPromptEncoder(engine.input_processor, fetchers, engine.executor)
    return build


def decode_kv_receiver(opts, host: str):
    """What a decode engine registers where prompts' KV lands (its KV cache, or on a GPU the receive buffers) for
    peers' writes with (engine process), at the address peers reach this instance by."""
    from vlserve.disagg.registry import advertised_host, reachable_host, registry_target
    from vlserve.disagg.transports.row_writer import kv_receiver_maker

    return kv_receiver_maker(opts.transfer_backend,
                             reachable_host(advertised_host(opts, host), toward=registry_target(opts).host),
                             opts.disagg_secret)


def make_engine(opts: Options, log_level: str = "INFO", role: str = SERVE) -> AsyncLLM:
    """Resolves the config and loads the tokenizer (clear errors here, before the engine process starts).
    `role`: "serve" (media handled here), or "language" / "decode", whose prompts are worked on by peers."""
    server = opts.server
    if role in DISAGG_ROLES:
        from vlserve.disagg.registry import advertised_events_endpoint, advertised_host
        from vlserve.disagg.remote_encoder import remote_prompt_encoder

        public = advertised_host(opts.disagg, server.host)
        events = advertised_events_endpoint(opts.engine.kv_events_endpoint, public)
        encoder = remote_prompt_encoder(opts.disagg, f"{public}:{server.port}", opts.engine.model, role,
                                        kv_events=events)
    else:
        encoder = local_prompt_encoder(server)
    template = load_chat_template(server.chat_template) if server.chat_template is not None else None
    engine = AsyncLLM(opts.engine, server.served_model_name or opts.engine.model,
                      max_waiting_requests=server.max_waiting_requests, media_threads=server.media_threads,
                      log_requests=not server.disable_log_requests, log_level=log_level,
                      media_bounds=server.media_bounds(), heartbeat_timeout=server.engine_heartbeat_timeout,
                      prompt_encoder=encoder, kv_role=role if role in KV_ROLES else None,
                      kv_receiver=decode_kv_receiver(opts.disagg, server.host) if role == DECODE else None)
    if template is not None:
        engine.tokenizer.chat_template = template
    return engine


def build_app(engine: AsyncLLM, server: ServerArgs) -> FastAPI:
    """The app around a started engine; the engine's lifetime is the caller's (see `serve`)."""
    model_name = engine.model_name
    chat = OpenAIServingChat(engine, server, model_name)
    completion = OpenAIServingCompletion(engine, server, model_name)
    responses = OpenAIServingResponses(chat)
    loras = OpenAIServingLoRA(engine, server, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        logger.info("serving %r on http://%s:%d (HTTP: %s on %s)", model_name, server.host, server.port,
                    parser_name(), type(asyncio.get_running_loop()).__module__.split(".")[0])
        yield

    docs = server.enable_api_docs
    app = FastAPI(title="vlserve", version=vlserve.__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    install_error_handlers(app)
    relative_slash_redirects(app)
    install_api_key_check(app, server.api_key)

    # Bodies are read and parsed by the handlers themselves: size limit first, strict JSON, off the event loop
    # when large. `openapi_extra` keeps the documented schema.
    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await chat.create(request)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await completion.create(request)

    add_audio_routes(app, chat)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def create_response(request: Request):
        return await responses.create(request)

    @app.get("/v1/models")
    async def models():  # vLLM's cards: the base model, then one per LoRA adapter with the base as its parent
        def card(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": 0, "owned_by": "vlserve", "root": root,
                    "parent": parent, "max_model_len": engine.cfg.max_model_len}

        loras = getattr(engine, "loras", None)  # None: started without --enable-lora
        adapters = tuple(loras.adapters.values()) if loras is not None else ()
        # `lora`: what a router needs to hash prompts as this server's caches do (vlserve.router.replicas)
        return {"object": "list", "data": [card(model_name, str(engine.cfg.model_path), None),
                                           *(card(a.name, a.path, model_name) | {"lora": {"key": a.key,
                                                                                          "towers": a.towers}}
                                             for a in adapters)]}

    # Always routed: without --enable-lora / --allow-runtime-lora they answer 400 naming the flag to start with.
    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request):
        return await loras.load(request)

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        return await loras.unload(request)

    @app.get("/health")
    async def health():  # liveness: the engine is alive (a restart is what helps otherwise)
        if not engine.is_healthy:
            return error_response(f"the engine is not available: {engine.unhealthy_reason}", 503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():  # readiness: this instance can serve what it accepts (its engine and the peers it needs)
        reason = engine.not_ready_reason
        if reason is not None:
            return error_response(f"not ready: {reason}", 503)
        # Under `serve --disagg`: roles that keep crashing while this one serves without them.
        return JSONResponse({"status": "ready", "degraded": read_degraded()})

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": vlserve.__version__})

    if server.playground:
        add_playground(app, playground_config(server, engine.cfg.limit_mm_per_prompt))
    return app


def _body_schema(model) -> dict:
    return {"requestBody": {"content": {"application/json": {"schema": model.model_json_schema()}},
                            "required": True}}


async def serve(opts: Options, log_level: str = "INFO", role: str = SERVE, sock: socket.socket | None = None) -> int:
    """Port (unless the caller bound it already), then engine, then uvicorn until SIGINT/SIGTERM (a graceful stop:
    server/drain.py), then the engine's shutdown. Returns the exit code: 0 once stopped, 1 when the engine died
    while serving (the server stops, as vLLM's does, so that a supervisor restarts it rather than it answering 503
    for ever)."""
    import uvicorn

    server = opts.server
    hosts = HostPolicy.of(server, opts.disagg.advertise_host)  # a wrong --allowed-hosts is refused before any work
    size_default_executor(opts.engine.cpu_threads)
    sock = sock or bind_socket(server.host, server.port)
    try:
        with SigtermStop() as sigterm:
            engine = make_engine(opts, log_level, role)
            await engine.start()
            announced = await announce_replica(opts, engine) if role == SERVE else None
            try:
                drain = Drain(server.shutdown_timeout, on_cut=engine.stop_requests)
                config = uvicorn.Config(HostCheck(DrainGate(build_app(engine, server), drain), hosts),
                                        log_level=log_level.lower(), access_log=False,
                                        timeout_graceful_shutdown=UVICORN_BACKSTOP_S, log_config=None,
                                        http=http_protocol(server.header_read_timeout))
                http = graceful_server(config, drain)
                freeze_startup_heap()
                sigterm.serving()
                tasks = [asyncio.create_task(drain.run(http)),
                         asyncio.create_task(stop_when_engine_dies(engine, drain))]
                try:
                    await http.serve(sockets=[sock])
                finally:
                    for task in tasks:
                        task.cancel()
            finally:
                if announced is not None:
                    await finish(announced.stop())
                await finish(engine.shutdown())
            return 1 if engine.core.dead_reason is not None else 0
        return 0  # stopped by SIGTERM during start-up
    finally:
        sock.close()


async def stop_when_engine_dies(engine: AsyncLLM, drain: Drain) -> None:
    """Stops the server (what is in flight has failed already) once the engine process is gone for good."""
    await engine.dead.wait()
    logger.error("the engine is gone (%s): stopping this server with exit code 1 so that its supervisor "
                 "restarts it", engine.core.dead_reason)
    drain.request_stop("the engine is gone", force=True)
