"""A client that leaves mid-stream aborts its request at once, wherever the sending task was cancelled: also while
a chunk was being handed on, when the stream's generator is parked at a `yield` (Starlette then drops the
generator, and the engine would go on generating for nobody until the garbage collector finalized it)."""

from __future__ import annotations

import asyncio

from vlserve.server.serving import SSEResponse


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
