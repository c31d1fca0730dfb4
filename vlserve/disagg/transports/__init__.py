"""How a chunk's data reaches the receiver's blocks. Chosen by `--transfer-backend`; callers never ask which."""

from __future__ import annotations

from vlserve.core.errors import ConfigurationError
from vlserve.disagg.transports.base import ChunkData, Transport
from vlserve.disagg.transports.mooncake import MooncakeTransport, mooncake_engine_class
from vlserve.disagg.transports.nixl import NixlTransport, nixl_api
from vlserve.disagg.transports.shm import ShmTransport
from vlserve.disagg.transports.zmq import ZmqTransport

TRANSPORTS: dict[str, type[Transport]] = {"zmq": ZmqTransport, "shm": ShmTransport, "mooncake": MooncakeTransport,
                                         "nixl": NixlTransport}

_LIBRARIES = {"mooncake": mooncake_engine_class, "nixl": nixl_api}


def unavailable_reason(backend: str) -> str | None:
    """Why `backend` cannot run on this machine (its library is missing), or None."""
    try:
        _LIBRARIES.get(backend, lambda: None)()
    except ImportError as e:
        return str(e)
    return None


def require_backend(backend: str) -> None:
    """A role refuses to start (one line, the exit code of a configuration error) with a backend whose library
    `make serve` did not install: `make install-disagg` does (`make test` too)."""
    why = unavailable_reason(backend)
    if why is not None:
        raise ConfigurationError(f"{why}; in a checkout: make install-disagg")


__all__ = ["TRANSPORTS", "ChunkData", "Transport", "require_backend", "unavailable_reason"]
