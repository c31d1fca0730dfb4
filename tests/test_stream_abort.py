"""A client that leaves mid-stream aborts its request at once, wherever the sending task was cancelled: also while
a chunk was being handed on, when the stream's generator is parked at a `yield` (Starlette then drops the
generator, and the engine would go on generating for nobody until the garbage collector finalized it), and before
the generator ever started. A stream the router relays ends with an error event when the router stops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import ClientDisconnect, Request

from vlserve.core.config import ServerArgs
from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.router.proxy import _Relay
from vlserve.server.drain import Drain, DrainGate
from vlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.server.responses_protocol import ResponsesRequest
from vlserve.server.serving import SSEResponse
from vlserve.server.serving_chat import ChatRun, OpenAIServingChat
from vlserve.server.serving_completion import OpenAIServingCompletion
from vlserve.server.serving_responses import OpenAIServingResponses


def test_generator_closed_when_the_client_leaves_during_a_send():
    async def run() -> tuple[bool, int]:
        closed = asyncio.Event()

        async def chunks():
            try:
                while True:
                    yield b"data: {}\n\n"
            finally:
                closed.set()  # where the real stream aborts its request

        sent = 0

        async def send(message):
            nonlocal sent
            sent += 1
            if sent == 3:
                await asyncio.sleep(3600)  # parked handing a chunk on (a full socket, a middleware's queue)

        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        response = SSEResponse(chunks())  # held, as the app's middleware holds it: no garbage collection
        task = asyncio.create_task(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
        while sent < 3:
            await asyncio.sleep(0.01)
        gone.set()
        await asyncio.wait_for(task, 5)
        return closed.is_set(), sent

    closed, sent = asyncio.run(run())
    assert sent == 3 and closed


# ---- a stream whose generator never started ------------------------------------------------------------------
# The client left (or the server stopped) between the engine's first output and the first chunk: the response ends
# before it iterated its generator, whose `finally` (closing the engine request) then never runs. The request must
# be aborted all the same, not generate up to max_tokens for nobody.

class _Handle:
    """An engine request's outputs (a RequestHandle): closing it aborts the request."""

    def __init__(self):
        self.closed, self.taken = False, 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        self.taken += 1
        if self.taken > 1:
            await asyncio.Event().wait()  # the next tokens are slow to come
        return RequestOutput("r", "", [1, 2], [CompletionOutput(0, "", [])])

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.close()


class _Prepared:
    num_tokens = 2

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Engine:
    loras = None
    executor = None
    cfg = SimpleNamespace(max_model_len=64)

    def __init__(self):
        self.handles: list[_Handle] = []

    def check_accepting(self) -> None:
        pass

    async def prepare(self, *args) -> _Prepared:
        return _Prepared()

    def generate(self, *args) -> _Handle:
        self.handles.append(_Handle())
        return self.handles[-1]


def _present() -> Request:
    """The handler's request: its body was read, its client stays while the handler runs."""
    async def receive():
        await asyncio.Event().wait()

    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": []}, receive)


def _chat_stream(engine: _Engine):
    chat = OpenAIServingChat(engine, ServerArgs(), "m")

    async def parse(raw, model):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)

    async def start(raw, body, id_prefix=None):
        return ChatRun("chatcmpl-1", await engine.generate().__anext__(), engine.handles[-1], None, False, "m")

    chat.parse, chat.start = parse, start
    return chat


def _responses_stream(engine: _Engine):
    chat = _chat_stream(engine)

    async def parse(raw, model):
        return ResponsesRequest(input="hi", stream=True)

    chat.parse = parse
    return OpenAIServingResponses(chat)


def _completions_stream(engine: _Engine):
    completion = OpenAIServingCompletion(engine, ServerArgs(), "m")

    async def parse(raw, model):
        return CompletionRequest(prompt=["a", "b"], stream=True, max_tokens=4)

    completion.parse = parse
    return completion


@pytest.mark.parametrize("api", [_chat_stream, _completions_stream, _responses_stream])
def test_a_stream_that_never_started_aborts_its_engine_requests(api):
    async def run() -> list[_Handle]:
        engine = _Engine()
        response = await api(engine).create(_present())
        assert isinstance(response, SSEResponse)
        sent = []

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client left before the first chunk")  # what a server's send does then
            sent.append(message)

        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert not sent
        return engine.handles

    handles = asyncio.run(run())
    assert handles and all(h.closed for h in handles), "an engine request runs on for nobody"


# ---- the router's stop -----------------------------------------------------------------------------------------
class _ReplicaStream:
    """A replica's answer, httpx-like: one event, then nothing for a long while."""

    def __init__(self):
        self.closed = False

    async def aiter_raw(self):
        yield b'data: {"choices": []}\n\n'
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True


def test_the_router_stop_ends_a_relayed_stream_with_an_error_event_and_done():
    """A stream the router relays, waiting for the replica's next chunk when the drain cuts: it ends as the
    server's own streams do (`data: {"error": ...}`, `data: [DONE]`) and lets go of the replica."""
    async def run():
        drain = Drain(0.0)
        replica, upstream = SimpleNamespace(in_flight=1), _ReplicaStream()
        response = SSEResponse(_Relay(SimpleNamespace(drain=drain), replica, upstream))
        bodies, first = [], asyncio.Event()

        async def send(message):
            if message.get("body"):
                bodies.append(message["body"])
                first.set()

        async def receive():
            await asyncio.Event().wait()

        gate = DrainGate(response, drain)  # as run_router serves it
        scope = {"type": "http", "path": "/v1/chat/completions", "asgi": {"spec_version": "2.3"}}
        task = asyncio.create_task(gate(scope, receive, send))
        await asyncio.wait_for(first.wait(), 10)
        drain.request_stop("SIGINT")
        await asyncio.wait_for(drain.run(SimpleNamespace(should_exit=False)), 10)
        await asyncio.wait_for(task, 10)
        return bodies, upstream.closed, replica.in_flight

    bodies, closed, in_flight = asyncio.run(run())
    assert bodies[-1].endswith(b"data: [DONE]\n\n"), bodies
    assert b'"code":503' in bodies[-1] and b"shutting down" in bodies[-1], bodies
    assert closed and in_flight == 0
