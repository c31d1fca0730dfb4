"""What a prompt's KV handoff from a prefill instance to a decode instance costs on one host, beside a plain
memory copy of the same bytes (#47), in three generations, timed on the same rows in the same run:

1. first: the prefill engine process sent the rows to its front end as a ZeroMQ frame, the front end wrote them
   into the decode instance's receive blocks (shm), and the decode engine copied them into its KV cache when it
   admitted the request;
2. then: the prefill engine process writes them into the receive blocks itself (transports.row_writer), the
   decode engine still copies them in at admission;
3. now: the prefill engine process writes them straight into the blocks the decode engine reserved in its KV
   cache, which lives in a shared file (core.config.kv_cache_shared): nothing is copied at admission.

Over zmq (the default backend), timed the same way into the same KV file:
- before: the rows went engine -> prefill front end (ipc://) -> decode front end (tcp://) as frames, and the
  decode front end copied them into the KV blocks;
- now: the prefill engine's writer sends them to the row socket the decode engine process serves
  (transports.zmq: a Unix socket on loopback; TCP with CurveZMQ and the secret otherwise, timed here on this
  machine's own address), whose thread copies them into its KV blocks and answers; no front end in between.

"first" has a second process send the rows over ipc:// to this one; the admission copy is the decode connector's
(gather the rows, lay them out by layer, copy into each layer's cache). The bound is one memory copy of the rows.
Also timed: what the prefill engine's own thread spends exporting a finished prompt before any of the above,
while its other requests wait: first as a gather then a permute (`kv_to_rows(read_kv(...))`), then a slice copy
per run straight into the rows (`ModelShard.read_kv_rows`, called here on a stand-in shard holding the same
caches); now (one CPU rank) nothing but naming the prompt's slots: its blocks stay allocated until the transfer
is over and the writer thread reads each chunk out of them as it writes it (timed as the writer thread's whole
work: read out of the prefill's blocks, write into the decode engine's).

    .venv/bin/python benchmarks/kv_transfer.py [--tokens 2000] [--kv-heads 2] [--head-dim 128] [--layers 28]

The default is Qwen2-VL-2B's KV (28 layers x K,V x 2 KV heads x 128 = 14,336 values a token); 2,000 tokens are
57 MB in bf16.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlserve.disagg.transports.row_writer import decode_target, encode_destination, row_writer_maker  # noqa: E402
from vlserve.disagg.transports.shm import ShmTransport  # noqa: E402
from vlserve.engine.kv_handoff import kv_to_rows, rows_to_kv  # noqa: E402
from vlserve.engine.model_shard import ModelShard  # noqa: E402
from vlserve.engine.transfer_buffers import TransferBuffers  # noqa: E402

BLOCK_ROWS = 16
GRANT = "bench"  # the one transfer the decode side reserves its blocks for (a row socket takes no other write)


def _engine_side(address: str, nbytes: int, rounds: int) -> None:
    """The old engine process: sends the rows to its front end as one frame per round."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    rows = torch.ones(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        sock.send(rows.numpy(), copy=False)  # as the engine sent its tensor frames
    sock.close(linger=-1)
    ctx.term()  # every frame sent before `rows` goes


def _decode_engine_side(layout: bytes, conn, host: str, secret: str | None) -> None:
    """A decode engine process over zmq: maps the KV file, serves its row socket until told to stop."""
    from vlserve.disagg.transports.row_writer import kv_receiver_maker
    from vlserve.engine.transfer_buffers import BufferLayout

    from vlserve.engine.write_grants import WriteGrants

    buffers = TransferBuffers.attach(msgspec.msgpack.decode(layout, type=BufferLayout))
    buffers.grants = WriteGrants()  # as a decode engine's connector has them, reserving every block for one transfer
    buffers.grants.open(GRANT, range(buffers.num_blocks))
    receiver = kv_receiver_maker("zmq", host, secret)(buffers)
    conn.send(receiver.target)
    conn.recv()
    receiver.close()


def _own_address() -> str | None:
    """This machine's address toward the outside (not loopback), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 9))  # UDP: picks the route, sends nothing
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def kv_shape_args(ap: argparse.ArgumentParser, rounds: int) -> argparse.ArgumentParser:
    """The KV benchmarks' options: a prompt's length and the model's KV shape (Qwen2-VL-2B by default)."""
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def main() -> None:
    args = kv_shape_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), rounds=7).parse_args()
    dtype = getattr(torch, args.dtype)
    layers, heads, dim = args.layers, args.kv_heads, args.head_dim
    args.row_width = width = layers * 2 * heads * dim
    rows = torch.randn(args.tokens, width).to(dtype)
    nbytes = rows.numel() * rows.element_size()
    num_blocks = -(-args.tokens // BLOCK_ROWS)
    buffers = TransferBuffers.create(num_blocks, BLOCK_ROWS, width, dtype)  # receive blocks
    kv_file = TransferBuffers.create(num_blocks, BLOCK_ROWS, width, dtype, parts=layers * 2)  # a KV cache
    private_cache = torch.zeros(layers, 2, num_blocks * BLOCK_ROWS, heads, dim, dtype=dtype)
    try:
        blocks = buffers.allocate(args.tokens)
        target = ShmTransport().target(buffers)
        destination = encode_destination(target, blocks, "shm")
        in_place = encode_destination(ShmTransport().target(kv_file), blocks, "shm")
        writer = row_writer_maker("shm", "127.0.0.1", 120.0)()
        slots = torch.arange(args.tokens)  # the request's KV slots (its blocks are the run's, in order)

        def admission_copy() -> None:  # what the decode connector did with rows in receive blocks
            kv = rows_to_kv(buffers.read_rows(blocks, 0, args.tokens), layers, heads, dim)
            for cache, layer in zip(private_cache, kv):
                cache.index_copy_(1, slots, layer)

        def timed(fn) -> list[float]:
            fn()  # warm: the file mapped, pages touched
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times

        copy_target = torch.empty_like(rows)
        bound = timed(lambda: copy_target.copy_(rows))
        then_write = timed(lambda: writer.write(destination, rows))
        then_admit = timed(admission_copy)
        now = timed(lambda: writer.write(in_place, rows))
        prefill_caches = [torch.randn(2, num_blocks * BLOCK_ROWS, heads, dim).to(dtype) for _ in range(layers)]
        export_before = timed(lambda: kv_to_rows(torch.stack([c.index_select(1, slots) for c in prefill_caches])))
        shard = SimpleNamespace(tp=SimpleNamespace(size=1), device=torch.device("cpu"), kv_caches=prefill_caches,
                                kv_layers=list(range(layers)))
        export_then = timed(lambda: ModelShard.read_kv_rows(shard, slots))
        prompt_blocks = list(range(num_blocks))
        export_now = timed(lambda: torch.tensor(prompt_blocks)[slots // BLOCK_ROWS] * BLOCK_ROWS + slots % BLOCK_ROWS)
        if not torch.equal(ModelShard.read_kv_rows(shard, slots),
                           kv_to_rows(torch.stack([c.index_select(1, slots) for c in prefill_caches]))):
            raise SystemExit("the rows read straight differ from the gathered ones")
        written = kv_file.planes.view(layers, 2, -1, heads, dim)[:, :, : args.tokens]
        if not torch.equal(written, private_cache[:, :, : args.tokens]):  # the same KV, wherever it went
            raise SystemExit("the KV written in place differs from the KV copied in at admission")
        expected = written.clone()
        written.zero_()  # for the zmq paths to fill again

        # Before: the rows arrive from another process over ipc://, then the front end writes them.
        address = f"ipc://{tempfile.mkdtemp()}/kv"
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.bind(address)
        sender = multiprocessing.get_context("spawn").Process(target=_engine_side,
                                                              args=(address, nbytes, args.rounds + 1))
        sender.start()
        front_end = row_writer_maker("shm", "127.0.0.1", 120.0)()

        def receive_and_write() -> None:
            frame = pull.recv(copy=False)
            got = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(dtype).view(args.tokens, args.row_width)
            front_end.write(destination, got)

        first_write = timed(receive_and_write)
        sender.join()

        # zmq before: the same ipc:// frames, then front end to front end over tcp://, copied into the KV blocks.
        sender = multiprocessing.get_context("spawn").Process(target=_engine_side,
                                                              args=(address, nbytes, args.rounds + 1))
        sender.start()
        tcp_out, tcp_in = zmq.Context.instance().socket(zmq.PUSH), zmq.Context.instance().socket(zmq.PULL)
        port = tcp_in.bind_to_random_port("tcp://127.0.0.1")
        tcp_out.connect(f"tcp://127.0.0.1:{port}")
        plane_index = torch.arange(args.tokens)

        def frames_through_front_ends() -> None:
            tcp_out.send(pull.recv(copy=False), copy=False)
            frame = tcp_in.recv(copy=False)
            got = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(dtype).view(args.tokens, args.row_width)
            kv_file.write_rows(blocks, plane_index, got)

        zmq_before = timed(frames_through_front_ends)
        sender.join()
        for sock in (pull, tcp_out, tcp_in):
            sock.close(0)

        # zmq now: the prefill engine's writer -> the decode engine process's row socket -> its KV blocks; on
        # loopback a Unix socket; over TCP (this machine's own address) with the secret, as across machines.
        zmq_now = {}
        for how, host, secret in [("ipc", "127.0.0.1", None), ("tcp", _own_address(), "bench-secret")]:
            if host is None:
                continue
            written.zero_()
            ours, theirs = multiprocessing.get_context("spawn").Pipe()
            decode = multiprocessing.get_context("spawn").Process(
                target=_decode_engine_side, args=(msgspec.msgpack.encode(kv_file.layout), theirs, host, secret))
            decode.start()
            zmq_writer = row_writer_maker("zmq", host, 120.0, secret)()
            target = msgspec.structs.replace(decode_target(ours.recv()), grant=GRANT)
            to_decode = encode_destination(target, blocks, "zmq")
            zmq_now[how] = timed(lambda: zmq_writer.write(to_decode, rows))
            if not torch.equal(written, expected):
                raise SystemExit(f"the KV written over zmq ({how}) differs")
            ours.send("stop")
            decode.join()
            zmq_writer.close()
        # now, the prefill's writer thread: its chunk read out of the prefill's blocks, then written in place
        shard._rows_scratch = None
        writer_thread = timed(lambda: writer.write(in_place, ModelShard.read_kv_rows(shard, slots, scratch=True)))
        for w in (writer, front_end):
            w.close()
    finally:
        buffers.unlink()
        kv_file.unlink()

    med = statistics.median
    copy = med(bound)

    def line(name: str, parts: list[list[float]]) -> None:
        total = sum(med(t) for t in parts)
        each = " + ".join(f"{med(t) * 1e3:.2f}" for t in parts)
        print(f"{name:<58} {total * 1e3:8.2f} ms  ({each})  {total / copy:5.1f}x the bound")

    print(f"{args.tokens} tokens x {width} {args.dtype} ({layers} layers x K,V x {heads} heads x {dim}): "
          f"{nbytes / 1e6:.1f} MB of KV, medians of {args.rounds}")
    print(f"{'memory copy (bound)':<58} {copy * 1e3:8.2f} ms  {nbytes / copy / 1e9:5.1f} GB/s")
    line("first: engine -> front end -> receive blocks; admission copy", [first_write, then_admit])
    line("then:  engine -> receive blocks; admission copy", [then_write, then_admit])
    line("now:   engine -> the decode engine's KV blocks", [now])
    line("zmq before: engine -> 2 front ends -> KV blocks (frames)", [zmq_before])
    for how, times in zmq_now.items():
        line(f"zmq now: engine -> decode engine's row socket ({how}) -> KV", [times])
    line("prefill engine thread, export first: gather + permute", [export_before])
    line("prefill engine thread, export then: straight into rows", [export_then])
    line("prefill engine thread, export now: the slots named (kept)", [export_now])
    line("prefill writer thread now: read from blocks + write in place", [writer_thread])


if __name__ == "__main__":
    main()
