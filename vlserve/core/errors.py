"""Exceptions vlserve raises on purpose. Each carries the HTTP status the server answers with."""

EXIT_CONFIG = 78  # sysexits' EX_CONFIG: the process cannot start with these options or this checkpoint


class VlserveError(Exception):
    """Base class of every error vlserve raises deliberately."""

    http_status = 500
    error_type = "InternalServerError"


class InvalidInputError(VlserveError, ValueError):
    """The request itself is wrong: bad image, bad parameter, prompt too long, ..."""

    http_status = 400
    error_type = "BadRequestError"


class MediaTooLargeError(InvalidInputError):
    """Media over a size limit: download bytes, decoded pixels (decompression bombs)."""

    http_status = 413
    error_type = "PayloadTooLargeError"


class RequestTooLargeError(InvalidInputError):
    """A request body over the server's size limit."""

    http_status = 413
    error_type = "PayloadTooLargeError"


class RequestTimeoutError(InvalidInputError):
    """The client took longer than the server allows to send its request body (--body-read-timeout)."""

    http_status = 408
    error_type = "RequestTimeoutError"


class MediaFetchError(InvalidInputError):
    """A media URL was refused by policy or could not be fetched (bad status, timeout, unreachable)."""


class AuthenticationError(VlserveError):
    http_status = 401
    error_type = "AuthenticationError"


class NotFoundError(VlserveError):
    """Unknown model name, unknown route."""

    http_status = 404
    error_type = "NotFoundError"


class ServiceUnavailableError(VlserveError):
    """The server cannot take the request now: engine dead, waiting queue full, no encoder."""

    http_status = 503
    error_type = "ServiceUnavailableError"


class EngineDeadError(ServiceUnavailableError):
    """The engine-core process is gone; nothing more can be generated."""


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or failed: the model can no longer run, the engine stops."""


class ConfigurationError(VlserveError):
    """The server cannot start with these options or this checkpoint: restarting it will not help (the process
    exits with EXIT_CONFIG, and `serve --disagg` stops instead of restarting the role)."""


class ModelLoadError(ConfigurationError):
    """A checkpoint cannot be loaded: missing file, corrupt weights, unsupported architecture."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's `architectures` names no model vlserve implements."""


def exit_code(error: VlserveError) -> int:
    """A process's exit code for an error that ends it: EXIT_CONFIG when the options or checkpoint are wrong."""
    return EXIT_CONFIG if isinstance(error, (ConfigurationError, InvalidInputError)) else 1


# OpenAI-style error JSON, the same from every vlserve HTTP server (API, registry, roles).
_STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                 405: "MethodNotAllowedError", 413: "PayloadTooLargeError", 422: "UnprocessableEntityError",
                 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, err_type: str | None = None) -> dict:
    err_type = err_type or _STATUS_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}
