"""What chat and completions share: reading bodies within limits, model check (the base model or a LoRA adapter),
token budget, disconnects, SSE framing; and the runtime LoRA endpoints."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from vlserve.core.config import ServerArgs
from vlserve.core.errors import (InvalidInputError, NotFoundError, RequestTimeoutError, RequestTooLargeError,
                                 VlserveError)
from vlserve.core.lora import AdapterRef
from vlserve.core.outputs import RequestOutput
from vlserve.core.sampling_params import SamplingParams
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.frontend.prepared_prompt import PreparedPrompt
from vlserve.server.errors import error_body, error_from_exception, log_client_error
from vlserve.server.protocol import parse_body

PARSE_INLINE_BYTES = 256 * 1024  # bigger bodies are parsed on a thread, off the event loop (as read: not copied)
_json = msgspec.json.Encoder()
MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_PATH_CHARS = 256, 4096
LISTED_MODELS = 8  # a 404 for an unknown model names the served ones when there are at most this many
# U+2028/U+2029 are legal raw in JSON but end a line for JavaScript and some SSE readers: send them escaped.
_LINE_SEPARATORS = (("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))


def escape_line_separators(payload: bytes) -> bytes:
    """JSON bytes with U+2028/U+2029 escaped: one line for SSE readers, JavaScript and JSONL readers alike."""
    for raw, escaped in _LINE_SEPARATORS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return payload


def sse(data: dict | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    return b"data: " + escape_line_separators(payload) + b"\n\n"


SSE_DONE = sse("[DONE]")


class SSEResponse(StreamingResponse):
    """A stream whose generator is closed when the response ends, however it ends: that aborts the request.

    A client that leaves mid-stream cancels the sending task. If that lands inside the generator (waiting for the
    engine), the generator unwinds itself; but if it lands while a chunk is being handed on (the generator is
    parked at a `yield`), Starlette just drops the generator, and until the garbage collector finalizes it the
    engine goes on generating for nobody, up to max_tokens. Closing it here makes the abort immediate.

    `owned`: what the generator closes in its `finally` (its engine requests), closed here too: a generator that
    never started (the client left, or the server stopped, before its first chunk) never runs its `finally`."""

    def __init__(self, content: AsyncIterator[bytes], *owned):
        super().__init__(content, media_type="text/event-stream")
        self.owned = owned

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for item in self.owned:
                await item.aclose()


async def read_body(raw: HTTPRequest, limit: int, timeout: float = math.inf) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` (header or bytes read), and
    with 408 if it has not all arrived `timeout` seconds after its headers (a slow-loris client)."""
    return bytes(await read_body_buffer(raw, limit, timeout))


async def read_body_buffer(raw: HTTPRequest, limit: int, timeout: float = math.inf) -> bytearray:
    """`read_body`'s body as the buffer it was read into: no copy of it is made on the event loop (copying a
    body of tens of megabytes there would hold up every other request, /health included)."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"the request body is {declared} bytes, over the limit of {limit} bytes "
                                   "(--max-request-bytes)")
    body = bytearray()
    try:
        async with asyncio.timeout(None if math.isinf(timeout) else timeout):
            async for chunk in raw.stream():
                body += chunk
                if len(body) > limit:
                    raise RequestTooLargeError(f"the request body is over the limit of {limit} bytes "
                                               "(--max-request-bytes)")
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {timeout:g}s (--body-read-timeout); "
                                  f"{len(body)} bytes came") from None
    return body


class OpenAIServing:
    id_prefix = "req"

    def __init__(self, engine: AsyncLLM, server: ServerArgs, model_name: str):
        self.engine = engine
        self.server = server
        self.model_name = model_name

    async def parse(self, raw: HTTPRequest, model: type[BaseModel]):
        body = await read_body_buffer(raw, self.server.max_request_bytes, self.server.body_read_timeout)
        if len(body) <= PARSE_INLINE_BYTES:
            parsed = parse_body(body, model)
        else:
            parsed = await asyncio.get_running_loop().run_in_executor(self.engine.executor, parse_body, body, model)
        parsed.check_fields(self.server)
        return parsed

    async def check_structured_outputs(self, params: SamplingParams, raw: HTTPRequest) -> None:
        """A schema or grammar that cannot compile is refused here (400 with the reason), on the constraint
        compile threads (503 when they are all taken). A client that leaves stops the wait, and its compile, if
        it has not started: told by the disconnect message itself (`is_disconnected` polls never see one
        through the app's HTTP middleware)."""
        if params.structured_outputs is not None:
            await self.until_done_or_disconnect(raw, self.engine.grammar_compiler.check(params.structured_outputs))

    def check_model(self, name: str | None) -> AdapterRef | None:
        """The LoRA adapter a request's `model` names; None for the base model (or no name). 404 otherwise."""
        if name is None or name == self.model_name:
            return None
        loras = getattr(self.engine, "loras", None)  # the engine's catalogue, or a router's view of its replicas'
        adapters = loras.adapters if loras is not None else {}
        ref = adapters.get(name)
        if ref is not None:
            return ref
        served = [self.model_name, *adapters]
        listed = (", ".join(map(repr, served)) if len(served) <= LISTED_MODELS
                  else f"{self.model_name!r} and {len(adapters)} LoRA adapters (see GET /v1/models)")
        raise NotFoundError(f"the model {name!r} does not exist; this server serves {listed}")

    def answered_model(self, adapter: AdapterRef | None) -> str:
        """The `model` an answer names: what the request asked for, as vLLM does."""
        return self.model_name if adapter is None else adapter.name

    def new_request_id(self, given: str | None, prefix: str | None = None) -> str:
        return f"{prefix or self.id_prefix}-{given or uuid.uuid4().hex}"

    def max_tokens(self, prompt: PreparedPrompt, requested: int | None) -> int:
        """The user's max_tokens, or what is left of the context; refused if the two do not fit together."""
        limit = self.engine.cfg.max_model_len
        room = limit - prompt.num_tokens
        if requested is None:
            if room < 1:
                raise InvalidInputError(f"the prompt has {prompt.num_tokens} tokens, which leaves no room to "
                                        f"generate within the model's maximum context length ({limit} tokens)")
            return room
        if requested >= 1 and requested > room:
            raise InvalidInputError(f"this model's maximum context length is {limit} tokens; the prompt has "
                                    f"{prompt.num_tokens} tokens and max_tokens is {requested}: reduce one of them")
        return requested

    def check_logprob_budget(self, sequences: int, max_tokens: int | None, top_logprobs: int | None) -> None:
        """What logprobs cost grows with sequences x tokens x alternatives: refused above --max-logprob-entries."""
        if top_logprobs is None or max_tokens is None:
            return
        entries, limit = sequences * max_tokens * (top_logprobs + 1), self.server.max_logprob_entries
        if entries > limit:
            raise InvalidInputError(
                f"{sequences} sequences x max_tokens {max_tokens} x {top_logprobs + 1} log-probabilities per token "
                f"is {entries}, over the {limit} one request may ask for (--max-logprob-entries): lower n, "
                "max_tokens or top_logprobs")

    async def json_response(self, build: Callable[[], dict], off_loop: bool) -> Response:
        """The answer as JSON; a big one (logprobs of many tokens) is built and encoded on a worker thread."""
        if not off_loop:
            return JSONResponse(build())
        body = await asyncio.get_running_loop().run_in_executor(self.engine.executor,
                                                                lambda: _json.encode(build()))
        return Response(body, media_type="application/json")

    async def until_done_or_disconnect(self, raw: HTTPRequest, work: Awaitable):
        """Runs `work`; if the client goes away first, cancels it (which aborts the request in the engine).

        A prepared prompt that arrives after all, once its handler has given up on it, is closed: nobody else
        holds it.
        """
        task = asyncio.ensure_future(work)
        # Told by the disconnect message itself: `is_disconnected()` polls never see one through the app's HTTP
        # middleware, and a plain (not streamed) request would run to max_tokens for nobody.
        left = asyncio.ensure_future(_client_leaves(raw))
        try:
            await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ClientGoneError("the client disconnected before its answer was ready")
        except BaseException:
            task.cancel()
            task.add_done_callback(_close_abandoned)
            raise
        finally:
            left.cancel()

    @staticmethod
    async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = None
        async for last in outputs:
            pass
        return last

    @staticmethod
    def usage(out: RequestOutput) -> dict:
        completion = sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
                "total_tokens": len(out.prompt_token_ids) + completion,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def error_event(self, exc: Exception, request_id: str) -> bytes:
        """Once a stream has started the status is sent: errors travel as an SSE event, then [DONE]."""
        message, status = error_from_exception(exc)
        log_client_error(f"stream {request_id}", status, message)
        return sse(error_body(message, status))


class _LoRABody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)

    def check_fields(self, server: ServerArgs) -> None:
        pass  # bounded by the fields themselves


class LoadLoRAAdapterRequest(_LoRABody):
    lora_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)
    load_inplace: bool = False  # vLLM's: replace an adapter already served under this name


class UnloadLoRAAdapterRequest(_LoRABody):
    lora_int_id: int | None = None  # vLLM's; adapters are told apart by name here


class OpenAIServingLoRA(OpenAIServing):
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Off unless --allow-runtime-lora: the path
    is a folder on the server's machine (under --lora-dir), so whoever may call them chooses what the server
    reads there."""

    async def load(self, raw: HTTPRequest) -> Response:
        self._check_allowed()
        body: LoadLoRAAdapterRequest = await self.parse(raw, LoadLoRAAdapterRequest)
        await self.engine.load_lora(body.lora_name, body.lora_path, replace=body.load_inplace,
                                    lora_dirs=self.server.lora_dir)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, raw: HTTPRequest) -> Response:
        self._check_allowed()
        body: UnloadLoRAAdapterRequest = await self.parse(raw, UnloadLoRAAdapterRequest)
        await self.engine.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _check_allowed(self) -> None:
        # A 400 that says what to do (rather than the 404 of an unknown route): these are vLLM's paths.
        if self.engine.loras is None:
            raise InvalidInputError("this server serves no LoRA adapters: start it with --enable-lora (and "
                                    "--allow-runtime-lora to load adapters while it runs)")
        if not self.server.allow_runtime_lora:
            raise InvalidInputError("loading and unloading LoRA adapters at runtime is off: start the server with "
                                    "--allow-runtime-lora (API clients then choose folders the server reads)")


class ClientGoneError(VlserveError):
    """Nobody reads this answer; it ends the handler without an error logged (a cancelled one is, by the
    HTTP middleware: "No response returned")."""

    http_status = 499  # nginx's "client closed request"
    error_type = "ClientClosedRequest"


async def _client_leaves(raw: HTTPRequest) -> None:
    """Returns once the client disconnects (its body was read whole: nothing else can arrive)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _close_abandoned(task: asyncio.Future) -> None:
    """What a handler gave up on arrived after all: closed, since nobody else holds it (a prepared prompt's
    buffers; a replica's answer the router was opening, whose connection would otherwise keep it generating)."""
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if isinstance(result, PreparedPrompt):
        result.close()
    elif callable(getattr(result, "aclose", None)):
        asyncio.ensure_future(result.aclose())


def created() -> int:
    return int(time.time())
