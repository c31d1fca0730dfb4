"""What a prefill instance's KV handoff costs on one host, beside a plain memory copy of the same bytes (#47).

Before: the engine process sent a prompt's KV rows to its front end as a ZeroMQ frame, and the front end wrote them
into the decode instance's receive blocks (shm). After: the engine process writes them into those blocks itself
(transports.row_writer), and the front end passes only where. Both are timed here on the same rows, same run:
"before" as a second process sending the rows over ipc:// and this one writing them, "after" as the shm writer
alone. The bound is one memory copy of the rows.

    .venv/bin/python benchmarks/kv_transfer.py [--tokens 2000] [--row-width 14336] [--dtype bfloat16]

The default row is Qwen2-VL-2B's (28 layers x K,V x 2 KV heads x 128); 2,000 tokens are 57 MB in bf16.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlserve.disagg.transports.row_writer import encode_destination, row_writer_maker  # noqa: E402
from vlserve.disagg.transports.shm import ShmTransport  # noqa: E402
from vlserve.engine.transfer_buffers import TransferBuffers  # noqa: E402

BLOCK_ROWS = 16


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--row-width", type=int, default=14336)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = torch.randn(args.tokens, args.row_width).to(dtype)
    nbytes = rows.numel() * rows.element_size()
    buffers = TransferBuffers.create(-(-args.tokens // BLOCK_ROWS), BLOCK_ROWS, args.row_width, dtype)
    try:
        blocks = buffers.allocate(args.tokens)
        target = ShmTransport().target(buffers)
        destination = encode_destination(target, blocks, "shm")
        writer = row_writer_maker("shm", "127.0.0.1", 120.0)()

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
        after = timed(lambda: writer.write(destination, rows))

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

        before = timed(receive_and_write)
        sender.join()
        pull.close(0)
        for w in (writer, front_end):
            w.close()
    finally:
        buffers.unlink()

    def ms(times: list[float]) -> str:
        return f"{statistics.median(times) * 1e3:8.2f} ms  ({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f})"

    print(f"{args.tokens} tokens x {args.row_width} {args.dtype}: {nbytes / 1e6:.1f} MB of KV rows, "
          f"median of {args.rounds} (min-max)")
    print(f"memory copy (bound)          {ms(bound)}  {nbytes / statistics.median(bound) / 1e9:5.1f} GB/s")
    print(f"before: engine -> front end -> shm  {ms(before)}  "
          f"{statistics.median(before) / statistics.median(bound):4.1f}x the bound")
    print(f"after:  engine -> shm               {ms(after)}  "
          f"{statistics.median(after) / statistics.median(bound):4.1f}x the bound")


if __name__ == "__main__":
    main()
