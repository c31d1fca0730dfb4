"""The engine-core process: receives requests over ZeroMQ, steps the engine, sends outputs back.

The loop never waits on I/O it does not own: media decoding and tokenization happened in the front-end, so a
step is scheduling + model forward only. While there is work it drains the input socket without blocking
between steps; when idle it blocks on the socket (with a timeout to notice an orphaned parent).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import msgspec
import zmq

from vlserve.core.config import EngineArgs
from vlserve.engine.config import resolve_config
from vlserve.engine.core import EngineCore
from vlserve.core.wire import (AddRequest, EngineFailed, EngineInput, EngineMessage, EngineOutputs, EngineReady,
                                 EngineStats, FinishRequests, Framer, RequestRejected, Shutdown, request_from_wire)
from vlserve.core.errors import VlserveError

logger = logging.getLogger("vlserve.engine")
IDLE_POLL_MS = 1000


def encode_args(args: EngineArgs) -> bytes:
    return msgspec.json.encode(dataclasses.asdict(args))


def decode_args(data: bytes) -> EngineArgs:
    return EngineArgs(**msgspec.json.decode(data))


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket):
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.in_framer = Framer(EngineInput)
        self.out_framer = Framer(EngineMessage)
        self.rejected: list[RequestRejected] = []
        self.parent_pid = os.getppid()
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished
            if self.inputs.poll(0 if busy else IDLE_POLL_MS):
                self._drain_inputs()
            elif not busy and os.getppid() != self.parent_pid:
                logger.warning("front-end process is gone; engine core exits")
                return
            outputs = self.core.step() if self.core.has_unfinished else []
            if outputs or self.rejected or busy:
                self._send(outputs)

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
                logger.error("dropped an undecodable message: %s", e)
                continue
            self._handle(msg, frames)

    def _handle(self, msg, frames) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.core.add_request(request_from_wire(msg, frames))
            except (VlserveError, ValueError) as e:
                status = getattr(e, "http_status", 400)
                self.rejected.append(RequestRejected(msg.request_id, str(e), status))
        elif isinstance(msg, FinishRequests):
            if msg.reason == "stop":
                self.core.stop_requests(msg.request_ids)
            else:
                self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _send(self, outputs) -> None:
        metrics = self.core.get_metrics()
        stats = EngineStats(**{k: v for k, v in metrics.items() if k in EngineStats.__struct_fields__},
                            encoder_seconds=self.core.runner.encoder_seconds)
        self.core.runner.encoder_seconds = []
        self.outputs.send_multipart(self.out_framer.encode(EngineOutputs(outputs, self.rejected, stats)))
        self.rejected = []


def run_engine_core(args_json: bytes, input_addr: str, output_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the spawned process."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front-end, which shuts us down in order
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_addr)
    outputs.connect(output_addr)
    framer = Framer(EngineMessage)
    try:
        core = EngineCore(resolve_config(decode_args(args_json)))
    except Exception as e:  # noqa: BLE001 - any start-up failure must reach the front-end as a message
        if not isinstance(e, VlserveError):  # ours have clear messages; anything else needs its traceback
            logger.exception("engine core failed to start")
        outputs.send_multipart(framer.encode(EngineFailed(f"{type(e).__name__}: {e}")))
        return
    outputs.send_multipart(framer.encode(EngineReady(core.cfg.num_kv_blocks, core.cfg.max_model_len)))
    try:
        EngineCoreLoop(core, inputs, outputs).run()
    except Exception as e:  # noqa: BLE001 - report, then exit: the front-end fails pending requests with 503
        logger.exception("engine core crashed")
        outputs.send_multipart(framer.encode(EngineFailed(f"engine core crashed: {type(e).__name__}: {e}")))
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()
