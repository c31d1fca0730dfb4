"""A prepared prompt has one owner, and what it holds outside the engine (a disaggregated server's receive blocks)
comes back exactly once on every path: the request finishes, a check after prepare refuses it (n > 1 logprob
budget, max_tokens past the context, the second prompt of a completions call), the engine refuses it, the client
leaves while prepare runs (also when the prompt arrives after all, just as it left).

The server runs in this process on a real engine process; its prompt encoder is the local one plus a lease of
real receive blocks per prompt (`TransferBuffers`), freed by the prompt's release, as a remote encoder's are."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import pytest
import torch
from starlette.requests import Request

from vlserve.core.config import EngineArgs, ServerArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.frontend.prepared_prompt import PreparedPrompt, PromptSpentError
from vlserve.frontend.prompt_encoder import EncodedPrompt, LocalPromptEncoder
from vlserve.server.serving import ClientGoneError
from vlserve.server.serving_chat import OpenAIServingChat
from vlserve.server.serving_completion import OpenAIServingCompletion

MAX_MODEL_LEN = 512
KV_BLOCKS = 16  # x 16 tokens: less than max_model_len, so the engine itself refuses a long enough request


# ---- the owner itself ------------------------------------------------------------------------------------------
def _prompt() -> ProcessedPrompt:
    return ProcessedPrompt([5, 6, 7], [], torch.arange(3).expand(3, -1).contiguous(), 0)


def _counted() -> tuple[PreparedPrompt, list]:
    calls = []
    return PreparedPrompt(_prompt(), 0.0, release=lambda: calls.append(1)), calls


def test_closing_twice_releases_once():
    prepared, calls = _counted()
    prepared.close()
    prepared.close()
    assert calls == [1] and not prepared.is_open


def test_an_exception_inside_with_releases_and_propagates():
    prepared, calls = _counted()
    with pytest.raises(ValueError, match="boom"):
        with prepared:
            raise ValueError("boom")
    assert calls == [1]


def test_a_handed_over_prompt_is_the_new_owners_and_cannot_be_sent_again():
    prepared, calls = _counted()
    with prepared:
        release = prepared.hand_over()
    assert calls == []  # leaving the block did not free what the new owner holds
    with pytest.raises(PromptSpentError):
        prepared.hand_over()
    release()
    assert calls == [1]
    closed, _ = _counted()
    closed.close()
    with pytest.raises(PromptSpentError):  # its rows are gone: sending it would read freed blocks
        closed.hand_over()


def test_a_prompt_without_anything_to_free_still_has_one_owner():
    prepared = PreparedPrompt(_prompt(), 0.0)
    assert prepared.hand_over() is None
    with pytest.raises(PromptSpentError):
        prepared.hand_over()
    prepared.close()  # nothing to free, nothing raised


# ---- a server in this process -----------------------------------------------------------------------------------
def new_pool() -> TransferBuffers:
    return TransferBuffers.create(64, 16, 8, torch.float32, shared=False)


class LeasingEncoder:
    """The local prompt encoder, plus receive blocks leased for each prompt and freed by its release. `gate`: encode
    waits for it after leasing (a slow encoder); `finish_anyway`: cancelled while waiting, it returns its prompt
    all the same (its rows had arrived as the cancellation came)."""

    transfer_buffers = None  # the engine never reads these blocks: who frees them is what is under test

    def __init__(self, engine: AsyncLLM):
        self.local = LocalPromptEncoder(engine.input_processor, {}, engine.executor)
        self.pool = new_pool()
        self.released: Counter = Counter()
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()
        self.finish_anyway = False

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def not_ready_reason(self) -> str | None:
        return None

    async def encode(self, prompt: dict, mm_processor_kwargs, request_id: str, params=None,
                     lora=None, peer=None) -> EncodedPrompt:
        processed = (await self.local.encode(prompt, mm_processor_kwargs, request_id)).prompt
        pool = self.pool  # each test has its own: a leak fails that test only
        blocks = pool.allocate(processed.num_tokens)
        try:
            if self.gate is not None:
                self.waiting.set()
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:
                    if not self.finish_anyway:
                        raise
        except BaseException:
            pool.free(blocks)  # never handed out: the encoder's own to free
            raise

        def release() -> None:
            self.released[request_id] += 1
            pool.free(blocks)

        return EncodedPrompt(processed, release)


class LoopThread:
    """An event loop running in its own thread for the module: the engine's outputs are read between tests too."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Served:
    def __init__(self, loop: LoopThread, engine: AsyncLLM):
        self.loop, self.engine = loop, engine
        self.encoder: LeasingEncoder = engine.prompt_encoder
        server = ServerArgs(max_logprob_entries=1000)
        self.chat = OpenAIServingChat(engine, server, engine.model_name)
        self.completion = OpenAIServingCompletion(engine, server, engine.model_name)

    def post(self, path: str, body: dict, leave: asyncio.Event | None = None):
        """The handler's answer, or the exception it raised. `leave`: the client disconnects once it is set."""
        handler = self.chat if path == "chat" else self.completion

        async def call():
            try:
                return await handler.create(_request(body, leave))
            except Exception as e:  # noqa: BLE001 - the test looks at it
                return e

        return self.loop.run(call())

    def wait_all_released(self) -> None:
        """Every leased block back, and no prompt released twice."""
        pool = self.encoder.pool
        deadline = time.monotonic() + 30
        while pool.num_free != pool.num_blocks:
            assert time.monotonic() < deadline, f"receive blocks leaked: {pool.num_free} of {pool.num_blocks} free"
            time.sleep(0.05)
        pool.check_integrity()
        assert all(n == 1 for n in self.encoder.released.values()), self.encoder.released


def _request(body: dict, leave: asyncio.Event | None) -> Request:
    data, sent = json.dumps(body).encode(), []

    async def receive() -> dict:
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": data, "more_body": False}
        await (leave or asyncio.Event()).wait()  # the client stays until it leaves
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
    return Request(scope, receive)


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    loop = LoopThread()
    args = EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=MAX_MODEL_LEN,
                      num_kv_blocks=KV_BLOCKS)

    async def start() -> AsyncLLM:
        engine = AsyncLLM(args, "m", media_threads=1, log_requests=False, prompt_encoder=LeasingEncoder)
        await engine.start()
        return engine

    engine = loop.run(start())
    try:
        yield Served(loop, engine)
    finally:
        loop.run(engine.shutdown())
        loop.close()


@pytest.fixture
def fresh(served):
    enc = served.encoder
    enc.pool = new_pool()
    enc.released.clear()
    enc.gate, enc.finish_anyway = None, False
    enc.waiting = asyncio.Event()
    yield served
    served.wait_all_released()


def _chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hello there"}], "temperature": 0, **kw}


def test_a_finished_request_releases_its_prompt_once(fresh):
    resp = fresh.post("chat", _chat(max_tokens=3))
    assert not isinstance(resp, Exception), resp
    fresh.wait_all_released()
    assert len(fresh.encoder.released) == 1


@pytest.mark.parametrize("body, why", [
    (_chat(n=2, logprobs=True, top_logprobs=1), "max-logprob-entries"),  # n > 1: the budget needs max_tokens
    (_chat(max_tokens=MAX_MODEL_LEN), "maximum context length"),
])
def test_a_check_after_prepare_releases_the_prompt(fresh, body, why):
    err = fresh.post("chat", body)
    assert isinstance(err, InvalidInputError) and why in str(err), err
    assert sum(fresh.encoder.released.values()) == 1  # at once: it never reached the engine


def test_a_refused_second_prompt_releases_both(fresh):
    """Completions: the first prompt is already running when the second turns out too long for max_tokens."""
    err = fresh.post("completion", {"prompt": [[5, 6, 7], [5] * (MAX_MODEL_LEN - 4)], "max_tokens": 8})
    assert isinstance(err, InvalidInputError) and "maximum context length" in str(err), err
    fresh.wait_all_released()
    assert len(fresh.encoder.released) == 2


def test_a_prompt_the_engine_refuses_is_released(fresh):
    err = fresh.post("chat", _chat(max_tokens=KV_BLOCKS * 16))  # within the context, more than the whole KV pool
    assert isinstance(err, InvalidInputError) and "KV cache" in str(err), err


@pytest.mark.parametrize("finish_anyway", [False, True], ids=["cancelled", "arrives-as-the-client-leaves"])
def test_a_client_that_leaves_while_prepare_runs_leaks_nothing(fresh, finish_anyway):
    enc = fresh.encoder

    async def setup() -> asyncio.Event:
        enc.gate, enc.finish_anyway = asyncio.Event(), finish_anyway  # the gate stays shut: the client leaves first
        leave = asyncio.Event()

        async def leave_once_encoding():
            await enc.waiting.wait()
            leave.set()

        asyncio.ensure_future(leave_once_encoding())
        return leave

    leave = fresh.loop.run(setup())
    err = fresh.post("chat", _chat(max_tokens=3), leave)
    assert isinstance(err, ClientGoneError), err
    fresh.wait_all_released()
    assert sum(enc.released.values()) == (1 if finish_anyway else 0)  # else the encoder freed its own lease


def test_a_prompt_is_sent_once(fresh):
    """A second send would read blocks the first request's end frees: refused, and nothing freed twice."""
    engine = fresh.engine

    async def scenario():
        prepared = await engine.prepare({"prompt": "twice"}, request_id="once")
        handle = engine.generate(prepared, SamplingParams(max_tokens=2, temperature=0), "once")
        with pytest.raises(PromptSpentError):
            engine.generate(prepared, SamplingParams(max_tokens=2, temperature=0), "twice")
        return [out async for out in handle][-1]

    assert fresh.loop.run(scenario()).finished
    fresh.wait_all_released()
    assert fresh.encoder.released == Counter({"once": 1})
