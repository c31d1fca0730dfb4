"""`--api-key`: 'Authorization: Bearer KEY' required on /v1 routes (and the API docs), compared in constant time.
Shared by the OpenAI server and the router.

/health, /ready, /version, /metrics and the playground page stay open, as vLLM leaves them: liveness and readiness
probes and Prometheus scrapers (a router scraping its replicas too) read them without a key. /metrics holds
counts and latencies, never a prompt or an answer."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request

from vlserve.server.errors import error_response, log_client_error

DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


def install_api_key_check(app: FastAPI, api_key: str | None) -> None:
    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        path = request.url.path
        if api_key and (path.startswith("/v1") or path in DOC_PATHS):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                log_client_error(f"{request.method} {path}", 401, "invalid or missing API key")
                return error_response("invalid or missing API key", 401)
        return await call_next(request)
