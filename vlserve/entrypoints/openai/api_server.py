"""The FastAPI app: OpenAI routes, health, metrics, version; the engine starts and stops with the app."""

from __future__ import annotations

import contextlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import vlserve
from vlserve.config import EngineArgs
from vlserve.engine.async_llm import AsyncLLM
from vlserve.entrypoints.openai.errors import error_response, install_error_handlers
from vlserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.entrypoints.openai.serving_chat import OpenAIServingChat
from vlserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.media.image import DEFAULT_MAX_PIXELS_DECODED
from vlserve.metrics.prometheus import CONTENT_TYPE

logger = logging.getLogger("vlserve.server")


@dataclass
class ServerArgs:
    """Front-end settings (the engine's are EngineArgs)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allow_private_media_urls: bool = False
    max_media_bytes: int = 20 * 2**20
    max_video_bytes: int = 200 * 2**20
    media_fetch_timeout: float = 10.0
    max_image_pixels: int = DEFAULT_MAX_PIXELS_DECODED
    max_waiting_requests: int | None = None
    media_threads: int = 4
    disable_log_requests: bool = False
    log_level: str = "INFO"

    def media_policy(self, max_bytes: int | None = None) -> MediaPolicy:
        return MediaPolicy(allowed_local_media_path=self.allowed_local_media_path,
                           allowed_media_domains=tuple(self.allowed_media_domains),
                           allow_private_media_urls=self.allow_private_media_urls,
                           max_bytes=max_bytes or self.max_media_bytes, timeout_s=self.media_fetch_timeout)


def make_engine(engine_args: EngineArgs, server: ServerArgs) -> AsyncLLM:
    """Resolves the config and loads the tokenizer (clear errors here, before anything listens)."""
    engine = AsyncLLM(engine_args, server.served_model_name or engine_args.model,
                      max_waiting_requests=server.max_waiting_requests, media_threads=server.media_threads,
                      log_requests=not server.disable_log_requests, log_level=server.log_level)
    engine.input_processor.max_pixels_decoded = server.max_image_pixels
    return engine


def build_app(engine: AsyncLLM, server: ServerArgs) -> FastAPI:
    """The app around a started engine; the engine's lifetime is the caller's (see `serve`)."""
    model_name = engine.model_name
    fetchers = {"image": MediaFetcher(server.media_policy()),
                "video": MediaFetcher(server.media_policy(max_bytes=server.max_video_bytes))}
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


async def serve(engine_args: EngineArgs, server: ServerArgs, disagg=None) -> None:
    """Engine first (a model that fails to load never opens the port), then uvicorn until Ctrl-C.

    With `disagg` (DisaggOptions) this is a language server: media requests go to encoder services.
    """
    import uvicorn

    engine = make_engine(engine_args, server)
    await engine.start()
    client = None
    try:
        if disagg is not None:
            from vlserve.disagg.language_client import make_language_client

            client = make_language_client(engine, disagg, f"{server.host}:{server.port}")
            await client.start()
            engine.remote_encoder = client
        app = build_app(engine, server)
        config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level.lower(),
                                access_log=False, timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        if client is not None:
            await client.stop()
        await engine.shutdown()
