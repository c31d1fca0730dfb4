"""POST /v1/chat/completions: messages with images -> one engine request (n samples), streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from vlserve.core.errors import InvalidInputError
from vlserve.core.lora import AdapterRef
from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.structured_outputs import StructuredOutputsError
from vlserve.frontend.prepared_prompt import PreparedPrompt
from vlserve.frontend.chat import ParsedChat, parse_chat_messages
from vlserve.frontend.tokenizer import render_chat
from vlserve.frontend.tool_calls import ToolCallStream, extract_tool_calls
from vlserve.server.protocol import ChatCompletionRequest
from vlserve.server.serving import SSE_DONE, OpenAIServing, SSEResponse, created, sse


def chat_logprobs(c: CompletionOutput, start: int, top_k: int) -> dict | None:
    """OpenAI's chat logprobs for tokens [start:] of one choice."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        sampled = entry[tid]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_k), key=lambda x: x.rank)
        content.append({"token": sampled.decoded_token, "logprob": sampled.logprob,
                        "bytes": list(sampled.decoded_token.encode()),
                        "top_logprobs": [{"token": t.decoded_token, "logprob": t.logprob,
                                          "bytes": list(t.decoded_token.encode())} for t in top]})
    return {"content": content}


def _calls_finish(reason: str | None) -> str | None:
    """A choice that made tool calls and stopped by itself finished for "tool_calls" (OpenAI's reason)."""
    return "tool_calls" if reason == "stop" else reason


@dataclass
class ChatRun:
    """A chat request the engine has taken: its first output and the stream of the rest."""

    request_id: str
    first: RequestOutput
    outputs: AsyncIterator[RequestOutput]
    top_logprobs: int | None  # None: no logprobs asked for
    parse_calls: bool  # tools were offered: tool calls are parsed out of the text
    model: str  # the model name the answer gives: the base model's or the LoRA adapter's the request named


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    python_media = False  # parts holding Python objects: only in requests this server builds itself

    async def create(self, raw: HTTPRequest):
        body: ChatCompletionRequest = await self.parse(raw, ChatCompletionRequest)
        run = await self.start(raw, body)
        top_k = run.top_logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(self._stream(run.request_id, run.first, run.outputs, include_usage, top_k,
                                            run.parse_calls, run.model), run.outputs)
        final = await self.final(raw, run)
        return await self.json_response(
            lambda: self._response(run.request_id, final, top_k, run.parse_calls, run.model),
            off_loop=run.top_logprobs is not None)

    async def start(self, raw: HTTPRequest, body: ChatCompletionRequest, id_prefix: str | None = None) -> ChatRun:
        """A parsed chat request checked, rendered and handed to the engine; returns with its first output, so a
        request the engine refuses still gets its 4xx. What the other APIs built on chat (Responses,
        transcriptions) run too: the same checks, limits and metrics."""
        adapter = self.check_model(body.model)
        self.engine.check_accepting()
        top_k = body.logprobs_count()
        checked = body.sampling_params(body.requested_max_tokens(), top_k)  # refuse bad values before any work
        self.check_logprob_budget(body.n, body.requested_max_tokens(), top_k)
        try:
            await self.check_structured_outputs(checked, raw)
        except StructuredOutputsError as e:  # name the field the client sent, e.g. response_format's schema
            raise body.constraint_error(e) from None
        tools, choice = body.tool_setup()
        request_id = self.new_request_id(body.request_id, id_prefix)
        prepared = await self.until_done_or_disconnect(raw, self._prepare(body, time.monotonic(), request_id,
                                                                                   checked, adapter))
        with prepared:  # closed here unless the engine takes it over
            params = body.sampling_params(self.max_tokens(prepared, body.requested_max_tokens()), top_k)
            self.check_logprob_budget(body.n, params.max_tokens, top_k)
            outputs = self.engine.generate(prepared, params, request_id, adapter)
        try:
            first = await self.until_done_or_disconnect(raw, outputs.__anext__())
        except BaseException:
            outputs.close()  # e.g. the client left just as an output arrived: nobody reads the rest
            raise
        return ChatRun(request_id, first, outputs, top_k, choice.mode != "none", self.answered_model(adapter))

    async def final(self, raw: HTTPRequest, run: ChatRun) -> RequestOutput:
        """The finished output of a started request (not streamed)."""
        try:
            return run.first if run.first.finished else await self.until_done_or_disconnect(
                raw, self.final_output(run.outputs))
        except BaseException:
            run.outputs.close()
            raise

    async def _prepare(self, body: ChatCompletionRequest, arrival: float, request_id: str,
                       params: SamplingParams, adapter: AdapterRef | None = None) -> PreparedPrompt:
        if body.chat_template is not None and not self.server.trust_request_chat_template:
            raise InvalidInputError("chat_template in a request is refused by this server (a template is code); "
                                    "the operator may allow it with --trust-request-chat-template")
        loop = asyncio.get_running_loop()
        chat, text = await loop.run_in_executor(self.engine.executor, self._chat_text, body)
        return await self.engine.prepare(chat.prompt(text), body.mm_processor_kwargs, arrival, request_id, params,
                                         adapter)

    def _chat_text(self, body: ChatCompletionRequest) -> tuple[ParsedChat, str]:
        """The messages parsed and bounded, then rendered by the chat template. On a worker thread: parsing reads
        every text and media part, tens of megabytes in a big body, which the event loop must not wait for."""
        chat = parse_chat_messages(body.messages, allow_python_objects=self.python_media,
                                   modalities=self.engine.cfg.model.modalities)
        limit_chars = self.engine.input_processor.max_prompt_chars
        if chat.num_text_chars > limit_chars:
            raise InvalidInputError(f"the messages hold {chat.num_text_chars} characters of text, more than can fit "
                                    f"in the model's context of {self.engine.cfg.max_model_len} tokens")
        for kind, items in chat.media.items():  # before any download
            limit = self.engine.cfg.limit_mm_per_prompt.get(kind, 0)
            if len(items) > limit:
                raise InvalidInputError(f"{len(items)} {kind}s in one request; at most {limit} allowed "
                                        f"(--limit-mm-per-prompt {kind}={limit})")
        tools, _ = body.tool_setup()
        return chat, render_chat(self.engine.tokenizer, chat.messages, body.add_generation_prompt, body.chat_template,
                                 body.chat_template_kwargs, tools)

    def _response(self, request_id: str, out: RequestOutput, top_k: int, parse_calls: bool,
                  model: str | None = None) -> dict:
        choices = []
        for c in out.outputs:
            message: dict = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if parse_calls:
                content, calls = extract_tool_calls(c.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish_reason = _calls_finish(finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c, 0, top_k),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": created(),
                "model": model or self.model_name, "choices": choices, "usage": self.usage(out)}

    async def _stream(self, request_id: str, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      include_usage: bool, top_k: int, parse_calls: bool,
                      model: str | None = None) -> AsyncIterator[bytes]:
        stamp, model = created(), model or self.model_name

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": stamp, "model": model,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        n = len(first.outputs)
        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n
        calls = [ToolCallStream() for _ in range(n)] if parse_calls else None
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
            out = first
            while True:
                choices = []
                for c in out.outputs:
                    i = c.index
                    text = c.text[sent_chars[i]:]
                    # Tokens whose text is held back (a partial UTF-8 char or stop string) wait for a later chunk.
                    if done[i] or (c.finish_reason is None and (not text or len(c.token_ids) == sent_tokens[i])):
                        continue
                    delta: dict = {"content": text} if text else {}
                    finish_reason = c.finish_reason
                    if calls is not None:
                        content, new_calls = calls[i].feed(c.text, c.finish_reason is not None)
                        delta = {"content": content} if content else {}
                        if new_calls:
                            delta["tool_calls"] = new_calls
                        if calls[i].num_calls:
                            finish_reason = _calls_finish(finish_reason)
                        if not delta and finish_reason is None:
                            continue  # held back (a call being written); these tokens' logprobs go with the next delta
                    choices.append({"index": i, "delta": delta, "logprobs": chat_logprobs(c, sent_tokens[i], top_k),
                                    "finish_reason": finish_reason})
                    sent_chars[i], sent_tokens[i], done[i] = len(c.text), len(c.token_ids), c.finish_reason is not None
                if choices:
                    yield chunk(choices)
                if all(done):
                    break
                # The output is one object the engine keeps updating: it may have moved on, even finished, while
                # the chunk above was being sent. Then the rest is already here; else wait for more.
                if not out.finished:
                    out = await outputs.__anext__()
            if include_usage:
                yield chunk([], self.usage(out))
        except Exception as e:  # noqa: BLE001 - the status line is gone; the error goes in the stream
            yield self.error_event(e, request_id)
        finally:
            await outputs.aclose()
        yield SSE_DONE
