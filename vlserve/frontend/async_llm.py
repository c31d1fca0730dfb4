"""The front-end's engine client: an engine-core process behind ZeroMQ, driven from asyncio.

Inputs are prepared here (tokenizing, decoding and preprocessing on a thread pool), sent as typed messages,
and the outputs coming back are detokenized here and handed to each request's stream. A watchdog notices a
dead engine process: pending requests then fail with 503 instead of hanging, and so do new ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio

from vlserve.core.config import EngineArgs
from vlserve.engine.config import resolve_config
from vlserve.engine.core_process import encode_args, run_engine_core
from vlserve.frontend.llm_engine import fan_out
from vlserve.frontend.output_processor import OutputProcessor
from vlserve.core.request import Request
from vlserve.core.wire import (EngineFailed, EngineMessage, EngineOutputs, EngineReady, EngineStats,
                                 FinishRequests, Framer, EngineInput, Shutdown, request_to_wire)
from vlserve.core.errors import EngineDeadError, InvalidInputError, ServiceUnavailableError, VlserveError
from vlserve.frontend.media.image import ImageProcessorConfig
from vlserve.frontend.metrics import ServerMetrics
from vlserve.core.outputs import RequestOutput
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.tokenizer import load_tokenizer
from vlserve.core.sampling_params import SamplingParams

logger = logging.getLogger("vlserve.engine")
WATCHDOG_INTERVAL_S = 0.5


@dataclass
class PreparedPrompt:
    """A prompt after tokenization, preprocessing and placeholder expansion; ready to be sent."""

    text: str | None
    request: Request
    arrival: float  # when the API call came in: TTFT and e2e include media fetching and preprocessing

    @property
    def num_tokens(self) -> int:
        return self.request.num_prompt_tokens


class RequestStream:
    """Latest output of one request. The consumer may lag: it always gets the newest cumulative state."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._latest: RequestOutput | None = None
        self._error: Exception | None = None
        self._event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            raise self._error
        return self._latest


class AsyncLLM:
    def __init__(self, args: EngineArgs, model_name: str, max_waiting_requests: int | None = None,
                 media_threads: int = 4, log_requests: bool = True, log_level: str = "INFO"):
        self.args = args
        self.cfg = resolve_config(args)  # reads config files only; the weights load in the engine process
        self.model_name = model_name
        self.tokenizer = load_tokenizer(self.cfg.model_path)
        self.input_processor = InputProcessor(self.cfg, self.tokenizer,
                                              ImageProcessorConfig.from_pretrained(self.cfg.model_path))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = ServerMetrics(model_name)
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        self.log_level = log_level
        self.executor = ThreadPoolExecutor(max_workers=media_threads, thread_name_prefix="vlserve-media")
        self.streams: dict[str, RequestStream] = {}
        self.dead_reason: str | None = None
        self.proc: multiprocessing.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._in_framer, self._out_framer = Framer(EngineInput), Framer(EngineMessage)
        self.remote_encoder = None  # a DisaggClient on a disaggregated language server
        self._prep_ids = itertools.count()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="vlserve-ipc-")
        in_addr, out_addr = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._sync_ctx, self._async_ctx = zmq.Context(), zmq.asyncio.Context()
        # Sends are synchronous and never block (no high-water mark), so an abort can be sent from a
        # `finally` of a cancelled task; receives are awaited.
        self.in_sock = self._sync_ctx.socket(zmq.PUSH)
        self.in_sock.setsockopt(zmq.SNDHWM, 0)
        self.in_sock.bind(in_addr)
        self.out_sock = self._async_ctx.socket(zmq.PULL)
        self.out_sock.bind(out_addr)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(encode_args(self.args), in_addr, out_addr, self.log_level),
            name="vlserve-engine-core", daemon=True)
        self.proc.start()
        ready = await self._wait_ready()
        logger.info("engine core ready (pid %d): %d KV blocks, max_model_len %d", self.proc.pid,
                    ready.num_kv_blocks, ready.max_model_len)
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]

    async def _wait_ready(self) -> EngineReady:
        while True:
            if await self.out_sock.poll(200):
                msg = self._out_framer.decode(await self.out_sock.recv_multipart())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    await self.shutdown()
                    raise VlserveError(f"engine core failed to start: {msg.message}")
            elif not self.proc.is_alive():
                code = self.proc.exitcode
                await self.shutdown()
                raise VlserveError(f"engine core process exited during start-up (exit code {code})")

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.proc is not None and self.proc.is_alive():
            self.in_sock.send_multipart(self._in_framer.encode(Shutdown()))
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)
            if self.proc.is_alive():
                self.proc.terminate()
        self._fail_all("the server is shutting down")
        self.in_sock.close(linger=0)
        self.out_sock.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def stats(self) -> EngineStats:
        return self.metrics.stats

    # ---- requests ----------------------------------------------------------------------------------------
    async def prepare(self, prompt: dict | str, mm_processor_kwargs: dict | None = None,
                      arrival: float | None = None) -> PreparedPrompt:
        """Tokenize + decode + preprocess on the thread pool (the event loop keeps serving meanwhile)."""
        self.check_accepting()
        arrival = arrival if arrival is not None else time.monotonic()
        if self.remote_encoder is not None and isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # Disaggregated: an encoder service fetches, preprocesses, tokenizes and encodes; rows come back.
            req = await self.remote_encoder.encode(f"prep-{next(self._prep_ids)}", prompt["prompt"],
                                                   prompt["multi_modal_data"], prompt.get("multi_modal_uuids") or {},
                                                   mm_processor_kwargs or {})
            return PreparedPrompt(prompt["prompt"], req, arrival)
        loop = asyncio.get_running_loop()
        text, req = await loop.run_in_executor(self.executor, self.input_processor.process, "template", prompt,
                                               SamplingParams(), mm_processor_kwargs)
        return PreparedPrompt(text, req, arrival)

    def check_accepting(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        if self.max_waiting_requests is not None:
            waiting = max(self.output_processor.num_unfinished_children - self.cfg.max_num_seqs,
                          self.stats.num_requests_waiting)
            if waiting >= self.max_waiting_requests:
                raise ServiceUnavailableError(
                    f"the server is overloaded: {waiting} requests are waiting (max_waiting_requests="
                    f"{self.max_waiting_requests}); retry later")

    async def generate(self, prompt: PreparedPrompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative output as it grows; the last one has `finished` set.

        Leaving the iteration early (client gone, task cancelled) aborts the request in the engine.
        """
        self.check_accepting()
        if request_id in self.streams:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        reqs, children = fan_out(prompt.request, params, request_id)
        stream = RequestStream(prompt.arrival)
        self.streams[request_id] = stream
        self.output_processor.add(request_id, prompt.text, prompt.request.prompt_token_ids, children)
        finished = False
        try:
            for req in reqs:
                req.arrival_time = stream.arrival
                msg, tensors = request_to_wire(req)
                self.in_sock.send_multipart(self._in_framer.encode(msg, tensors), copy=False)
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        child_ids = self.output_processor.abort(request_id)
        if child_ids and self.dead_reason is None:
            self.in_sock.send_multipart(self._in_framer.encode(FinishRequests(child_ids, "abort")))

    # ---- engine outputs ------------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            frames = await self.out_sock.recv_multipart()
            try:
                msg = self._out_framer.decode(frames)
            except Exception as e:  # noqa: BLE001 - a bad message must not kill the loop silently
                logger.error("undecodable message from the engine: %s", e)
                continue
            if isinstance(msg, EngineFailed):
                self._fail_all(msg.message)
                return
            if isinstance(msg, EngineOutputs):
                self._handle(msg)

    def _handle(self, msg: EngineOutputs) -> None:
        self.metrics.on_engine_stats(msg.stats)
        for rej in msg.rejected:
            parent = self.output_processor.parent_of(rej.request_id)
            if parent is None:
                continue
            stream = self.streams.get(parent)
            self.abort(parent)  # siblings of an n>1 request go too
            if stream is not None:
                err = InvalidInputError(rej.message)
                err.http_status = rej.status
                stream.fail(err)
        outputs, stop_now = self.output_processor.process(msg.outputs)
        if stop_now:
            self.in_sock.send_multipart(self._in_framer.encode(FinishRequests(stop_now, "stop")))
        now = time.monotonic()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(out, stream, now)
            stream.put(out)
            if out.finished:
                del self.streams[out.request_id]

    def _observe(self, out: RequestOutput, stream: RequestStream, now: float) -> None:
        m = self.metrics
        if stream.first_token is None:
            stream.first_token = now
            m.ttft.observe(now - stream.arrival)
        else:
            m.itl.observe(now - stream.last_token)
        stream.last_token = now
        if not out.finished:
            return
        m.e2e.observe(now - stream.arrival)
        if self.log_requests:
            gen = sum(len(c.token_ids) for c in out.outputs)
            reasons = ",".join(str(c.finish_reason) for c in out.outputs)
            logger.info("request %s: prompt %d tokens, generated %d, ttft %.0f ms, e2e %.2f s, finish %s",
                        out.request_id, len(out.prompt_token_ids), gen, (stream.first_token - stream.arrival) * 1e3,
                        now - stream.arrival, reasons)

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.proc.is_alive():
                self._fail_all(f"engine core process died (exit code {self.proc.exitcode})")

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if reason != "the server is shutting down":
                logger.error("engine failed: %s", reason)
        for rid, stream in list(self.streams.items()):
            stream.fail(EngineDeadError(f"the engine stopped: {reason}"))
            self.output_processor.abort(rid)
        self.streams.clear()
