"""Every failure becomes OpenAI's error JSON with a fitting status; a stack trace never reaches a client."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlserve.core.errors import VlserveError

logger = logging.getLogger("vlserve.server")

_STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                 405: "MethodNotAllowedError", 413: "PayloadTooLargeError", 422: "UnprocessableEntityError",
                 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, err_type: str | None = None) -> dict:
    err_type = err_type or _STATUS_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def error_response(message: str, status: int, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


def error_from_exception(exc: Exception) -> tuple[str, int]:
    """(message, status) for any exception: ours carry their status, anything else is a logged 500."""
    if isinstance(exc, VlserveError):
        return str(exc), exc.http_status
    logger.error("internal error", exc_info=exc)
    return f"internal server error ({type(exc).__name__})", 500


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return error_response(_validation_message(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(VlserveError)
    async def _ours(_: Request, exc: VlserveError):
        return error_response(*error_from_exception(exc))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception):
        return error_response(*error_from_exception(exc))
