"""Collects the prefix cache's changes during a step and publishes them as one `KVEventBatch` (core/kv_events.py).

The block pool reports to a `KVEventRecorder` only when one is attached (`--kv-events-endpoint`): with the option
off the pool's hooks are one `is None` test each. Publishing never blocks the step: the PUB socket drops a batch
when its high-water mark is reached (a subscriber too slow, or none reachable), and the sequence number it had
tells subscribers one was lost.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Callable

import zmq

from vlserve.core.block_hash import ROOT
from vlserve.core.errors import ConfigurationError
from vlserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

SEND_HWM = 1000  # batches queued per subscriber before new ones are dropped
KEEPALIVE_S = 1.0  # an idle engine still says it is there this often (a silent replica turns cold at routers)


class KVEventRecorder:
    """The events of the current step, in order; consecutive stores of one chain (or removals) share an event."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[KVEvent] = []

    def stored(self, block_hash: bytes, parent: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockStored([block_hash], None if parent == ROOT else parent, self.block_size))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]  # what came before in this step is moot

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class KVEventPublisher:
    """Binds a ZeroMQ PUB socket at `endpoint` (`tcp://HOST:PORT`; port `*` picks a free one, see `.endpoint`)."""

    def __init__(self, endpoint: str, block_size: int, keepalive_s: float = KEEPALIVE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.recorder = KVEventRecorder(block_size)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.keepalive_s = keepalive_s
        self._clock = clock
        self._seq = 0
        self._last_sent = float("-inf")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigurationError(f"--kv-events-endpoint {endpoint}: cannot bind: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0
        logger.info("publishing KV cache events on %s as %s", self.endpoint, self.replica_id)

    def flush(self, keepalive: bool = True) -> KVEventBatch | None:
        """Sends this step's events as one batch; with none, an empty batch if `keepalive_s` passed since the
        last one (and `keepalive`). Returns the batch sent, or None."""
        events = self.recorder.take()
        now = self._clock()
        if not events and not (keepalive and now - self._last_sent >= self.keepalive_s):
            return None
        batch = KVEventBatch(self.replica_id, self._seq, time.time(), events)
        self._seq += 1  # even when dropped below: the gap tells subscribers
        self._last_sent = now
        try:
            self._sock.send(encode_batch(batch), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return batch

    def close(self) -> None:
        self._sock.close(linger=0)
