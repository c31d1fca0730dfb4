"""`vlserve router`: the OpenAI API in front of several replicas (`serve --registry`, `language`, `decode`),
found through the registry, each request sent where its prompt's prefix is cached (router/choice.py).

Start-up: the port is bound first, then the tokenizer and processor load (config files only, no weights), then
the replica list starts and uvicorn serves. /ready answers 200 once a replica is known and answers.

Replicas see clients' prompts: the router routes only to replicas of a registry that needs a credential to join
(a bootstrap with --disagg-secret, etcd with a user or client certificate) unless --allow-unsigned-replicas, and
sends them its own key, never the client's (router/proxy.py). It answers only the Host names of
server/hosts.py, as a server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import httpx

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import vlserve
from vlserve.core.config import Options
from vlserve.core.cpu_budget import size_default_executor
from vlserve.core.errors import InvalidInputError
from vlserve.core.http_protocol import http_protocol, run as run_loop
from vlserve.core.processes import SigtermStop, finish
from vlserve.disagg.auth import PeerAuth, require_secret_off_loopback
from vlserve.disagg.bootstrap import OPEN_CHECK_HEADER
from vlserve.disagg.registries import open_registry
from vlserve.disagg.registry import InstanceInfo, new_instance_id, registry_target
from vlserve.frontend.metrics import CONTENT_TYPE
from vlserve.router.choice import Chooser
from vlserve.router.metrics import RouterMetrics
from vlserve.router.prompts import PromptHasher
from vlserve.router.proxy import Proxy
from vlserve.router.replicas import ReplicaSet
from vlserve.server.api_key import install_api_key_check
from vlserve.server.drain import UVICORN_BACKSTOP_S, Drain, DrainGate, graceful_server
from vlserve.server.errors import error_response, install_error_handlers
from vlserve.server.hosts import HostCheck, HostPolicy, relative_slash_redirects
from vlserve.server.listen import bind_socket
from vlserve.server.playground.routes import add_playground, playground_config
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from vlserve.server.responses_protocol import ResponsesRequest
from vlserve.server.serving import PARSE_INLINE_BYTES, OpenAIServing, read_body

logger = logging.getLogger("vlserve.router")


class ReplicaAdapters:
    """The server's model check reads an engine's adapter catalogue (`.loras.adapters`); here it is the union of
    the adapters the replicas list."""

    def __init__(self, replicas: ReplicaSet):
        self.loras = self
        self.replicas = replicas

    @property
    def adapters(self):
        return self.replicas.adapters()


def build_router_app(opts: Options, hasher: PromptHasher, replicas: ReplicaSet,
                     drain: Drain | None = None) -> FastAPI:
    """`drain`: the router's stop (run_router), which cuts the streams it relays."""
    server, d = opts.server, opts.disagg
    model_name = server.served_model_name or opts.engine.model
    # The server's model check and disconnect handling (it needs no engine for those).
    serving = OpenAIServing(ReplicaAdapters(replicas), server, model_name)
    metrics = RouterMetrics(replicas)
    chooser = Chooser(d.routing, d.routing_cache_weight, opts.engine.block_size)
    # One key on every role works by default; but to replicas of an open registry (anyone may have registered)
    # the router's own key would hand out the key its clients use: only an explicit --replica-api-key goes there.
    replica_key = d.replica_api_key or (None if d.allow_unsigned_replicas else server.api_key)
    if replica_key:
        replicas.auth = {"authorization": f"Bearer {replica_key}"}  # to read their /v1/models
    proxy = Proxy(replicas, chooser, metrics, serving.until_done_or_disconnect,
                  replica_key=replica_key, read_timeout=d.replica_read_timeout,
                  max_response_bytes=d.max_replica_response_bytes, executor=hasher.executor,
                  drain=drain or Drain(server.shutdown_timeout))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        logger.info("routing %r (%s) on http://%s:%d", model_name, d.routing, server.host, server.port)
        yield
        await proxy.aclose()

    app = FastAPI(title="vlserve router", version=vlserve.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    relative_slash_redirects(app)
    install_api_key_check(app, server.api_key)

    async def route(raw: Request, path: str, model, hash_fn) -> Response:
        data = await read_body(raw, server.max_request_bytes, server.body_read_timeout)
        if len(data) <= PARSE_INLINE_BYTES:
            body = parse_body(data, model)
        else:
            body = await asyncio.get_running_loop().run_in_executor(hasher.executor, parse_body, data, model)
        body.check_fields(server)
        adapter = serving.check_model(body.model)  # a LoRA adapter some replica serves, or the base model
        hashes, whole = (await serving.until_done_or_disconnect(raw, hash_fn(body, adapter))
                         if d.routing == "cache-aware" else ([], False))
        return await proxy.forward(raw, path, data, hashes, whole, adapter.name if adapter is not None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await route(raw, "/v1/chat/completions", ChatCompletionRequest, hasher.chat)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await route(raw, "/v1/completions", CompletionRequest, hasher.completion)

    async def response_hint(body: ResponsesRequest, adapter) -> tuple[list[bytes], bool]:
        chat = await asyncio.get_running_loop().run_in_executor(hasher.executor, body.to_chat_request)
        return await hasher.chat(chat, adapter)  # the chat request a replica runs for it: the same prefix

    @app.post("/v1/responses")
    async def responses(raw: Request):
        return await route(raw, "/v1/responses", ResponsesRequest, response_hint)

    @app.get("/v1/models")
    async def models():  # the model, then the LoRA adapters its replicas serve
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "vlserve", "parent": None,
                "max_model_len": hasher.cfg.max_model_len}
        adapters = [{**card, "id": name, "root": ref.path, "parent": model_name}
                    for name, ref in replicas.adapters().items()]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/health")
    async def health():  # liveness: this process answers
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if replicas.refused:
            return error_response(f"not ready: {replicas.refused}", 503)
        if not replicas.num_answering:
            known = len(replicas.replicas)
            return error_response(f"not ready: {known} replicas known, none answering yet (roles "
                                  f"{', '.join(d.replica_role)} at {registry_target(d).endpoints[0]})", 503)
        return JSONResponse({"status": "ready", "replicas": len(replicas.replicas),
                             "answering": replicas.num_answering})

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": vlserve.__version__})

    if server.playground:  # the same page as a server's: it talks to this router's /v1 routes
        add_playground(app, playground_config(server, hasher.cfg.limit_mm_per_prompt))
    return app


def open_replicas(opts: Options) -> ReplicaSet:
    d = opts.disagg
    auth = PeerAuth(d.disagg_secret)
    require_secret_off_loopback(auth, registry_target(d).host, "this router's registry")
    open_to = check_registry_trust(opts)
    if open_to:
        logger.warning("routing to replicas of a registry that is %s (--allow-unsigned-replicas)", open_to)
    # The router only reads the registry: this record is never registered.
    registry = open_registry(d, InstanceInfo(new_instance_id(), "router", ""), opts.engine.model, auth=auth)
    target = registry_target(d)
    check = None
    if target.kind == "bootstrap" and auth.enabled and not d.allow_unsigned_replicas:
        async def check() -> str:
            return await bootstrap_open(target.endpoints[0])
    return ReplicaSet(registry, tuple(d.replica_role), d.heartbeat_interval, open_check=check)


async def bootstrap_open(endpoint: str) -> str:
    """Why the bootstrap at `endpoint` is open to anyone ("" when it refuses an unsigned call, or cannot be
    reached): a router's own --disagg-secret proves nothing if the registry was started without one."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            resp = await http.get(f"{endpoint}/instances", headers={OPEN_CHECK_HEADER: "1"})
    except httpx.HTTPError:
        return ""
    if resp.status_code < 400:
        return (f"the bootstrap at {endpoint} answers unsigned calls (started without --disagg-secret): anyone who "
                "reaches it could register as a replica and receive clients' prompts; give it the secret, or pass "
                "--allow-unsigned-replicas")
    return ""


def check_registry_trust(opts: Options) -> str:
    """Refuses a registry anyone who reaches it can register in (their replicas would get clients' prompts) unless
    --allow-unsigned-replicas; returns why it is open ("" when only holders of a credential can register)."""
    d = opts.disagg
    target = registry_target(d)
    open_to = ""
    if target.kind == "bootstrap" and not d.disagg_secret:
        open_to = "a bootstrap without --disagg-secret"
    elif target.kind == "etcd" and not (d.registry_user or d.registry_cert):
        open_to = "etcd without --registry-user or --registry-cert"
    if open_to and not d.allow_unsigned_replicas:
        raise InvalidInputError(
            f"the registry at {target.endpoints[0]} is {open_to}: any process that reaches it could register as a "
            "replica and receive clients' prompts. Give every role --disagg-secret (or VLSERVE_DISAGG_SECRET), or "
            "etcd credentials, or pass --allow-unsigned-replicas to route to its replicas anyway")
    return open_to


async def run_router(opts: Options, log_level: str = "INFO", sock: socket.socket | None = None) -> int:
    import uvicorn


    server = opts.server
    hosts = HostPolicy.of(server)  # a wrong --allowed-hosts, or an open registry, is refused before any work
    check_registry_trust(opts)
    size_default_executor()
    sock = sock or bind_socket(server.host, server.port)
    try:
        with SigtermStop() as sigterm:
            hasher = PromptHasher(opts)
            replicas = open_replicas(opts)
            await replicas.start()
            try:
                drain = Drain(server.shutdown_timeout)
                app = DrainGate(build_router_app(opts, hasher, replicas, drain), drain)
                config = uvicorn.Config(HostCheck(app, hosts), log_level=log_level.lower(), access_log=False,
                                        timeout_graceful_shutdown=UVICORN_BACKSTOP_S, log_config=None,
                                        http=http_protocol(server.header_read_timeout))
                http = graceful_server(config, drain)
                sigterm.serving()
                stopper = asyncio.create_task(drain.run(http))
                try:
                    await http.serve(sockets=[sock])
                finally:
                    stopper.cancel()
            finally:
                await finish(replicas.stop())
                hasher.close()
        return 0
    finally:
        sock.close()


def main(opts: Options, log_level: str, sock: socket.socket) -> int:
    return run_loop(run_router(opts, log_level, sock))
