"""Every failure becomes OpenAI's error JSON with a fitting status; a stack trace never reaches a client.

Client errors (4xx) are logged on one line each with their reason; anything else is a logged 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlserve.core.errors import VlserveError, error_body

logger = logging.getLogger("vlserve.server")
LOGGED_MESSAGE_CHARS = 300


def error_response(message: str, status: int, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


def one_line(text: str, limit: int = LOGGED_MESSAGE_CHARS) -> str:
    """Printable, single-line and bounded: what a client sent can never forge or flood log lines."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def log_client_error(where: str, status: int, message: str) -> None:
    if 400 <= status < 500:
        logger.info("%s -> %d: %s", one_line(where, 120), status, one_line(message))


def error_from_exception(exc: Exception) -> tuple[str, int]:
    """(message, status) for any exception: ours carry their status, anything else is a logged 500."""
    if isinstance(exc, VlserveError):
        return str(exc), exc.http_status
    logger.error("internal error", exc_info=exc)
    return f"internal server error ({type(exc).__name__})", 500


def describe_validation(errors: list) -> str:
    """What a 400 says of failed validation (pydantic's or FastAPI's errors()): each wrong field (its dotted place,
    without FastAPI's leading "body") and why, up to five."""
    parts = []
    for err in errors[:5]:
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        loc = tuple(err.get("loc", ()))
        where = ".".join(str(x) for x in (loc[1:] if loc[:1] == ("body",) else loc))
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def _respond(request: Request, message: str, status: int) -> JSONResponse:
    log_client_error(f"{request.method} {request.url.path}", status, message)
    return error_response(message, status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _respond(request, describe_validation(exc.errors()), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _respond(request, str(exc.detail), exc.status_code)

    # Ours get their own handler: Starlette hands a bare `Exception` handler to its outermost middleware, which
    # answers and then re-raises, so the connection is dropped and a keep-alive client sees a reset next time.
    @app.exception_handler(VlserveError)
    async def _ours(request: Request, exc: VlserveError):
        return _respond(request, *error_from_exception(exc))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        return _respond(request, *error_from_exception(exc))
