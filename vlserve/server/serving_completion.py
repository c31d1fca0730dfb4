"""POST /v1/completions: text (or token-id) prompts; several prompts run as parallel engine requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest

from vlserve.core.errors import InvalidInputError
from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.core.structured_outputs import StructuredOutputsError
from vlserve.server.protocol import CompletionRequest
from vlserve.server.serving import SSE_DONE, OpenAIServing, SSEResponse, created, sse


def completion_logprobs(c: CompletionOutput, start: int, top_k: int, text_offset: int) -> dict | None:
    """The legacy completions logprobs layout for tokens [start:] of one choice."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        sampled = entry[tid]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank is not None and lp.rank <= top_k})
        offsets.append(text_offset)
        text_offset += len(sampled.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    async def create(self, raw: HTTPRequest):
        body: CompletionRequest = await self.parse(raw, CompletionRequest)
        adapter = self.check_model(body.model)
        model = self.answered_model(adapter)
        self.engine.check_accepting()
        arrival, prompts = time.monotonic(), body.prompts()
        if len(prompts) * body.n > self.server.max_n:
            raise InvalidInputError(f"{len(prompts)} prompts x n={body.n} is more than the {self.server.max_n} "
                                    "sequences one request may ask for (--max-n)")
        checked = body.sampling_params(body.max_tokens, body.logprobs)  # refuse bad values before any work
        self.check_logprob_budget(len(prompts) * body.n, body.max_tokens, body.logprobs)
        try:
            await self.check_structured_outputs(checked, raw)
        except StructuredOutputsError as e:  # name the field the client sent, e.g. response_format's schema
            raise body.constraint_error(e) from None
        request_id = self.new_request_id(body.request_id)
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        gens, top_k = [], body.logprobs or 0
        try:
            for prompt, rid in zip(prompts, ids):
                preparing = self.engine.prepare(prompt, None, arrival, rid, checked, adapter)
                with await self.until_done_or_disconnect(raw, preparing) as prepared:  # closed unless sent
                    params = body.sampling_params(self.max_tokens(prepared, body.max_tokens), body.logprobs)
                    self.check_logprob_budget(len(prompts) * body.n, params.max_tokens, body.logprobs)
                    gens.append(self.engine.generate(prepared, params, rid, adapter))
            firsts = await self.until_done_or_disconnect(raw, self._first_outputs(gens))
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return SSEResponse(self._stream(request_id, firsts, gens, include_usage, top_k, model), *gens)
            finals = await self.until_done_or_disconnect(
                raw, asyncio.gather(*(self._last(f, g) for f, g in zip(firsts, gens))))
        except BaseException:
            for g in gens:  # one prompt refused, or the client left: none runs on for nobody
                g.close()
            raise
        n = body.n

        def response() -> dict:
            choices = [self._choice(k * n + c.index, c, top_k) for k, out in enumerate(finals) for c in out.outputs]
            return {"id": request_id, "object": "text_completion", "created": created(), "model": model,
                    "choices": choices, "usage": self._sum_usage(finals)}

        return await self.json_response(response, off_loop=body.logprobs is not None)

    @staticmethod
    async def _first_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        try:
            return list(await asyncio.gather(*(g.__anext__() for g in gens)))
        except BaseException:
            for g in gens:  # one prompt refused: the others must not keep running
                await g.aclose()
            raise

    async def _last(self, first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        return first if first.finished else await self.final_output(gen)

    @staticmethod
    def _choice(index: int, c: CompletionOutput, top_k: int, text: str | None = None, start: int = 0,
                offset: int = 0) -> dict:
        return {"index": index, "text": c.text if text is None else text,
                "logprobs": completion_logprobs(c, start, top_k, offset),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _sum_usage(self, outs: list[RequestOutput]) -> dict:
        usages = [self.usage(o) for o in outs]
        total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        total["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outs)}
        return total

    async def _stream(self, request_id: str, firsts: list[RequestOutput], gens: list, include_usage: bool,
                      top_k: int, model: str | None = None) -> AsyncIterator[bytes]:
        """Chunks of all prompts interleaved as they come, each choice with its own global index."""
        stamp, n, model = created(), len(firsts[0].outputs), model or self.model_name
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, first: RequestOutput, gen) -> None:
            try:
                await queue.put((k, first))
                if not first.finished:
                    async for out in gen:
                        await queue.put((k, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which reports it in the stream
                await queue.put((k, e))

        tasks = [asyncio.create_task(pump(k, f, g)) for k, (f, g) in enumerate(zip(firsts, gens))]
        sent: dict[int, tuple[int, int, bool]] = {}  # global choice index -> (chars, tokens, finished) sent
        finals: dict[int, RequestOutput] = {}
        try:
            while len(finals) < len(firsts):
                k, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                choices = []
                for c in out.outputs:
                    idx = k * n + c.index
                    chars, toks, done = sent.get(idx, (0, 0, False))
                    if done or (c.finish_reason is None and (len(c.token_ids) == toks or len(c.text) == chars)):
                        continue  # finished already, nothing new, or its text is still held back
                    choices.append(self._choice(idx, c, top_k, c.text[chars:], toks, chars))
                    sent[idx] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                if choices:
                    body = {"id": request_id, "object": "text_completion", "created": stamp, "model": model,
                            "choices": choices}
                    if include_usage:
                        body["usage"] = None
                    yield sse(body)
                if all(sent.get(k * n + c.index, (0, 0, False))[2] for c in out.outputs):
                    finals[k] = out
                elif out.finished:  # it finished while the chunk above was sent (one object, updated in place)
                    queue.put_nowait((k, out))
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": stamp, "model": model,
                           "choices": [], "usage": self._sum_usage(list(finals.values()))})
        except Exception as e:  # noqa: BLE001 - the status line is gone; the error goes in the stream
            yield self.error_event(e, request_id)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # a generator can't be closed while running
            for g in gens:
                await g.aclose()
        yield SSE_DONE
