"""Rank 0 of a tensor-parallel engine: the scheduler's side. It starts (or, under torchrun, meets) the other
ranks, and before each vision-tower call and each forward pass tells them what to run, then runs its own share;
the model's collectives make the ranks meet inside.

It offers what a `ModelShard` offers (`encode_images`, `encode_audio`, `forward`, `model`, `kv_caches`), so the
model runner does not know how many ranks there are. A rank that dies is noticed at once: inside a collective the
transport reports the closed connection, between steps `check_alive` sees the process gone or its failure message.
Either way a `TensorParallelError` ends the engine (the server answers 503 and exits); nothing waits forever.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import msgspec
import torch
import torch.distributed as dist
import zmq

from vlserve.core.config import encode_args
from vlserve.core.errors import InvalidInputError, ModelLoadError, TensorParallelError
from vlserve.core.wire import Framer, tensor_ref
from vlserve.engine.config import DATA, VlserveConfig
from vlserve.engine.forward_batch import ForwardBatch, batch_to_wire
from vlserve.engine.kv_handoff import kv_to_rows
from vlserve.engine.model_shard import ModelShard, kv_heads_of, load_shard
from vlserve.engine.private_sockets import PrivateSockets
from vlserve.engine.ranked_kv import RankedKV
from vlserve.engine.transfer_buffers import BufferLayout
from vlserve.engine.tp.messages import (
    Failed,
    FollowerMessage,
    Hello,
    LeaderMessage,
    LoRAStep,
    ReadKV,
    ReadState,
    Ready,
    RunEncode,
    RunForward,
    Stop,
    WriteKV,
    WriteState,
    lora_step,
)
from vlserve.engine.tp.placement import (
    Placement,
    collectives_file,
    device_for,
    join_group,
    leave_group,
    local_placement,
    pin_cores,
    torchrun_placement,
)
from vlserve.model.facts import encode_facts
from vlserve.model.layers.lora_rows import active_rows

logger = logging.getLogger("vlserve.tp")
START_TIMEOUT_S = 600.0  # every rank loads the checkpoint before it answers
COLLECTIVE_TIMEOUT_S = 600.0  # a rank silent this long inside one collective counts as dead
SPEC_ENV = "VLSERVE_TP_SPEC"
ADDRESS_BYTES = 1024


def identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def share_address(group_device: torch.device, text: str | None) -> str:
    """Rank 0 tells every rank `text` through the process group (under torchrun nothing else connects them)."""
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8, device=group_device)
    if text is not None:
        data = text.encode()
        if len(data) > ADDRESS_BYTES:
            raise InvalidInputError(f"tensor-parallel set-up message too long ({len(data)} bytes); use a shorter "
                                    "temporary directory path")
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


def bind_control(private: PrivateSockets, sock: zmq.Socket, place: Placement) -> str:
    """Binds rank 0's control socket where the other ranks can reach it; returns its address."""
    if place.local_size == place.size:
        return private.bind(sock, "control")
    # ranks on other machines: TCP, encrypted (torchrun's ranks get the token over their process group)
    port = private.bind_tcp(sock, "control")
    return f"tcp://{os.environ.get('VLSERVE_TP_HOST', os.environ.get('MASTER_ADDR'))}:{port}"


class TPLeader:
    def __init__(self, place: Placement, sock: zmq.Socket, procs: list[subprocess.Popen]):
        self.place = place
        self.sock = sock
        self.procs = procs  # the other ranks when we started them (none under torchrun)
        self.shard: ModelShard | None = None
        self.failure: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._out = Framer(LeaderMessage)
        self._in = Framer(FollowerMessage)
        self._held: dict[int, str] = {}  # LoRA slot -> key of the adapter the other ranks hold there
        self.kv_buffers: RankedKV | None = None  # the KV cache in shared files, every rank's mapped here
        self._rows_scratch: torch.Tensor | None = None  # a prefill writer thread's rows (read_kv_rows(scratch))

    # ---- start -------------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: VlserveConfig) -> TPLeader:
        size = cfg.tensor_parallel_size
        place = torchrun_placement(size)
        if place is not None and place.rank != 0:
            raise InvalidInputError(f"rank {place.rank} of a torchrun job runs a worker, not an engine: start it with "
                                    "the same vlserve command (it becomes a worker by itself)")
        ctx = zmq.Context()
        sock, private, procs, shm_path, undo_pin = None, None, [], None, lambda: None
        try:  # until the finalizer owns them, a failure frees what was made so far
            # Only ranks that hold the token are served (engine/private_sockets.py); on one machine the ranks meet
            # in its private folder, which no other user can enter (the control socket, torch's file store).
            private = PrivateSockets(ctx, "vlserve-ranks-")
            place = place or local_placement(size, private.folder)
            device = device_for(cfg.device, place.local_rank)
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises instead of vanishing
            sock.setsockopt(zmq.LINGER, 0)
            address = bind_control(private, sock, place)
            shm_path = collectives_file(place, device)
            for r in range(1, 1 if place.from_env else size):
                procs.append(_spawn(r, place, address, private.token, shm_path, cfg))
            # after the spawns: a child inherits its parent's cores, and each rank picks its slice of all of them
            cpu_threads = cfg.args.cpu_threads if cfg.args is not None else None
            if device.type == "cpu":
                undo_pin = pin_cores(place.local_rank, place.local_size, cpu_threads)
        except BaseException:
            _stop(sock, ctx, private, size, procs, undo_pin, shm_path)
            raise
        leader = cls(place, sock, procs)
        leader._finalizer = weakref.finalize(leader, _stop, sock, ctx, private, place.size, procs, undo_pin,
                                             shm_path)
        try:
            if not place.from_env:
                leader._wait_for(Hello, "start")
            group = leader._join(device, shm_path)
            if place.from_env:
                share_address(device if device.type == "cuda" else torch.device("cpu"), json.dumps(
                    {"address": address, "token": private.token, "num_kv_blocks": cfg.num_kv_blocks,
                     "shm_path": shm_path}))
                leader._wait_for(Hello, "connect")
            leader.shard = load_shard(cfg, group, device)
            ready = leader._wait_for(Ready, "load the model")
            if leader.shard.kv_buffers is not None:
                leader.kv_buffers = ranked_kv(leader.shard, [ready[r].kv_layout for r in range(1, size)])
            _unlink(shm_path)  # every rank has mapped it: the name can go (no file left behind by a crash)
        except BaseException:
            leader.shutdown()
            raise
        logger.info("tensor parallel: %d ranks ready (%s)", size, "torchrun" if place.from_env else "local processes")
        return leader

    def _join(self, device: torch.device, shm_path: str | None):
        """Joins the process group while watching the ranks we started: one that dies before it joins would
        otherwise leave us waiting for the rendezvous timeout."""
        result: dict = {}

        def join():
            try:
                result["group"] = join_group(self.place, device, COLLECTIVE_TIMEOUT_S, shm_path)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = e

        thread = threading.Thread(target=join, name="vlserve-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.2)
            self._check_processes()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel ranks did not meet within {START_TIMEOUT_S:.0f}s")
        if "error" in result:
            raise result["error"]
        return result["group"]

    def _wait_for(self, kind: type, what: str) -> dict:
        """Each other rank's message of `kind` (rank -> it)."""
        pending, got = set(range(1, self.place.size)), {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks {sorted(pending)} did not {what} within "
                                          f"{START_TIMEOUT_S:.0f}s")
            self._check_processes()
            if not self.sock.poll(200):
                continue
            msg = self._receive()
            if isinstance(msg, Failed):
                raise ModelLoadError(f"tensor-parallel rank {msg.rank} failed to start: {msg.why}")
            if isinstance(msg, kind):
                pending.discard(msg.rank)
                got[msg.rank] = msg
        return got

    def _receive(self):
        frames = self.sock.recv_multipart()
        try:
            return self._in.decode(frames[1:])
        except msgspec.DecodeError as e:
            logger.error("undecodable message from %r: %s", frames[0][:32], e)
            return None

    # ---- what the model runner calls -----------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.shard.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.shard.kv_caches

    @property
    def tp(self):
        return self.shard.tp

    @property
    def encoder_mode(self) -> str:
        return self.shard.encoder_mode

    @property
    def lora(self):
        """Rank 0's adapter slots: the model runner assigns them; every step tells the other ranks (`_lora`)."""
        return self.shard.lora

    def _lora(self, groups, tensors: list) -> LoRAStep | None:
        """What the other ranks need to apply a pass's adapters (None: none run in it): the slots, and the whole
        pairs of adapters put in a slot since the ranks were last told (`_told`, once the message is sent)."""
        lora = self.shard.lora
        if not groups or lora is None:
            return None
        loads = {slot: lora.whole_weights(ref) for slot, ref in enumerate(lora.slot_refs)
                 if ref is not None and self._held.get(slot) != ref.key}
        return lora_step(lora.slot_refs, groups, loads, tensors)

    def _told(self, slots: list) -> None:
        """Every other rank has been sent these slots (with any weights they lacked): they hold them now."""
        self._held = {slot: ref.key for slot, ref in enumerate(slots) if ref is not None}

    def _tell_others(self, msg, tensors: list[torch.Tensor] | None = None) -> None:
        """The same message to every other rank (they run it in the order sent)."""
        frames = self._out.encode(msg, tensors or [])
        for rank in range(1, self.place.size):
            self._send_frames(rank, frames)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        grids = [tuple(g) for g in grids]
        data = self.encoder_mode == DATA
        frames = None if data else self._encode_frames(grids, pixels)  # the same message for every rank
        for rank in range(1, self.place.size):
            self._send_frames(rank, self._encode_frames(grids, self.shard.share_of(rank, pixels, grids)) if data
                              else frames)
        if self.shard.lora is not None and active_rows():
            self._told(self.shard.lora.slot_refs)
        mine = self.shard.share_of(0, pixels, grids) if data else pixels
        return self._collective(lambda: self.shard.encode_images(mine, grids))

    def encode_audio(self, features: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        return self.shard.encode_audio(features, lengths)  # rank 0's whole tower; the other ranks wait

    def _encode_frames(self, grids: list[tuple[int, int, int]], pixels: torch.Tensor) -> list:
        tensors: list[torch.Tensor] = []
        # a tower adapter runs around this call (vlserve.engine.encoder_runner): the other ranks apply it too
        step = self._lora(active_rows(), tensors)
        return self._out.encode(RunEncode(grids, tensor_ref(pixels, tensors), step), tensors)

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        tensors: list[torch.Tensor] = []
        msg = RunForward(batch_to_wire(batch, tensors), self._lora(batch.lora_rows, tensors))
        self._tell_others(msg, tensors)
        if msg.lora is not None:
            self._told(msg.lora.slots)
        return self._collective(lambda: self.shard.forward(batch))

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """Every key/value head at these slots: each rank's own, gathered (ModelShard.read_kv)."""
        tensors: list[torch.Tensor] = []
        self._tell_others(ReadKV(tensor_ref(slots, tensors)), tensors)
        return self._collective(lambda: self.shard.read_kv(slots))

    @property
    def reads_kv_off_thread(self) -> bool:
        """Every rank's KV file is mapped here: `read_kv_rows` reads them, so a writer thread may call it mid-step."""
        return self.kv_buffers is not None

    def read_kv_rows(self, slots: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """[len(slots), width]: the KV cache at these slots as handoff rows. With every rank's file mapped here,
        read straight out of them (no collective: no other rank takes part); `scratch`: into memory reused by the
        next such call (one thread only). Else every rank's heads gathered."""
        if self.kv_buffers is None:
            return kv_to_rows(self.read_kv(slots))
        out = None
        if scratch:
            numel = slots.numel() * self.kv_buffers.layout.width
            if self._rows_scratch is None or self._rows_scratch.numel() < numel:
                self._rows_scratch = torch.empty(numel, dtype=self.kv_buffers.shards[0].planes.dtype)
            out = self._rows_scratch[:numel].view(slots.numel(), -1)
        return self.kv_buffers.read_slots(slots, out)

    def read_kv_layer(self, slots: torch.Tensor, kv_layer: int) -> torch.Tensor:
        """[len(slots), 2, every head x head size]: one layer's keys and values at these slots, out of every
        rank's file (mapped here: `reads_kv_off_thread`)."""
        return self.kv_buffers.read_slots(slots, planes=range(2 * kv_layer, 2 * kv_layer + 2))

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Each rank writes its own heads of `kv` (every head) at these slots, before its next step."""
        tensors: list[torch.Tensor] = []
        self._tell_others(WriteKV(tensor_ref(slots, tensors), tensor_ref(kv.contiguous(), tensors)), tensors)
        self.shard.write_kv(slots, kv)

    def read_state_rows(self, slot: int, width: int) -> torch.Tensor:
        """A hybrid model's linear states in `slot`, every rank's heads gathered (ModelShard.read_state_rows)."""
        self._tell_others(ReadState(slot, width))
        return self._collective(lambda: self.shard.read_state_rows(slot, width))

    def write_state_rows(self, slot: int, rows: torch.Tensor) -> None:
        """Each rank writes its heads' part of `rows` into `slot`, before its next step."""
        tensors: list[torch.Tensor] = []
        self._tell_others(WriteState(slot, tensor_ref(rows.contiguous(), tensors)), tensors)
        self.shard.write_state_rows(slot, rows)

    # ---- failures ------------------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raises TensorParallelError once any rank has died or reported a failure (cheap: call it every loop)."""
        if self.failure is None:
            self._check_processes()
            while self.failure is None and self.sock.poll(0):
                msg = self._receive()
                if isinstance(msg, Failed):
                    self.failure = f"tensor-parallel rank {msg.rank} failed: {msg.why}"
        if self.failure is not None:
            raise TensorParallelError(f"{self.failure}; the engine stops")

    def _check_processes(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None and self.failure is None:
                self.failure = f"tensor-parallel rank {rank} exited (code {proc.returncode})"
        if self.failure is not None:
            raise TensorParallelError(f"{self.failure}; the engine stops")

    def _collective(self, fn):
        """Runs rank 0's share of a step the other ranks were told to run. Whatever interrupts it (a lost rank,
        an error here, Ctrl-C) leaves the ranks out of step, so the engine cannot go on after it."""
        self.check_alive()
        try:
            return fn()
        except BaseException as e:
            time.sleep(0.2)  # let a dying rank's exit or failure message arrive, to name it
            try:
                self.check_alive()
            except TensorParallelError as lost:
                raise lost from e
            self.failure = f"a step failed on rank 0 ({type(e).__name__}: {str(e)[:300]})"
            if isinstance(e, Exception):
                raise TensorParallelError(f"{self.failure}; the engine stops") from e
            raise

    def _send(self, rank: int, msg, tensors: list[torch.Tensor] | None = None) -> None:
        self._send_frames(rank, self._out.encode(msg, tensors))

    def _send_frames(self, rank: int, frames: list) -> None:
        try:
            self.sock.send_multipart([identity(rank), *frames])
        except zmq.ZMQError as e:  # unroutable: that rank is gone
            self.failure = self.failure or f"tensor-parallel rank {rank} is unreachable ({e})"
            raise TensorParallelError(f"{self.failure}; the engine stops") from e

    # ---- stop ----------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the other ranks and leaves the group (also done at exit, or when the engine is dropped)."""
        self._finalizer()


def ranked_kv(shard: ModelShard, layouts: list[bytes | None]) -> RankedKV:
    """Every rank's KV file (rank 0's own, the others' as they announced them), as one KV cache."""
    if any(lay is None for lay in layouts):
        raise TensorParallelError("a rank did not put its KV cache in a shared file")
    text = shard.model.cfg.text
    size = len(layouts) + 1
    heads = [kv_heads_of(text.num_kv_heads, text.head_dim, rank, size) for rank in range(size)]
    return RankedKV.attach(shard.kv_buffers, [msgspec.msgpack.decode(lay, type=BufferLayout) for lay in layouts],
                           heads, text.num_kv_heads)


def _spawn(rank: int, place: Placement, address: str, token: str, shm_path: str | None,
           cfg: VlserveConfig) -> subprocess.Popen:
    """Another rank of this machine, in its own process (`python -m vlserve.engine.tp.worker`): its spec in its
    environment, the token on its stdin (a pipe: unlike the environment, not left readable under /proc)."""
    # (an encode service has no KV cache: 0 blocks, left to resolve as none)
    args = dataclasses.replace(cfg.args, model=str(cfg.model_path), num_kv_blocks=cfg.num_kv_blocks or None)
    spec = {"placement": dataclasses.asdict(dataclasses.replace(place, rank=rank, local_rank=rank)),
            "address": address, "shm_path": shm_path, "args": encode_args(args).decode(),
            "kv_cache_file": cfg.kv_cache_file,
            "facts": encode_facts(cfg.facts).decode(), "parent": os.getpid(),
            "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
    env = {**os.environ, SPEC_ENV: json.dumps(spec)}
    proc = subprocess.Popen([sys.executable, "-m", "vlserve.engine.tp.worker"], env=env, stdin=subprocess.PIPE)
    try:  # one line fits in the pipe's buffer: never blocks
        os.write(proc.stdin.fileno(), token.encode() + b"\n")
    except BrokenPipeError:
        pass  # it has exited already: the start notices
    proc.stdin.close()
    return proc


def _unlink(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _stop(sock: zmq.Socket | None, ctx: zmq.Context, private: PrivateSockets | None, size: int,
          procs: list[subprocess.Popen], undo_pin, shm_path: str | None) -> None:
    """Tells the other ranks to stop, waits briefly for the ones we started, then ends whatever is left; frees
    the group, the private folder and the cores (None: not made yet)."""
    stop = Framer(LeaderMessage).encode(Stop())
    for rank in range(1, size if sock is not None else 1):
        try:
            sock.send_multipart([identity(rank), *stop], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # that rank is gone already
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    leave_group()
    _unlink(shm_path)
    if sock is not None:
        sock.close(linger=500 if not procs else 0)  # torchrun's ranks are not ours to wait for: let the stop leave
    if private is not None:
        private.close()
    ctx.term()  # also ends the private sockets' token checker
    undo_pin()
