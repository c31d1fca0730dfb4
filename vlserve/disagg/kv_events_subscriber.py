"""Subscribes to replicas' KV cache events (`--kv-events-endpoint`) and feeds them to a `KVIndex`.

One SUB socket per replica, so a batch is known by the endpoint it came from (the replica's name as the caller
knows it, from the registry say), never by what the message claims. Use one instance from one thread (ZeroMQ
sockets are not thread-safe); the index it feeds may be queried from any thread.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from vlserve.core.kv_events import decode_batch
from vlserve.disagg.kv_index import KVIndex

logger = logging.getLogger(__name__)

RECV_HWM = 10_000  # batches buffered per replica before ZeroMQ drops (the sequence gap then says so)


class KVEventSubscriber:
    def __init__(self, index: KVIndex, context: zmq.Context | None = None):
        self.index = index
        self._ctx = context or zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._name_of: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        self.undecodable = 0

    def add(self, name: str, endpoint: str) -> None:
        """Follows replica `name` publishing at `endpoint` (ZeroMQ reconnects by itself if it restarts)."""
        if name in self._sockets:
            raise ValueError(f"replica {name!r} is already subscribed")
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._sockets[name] = sock
        self._name_of[sock] = name
        self._poller.register(sock, zmq.POLLIN)
        self.index.add_replica(name)

    def remove(self, name: str) -> None:
        sock = self._sockets.pop(name, None)
        if sock is not None:
            self._poller.unregister(sock)
            del self._name_of[sock]
            sock.close(linger=0)
        self.index.remove_replica(name)

    def poll(self, timeout_ms: int = 100) -> int:
        """Waits up to `timeout_ms` for events, applies every batch that arrived; returns how many."""
        applied = 0
        for sock, _ in self._poller.poll(timeout_ms):
            name = self._name_of[sock]
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    batch = decode_batch(data)
                except msgspec.DecodeError as e:  # not our publisher, or another version: the next seq tells
                    self.undecodable += 1
                    logger.warning("replica %s: undecodable KV events message dropped: %s", name, e)
                    continue
                self.index.apply(name, batch)
                applied += 1
        self.index.expire()
        return applied

    def close(self) -> None:
        for name in list(self._sockets):
            self.remove(name)
