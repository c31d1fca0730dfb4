"""The front-end's engine client, driven from asyncio: prompts in through a prompt encoder, requests out to the
engine-core process, outputs back, detokenized, to each request's stream.

Nothing that grows with a request's size runs on the event loop: media decoding, tokenization and template
rendering run on a thread pool, and the n samples of a request cross to the engine as one message (the engine
fans them out). When the engine fails or stops answering, waiting requests get a 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from vlserve.core.config import EngineArgs
from vlserve.core.cpu_budget import media_pool_size, plan_threads
from vlserve.core.errors import EngineDeadError, InvalidInputError, ServiceUnavailableError, VlserveError
from vlserve.core.lora import AdapterRef
from vlserve.core.messages import EngineCoreOutput, Handoff
from vlserve.core.outputs import RequestOutput
from vlserve.core.processes import finish
from vlserve.core.prompt import MEDIA_KINDS
from vlserve.core.sampling_params import SamplingParams, fan_out
from vlserve.core.structured_outputs import GrammarLimits
from vlserve.core.wire import EngineOutputs, FinishRequests, KVSend, KVWritten, prompt_to_wire
from vlserve.engine.core_client import EngineCoreClient
from vlserve.engine.transfer_buffers import BufferLayout
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.grammar_compiler import GrammarCompiler
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.kv_reservations import KVReservations
from vlserve.frontend.kv_writes import KVWrites
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.frontend.metrics import ServerMetrics
from vlserve.frontend.output_processor import OutputProcessor
from vlserve.frontend.prepared_prompt import PreparedPrompt
from vlserve.frontend.prompt_encoder import LocalPromptEncoder, PromptEncoder
from vlserve.frontend.served_adapters import ServedAdapters
from vlserve.lora.catalog import LoRACatalog, with_adapter
from vlserve.model.facts import resolve_model_facts

logger = logging.getLogger("vlserve.engine")


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


def default_prompt_encoder(engine: "AsyncLLM") -> PromptEncoder:
    """Local processing under the default (safe) media policy."""
    fetchers = {kind: MediaFetcher(MediaPolicy()) for kind in MEDIA_KINDS}
    return LocalPromptEncoder(engine.input_processor, fetchers, engine.executor)


@dataclass
class _Prefill:
    """A prefill waiting for its first token (an output) and its KV (handed back in the same message)."""

    future: asyncio.Future
    first: EngineCoreOutput | None = None

    def fail(self, message: str, status: int) -> None:
        if not self.future.done():
            err = InvalidInputError(message) if status < 500 else ServiceUnavailableError(message)
            if status < 500:
                err.http_status = status
            self.future.set_exception(err)


def _kept_but_not_taken(future: asyncio.Future) -> bool:
    """A prefill's result that its caller, cancelled, never took (its KV the engine keeps)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return False
    return asyncio.current_task().cancelling() > 0


class RequestHandle:
    """Async iterator over one request's outputs; `close()` aborts the request unless it finished."""

    def __init__(self, engine: "AsyncLLM", request_id: str, stream: RequestStream):
        self.engine, self.request_id, self.stream = engine, request_id, stream
        self.finished = False

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.stream.get()
        except BaseException:
            self.close()
            raise
        self.finished = out.finished
        return out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, args: EngineArgs, model_name: str, max_waiting_requests: int | None = None,
                 media_threads: int | None = None, log_requests: bool = True, log_level: str = "INFO",
                 media_bounds: dict | None = None, heartbeat_timeout: float = 10.0,
                 prompt_encoder: Callable[["AsyncLLM"], PromptEncoder] | None = None, kv_role: str | None = None,
                 kv_writer: Callable | None = None, kv_receiver: Callable | None = None):
        """`kv_role`: the role (prefill, decode) whose KV connector the engine process plugs in, if any.
        `kv_writer`: a prefill engine writes its KV rows into receivers itself with what this makes (a picklable
        maker of a kv_connector.RowWriter, run in the engine process); `kv_writes` asks for each chunk.
        `kv_receiver`: a decode engine registers where prompts' KV lands (its KV cache in a shared file, whose
        blocks `kv_reservations` reserves per transfer; else the receive buffers) for peers' writes with what this
        makes (picklable, run in the engine process).
        `media_bounds`: `ServerArgs.media_bounds()` (default: every option's default). `media_threads`: the media
        pool's size (default: from the CPU budget, see core/cpu_budget.py)."""
        # Config files only (the weights load in the engine process), resolved here once: the engine gets them.
        self.facts = resolve_model_facts(args, media=media_bounds)
        self.cfg = FrontendConfig.of(self.facts, args)
        self.args = args
        self.model_name = model_name
        self.input_processor = InputProcessor.for_model(self.cfg, **(media_bounds or {}))
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = ServerMetrics(model_name, self.cfg.model.modalities)
        self.loras: LoRACatalog | None = None  # the adapters a request may name as its model (--enable-lora)
        if args.enable_lora:
            self.loras = LoRACatalog(self.cfg.model, self.cfg.model_path, args.max_lora_rank,
                                     args.lora_host_bytes(), self.cfg.dtype)  # the engine's bound
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        media_pool = media_pool_size(media_threads, plan_threads(args.cpu_threads).total)
        self.executor = ThreadPoolExecutor(max_workers=media_pool, thread_name_prefix="vlserve-media")
        self.adapters = ServedAdapters(self.loras, model_name, self.executor)  # runtime loads read on the pool
        if self.loras is not None:
            self.adapters.start_with(args.lora_modules)
        # Constraints compile on their own bounded pool: a slow grammar never holds up media work.
        self.grammar_compiler = GrammarCompiler(GrammarLimits.from_args(args))
        self.metrics.watch("structured_outputs_compiles_in_flight", "Structured-outputs constraints being compiled "
                           "or queued for a compile thread (503 past --structured-outputs-threads + "
                           "--structured-outputs-max-queued).", lambda: self.grammar_compiler.in_flight)
        self.dead = asyncio.Event()  # set once the engine process is gone for good
        self.stopping: str | None = None  # why new requests are refused: the server is stopping (stop_requests)
        self.streams: dict[str, RequestStream] = {}
        # request id -> frees its prompt (taken over from its PreparedPrompt) once the engine is done with it
        self.releases: dict[str, Callable[[], None]] = {}
        # Prompts freed while their request still runs in the engine (`EngineOutputs.inputs_released`): the id
        # stays taken until the engine's final `released`, which then frees nothing.
        self._freed_early: set[str] = set()
        self.prefills: dict[str, _Prefill] = {}  # prefill instance: requests whose KV the engine sends back
        self.prompt_encoder: PromptEncoder = (prompt_encoder or default_prompt_encoder)(self)
        buffers = self.prompt_encoder.transfer_buffers  # where a remote encoder's rows land, if anywhere
        self.core = EngineCoreClient(args, self.facts, log_level, heartbeat_timeout, on_outputs=self._handle,
                                     on_failure=self._fail_all,
                                     transfer_layout=None if buffers is None else buffers.layout, kv_role=kv_role,
                                     media_pool=media_pool, kv_writer=kv_writer, kv_receiver=kv_receiver)
        self.kv_writes = KVWrites(self.core.send, lambda: self.core.dead_reason is None)
        self.kv_reservations = KVReservations(self.core.send, lambda: self.core.dead_reason is None)
        self.kv_layout: BufferLayout | None = None  # a decode engine's KV cache in a shared file (from its start)
        self.kv_target: bytes | None = None  # how peers write a decode engine's prompts' KV (it registered it)
        self.num_kv_blocks = 0  # the engine's KV pool (from its start)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            ready = await self.core.start()
        except BaseException:
            await finish(self.prompt_encoder.stop())
            raise
        logger.info("engine core ready (pid %d): %d KV blocks, max_model_len %d", self.core.proc.pid,
                    ready.num_kv_blocks, ready.max_model_len)
        if ready.kv_layout is not None:
            self.kv_layout = msgspec.msgpack.decode(ready.kv_layout, type=BufferLayout)
        self.kv_target = ready.kv_target
        self.num_kv_blocks = ready.num_kv_blocks
        try:
            await self.prompt_encoder.start()
        except BaseException:
            await finish(self.prompt_encoder.stop())
            await finish(self.core.shutdown())
            raise

    async def shutdown(self) -> None:
        await self.prompt_encoder.stop()
        await self.core.shutdown()
        self._fail_all("the server is shutting down", log=False)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.grammar_compiler.shutdown()

    def stop_requests(self, reason: str) -> None:
        """The server is stopping: every request in flight ends now with a 503 saying `reason` (a stream's last
        event, or a waiting answer) and leaves the engine; new ones are refused with it."""
        self.stopping = reason
        for rid, stream in list(self.streams.items()):
            stream.fail(ServiceUnavailableError(reason))
            self.abort(rid)

    @property
    def is_healthy(self) -> bool:
        return self.core.available

    @property
    def unhealthy_reason(self) -> str | None:
        return self.core.dead_reason or self.core.unresponsive_reason

    @property
    def not_ready_reason(self) -> str | None:
        """Why this server cannot serve what it accepts right now (None: ready). Liveness is `is_healthy`."""
        if not self.is_healthy:
            return f"the engine is not available: {self.unhealthy_reason}"
        return self.prompt_encoder.not_ready_reason()

    @property
    def stats(self):
        return self.metrics.stats

    # ---- requests ----------------------------------------------------------------------------------------
    async def prepare(self, prompt: dict, mm_processor_kwargs: dict | None = None, arrival: float | None = None,
                      request_id: str = "", params: SamplingParams | None = None,
                      adapter: AdapterRef | None = None, peer: str | None = None) -> PreparedPrompt:
        """Media, tokenization and placeholder expansion through the prompt encoder (off the event loop).
        `params`: the request's sampling parameters as far as known (all but a defaulted max_tokens); a prompt
        encoder that prefills elsewhere (decode instance) samples the first token with them. `adapter`: the LoRA
        adapter `generate` will be given (an encoder elsewhere runs the towers with it). `peer`: the instance id of
        the encoder to ask first (one that encoded the items already: Dynamo's encode step), if it is paired.

        The caller owns the result: it sends it (`generate` / `prefill`) or closes it (`with prepared:`)."""
        self.check_accepting()
        arrival = arrival if arrival is not None else time.monotonic()
        encoded = await self.prompt_encoder.encode(prompt, mm_processor_kwargs, request_id, params, adapter, peer)
        return PreparedPrompt.from_encoded(encoded, arrival)

    def check_accepting(self) -> None:
        if self.stopping is not None:
            raise ServiceUnavailableError(self.stopping)
        if not self.core.available:
            raise EngineDeadError(f"the engine is not available: {self.unhealthy_reason}")
        if self.max_waiting_requests is not None:
            waiting = max(self.output_processor.num_unfinished_children - self.cfg.max_num_seqs,
                          self.stats.num_requests_waiting)
            if waiting >= self.max_waiting_requests:
                raise ServiceUnavailableError(
                    f"the server is overloaded: {waiting} requests are waiting (max_waiting_requests="
                    f"{self.max_waiting_requests}); retry later")

    def generate(self, prepared: PreparedPrompt, params: SamplingParams, request_id: str,
                 adapter: AdapterRef | None = None) -> "RequestHandle":
        """Takes the prompt over and sends the request now (or raises, with the prompt freed); iterate the handle
        for its cumulative outputs, the last one `finished`. Closing the handle early (client gone) aborts it in
        the engine. `adapter`: the LoRA adapter it runs with (None: the base model)."""
        release = prepared.hand_over()
        try:
            self.check_accepting()
            self._check_id_free(request_id)
            prompt = with_adapter(prepared.prompt, adapter)
            msg, tensors = prompt_to_wire(request_id, prompt, params, prepared.arrival, handoff=prepared.handoff)
            children = fan_out(params, request_id)
        except BaseException:
            if release is not None:
                release()  # never reached the engine
            raise
        self.metrics.count_items(prompt.mm_items)
        stream = RequestStream(prepared.arrival)
        self.streams[request_id] = stream
        self.output_processor.add(request_id, prompt.text, prompt.prompt_token_ids, children)
        self._send(msg, tensors, request_id, release)
        return RequestHandle(self, request_id, stream)

    async def prefill(self, prepared: PreparedPrompt, params: SamplingParams, request_id: str,
                      adapter: AdapterRef | None = None, kv_send: KVSend | None = None) -> Handoff:
        """Prefill instance: takes the prompt over, computes it (with LoRA adapter `adapter`, if any) and samples
        its first token as the whole request would (`params.for_prefill()`); returns that output with the random
        state. The engine keeps the prompt's KV to write it itself (`kv_writes`; released with
        `kv_writes.release`); `kv_send` (its id from `kv_writes.expect`): where the first rows go as they are
        computed. Cancelling aborts it in the engine."""
        release = prepared.hand_over()
        try:
            self.check_accepting()
            self._check_id_free(request_id)
            prompt = with_adapter(prepared.prompt, adapter)
            msg, tensors = prompt_to_wire(request_id, prompt, params.for_prefill(), prepared.arrival)
            msg.kv_send = kv_send
        except BaseException as e:
            if release is not None:
                release()
            if kv_send is not None:  # never reached the engine: nothing was written
                self.kv_writes.settle([KVWritten(request_id, kv_send.write_id, error=f"not sent: {e}")])
            raise
        self.metrics.count_items(prompt.mm_items)
        waiting = _Prefill(asyncio.get_running_loop().create_future())
        self.prefills[request_id] = waiting
        self._send(msg, tensors, request_id, release)
        try:
            return await waiting.future
        finally:
            if self.prefills.pop(request_id, None) is not None and self.core.dead_reason is None:
                self.core.send(FinishRequests([request_id], "abort"))  # cancelled: nobody takes its KV
            elif _kept_but_not_taken(waiting.future):  # cancelled as it settled: the engine drops what it kept
                self.kv_writes.release(request_id)

    # ---- LoRA adapters -------------------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str, replace: bool = False, lora_dirs: tuple[str, ...] = ()
                        ) -> AdapterRef:
        """Serves the adapter at `path` as `name` (served_adapters.py: ServedAdapters.load)."""
        return await self.adapters.load(name, path, replace, lora_dirs)

    async def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name` to new requests (served_adapters.py: ServedAdapters.unload)."""
        await self.adapters.unload(name)

    def _check_id_free(self, request_id: str) -> None:
        # An id whose prompt is not yet released is still the engine's: its report must free that prompt only.
        if request_id in self.streams or request_id in self.prefills or request_id in self.releases \
                or request_id in self._freed_early:
            raise InvalidInputError(f"request id {request_id!r} is already in use")

    def _send(self, msg, tensors: list, request_id: str, release: Callable[[], None] | None) -> None:
        """From here the engine's report (released, refused, or its death) frees the prompt."""
        if release is not None:
            self.releases[request_id] = release
        self.core.send(msg, tensors)

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        child_ids = self.output_processor.abort(request_id)
        if child_ids and self.core.dead_reason is None:  # a frozen engine reads it when it wakes up
            self.core.send(FinishRequests(child_ids, "abort"))

    # ---- engine outputs ------------------------------------------------------------------------------------
    def _handle(self, msg: EngineOutputs) -> None:
        """One engine message, request by request: a request whose part cannot be handled (a bug, e.g. in its
        detokenizer) fails alone with a 500 and leaves the engine; the others go on. What still escapes is the
        output loop's to judge (it marks the engine dead: see EngineCoreClient._output_loop)."""
        try:
            self.metrics.on_engine_stats(msg.stats)
        except Exception:  # noqa: BLE001 - the metrics only: no request depends on them
            logger.exception("the engine's stats could not be recorded")
        if self.prefills:
            msg.outputs = self._take_prefills(msg)
        if msg.written:
            self.kv_writes.settle(msg.written)
        if msg.reserved:
            self.kv_reservations.settle(msg.reserved)
        for rej in msg.rejected:
            try:
                self._reject(rej.request_id, rej.message, rej.status)
            except Exception as e:  # noqa: BLE001
                self._fail_request(rej.request_id, e)
        changed: dict[str, RequestOutput] = {}  # each request's output once, in order (n samples share one)
        stop_now: list[str] = []
        for co in msg.outputs:
            parent = self.output_processor.parent_of(co.request_id)
            try:
                outputs, stops = self.output_processor.process([co])
            except Exception as e:  # noqa: BLE001
                self._fail_request(parent or co.request_id, e)
                continue
            stop_now += stops
            for out in outputs:
                changed[out.request_id] = out
        if stop_now:
            self.core.send(FinishRequests(stop_now, "stop"))
        now = time.monotonic()
        for out in changed.values():
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            try:
                self._observe(out, stream, now)
            except Exception:  # noqa: BLE001 - the metrics only: the request still gets its output
                logger.exception("request %s: its metrics could not be recorded", out.request_id)
            stream.put(out)
            if out.finished:
                del self.streams[out.request_id]
        for request_id in msg.inputs_released:  # first: a request's final release may be in this message too
            self._freed_early.add(request_id)
            self._release_logged(request_id)
        for request_id in msg.released:
            if request_id in self._freed_early:
                self._freed_early.discard(request_id)  # freed already; the id is free again
            else:
                self._release_logged(request_id)

    def _release_logged(self, request_id: str) -> None:
        try:
            self._release(request_id)
        except Exception:  # noqa: BLE001 - the engine is done with it: the request itself is not affected
            logger.exception("request %s: its prompt's buffers could not be released", request_id)

    def _reject(self, request_id: str, message: str, status: int) -> None:
        """Refused by the engine (at admission, or after: its KV could not be written or exported, ...)."""
        waiting = self.prefills.pop(request_id, None)
        if waiting is not None:
            waiting.fail(message, status)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            err = InvalidInputError(message)
            err.http_status = status
            stream.fail(err)
        self.output_processor.abort(request_id)
        self._release(request_id)  # the engine does not use the prompt any more

    def _fail_request(self, request_id: str, error: Exception) -> None:
        """Handling this request's output failed: it fails with a 500 (the server's fault) and leaves the engine."""
        logger.error("request %s: its output could not be handled", request_id, exc_info=error)
        failure = VlserveError(f"internal error handling this request's output: {type(error).__name__}")
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.fail(failure)
        waiting = self.prefills.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_exception(failure)
        self.abort(request_id)

    def _take_prefills(self, msg: EngineOutputs) -> list[EngineCoreOutput]:
        """Settles the prefills whose first token and KV arrived; returns the other requests' outputs."""
        rest = []
        for out in msg.outputs:
            waiting = self.prefills.get(out.request_id)
            if waiting is None:
                rest.append(out)
            else:
                waiting.first = out
        for handed in msg.handed:
            waiting = self.prefills.pop(handed.request_id, None)
            if waiting is not None and waiting.first is not None and not waiting.future.done():
                waiting.future.set_result(Handoff(waiting.first, handed.generator_state))
        for rid, waiting in list(self.prefills.items()):
            if waiting.first is not None and waiting.first.finish_reason == "abort":
                del self.prefills[rid]  # e.g. its grammar refused the token: nothing to hand over
                waiting.fail("the prefill was aborted by the engine", 500)
        return rest

    def _release(self, request_id: str) -> None:
        release = self.releases.pop(request_id, None)
        if release is not None:
            release()

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

    def _fail_all(self, reason: str, log: bool = True) -> None:
        """Every request in flight fails with 503 (the engine died or stopped answering) and leaves the engine."""
        if self.core.dead_reason is not None:
            self.dead.set()
        for rid, stream in list(self.streams.items()):
            stream.fail(EngineDeadError(f"the engine stopped: {reason}"))
            self.abort(rid)
        self.streams.clear()
        for waiting in self.prefills.values():
            if not waiting.future.done():
                waiting.future.set_exception(EngineDeadError(f"the engine stopped: {reason}"))
        self.kv_writes.fail_all(reason)
        self.kv_reservations.fail_all(reason)
        if self.core.dead_reason is not None or not log:
            for rid in list(self.releases):  # a dead engine reads nothing any more
                self._release(rid)
            self._freed_early.clear()
