"""What chat and completions share: model check, token budget, media fetching, disconnects, SSE framing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import msgspec
from fastapi import Request as HTTPRequest

from vlserve.frontend.async_llm import AsyncLLM, PreparedPrompt
from vlserve.server.errors import error_body, error_from_exception
from vlserve.core.errors import InvalidInputError, NotFoundError
from vlserve.frontend.media.fetch import MediaFetcher
from vlserve.core.outputs import RequestOutput

DISCONNECT_POLL_S = 0.5
_json = msgspec.json.Encoder()


def sse(data: dict | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse("[DONE]")


class OpenAIServing:
    id_prefix = "req"

    def __init__(self, engine: AsyncLLM, fetchers: dict[str, MediaFetcher], model_name: str):
        self.engine = engine
        self.fetchers = fetchers  # media kind -> fetcher
        self.model_name = model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFoundError(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    def new_request_id(self, given: str | None) -> str:
        return f"{self.id_prefix}-{given or uuid.uuid4().hex}"

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

    async def fetch_media(self, kind: str, sources: list) -> list:
        """A request's URLs of one kind fetched concurrently under the server's URL policy (its own size
        limit per kind); embedding entries pass through untouched."""
        fetcher = self.fetchers[kind]

        async def one(src):
            return await fetcher.fetch(src) if isinstance(src, str) else src

        return list(await asyncio.gather(*(one(s) for s in sources)))

    async def until_done_or_disconnect(self, raw: HTTPRequest, work: Awaitable):
        """Runs `work`; if the client goes away first, cancels it (which aborts the request in the engine)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    task.cancel()
                    raise asyncio.CancelledError("client disconnected")
        finally:
            if not task.done():
                task.cancel()

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

    @staticmethod
    def error_event(exc: Exception) -> bytes:
        """Once a stream has started the status is sent: errors travel as an SSE event, then [DONE]."""
        message, status = error_from_exception(exc)
        return sse(error_body(message, status))


def created() -> int:
    return int(time.time())
