"""The front-end's handle on the engine-core process: spawn it, talk to it over ZeroMQ, and watch it.

Three things end the engine's service, and each is noticed within seconds: the process exits (watched), it
reports a failure (a message), or it stops answering heartbeats (frozen, e.g. SIGSTOP) or stops completing
steps while it has work (a stuck step). An unresponsive engine that answers again is taken back.

The three sockets are Unix sockets in a private folder, served only to the engine process (it proves itself with
a token: engine/private_sockets.py); the folder goes when the client shuts down, or at the next start after a crash.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from vlserve.core.config import EngineArgs, encode_args
from vlserve.core.errors import ConfigurationError, VlserveError
from vlserve.core.processes import finish
from vlserve.core.wire import (
    EngineFailed,
    EngineInput,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    Framer,
    Heartbeat,
    Shutdown,
)
from vlserve.engine.private_sockets import PrivateSockets
from vlserve.engine.transfer_buffers import BufferLayout
from vlserve.engine.zygote import start_process
from vlserve.model.facts import ModelFacts, encode_facts

if TYPE_CHECKING:
    from vlserve.engine.kv_connector import RowWriter

logger = logging.getLogger("vlserve.engine")
HEARTBEAT_INTERVAL_S = 1.0
STUCK_STEP_MIN_S = 300.0  # a step may take minutes on a CPU; never call a step stuck before this
SHUTDOWN_WAIT_S = 10.0


def _engine_process(*args) -> None:
    """The spawned process's entry: the engine's modules (model loader, scheduler, ...) are imported there only,
    never into the front end."""
    from vlserve.engine.core_process import run_engine_core

    run_engine_core(*args)


class EngineCoreClient:
    def __init__(self, args: EngineArgs, facts: ModelFacts, log_level: str = "INFO", heartbeat_timeout: float = 10.0,
                 on_outputs: Callable[[EngineOutputs], None] | None = None,
                 on_failure: Callable[[str], None] | None = None,
                 on_recovery: Callable[[], None] | None = None, transfer_layout: BufferLayout | None = None,
                 kv_role: str | None = None, media_pool: int | None = None,
                 kv_writer: Callable[[], RowWriter] | None = None, kv_receiver: Callable | None = None):
        """`facts`: resolved by the front end, shipped to the engine process, which uses them as they are.
        `transfer_layout`: receive buffers the engine process maps (a disaggregated language server's).
        `kv_role`: the role whose KV connector the engine plugs in (prefill, decode), if any. `media_pool`: the
        front end's media threads (the engine logs them beside its own). `kv_writer`: a picklable maker of the
        row writer a prefill engine writes its KV into receivers with (run_engine_core); `kv_receiver`: a
        picklable maker of what registers a decode engine's KV cache for peers' writes."""
        self.args, self.facts, self.log_level, self.kv_role = args, facts, log_level, kv_role
        self.kv_writer, self.kv_receiver = kv_writer, kv_receiver
        self.media_pool = media_pool
        self.transfer_layout = transfer_layout
        self.heartbeat_timeout = heartbeat_timeout
        self.stuck_after = max(STUCK_STEP_MIN_S, 30 * heartbeat_timeout)
        self.on_outputs = on_outputs or (lambda msg: None)
        self.on_failure = on_failure or (lambda reason: None)
        self.on_recovery = on_recovery or (lambda: None)
        self.proc: multiprocessing.Process | None = None
        self.dead_reason: str | None = None  # the process is gone or failed: final
        self.unresponsive_reason: str | None = None  # it stopped answering: may recover
        self._in_framer, self._out_framer = Framer(EngineInput), Framer(EngineMessage)
        self._hb_framer = Framer(Heartbeat)
        self._tasks: list[asyncio.Task] = []
        self._private: PrivateSockets | None = None
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> EngineReady:
        """Spawns the engine process and waits until it is ready; raises (with the cleanup done) if it fails."""
        # One context (the asyncio one shadows it), so one ZAP handler checks the engine's token on every socket.
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context.shadow(self._sync_ctx)
        try:
            self._private = PrivateSockets(self._sync_ctx, "vlserve-ipc-")
            # Sends are synchronous and never block (no high-water mark), so an abort can be sent from a `finally`
            # of a cancelled task; receives are awaited.
            self.in_sock = self._sync_ctx.socket(zmq.PUSH)
            self.in_sock.setsockopt(zmq.SNDHWM, 0)
            self.out_sock = self._async_ctx.socket(zmq.PULL)
            self.hb_sock = self._async_ctx.socket(zmq.PAIR)
            addresses = {name: self._private.bind(sock, name) for name, sock in
                         (("input", self.in_sock), ("output", self.out_sock), ("heartbeat", self.hb_sock))}
            self.proc = start_process(  # forked early (engine/zygote.py) or spawned; arguments through a pipe
                _engine_process,
                (encode_args(self.args), encode_facts(self.facts), addresses, self.log_level,
                 None if self.transfer_layout is None else msgspec.msgpack.encode(self.transfer_layout),
                 os.getpid(), self.kv_role, self.media_pool, self.kv_writer, self.kv_receiver, self._private.token),
                name="vlserve-engine-core")
            ready = await self._wait_ready()
        except BaseException:  # failed, or cancelled (SIGTERM) while it loads: stop it (it reads no message yet),
            # and free the sockets, the folder and the token checker
            await finish(self.shutdown(stop_now=True))
            raise
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch())]
        return ready

    async def _wait_ready(self) -> EngineReady:
        while True:
            if await self.out_sock.poll(100):
                msg = self._out_framer.decode(await self.out_sock.recv_multipart())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineFailed):
                    error = ConfigurationError if msg.config_error else VlserveError
                    raise error(f"the engine failed to start: {msg.message}")
            elif not self.proc.is_alive():
                raise VlserveError(f"the engine process exited during start-up (exit code {self.proc.exitcode})")

    async def shutdown(self, stop_now: bool = False) -> None:
        """In order: the engine finishes its step and exits. `stop_now`: SIGTERM (a start-up that will not be
        used); either way SIGKILL after a while."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self.proc is not None and self.proc.is_alive():
            if stop_now:
                self.proc.terminate()
                await asyncio.get_running_loop().run_in_executor(None, self.proc.join, SHUTDOWN_WAIT_S)
            elif self.dead_reason is None and self.unresponsive_reason is None:
                self.send(Shutdown())
                await asyncio.get_running_loop().run_in_executor(None, self.proc.join, SHUTDOWN_WAIT_S)
            if self.proc.is_alive():
                self.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
                await asyncio.get_running_loop().run_in_executor(None, self.proc.join, SHUTDOWN_WAIT_S)
        for sock in ("in_sock", "out_sock", "hb_sock"):
            if hasattr(self, sock):
                getattr(self, sock).close(linger=0)
        if self._private is not None:
            self._private.close()
            self._private = None
        if self._sync_ctx is not None:
            self._sync_ctx.term()  # the only owner (the asyncio context is its shadow); ends the token checker
        self._sync_ctx = self._async_ctx = None

    # ---- traffic -----------------------------------------------------------------------------------------
    def send(self, msg, tensors=None) -> None:
        self.in_sock.send_multipart(self._in_framer.encode(msg, tensors), copy=False)

    @property
    def available(self) -> bool:
        return self.dead_reason is None and self.unresponsive_reason is None

    async def _output_loop(self) -> None:
        """Must not die quietly: heartbeats would keep /health green while every stream waits for ever. A message
        it cannot decode is skipped, and `on_outputs` fails a request it cannot handle by itself (AsyncLLM). What
        still escapes means the front end's own state is broken: the engine is marked dead, loudly (/health red,
        waiting requests get a 503, the server exits with 1 for its supervisor to restart it)."""
        try:
            while True:
                frames = await self.out_sock.recv_multipart()
                try:
                    msg = self._out_framer.decode(frames)
                except Exception as e:  # noqa: BLE001 - a bad message must not kill the loop silently
                    logger.error("undecodable message from the engine: %s", e)
                    continue
                if isinstance(msg, EngineFailed):
                    self._die(msg.message)
                    return
                if isinstance(msg, EngineOutputs):
                    self.on_outputs(msg)
                    # A ready socket returns at once: let /health and other requests in between two steps' outputs.
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - see above: never a silent end
            logger.exception("the engine's outputs could not be handled")
            self._die(f"the front end could not handle the engine's outputs ({type(e).__name__}: {e})")

    # ---- liveness ----------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Must not die either: nothing else notices a frozen engine. If watching itself fails, the engine can no
        longer be vouched for: it is marked dead, loudly, as in `_output_loop`."""
        try:
            await self._watch_liveness()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never a silent end
            logger.exception("the engine's liveness could not be watched")
            self._die(f"the engine's liveness could not be watched ({type(e).__name__}: {e})")

    async def _watch_liveness(self) -> None:
        nonces = itertools.count()
        last_answer = time.monotonic()
        last_steps, steps_moved = -1, time.monotonic()
        while self.dead_reason is None:
            if not self.proc.is_alive():
                self._die(f"the engine process died (exit code {self.proc.exitcode})")
                return
            try:  # the engine's heartbeat socket stays connected while its process lives, even when frozen
                await asyncio.wait_for(self.hb_sock.send_multipart(self._hb_framer.encode(Heartbeat(next(nonces)))),
                                       HEARTBEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
            while (left := deadline - time.monotonic()) > 0:
                if await self.hb_sock.poll(left * 1000):
                    try:
                        beat = self._hb_framer.decode(await self.hb_sock.recv_multipart())
                    except msgspec.DecodeError as e:  # that answer only: the next one may do
                        logger.error("undecodable heartbeat from the engine: %s", e)
                        continue
                    now = time.monotonic()
                    last_answer = now
                    if beat.steps != last_steps or not beat.busy:
                        last_steps, steps_moved = beat.steps, now
            now = time.monotonic()
            if now - last_answer > self.heartbeat_timeout:
                self._unresponsive(f"the engine process has not answered for {now - last_answer:.0f}s")
            elif now - steps_moved > self.stuck_after:
                self._unresponsive(f"the engine has been inside one step for {now - steps_moved:.0f}s")
            elif self.unresponsive_reason is not None:
                logger.warning("the engine answers again; accepting requests")
                self.unresponsive_reason = None
                self.on_recovery()

    def _unresponsive(self, reason: str) -> None:
        if self.unresponsive_reason is None:
            logger.error("%s; failing its requests with 503 until it answers again", reason)
            self.unresponsive_reason = reason
            self.on_failure(reason)

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("engine failed: %s", reason)
            self.dead_reason = reason
            self.on_failure(reason)
