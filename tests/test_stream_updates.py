"""A request's output is one object the engine's output loop keeps updating. A stream must send everything even
when the object moves on, or finishes, while a chunk is being written to the client (seen with E->P->D, whose
outputs come in bursts): no text lost, one finish_reason, for chat and completions."""

from __future__ import annotations

import asyncio
import json

from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.server.serving_chat import OpenAIServingChat
from vlserve.server.serving_completion import OpenAIServingCompletion


class _Handle:
    """Yields nothing more: everything arrives by updating the first output in place."""

    def __init__(self, out: RequestOutput):
        self.out = out

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.out.finished:
            raise StopAsyncIteration
        await asyncio.Event().wait()  # never: the test finishes the output while a chunk is out

    async def aclose(self) -> None:
        pass


def _running() -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "Hello", [5])])


def _finish(out: RequestOutput) -> None:
    c = out.outputs[0]
    c.text, c.token_ids, c.finish_reason = "Hello there, world", [5, 6, 7, 8], "length"
    out.finished = True


def _events(raw: list[bytes]) -> list:
    out = []
    for chunk in raw:
        data = chunk.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def _drive(stream, out: RequestOutput) -> list:
    """Reads the stream; right after the first content chunk, the output finishes (as if during the write)."""
    raw = []
    async for chunk in stream:
        raw.append(chunk)
        if b"Hello" in chunk and not out.finished:
            _finish(out)
    return _events(raw)


def test_chat_stream_sends_what_arrived_while_a_chunk_was_written():
    chat = object.__new__(OpenAIServingChat)
    chat.model_name = "m"
    out = _running()
    events = asyncio.run(_drive(chat._stream("r", out, _Handle(out), False, 0, False), out))
    deltas = [e["choices"][0] for e in events if e != "[DONE]"]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hello there, world"
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
    assert events[-1] == "[DONE]"


def test_completion_stream_sends_what_arrived_while_a_chunk_was_written():
    completion = object.__new__(OpenAIServingCompletion)
    completion.model_name = "m"
    out = _running()
    events = asyncio.run(_drive(completion._stream("r", [out], [_Handle(out)], False, 0), out))
    choices = [e["choices"][0] for e in events if e != "[DONE]"]
    assert "".join(c["text"] for c in choices) == "Hello there, world"
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
