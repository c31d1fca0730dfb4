"""POST /v1/responses: OpenAI's Responses API, served by the chat path (the request is translated into a chat
request: responses_protocol.py) and answered as a Response object, or as its stream of typed events.

Stream events, in order: response.created, response.in_progress; for the text, response.output_item.added (a
message), response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done; for each tool call, response.output_item.added (a
function_call), response.function_call_arguments.delta, .done, response.output_item.done; last
response.completed, or response.incomplete when max_output_tokens cut it short (then the output is what was made).
An error after the stream started comes as an `error` event followed by response.failed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.frontend.tool_calls import ToolCallStream, extract_tool_calls
from vlserve.server.errors import error_from_exception, log_client_error
from vlserve.server.responses_protocol import ResponsesRequest
from vlserve.server.serving import SSEResponse, created, sse
from vlserve.server.serving_chat import ChatRun, OpenAIServingChat

ID_PREFIX = "resp"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _status(c: CompletionOutput) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def create(self, raw: HTTPRequest):
        body: ResponsesRequest = await self.chat.parse(raw, ResponsesRequest)
        # Walks the whole input (it can be tens of megabytes of media): off the event loop.
        chat_body = await asyncio.get_running_loop().run_in_executor(self.chat.engine.executor, body.to_chat_request)
        chat_body.check_fields(self.chat.server)
        run = await self.chat.start(raw, chat_body, id_prefix=ID_PREFIX)
        if body.stream:
            return SSEResponse(self._stream(body, run), run.outputs)
        out = await self.chat.final(raw, run)
        return JSONResponse(self.response(body, run.request_id, created(), out, self.output_items(out, run)))

    def response(self, body: ResponsesRequest, request_id: str, stamp: int, out: RequestOutput | None,
                 output: list[dict], status: str | None = None, error: dict | None = None) -> dict:
        """The Response object: `out` None while it is in progress (no usage yet)."""
        c = out.outputs[0] if out is not None else None
        status = status or ("in_progress" if c is None else _status(c))
        usage = None
        if out is not None:
            made = len(c.token_ids)
            usage = {"input_tokens": len(out.prompt_token_ids),
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": len(out.prompt_token_ids) + made}
        return {
            "id": request_id, "object": "response", "created_at": stamp, "status": status, "background": False,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            # the name the request used: the base model's, or a LoRA adapter's
            "model": body.model or self.chat.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None, "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": body.text_format()}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "truncation": "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {}}

    @staticmethod
    def output_items(out: RequestOutput, run: ChatRun) -> list[dict]:
        c = out.outputs[0]
        content, calls = extract_tool_calls(c.text) if run.parse_calls else (c.text, [])
        items = [] if content is None else [message_item(_item_id("msg"), content, _status(c))]
        return items + [call_item(call) for call in calls]

    async def _stream(self, body: ResponsesRequest, run: ChatRun) -> AsyncIterator[bytes]:
        events = _EventWriter()
        stamp = created()
        yield events.send("response.created", response=self.response(body, run.request_id, stamp, None, []))
        yield events.send("response.in_progress", response=self.response(body, run.request_id, stamp, None, []))
        items: list[dict] = []  # by output_index, as the stream gave them
        message: dict | None = None  # the open message item: text goes there
        calls = ToolCallStream() if run.parse_calls else None
        sent_chars = 0
        out = run.first
        try:
            while True:
                c = out.outputs[0]
                done = c.finish_reason is not None
                if calls is not None:
                    text, new_calls = calls.feed(c.text, done)
                else:
                    text, new_calls = c.text[sent_chars:], []
                    sent_chars = len(c.text)
                if text:
                    if message is None:
                        message = message_item(_item_id("msg"), None, "in_progress")
                        items.append(message)
                        yield events.send("response.output_item.added", output_index=len(items) - 1, item=message)
                        message["content"].append(_text_part(""))
                        yield events.send("response.content_part.added", **self._where(items, message),
                                          part=_text_part(""))
                    message["content"][0]["text"] += text
                    yield events.send("response.output_text.delta", **self._where(items, message), delta=text,
                                      logprobs=[])
                for call in new_calls:
                    for frame in self._call_events(events, items, call):
                        yield frame
                if done:
                    break
                # One object the engine keeps updating: it may have moved on (even finished) while the events
                # above were sent; then the rest is already here.
                if not out.finished:
                    out = await run.outputs.__anext__()
            if message is not None:
                for frame in self._close_message(events, items, message, _status(c)):
                    yield frame
            final = self.response(body, run.request_id, stamp, out, items)
            yield events.send(f"response.{final['status']}", response=final)
        except Exception as e:  # noqa: BLE001 - the status line is gone; the error goes in the stream
            message_text, status = error_from_exception(e)
            log_client_error(f"stream {run.request_id}", status, message_text)
            yield events.send("error", code=str(status), message=message_text, param=None)
            failed = self.response(body, run.request_id, stamp, None, items, status="failed",
                                   error={"code": str(status), "message": message_text})
            yield events.send("response.failed", response=failed)
        finally:
            await run.outputs.aclose()

    @staticmethod
    def _where(items: list[dict], message: dict) -> dict:
        return {"item_id": message["id"], "output_index": items.index(message), "content_index": 0}

    @staticmethod
    def _call_events(events: _EventWriter, items: list[dict], call: dict):
        item = call_item(call, status="in_progress")
        added = {**item, "arguments": ""}
        items.append(item)
        index = len(items) - 1
        yield events.send("response.output_item.added", output_index=index, item=added)
        yield events.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
        yield events.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"], name=item["name"])
        item["status"] = "completed"
        yield events.send("response.output_item.done", output_index=index, item=item)

    @classmethod
    def _close_message(cls, events: _EventWriter, items: list[dict], message: dict, status: str):
        where = cls._where(items, message)
        part = message["content"][0]
        yield events.send("response.output_text.done", **where, text=part["text"], logprobs=[])
        yield events.send("response.content_part.done", **where, part=part)
        message["status"] = status
        yield events.send("response.output_item.done", output_index=where["output_index"], item=message)


class _EventWriter:
    """Server-sent events with their type on the `event:` line and in the data, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def send(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\n" + sse(data)
