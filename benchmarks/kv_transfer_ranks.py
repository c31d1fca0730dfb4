"""What a prompt's KV handoff costs for each pair of tensor-parallel sizes (prefill ranks -> decode ranks) on one
host, before and after every rank's KV cache went into its own shared file (engine.ranked_kv), with the copies
of a token's row COUNTED, not estimated: every torch operation of the path runs under a dispatch mode that adds
up the bytes each copying operation writes (copy_, clone, index_select, index_copy_, _to_copy, cat, stack); a
message between two processes adds 2 copies of what it carries (into the kernel's socket buffers and out). The
count is bytes written / bytes of the rows.

The paths are the engines' own functions on caches of the benchmarked model's shape, run in this process (the
other rank's side of a collective or a message counted as it runs there):
- prefill at 1 rank (before = now): the writer thread reads the kept prompt's rows out of its blocks
  (`ModelShard.read_kv_rows(scratch)`); at 2 ranks before: the engine's thread gathered every rank's heads
  (`ModelShard.read_kv`: the shared-memory all-gather writes each rank's part in and reads all out, then the
  heads put in model order) and laid them out as rows (`kv_to_rows`); now: the writer thread reads each rank's
  heads straight out of that rank's file (`RankedKV.read_slots`);
- decode at 1 rank (before = now): the rows written into its KV blocks by the transport; at 2 ranks before: into
  receive blocks, then at admission read back (`read_rows`), made contiguous for the message to the other rank,
  and each rank's heads copied into its cache (`ModelShard.write_kv`); now: each rank's heads written into its
  file (`Transport.write` over ranked targets: `shard_rows`, then the write).
Over zmq the receiving side (the row sockets a decode engine process serves) runs on threads of this process,
its copies counted with the rest.

    .venv/bin/python benchmarks/kv_transfer_ranks.py [--backend shm|zmq] [--tokens 2000] [--kv-heads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kv_transfer import kv_shape_args  # noqa: E402
from vlserve.disagg.transports import TRANSPORTS  # noqa: E402
from vlserve.disagg.transports.zmq import RowServer, ZmqTransport  # noqa: E402
from vlserve.engine.kv_handoff import kv_to_rows, rows_to_kv  # noqa: E402
from vlserve.engine.model_shard import ModelShard, gathered_heads, kv_heads_of  # noqa: E402
from vlserve.engine.ranked_kv import RankedKV  # noqa: E402
from vlserve.engine.transfer_buffers import TransferBuffers  # noqa: E402

BLOCK_ROWS = 16
GRANT = "bench"
COPYING = {"copy_", "clone", "index_select", "index_copy_", "index_copy", "_to_copy", "cat", "stack", "index_put_"}


class CopyCounter(TorchDispatchMode):
    """Adds up the bytes every copying torch operation writes (its output; copy_'s destination)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in COPYING:
            written = args[0] if func.__name__.startswith(("copy_", "index_copy_", "index_put_")) else out
            self.nbytes += written.numel() * written.element_size()
        return out


def socket_hop(t: torch.Tensor, counter: CopyCounter) -> None:
    """A message between two processes carrying `t`: into the kernel and out again."""
    counter.nbytes += 2 * t.numel() * t.element_size()


def count_socket_copies() -> None:
    """zmq: each write's rows go through a socket (2 copies, counted by the sender) and the receiving thread's copy
    into the blocks counts too (its thread runs under the same counter)."""
    send, receive = ZmqTransport.write_rows, RowServer._write

    def counted_send(self, target, block_ids, rows):
        if CopyCounter.current is not None:
            socket_hop(rows, CopyCounter.current)
        return send(self, target, block_ids, rows)

    def counted_receive(self, msg, data):
        if CopyCounter.current is None:
            return receive(self, msg, data)
        with CopyCounter.current:
            return receive(self, msg, data)
    ZmqTransport.write_rows, RowServer._write = counted_send, counted_receive


def main() -> None:
    ap = kv_shape_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), rounds=5)
    ap.add_argument("--backend", default="shm", choices=["shm", "zmq"])
    args = ap.parse_args()
    dtype, layers, heads, dim, n = getattr(torch, args.dtype), args.layers, args.kv_heads, args.head_dim, args.tokens
    width = layers * 2 * heads * dim
    num_blocks = -(-n // BLOCK_ROWS)
    slots = torch.arange(n)
    blocks = list(range(num_blocks))
    row_bytes = n * width * torch.empty((), dtype=dtype).element_size()

    def rank_files(ranks: int) -> RankedKV:
        split = [kv_heads_of(heads, dim, r, ranks) for r in range(ranks)]
        files = [TransferBuffers.create(num_blocks, BLOCK_ROWS, layers * 2 * c * dim, dtype, parts=layers * 2)
                 for _, c in split]
        return RankedKV(files, split, heads)

    # The prefill's KV cache at 1 rank (private) and at 2 (each rank's file), holding the same prompt.
    whole = torch.randn(layers, 2, num_blocks * BLOCK_ROWS, heads, dim).to(dtype)
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=1), device=torch.device("cpu"),
                               kv_caches=list(whole), kv_layers=list(range(layers)), _rows_scratch=None)
    prefill2 = rank_files(2)
    for rank, (first, count) in enumerate(prefill2.heads):
        prefill2.shards[rank].planes.view(layers, 2, -1, count, dim).copy_(whole[:, :, :, first : first + count])
    order = gathered_heads(heads, dim, 2)

    def read_gathered() -> torch.Tensor:  # the engine thread's export at 2 ranks (before): ModelShard.read_kv
        parts = []
        for rank, (first, count) in enumerate(prefill2.heads):  # each rank's own heads at the slots
            part = prefill2.shards[rank].planes.view(layers, 2, -1, count, dim)
            parts.append(torch.stack([part[i].index_select(1, slots) for i in range(layers)]))
        # ShmCollectives.all_gather: each part written into shared memory, read out (cloned), its chunks joined,
        # then the parts joined along the heads
        read_out = [torch.cat([p.clone().clone()]) for p in parts]
        return kv_to_rows(torch.cat(read_out, dim=3).index_select(3, order))

    reads = {1: lambda: ModelShard.read_kv_rows(one_rank, slots, scratch=True),
             "2 before": read_gathered, "2 now": lambda: prefill2.read_slots(slots)}

    decode1 = TransferBuffers.create(num_blocks, BLOCK_ROWS, width, dtype, parts=layers * 2)
    receive = TransferBuffers.create(num_blocks, BLOCK_ROWS, width, dtype)
    decode2 = rank_files(2)
    for buffers in (decode1, receive, decode2):  # one transfer holds every block (a row socket checks it)
        buffers.grants.open(GRANT, blocks)
    caches2 = [torch.zeros(layers, 2, num_blocks * BLOCK_ROWS, c, dim, dtype=dtype) for _, c in decode2.heads]
    backend = TRANSPORTS[args.backend]
    receiver, sender = backend(), backend()  # the decode engine's (a zmq row socket per file) and the prefill's
    targets = {name: msgspec.structs.replace(receiver.register(b), grant=GRANT)
               for name, b in (("one", decode1), ("receive", receive), ("ranks", decode2))}
    if args.backend == "zmq":
        count_socket_copies()

    def write_one(rows):  # in place at one rank
        sender.write(targets["one"], blocks, rows)

    def write_two_before(rows):  # receive blocks, then admission: read back, the message, each rank's heads
        sender.write(targets["receive"], blocks, rows)
        kv = rows_to_kv(receive.read_rows(blocks, 0, rows.shape[0]), layers, heads, dim)
        message = kv.contiguous()
        if CopyCounter.current is not None:
            socket_hop(message, CopyCounter.current)
        for rank, (first, count) in enumerate(decode2.heads):
            mine = message.narrow(3, first, count)
            for cache, layer in zip(caches2[rank], mine):
                cache.index_copy_(1, slots, layer)

    def write_two_now(rows):
        sender.write(targets["ranks"], blocks, rows)

    writes = {1: write_one, "2 before": write_two_before, "2 now": write_two_now}

    def measure(read, write) -> tuple[float, float]:
        """(median ms, copies per token row) of reading the prompt's rows at the prefill and writing them."""
        write(read())  # warm: pages touched, files mapped
        counter = CopyCounter()
        CopyCounter.current = counter
        with counter:
            write(read())
        CopyCounter.current = None
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            write(read())
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3, counter.nbytes / row_bytes

    CopyCounter.current = None
    copy_target = torch.empty(n, width, dtype=dtype)
    source = torch.randn(n, width).to(dtype)
    bound = statistics.median([_timed(lambda: copy_target.copy_(source)) for _ in range(args.rounds)]) * 1e3
    print(f"{n} tokens x {width} {args.dtype} ({layers} layers x K,V x {heads} heads x {dim}): "
          f"{row_bytes / 1e6:.1f} MB of KV over {args.backend}, medians of {args.rounds}; one memory copy "
          f"{bound:.2f} ms")
    print(f"{'prefill ranks -> decode ranks':<32} {'before':>24} {'now':>24}")
    try:
        for p, d in [(1, 1), (2, 1), (1, 2), (2, 2)]:
            cells = []
            for when in ("before", "now"):
                read = reads[p] if p == 1 else reads[f"2 {when}"]
                write = writes[d] if d == 1 else writes[f"2 {when}"]
                ms, copies = measure(read, write)
                cells.append(f"{ms:7.1f} ms {copies:4.1f} copies")
            print(f"{f'TP{p} -> TP{d}':<32} {cells[0]:>24} {cells[1]:>24}")
        got = decode2.read_rows(blocks, 0, n)  # what the ranks hold is the prompt's KV, whatever the path
        if not torch.equal(got, kv_to_rows(whole[:, :, :n])):
            raise SystemExit("the KV written into the ranks' files differs from the prefill's")
    finally:
        sender.close()
        receiver.close()
        for f in [decode1, receive, *decode2.shards, *prefill2.shards]:
            f.unlink()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
