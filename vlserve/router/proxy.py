"""Forwards one OpenAI request to the replica the chooser picks and passes its answer through: an SSE stream
chunk by chunk as the replica sends it, anything else read whole within a bound, checked, with the replica's status.

A replica that refuses the connection is avoided and the request tried once on another (nothing was sent, so
nothing can run twice); one that fails after accepting it gives 502 (it may have started the work). A client
that leaves closes the upstream connection, which aborts the request on the replica.

What a replica is trusted with, and what it is not (it may be broken, or not ours):
- Credentials: the client's `Authorization` (and cookies, and any other header) never go upstream. Replicas get
  the router's own key (`--replica-api-key`, default the router's `--api-key`).
- Time: `--replica-read-timeout` between any two reads (the headers, each chunk). A replica silent that long gets
  the client a 504 (mid-stream: an error event, then [DONE]) and is avoided, so the next requests go elsewhere.
- Size: a whole answer is read within `--max-replica-response-bytes` (its Content-Length checked before any of it
  is read), never held past that; a stream is passed on chunk by chunk and never held.
- Form: an answer is JSON (an object: it must parse, on a worker thread when large) or, with status 200, an SSE
  stream; uvicorn's own plain-text errors (a 500, a 503) become the error JSON with their status. Anything else
  (HTML, another media type, a compressed body, a redirect) is 502 and the replica is avoided: nothing a replica
  sends reaches a browser as a page.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import httpx
import msgspec
from fastapi import Request
from fastapi.responses import Response

from vlserve.core.errors import VlserveError
from vlserve.router.choice import Chooser
from vlserve.router.metrics import RouterMetrics
from vlserve.router.replicas import Replica, ReplicaSet
from vlserve.server.drain import Drain, ShuttingDownError
from vlserve.server.errors import error_body, error_response, one_line
from vlserve.server.serving import PARSE_INLINE_BYTES, SSE_DONE, SSEResponse, sse

logger = logging.getLogger("vlserve.router")
FORWARDED_HEADERS = ("content-type", "accept")  # of the client's: never its authorization, cookies or the like
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
CONNECT_TIMEOUT_S = 5.0
JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"


class NoReplicaError(VlserveError):
    http_status = 503
    error_type = "ServiceUnavailable"


class ReplicaFailedError(VlserveError):
    http_status = 502
    error_type = "BadGateway"


class ReplicaTimeoutError(VlserveError):
    http_status = 504
    error_type = "GatewayTimeout"


class Proxy:
    def __init__(self, replicas: ReplicaSet, chooser: Chooser, metrics: RouterMetrics, until_done_or_disconnect, *,
                 replica_key: str | None = None, read_timeout: float = 600.0,
                 max_response_bytes: int = 256 * 2**20, executor: Executor | None = None,
                 drain: Drain | None = None):
        self.replicas, self.chooser, self.metrics = replicas, chooser, metrics
        self.drain = drain or Drain(0.0)  # the router's stop: it cuts the streams relayed
        self.until_done_or_disconnect = until_done_or_disconnect  # the server's: a leaving client cancels the work
        self.read_timeout, self.max_response_bytes, self.executor = read_timeout, max_response_bytes, executor
        # identity: a compressed body would be inflated past every bound before it could be measured
        self.own_headers = {"accept-encoding": "identity"}
        if replica_key:
            self.own_headers["authorization"] = f"Bearer {replica_key}"
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout, write=read_timeout, pool=None)
        self.http = httpx.AsyncClient(timeout=timeout, follow_redirects=False,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def forward(self, raw: Request, path: str, body: bytes, hashes: list[bytes], whole: bool = True,
                      adapter: str | None = None) -> Response:
        """`hashes`: the prompt's block hashes; `whole`: they cover all of it (else its size is unknown);
        `adapter`: the LoRA adapter it names (only replicas serving it take it)."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS} | self.own_headers
        tried: set[str] = set()
        # Once per request (a retry is the same request): which leading blocks other conversations share.
        common = self.chooser.observe(hashes, whole) if hashes and self.chooser.policy == "cache-aware" else 0
        for attempt in range(2):
            candidates = self.replicas.candidates(exclude=tried, adapter=adapter)
            if not candidates:
                break
            overlaps = (self.replicas.index.longest_prefixes(hashes)
                        if hashes and self.chooser.policy == "cache-aware" else {})
            choice = self.chooser.choose(candidates, overlaps, len(hashes), common, whole)
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
                raise self.failure(replica, e, "before answering") from None
            except BaseException:
                replica.in_flight -= 1
                raise
            self.metrics.routed(replica.name, choice.decision, choice.overlap, len(hashes))
            return await self._answer(raw, replica, resp)
        raise NoReplicaError("no replica could take the request (none known, or none accepted a connection)")

    def failure(self, replica: Replica, e: httpx.HTTPError, when: str) -> VlserveError:
        """The error for the client when the connection to `replica` failed or went silent; the replica is
        avoided either way."""
        where = replica.info.http_address
        if isinstance(e, httpx.TimeoutException):
            self.replicas.avoid(replica.name, f"silent for {self.read_timeout:g}s {when}")
            return ReplicaTimeoutError(f"the replica at {where} sent nothing for {self.read_timeout:g}s {when} "
                                       "(--replica-read-timeout)")
        self.replicas.avoid(replica.name, f"failed {when}: {type(e).__name__}")
        return ReplicaFailedError(f"the replica at {where} failed {when}: {type(e).__name__}")

    def _refused(self, replica: Replica, what: str) -> ReplicaFailedError:
        self.replicas.avoid(replica.name, f"answered {what}")
        return ReplicaFailedError(f"the replica at {replica.info.http_address} answered {what}, which the router "
                                  "does not pass on")

    async def _answer(self, raw: Request, replica: Replica, resp: httpx.Response) -> Response:
        status, media_type = resp.status_code, resp.headers.get("content-type", "")
        kind = media_type.split(";", 1)[0].strip().lower()
        streaming = False
        try:
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise self._refused(replica, f"a body encoded as {one_line(encoding, 40)!r}")
            if kind == SSE and status == 200:
                streaming = True  # the stream now owns the replica's count and the connection
                return SSEResponse(_Relay(self, replica, resp))
            if kind not in (JSON, TEXT) or not (200 <= status < 300 or 400 <= status < 600) \
                    or (kind == TEXT and status < 400):
                raise self._refused(replica, f"status {status} with content type {one_line(media_type, 80)!r}")
            content = await self.until_done_or_disconnect(raw, self._read_whole(replica, resp))
        finally:
            if not streaming:
                replica.in_flight -= 1
                await resp.aclose()
        if kind == TEXT:  # uvicorn's own errors: the server's error JSON, the replica's status and words
            text = one_line(content.decode("utf-8", errors="replace"))
            return error_response(f"the replica at {replica.info.http_address} answered {status}: {text}", status)
        await self._check_json(replica, content)
        return Response(content, status_code=status, media_type=JSON)

    async def _read_whole(self, replica: Replica, resp: httpx.Response) -> bytes:
        """The body within --max-replica-response-bytes: refused from its Content-Length, or cut off (the
        connection closed) as soon as more than that has come."""
        limit, where = self.max_response_bytes, replica.info.http_address
        declared = resp.headers.get("content-length", "").strip()
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise ReplicaFailedError(f"the replica at {where} announced {one_line(declared, 24)} bytes, over the "
                                     f"{limit} the router takes (--max-replica-response-bytes)")
        chunks, size = [], 0
        try:
            async for chunk in resp.aiter_raw():
                size += len(chunk)
                if size > limit:
                    raise ReplicaFailedError(f"the replica at {where} answered more than the {limit} bytes the "
                                             "router takes (--max-replica-response-bytes)")
                chunks.append(chunk)
        except httpx.HTTPError as e:
            raise self.failure(replica, e, "while answering") from None
        return b"".join(chunks)

    async def _check_json(self, replica: Replica, content: bytes) -> None:
        if len(content) <= PARSE_INLINE_BYTES:
            ok = _is_json_object(content)
        else:
            ok = await asyncio.get_running_loop().run_in_executor(self.executor, _is_json_object, content)
        if not ok:
            raise self._refused(replica, "a body labelled JSON that is not a JSON object")


class _Relay:
    """A replica's SSE stream as a response body, chunk by chunk as it arrives. `aclose` (SSEResponse calls it
    however the response ends: done, client gone, never started) releases the replica's count and connection
    once."""

    def __init__(self, proxy: Proxy, replica: Replica, resp: httpx.Response):
        self.proxy, self.replica, self.resp = proxy, replica, resp
        self._chunks = resp.aiter_raw()
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            async with self.proxy.drain.interruptible():
                return await self._chunks.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise
        except httpx.HTTPError as e:  # the replica died or went silent mid-stream: say so as the server does
            err = self.proxy.failure(self.replica, e, "mid-stream")
            logger.warning("%s", err)
            await self.aclose()
            return sse(error_body(str(err), err.http_status)) + SSE_DONE
        except ShuttingDownError as e:  # the router is stopping: the stream ends as a failed one does
            await self.aclose()
            return sse(error_body(str(e), e.http_status)) + SSE_DONE

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.replica.in_flight -= 1
            await self.resp.aclose()


_OBJECT = dict[str, msgspec.Raw]  # a JSON object, its values checked but never built
_UTF8_SLICE = 1 << 20


def _is_json_object(content: bytes) -> bool:
    """A well-formed JSON object in valid UTF-8, checked without building it (memory stays the body's own)."""
    try:
        msgspec.json.decode(content, type=_OBJECT)
        decoder, view = codecs.getincrementaldecoder("utf-8")(), memoryview(content)
        for start in range(0, len(content), _UTF8_SLICE):
            decoder.decode(view[start:start + _UTF8_SLICE])
        decoder.decode(b"", final=True)
        return True
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
