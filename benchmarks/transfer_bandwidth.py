"""Embedding and KV transfer bandwidth per transport on loopback, beside this machine's memory bandwidth.

    python -m benchmarks.transfer_bandwidth [--tokens 4096] [--kv-tokens 512] [--dtype bfloat16] [--rounds 20]

An embedding chunk is what an encoder sends for a prompt: every token's fill id and positions, and an embedding
row per media token (here all of them: the worst case), Qwen2.5-VL-7B's hidden size wide (3584). A KV chunk is
what a prefill instance sends a decode instance: a row per prompt token holding every layer's keys and values
(Qwen2.5-VL-7B: 28 layers x 2 x 4 KV heads x 128 = 28672 columns). Each backend moves it from a sender to a
receiver in this process over a real connection (zmq: frames over TCP copied into the blocks; shm: written
straight into the receiver's shared buffers; mooncake: the transfer engine's batch writes over TCP into
registered buffers; nixl: NIXL's UCX writes into registered buffers), the receiver handling each chunk as a
language or decode server does. Memory bandwidth (a read) is the bound a same-host copy cannot beat; a copy
reads and writes, so ~half of it is the practical ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch

from benchmarks.machine_bounds import read_bandwidth
from vlserve.disagg.transports import TRANSPORTS, unavailable_reason
from vlserve.disagg.transports.loopback import Loopback, media_chunk
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers


async def measure(backend: str, tokens: int, width: int, dtype: torch.dtype, rounds: int) -> float:
    block_tokens = 16
    blocks = -(-tokens // block_tokens)
    buffers = TransferBuffers.create(blocks, block_tokens, width, dtype)
    link = Loopback(backend, buffers)
    try:
        await link.connect()
        header, data = media_chunk(list(range(blocks))[::-1], block_tokens, tokens, (0, tokens), width, dtype)
        await link.transfer(header, data)  # warm-up: connections, mappings, registrations
        t0 = time.perf_counter()
        for _ in range(rounds):
            await link.transfer(header, data)
        return data.nbytes * rounds / (time.perf_counter() - t0)
    finally:
        link.close()
        buffers.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the embedding chunk")
    ap.add_argument("--width", type=int, default=3584, help="embedding row width")
    ap.add_argument("--kv-tokens", type=int, default=512, help="tokens of the KV chunk")
    ap.add_argument("--kv-width", type=int, default=28 * 2 * 4 * 128, help="KV row width")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")  # NIXL over TCP, like the other network transports here
    dtype = DTYPES[args.dtype]
    memory = read_bandwidth()
    print(f"memory read bandwidth {memory / 1e9:.1f} GB/s")
    for kind, tokens, width in (("embedding", args.tokens, args.width), ("KV", args.kv_tokens, args.kv_width)):
        mb = tokens * (width * dtype.itemsize + 32) / 2**20
        print(f"\n{kind} chunk: {tokens} tokens x {width} {args.dtype} = {mb:.1f} MiB")
        print(f"{'backend':>9} {'GB/s':>7} {'of memory':>10}")
        for backend in TRANSPORTS:
            why = unavailable_reason(backend)
            if why:
                print(f"{backend:>9}  unavailable: {why}")
                continue
            rate = asyncio.run(measure(backend, tokens, width, dtype, args.rounds))
            print(f"{backend:>9} {rate / 1e9:>7.2f} {rate / memory:>10.1%}")


if __name__ == "__main__":
    main()
