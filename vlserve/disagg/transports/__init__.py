"""How a chunk's data reaches the receiver's blocks. Chosen by `--transfer-backend`; callers never ask which."""

from __future__ import annotations

from vlserve.disagg.transports.base import ChunkData, Transport
from vlserve.disagg.transports.mooncake import MooncakeTransport
from vlserve.disagg.transports.shm import ShmTransport
from vlserve.disagg.transports.zmq import ZmqTransport

TRANSPORTS: dict[str, type[Transport]] = {"zmq": ZmqTransport, "shm": ShmTransport, "mooncake": MooncakeTransport}

__all__ = ["TRANSPORTS", "ChunkData", "Transport"]
