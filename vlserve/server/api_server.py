"""The FastAPI app: OpenAI routes, health, metrics, version; the engine starts and stops with the app."""

from __future__ import annotations

import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import vlserve
from vlserve.core.config import LANGUAGE, SERVE, EngineArgs, Options, ServerArgs
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.server.errors import error_response, install_error_handlers
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.server.serving_chat import OpenAIServingChat
from vlserve.server.serving_completion import OpenAIServingCompletion
from vlserve.frontend.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import CONTENT_TYPE

logger = logging.getLogger("vlserve.server")


def make_engine(engine_args: EngineArgs, server: ServerArgs, log_level: str = "INFO") -> AsyncLLM:
    """Resolves the config and loads the tokenizer (clear errors here, before anything listens)."""
    engine = AsyncLLM(engine_args, server.served_model_name or engine_args.model,
                      max_waiting_requests=server.max_waiting_requests, media_threads=server.media_threads,
                      log_requests=not server.disable_log_requests, log_level=log_level)
    engine.input_processor.max_pixels_decoded = server.max_image_pixels
    return engine


def build_app(engine: AsyncLLM, server: ServerArgs) -> FastAPI:
    """The app around a started engine; the engine's lifetime is the caller's (see `serve`)."""
    model_name = engine.model_name
    fetchers = {kind: MediaFetcher(MediaPolicy.from_args(server, kind)) for kind in ("image", "video")}
    state = {"engine": engine, "chat": OpenAIServingChat(engine, fetchers, model_name),
             "completion": OpenAIServingCompletion(engine, fetchers, model_name)}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        logger.info("serving %r on http://%s:%d", model_name, server.host, server.port)
        yield
        for fetcher in fetchers.values():
            await fetcher.aclose()

    app = FastAPI(title="vlserve", version=vlserve.__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return error_response("invalid or missing API key", 401)
        return await call_next(request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await state["chat"].create(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await state["completion"].create(body, request)

    @app.get("/v1/models")
    async def models():
        engine: AsyncLLM = state["engine"]
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "vlserve",
                "root": str(engine.cfg.model_path), "max_model_len": engine.cfg.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        engine: AsyncLLM = state["engine"]
        if not engine.is_healthy:
            return error_response(f"the engine is not running: {engine.dead_reason}", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state["engine"].metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": vlserve.__version__})

    return app


async def serve(opts: Options, log_level: str = "INFO", role: str = SERVE) -> None:
    """Engine first (a model that fails to load never opens the port), then uvicorn until Ctrl-C.

    As a `language` role, media requests go to encoder services.
    """
    import uvicorn

    engine_args, server = opts.engine, opts.server
    engine = make_engine(engine_args, server, log_level)
    await engine.start()
    client = None
    try:
        if role == LANGUAGE:
            from vlserve.disagg.language_client import make_language_client

            client = make_language_client(engine, opts.disagg, f"{server.host}:{server.port}")
            await client.start()
            engine.remote_encoder = client
        app = build_app(engine, server)
        config = uvicorn.Config(app, host=server.host, port=server.port, log_level=log_level.lower(),
                                access_log=False, timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        if client is not None:
            await client.stop()
        await engine.shutdown()
