"""Forwards one OpenAI request to the replica the chooser picks and passes its answer through: an SSE stream
chunk by chunk as the replica sends it, anything else whole, with the replica's status.

A replica that refuses the connection is avoided and the request tried once on another (nothing was sent, so
nothing can run twice); one that fails after accepting it gives 502 (it may have started the work). A client
that leaves closes the upstream connection, which aborts the request on the replica.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vlserve.core.errors import VlserveError
from vlserve.router.choice import Chooser
from vlserve.router.metrics import RouterMetrics
from vlserve.router.replicas import Replica, ReplicaSet
from vlserve.server.errors import error_body
from vlserve.server.serving import SSE_DONE, sse

logger = logging.getLogger("vlserve.router")
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)


class NoReplicaError(VlserveError):
    http_status = 503
    error_type = "ServiceUnavailable"


class ReplicaFailedError(VlserveError):
    http_status = 502
    error_type = "BadGateway"


class Proxy:
    def __init__(self, replicas: ReplicaSet, chooser: Chooser, metrics: RouterMetrics, until_done_or_disconnect):
        self.replicas, self.chooser, self.metrics = replicas, chooser, metrics
        self.until_done_or_disconnect = until_done_or_disconnect  # the server's: a leaving client cancels the work
        # No read timeout: a long generation streams for as long as it takes; the client's leaving ends it.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def forward(self, raw: Request, path: str, body: bytes, hashes: list[bytes], whole: bool = True) -> Response:
        """`hashes`: the prompt's block hashes; `whole`: they cover all of it (else its size is unknown)."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[str] = set()
        for attempt in range(2):
            candidates = self.replicas.candidates(exclude=tried)
            if not candidates:
                break
            overlaps = (self.replicas.index.longest_prefixes(hashes)
                        if hashes and self.chooser.policy == "cache-aware" else {})
            choice = self.chooser.choose(candidates, overlaps, len(hashes) if whole else 0)
            replica = self.replicas.replicas[choice.name]
            replica.in_flight += 1
            # Queued for prefill until the replica answers: a server sends its headers once the prompt is
            # prefilled (a stream's first chunk) or, not streaming, once done.
            replica.prefill_tokens += choice.new_tokens
            try:
                request = self.http.build_request("POST", f"{replica.url}{path}", content=body, headers=headers)
                try:
                    resp = await self.until_done_or_disconnect(raw, self.http.send(request, stream=True))
                finally:
                    replica.prefill_tokens -= choice.new_tokens
            except CONNECT_FAILURES as e:
                replica.in_flight -= 1
                tried.add(replica.name)
                self.replicas.avoid(replica.name, f"connection failed: {type(e).__name__}")
                self.metrics.retries.inc()
                continue
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                self.replicas.avoid(replica.name, f"failed before answering: {type(e).__name__}")
                raise ReplicaFailedError(f"the replica at {replica.info.http_address} failed before answering: "
                                         f"{type(e).__name__}") from None
            except BaseException:
                replica.in_flight -= 1
                raise
            self.metrics.routed(replica.name, choice.decision, choice.overlap, len(hashes))
            return await self._answer(raw, replica, resp)
        raise NoReplicaError("no replica could take the request (none known, or none accepted a connection)")

    async def _answer(self, raw: Request, replica: Replica, resp: httpx.Response) -> Response:
        media_type = resp.headers.get("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            return StreamingResponse(self._stream(replica, resp), status_code=resp.status_code,
                                     media_type=media_type)
        try:
            content = await self.until_done_or_disconnect(raw, resp.aread())
        except httpx.HTTPError as e:
            raise ReplicaFailedError(f"the replica at {replica.info.http_address} failed while answering: "
                                     f"{type(e).__name__}") from None
        finally:
            replica.in_flight -= 1
            await resp.aclose()
        return Response(content, status_code=resp.status_code, media_type=media_type)

    async def _stream(self, replica: Replica, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the replica died mid-stream: say so the way the server does, then end
            logger.warning("replica %s failed mid-stream: %s", replica.info.http_address, type(e).__name__)
            yield sse(error_body(f"the replica failed mid-stream: {type(e).__name__}", 502)) + SSE_DONE
        finally:
            replica.in_flight -= 1
            await resp.aclose()
