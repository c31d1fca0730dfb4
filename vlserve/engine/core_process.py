"""The engine-core process: receives requests over ZeroMQ, steps the engine, sends outputs back.

The loop never waits on I/O it does not own: media decoding and tokenization happened in the front-end, so a
step is scheduling + model forward only. While there is work it drains the input socket without blocking
between steps; when idle it blocks on the socket (with a timeout to notice an orphaned parent).

A separate thread answers the front-end's heartbeats with the step count, so a frozen process (SIGSTOP, a hang
holding the GIL) is noticed within seconds, and a main loop stuck inside one step is noticed too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import msgspec
import zmq

from vlserve.core.config import PREFILL, decode_args, kv_cache_shared
from vlserve.core.errors import ConfigurationError, InvalidInputError, VlserveError
from vlserve.core.processes import ENGINE_PROCESS_NAME, die_with_parent, freeze_startup_heap, log_format, name_process
from vlserve.core.wire import (
    AddRequest,
    CancelReserveKV,
    EngineFailed,
    EngineInput,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    EngineStats,
    FinishRequests,
    Framer,
    HandedKV,
    Heartbeat,
    KVReserved,
    KVWritten,
    ReleaseKV,
    RequestRejected,
    ReserveKV,
    Shutdown,
    prompt_from_wire,
    request_id_of,
)
from vlserve.engine.config import fit_kv_in_shared_memory, resolve_config, shared_kv_blocks_room
from vlserve.engine.core import EngineCore
from vlserve.engine.cpu_threads import apply_cpu_threads
from vlserve.engine.kv_connector import RowWriter, make_connector
from vlserve.engine.lora_loader import AdapterLoader
from vlserve.engine.private_sockets import connect_private
from vlserve.engine.transfer_buffers import BufferLayout, TransferBuffers
from vlserve.model.facts import decode_facts
from vlserve.model.hardware import log_once

logger = logging.getLogger("vlserve.engine")
IDLE_POLL_MS = 1000
WRITE_POLL_MS = 1  # while KV rows are being written for the front end: their end is reported within this
LOAD_POLL_MS = 5  # while LoRA adapters are being read for waiting requests: they are admitted within this


class Progress:
    """What the heartbeat thread reports: steps done so far, and whether there is work."""

    def __init__(self):
        self.steps = 0
        self.busy = False


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, progress: Progress,
                 parent_pid: int):
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.progress = progress
        self.in_framer = Framer(EngineInput)
        self.out_framer = Framer(EngineMessage)
        self.rejected: list[RequestRejected] = []
        self.parent_pid = parent_pid
        self.running = True
        self.connector = core.connector  # its own messages (a prefill engine's row writes) pass it by
        self.held_reported = (0, 0)  # (requests whose KV rows are kept, KV blocks reserved), as last reported
        self.loading_reported = 0  # requests waiting for their LoRA adapter, as last reported (they count as waiting)
        self.refused_writes: list[KVWritten] = []  # sends of requests not admitted (nothing was written)
        self.reserved: list[KVReserved] = []  # answers to the front end's KV block reservations
        # requests whose LoRA adapter is not in host memory wait for its read here, off this loop
        self.loader = AdapterLoader(core.lora) if core.lora is not None else None

    def run(self) -> None:
        while self.running:
            self.core.check_alive()
            busy = self.core.has_unfinished
            self.progress.busy = busy
            writing = self.connector is not None and self.connector.writes_in_flight
            loading = self.loader is not None and self.loader.busy
            if self.inputs.poll(0 if busy else WRITE_POLL_MS if writing else LOAD_POLL_MS if loading
                                else IDLE_POLL_MS):
                self._drain_inputs()
            elif not busy and os.getppid() != self.parent_pid:
                logger.warning("front-end process is gone; engine core exits")
                return
            if loading:
                self.loader.admit_ready()
            outputs = self.core.step() if self.core.has_unfinished else []
            if not busy:
                self.core.publish_kv_events()  # keepalive of an idle engine (a busy one publishes each step)
                if self.connector is not None:
                    self.connector.start_step()  # its expiries, which a busy engine runs each step
            self.rejected += [RequestRejected(rid, why, status) for rid, why, status in self.core.take_failed()]
            self.progress.steps += 1
            handed, written, held = [], self.refused_writes, (0, 0)
            self.refused_writes = []
            if self.connector is not None:
                handed, written = self.connector.take_exported(), written + self.connector.take_written()
                held = (self.connector.num_kept, self.connector.num_reserved_blocks)
                self.reserved += self.connector.answer_waiting()  # the blocks this step or a release freed
            loading_now = self.loader.num_held if self.loader is not None else 0
            if outputs or self.rejected or busy or self.core.has_released or written or self.reserved \
                    or held != self.held_reported or loading_now != self.loading_reported:
                self.held_reported = held  # the stats say it (a release alone would otherwise go unreported)
                self._send(outputs, handed, written)

    def _drain_inputs(self) -> None:
        while True:
            try:
                frames = self.inputs.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [f.buffer for f in frames]
            try:
                msg = self.in_framer.decode(frames)
            except msgspec.DecodeError as e:
                self._undecodable(frames, e)
                continue
            self._handle(msg, frames)

    def _undecodable(self, frames, error: Exception) -> None:
        """A message we cannot decode: if it names a request, that request gets an error instead of silence."""
        request_id = request_id_of(frames[0])
        if request_id is None:
            logger.error("dropped an undecodable message: %s", error)
            return
        logger.warning("request %r: undecodable, refused: %s", request_id[:128], error)
        self.rejected.append(RequestRejected(request_id, f"the request could not be decoded: {error}", 400))

    def _handle(self, msg, frames) -> None:
        if isinstance(msg, AddRequest):
            if self.loader is not None and self.loader.must_wait(msg.lora):  # its adapter is read first
                self.loader.hold(msg.request_id, msg.lora, msg.params,
                                 lambda refusal, msg=msg, frames=frames: self._add(msg, frames, refusal))
            else:
                self._add(msg, frames)
        elif isinstance(msg, FinishRequests):
            if self.loader is not None:  # still waiting for its adapter: it never starts; the front end frees it
                for admit in self.loader.drop(msg.request_ids):  # refused as any (a KV send answered too)
                    admit(("finished before its LoRA adapter was read", 400))
            if msg.reason == "stop":
                self.core.stop_requests(msg.request_ids)
            else:
                self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, (ReserveKV, ReleaseKV, CancelReserveKV)):
            self._reserve_or_release(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _add(self, msg: AddRequest, frames, refusal: tuple[str, int] | None = None) -> None:
        if refusal is not None:  # its adapter could not be had: (message, status), made once for all who waited
            self._refuse(msg, *refusal)
            return
        try:
            prompt = prompt_from_wire(msg, frames)
            self.core.add_request(msg.request_id, prompt, msg.params, msg.arrival_time, kv_transfer=msg.handoff,
                                  kv_send=msg.kv_send)
        except (VlserveError, ValueError) as e:
            self._refuse(msg, str(e), getattr(e, "http_status", 400))
        except Exception as e:  # noqa: BLE001 - a bug in our checks: that request fails, the engine goes on
            logger.exception("request %r could not be admitted", msg.request_id[:128])
            self._refuse(msg, f"internal error: {type(e).__name__}", 500)

    def _refuse(self, msg: AddRequest, why: str, status: int) -> None:
        """A request not admitted; its KV send, if any, is over too (nothing was written)."""
        self.rejected.append(RequestRejected(msg.request_id, why, status))
        if msg.kv_send is not None:
            self.refused_writes.append(KVWritten(msg.request_id, msg.kv_send.write_id, error=f"not admitted: {why}"))

    def _reserve_or_release(self, msg: ReserveKV | ReleaseKV | CancelReserveKV) -> None:
        """A decode front end's KV blocks for peers' writes; a bug here fails that reservation, not the engine. A
        reservation the pool is short for waits in the connector (answered after a step or release frees them)."""
        try:
            if self.connector is None:
                raise VlserveError("this engine has no KV connector")
            if isinstance(msg, ReleaseKV):
                return self.connector.release(msg)
            answer = self.connector.ask(msg) if isinstance(msg, ReserveKV) else self.connector.cancel(msg)
            if answer is not None:
                self.reserved.append(answer)
        except Exception as e:  # noqa: BLE001
            logger.exception("KV blocks of %r could not be %s", getattr(msg, "holder", "")[:128],
                             "released" if isinstance(msg, ReleaseKV) else "reserved")
            if not isinstance(msg, ReleaseKV):
                self.reserved.append(KVReserved(msg.reserve_id, error=f"{type(e).__name__}: {e}"))

    def _send(self, outputs, handed=(), written=()) -> None:
        metrics = self.core.get_metrics()
        self.loading_reported = self.loader.num_held if self.loader is not None else 0
        metrics["num_requests_waiting"] += self.loading_reported  # held for their adapter: waiting too
        stats = EngineStats(**{k: v for k, v in metrics.items() if k in EngineStats.__struct_fields__},
                            encoder_seconds=self.core.take_encoder_seconds(),
                            kv_rows_kept=self.held_reported[0], kv_blocks_reserved=self.held_reported[1])
        kv = [HandedKV(e.request_id, e.generator_state) for e in handed]
        msg = EngineOutputs(outputs, self.rejected, stats, released=self.core.take_released(),
                            inputs_released=self.core.take_inputs_released(), handed=kv, written=list(written),
                            reserved=self.reserved)
        self.outputs.send_multipart(self.out_framer.encode(msg, []), copy=False)
        self.rejected, self.reserved = [], []


def _answer_heartbeats(ctx: zmq.Context, address: str, token: str, progress: Progress,
                       stop: threading.Event) -> None:
    framer = Framer(Heartbeat)
    sock = None
    try:  # the context may be terminated at any point, even before the socket exists (a start failing at once)
        sock = ctx.socket(zmq.PAIR)
        connect_private(sock, address, token)
        while not stop.is_set():
            if sock.poll(200):
                ping = framer.decode(sock.recv_multipart())
                sock.send_multipart(framer.encode(Heartbeat(ping.nonce, progress.steps, progress.busy)))
    except zmq.ZMQError:
        pass  # context terminated: the process is exiting
    finally:
        if sock is not None:
            sock.close(linger=0)


def run_engine_core(args_json: bytes, facts_json: bytes, addresses: dict[str, str], log_level: str = "INFO",
                    transfer_layout: bytes | None = None, parent_pid: int | None = None,
                    kv_role: str | None = None, media_pool: int | None = None,
                    kv_writer: Callable[[], RowWriter] | None = None,
                    kv_receiver: Callable | None = None, token: str = "") -> None:
    """Entry point of the spawned process. Exits non-zero when the engine cannot start.

    `facts_json`: the model facts the front end resolved (`ModelFacts`): used as they are, never resolved again.
    `transfer_layout`: receive buffers (msgspec-encoded `BufferLayout`) to map, on a disaggregated server.
    `parent_pid`: the front-end's (this process outlives it by no more than a poll). `kv_role`: the role whose
    KV connector the engine plugs in (kv_connector.KV_CONNECTORS), None for an engine that computes all its KV.
    `media_pool`: the front end's media threads, for the `CPU budget:` line. `kv_writer`: makes (in this process)
    what a prefill engine writes its KV rows into receivers with (kv_connector.RowWriter). `kv_receiver`: called
    with where a decode engine's prompts' KV lands (its KV cache in shared files, or on a GPU the receive
    buffers), registers it for peers' writes (its `target` goes to the front end; closed when the engine stops).
    `token`: proves to the front end's sockets that this is its engine (engine/private_sockets.py)."""
    logging.basicConfig(level=log_level, format=log_format())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front-end, which shuts us down in order
    die_with_parent()
    name_process(ENGINE_PROCESS_NAME)
    parent_pid = parent_pid or os.getppid()
    if os.getppid() != parent_pid:  # the front-end died while this process was still importing: nobody to serve
        logger.warning("front-end process is gone before the engine started; exiting")
        sys.exit(1)
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    connect_private(inputs, addresses["input"], token)
    connect_private(outputs, addresses["output"], token)
    progress, stop = Progress(), threading.Event()
    heartbeats = threading.Thread(target=_answer_heartbeats,
                                  args=(ctx, addresses["heartbeat"], token, progress, stop),
                                  name="vlserve-heartbeat", daemon=True)
    heartbeats.start()
    framer = Framer(EngineMessage)
    exit_code = 0
    receiver, core = None, None
    try:
        try:
            log_once()
            args = decode_args(args_json)
            apply_cpu_threads(args.cpu_threads, args.tensor_parallel_size, media_pool)
            transfer = None
            if transfer_layout is not None:
                transfer = TransferBuffers.attach(msgspec.msgpack.decode(transfer_layout, type=BufferLayout))
            cfg = resolve_config(args, decode_facts(facts_json))
            if kv_cache_shared(kv_role, cfg.tensor_parallel_size, cfg.device.type):
                # A prefill's files only spare a gather: where they would not hold its whole cache it keeps it
                # private (and gathers its ranks' heads) rather than give up KV blocks.
                if kv_role != PREFILL or cfg.num_kv_blocks <= shared_kv_blocks_room(cfg):
                    cfg = fit_kv_in_shared_memory(dataclasses.replace(cfg, kv_cache_file=True))
            if kv_role == PREFILL and kv_writer is None:  # its KV leaves this process only through a writer
                raise ConfigurationError("a prefill engine process needs a row writer (vlserve prefill makes it)")
            connector = make_connector(kv_role, cfg, None if kv_writer is None else kv_writer())
            core = EngineCore(cfg, report_released=True, transfer=transfer, connector=connector)
            if kv_receiver is not None:  # where peers write prompts' KV: the KV cache, or the receive blocks
                registered = core.runner.kv_buffers if core.runner.kv_buffers is not None else transfer
                if registered is not None:
                    # A hybrid model's state rows are float32 bytes, not values: its rows are checked at admission
                    receiver = kv_receiver(registered, check_finite=not cfg.model.is_hybrid)
                    if connector is not None:  # the row socket refused non-finite rows: not read again at admission
                        connector.rows_checked = receiver.rows_checked
            kv = core.runner.kv_buffers
            if kv is not None and (receiver is None or not receiver.transport.maps_receiver_file):
                kv.unlink()  # mapped by every process that uses it: no name left for a crash to leave behind
        except Exception as e:  # noqa: BLE001 - any start-up failure must reach the front-end as a message
            if not isinstance(e, VlserveError):  # ours have clear messages; anything else needs its traceback
                logger.exception("engine core failed to start")
            config_error = isinstance(e, (ConfigurationError, InvalidInputError))
            outputs.send_multipart(framer.encode(EngineFailed(f"{type(e).__name__}: {e}", config_error)))
            exit_code = 1
            if core is not None:  # e.g. its KV receiver could not start: the other ranks and the writer go now
                try:
                    core.shutdown()
                finally:
                    if core.connector is not None:
                        core.connector.close()
            return
        kv = core.runner.kv_buffers if receiver is not None else None  # (a prefill's own files are its own)
        outputs.send_multipart(framer.encode(EngineReady(core.cfg.num_kv_blocks, core.cfg.max_model_len,
                                                         None if kv is None else msgspec.msgpack.encode(kv.layout),
                                                         None if receiver is None else receiver.target)))
        freeze_startup_heap()
        try:
            EngineCoreLoop(core, inputs, outputs, progress, parent_pid).run()
        except Exception as e:  # noqa: BLE001 - report, then exit: the front-end fails pending requests with 503
            logger.exception("engine core crashed")
            if core.connector is not None:  # no row write may land after the front end hears of the failure
                core.connector.close()
            outputs.send_multipart(framer.encode(EngineFailed(f"engine core crashed: {type(e).__name__}: {e}")))
            exit_code = 1
        finally:
            try:
                core.shutdown()
            finally:
                if core.connector is not None:
                    core.connector.close()
    finally:
        if receiver is not None:
            receiver.close()
        stop.set()
        inputs.close(linger=0)
        outputs.close(linger=1000)  # the last message (outputs or the failure) still reaches the front-end
        ctx.term()  # also wakes the heartbeat thread from its poll (ETERM): it closes its socket and ends
        heartbeats.join(timeout=1)
        if exit_code:
            sys.exit(exit_code)
