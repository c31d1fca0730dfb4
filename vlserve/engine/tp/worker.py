"""A tensor-parallel rank other than 0: loads its share of the model, then runs whatever rank 0 tells it, step
by step, until told to stop or rank 0 is gone.

Started by rank 0 on one machine (`python -m vlserve.engine.tp.worker`, its place and the engine's options in
the environment), or by torchrun on several (`vlserve serve ...` with `RANK` > 0 lands in `run_rank`).
Any failure is reported to rank 0 before this process exits, so the engine stops instead of waiting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import msgspec
import torch
import zmq

from vlserve.core.config import EngineArgs, decode_args
from vlserve.core.processes import die_with_parent, log_format
from vlserve.core.wire import Framer, tensor_from
from vlserve.engine.config import resolve_config
from vlserve.engine.forward_batch import batch_from_wire
from vlserve.engine.model_shard import load_shard
from vlserve.engine.private_sockets import connect_private
from vlserve.engine.tp.leader import COLLECTIVE_TIMEOUT_S, SPEC_ENV, identity, share_address
from vlserve.engine.tp.messages import (
    Failed,
    FollowerMessage,
    Hello,
    LeaderMessage,
    ReadKV,
    ReadState,
    Ready,
    RunEncode,
    RunForward,
    Stop,
    WriteKV,
    WriteState,
    lora_groups,
    lora_loads,
)
from vlserve.engine.tp.placement import Placement, device_for, join_group, leave_group, pin_cores, torchrun_placement
from vlserve.model.facts import ModelFacts, decode_facts
from vlserve.model.layers.lora_rows import lora_rows
from vlserve.model.layers.shm_collectives import ShmCollectives

logger = logging.getLogger("vlserve.tp")
IDLE_POLL_MS = 1000


def run_rank(place: Placement, args: EngineArgs, facts: ModelFacts | None = None, address: str | None = None,
             shm_path: str | None = None, parent: int | None = None, token: str = "",
             kv_cache_file: bool = False) -> int:
    """Runs this rank until rank 0 stops it or is gone; returns the exit code. `address`: rank 0's socket, and
    `token` what it admits (None under torchrun: rank 0 sends both, with the KV cache size, once the process group
    is up). `parent`: rank 0's pid when it started this process. `facts`: rank 0's (None under torchrun: each
    rank resolves them, from the same options). `kv_cache_file`: this rank keeps its KV cache in a shared file
    rank 0 maps (engine.ranked_kv: a decode engine, a prefill engine at several ranks)."""
    cfg = dataclasses.replace(resolve_config(args, facts, announce=False), kv_cache_file=kv_cache_file)
    device = device_for(cfg.device, place.local_rank)
    if device.type == "cpu":
        pin_cores(place.local_rank, place.local_size, args.cpu_threads)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity(place.rank))
    sock.setsockopt(zmq.LINGER, 2000)  # a failure report still leaves before the process does
    # rank 0's end of the connection closing (its process gone, wherever it ran) ends this rank too
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    out, inp = Framer(FollowerMessage), Framer(LeaderMessage)
    try:
        if address is not None:
            connect_private(sock, address, token)
            sock.send_multipart(out.encode(Hello(place.rank)))
            group = join_group(place, device, COLLECTIVE_TIMEOUT_S, shm_path)
        if address is None:  # torchrun: rank 0 says where the rest is once the group is up
            group = join_group(place, device, COLLECTIVE_TIMEOUT_S)
            shared = json.loads(share_address(device if device.type == "cuda" else torch.device("cpu"), None))
            cfg = dataclasses.replace(cfg, num_kv_blocks=shared["num_kv_blocks"])  # rank 0's scheduler decides
            if shared["shm_path"]:
                group = dataclasses.replace(group, local=ShmCollectives(shared["shm_path"], place.rank, place.size,
                                                                        COLLECTIVE_TIMEOUT_S))
            connect_private(sock, shared["address"], shared["token"])
            sock.send_multipart(out.encode(Hello(place.rank)))
        shard = load_shard(cfg, group, device)
        kv = shard.kv_buffers
        sock.send_multipart(out.encode(Ready(place.rank, None if kv is None else msgspec.msgpack.encode(kv.layout))))
        while True:
            ready = dict(poller.poll(IDLE_POLL_MS))
            if monitor in ready or (parent is not None and os.getppid() != parent):
                logger.warning("rank %d: rank 0 is gone; exiting", place.rank)
                return 1
            if sock not in ready:
                continue
            frames = sock.recv_multipart()
            msg = inp.decode(frames)
            if isinstance(msg, RunForward):
                batch = batch_from_wire(msg.batch, frames)
                if msg.lora is not None:
                    shard.lora.hold(msg.lora.slots, lora_loads(msg.lora, frames))
                    batch.lora_rows = lora_groups(msg.lora)
                shard.forward(batch)
            elif isinstance(msg, RunEncode):
                if msg.lora is not None:
                    shard.lora.hold(msg.lora.slots, lora_loads(msg.lora, frames))
                with lora_rows(() if msg.lora is None else lora_groups(msg.lora)):
                    shard.encode_images(tensor_from(msg.pixels, frames), [tuple(g) for g in msg.grids])
            elif isinstance(msg, ReadKV):
                shard.read_kv(tensor_from(msg.slots, frames))  # this rank's heads join rank 0's gather
            elif isinstance(msg, WriteKV):
                shard.write_kv(tensor_from(msg.slots, frames), tensor_from(msg.kv, frames))
            elif isinstance(msg, ReadState):
                shard.read_state_rows(msg.slot, msg.width)  # this rank's heads join rank 0's gather
            elif isinstance(msg, WriteState):
                shard.write_state_rows(msg.slot, tensor_from(msg.rows, frames))
            elif isinstance(msg, Stop):
                return 0
    except (Exception, msgspec.DecodeError) as e:  # noqa: BLE001 - every failure goes to rank 0, then we exit
        logger.exception("tensor-parallel rank %d failed", place.rank)
        try:
            sock.send_multipart(out.encode(Failed(place.rank, f"{type(e).__name__}: {str(e)[:500]}")))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        leave_group()
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
        ctx.term()


def run_if_worker(args: EngineArgs) -> int | None:
    """Under torchrun, a rank other than 0 runs its share of the model here (returns its exit code); None for the
    process that should go on to serve (rank 0, or no torchrun)."""
    place = torchrun_placement(args.tensor_parallel_size)
    if place is None or place.rank == 0:
        return None
    logger.info("torchrun rank %d of %d: running as a tensor-parallel worker", place.rank, place.size)
    return run_rank(place, args)


def main() -> None:
    spec = json.loads(os.environ[SPEC_ENV])
    token = sys.stdin.readline().strip()  # rank 0's private socket admits it (engine/private_sockets.py)
    logging.basicConfig(level=spec["log_level"], format=log_format())
    die_with_parent()
    if os.getppid() != spec["parent"]:  # rank 0 died before the line above could take effect
        sys.exit(1)
    place = Placement(**spec["placement"])
    sys.exit(run_rank(place, decode_args(spec["args"].encode()), decode_facts(spec["facts"]), spec["address"],
                      spec["shm_path"], spec["parent"], token, spec.get("kv_cache_file", False)))


if __name__ == "__main__":
    main()
