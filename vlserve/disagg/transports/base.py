"""The transport interface: the sender delivers a chunk's rows into the receiver's blocks by block id, the
receiver makes sure they are in those blocks when the header is handled. The chunk's token ids and positions
(small integers) always travel as frames beside the header, whatever the transport, and come back from
`receive`: they never take room in the blocks.

Every transport writes the rows into the blocks named by the header before the header goes: shared memory on one
host, Mooncake and NIXL straight into the receiver's memory, ZeroMQ over the receiver's row socket (a thread of the
process that holds the blocks copies them in); `receive` then only checks the header. The block layout
(engine.transfer_buffers) is the contract both sides share; the receiver describes its buffers once (`target`), and
every request carries that description to the sender (an encoder or a prefill instance).
"""

from __future__ import annotations

import asyncio
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import zmq.asyncio

from vlserve.core.errors import ConfigurationError
from vlserve.core.processes import finish
from vlserve.core.wire import Framer, tensor_from, tensor_ref
from vlserve.disagg.messages import RankTarget, SenderToReceiver, TransferChunk, TransferTarget
from vlserve.engine.ranked_kv import heads_cover, shard_rows
from vlserve.engine.transfer_buffers import DTYPES, TransferBuffers


@dataclass
class ChunkData:
    """What one chunk moves: every token's fill id and positions, and its rows (media tokens' embeddings, or
    every token's KV), which fill the run's slots from the first on."""

    fill_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n, k] int64
    rows: torch.Tensor  # [m, width], in the order of the header's segments (m may be 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fill_ids, self.positions, self.rows))


@dataclass
class ChunkTokens:
    """What `receive` hands back besides the rows it put in the blocks: the chunk's fill ids and positions."""

    fill_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n, k] int64
    nbytes: int  # the payload the chunk stands for (rows included, wherever they travelled)


ABORT_ACK_STATUS = 499  # a sender's TransferFailed answering AbortTransfer: nothing more is written
QUARANTINE_ENV = "VLSERVE_TRANSFER_QUARANTINE_S"
DEFAULT_QUARANTINE_S = 15.0


def quarantine_s() -> float:
    """How long a receiver holds the blocks of a failed in-place transfer waiting for the sender's word that
    nothing more is written ($VLSERVE_TRANSFER_QUARANTINE_S, default 15 s). A sender's own writes give up at two
    thirds of it (`write_timeout_s`), so set it alike on every role."""
    text = os.environ.get(QUARANTINE_ENV)
    if text is None:
        return DEFAULT_QUARANTINE_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1.0 <= value <= 3600.0:
        raise ConfigurationError(f"{QUARANTINE_ENV}={text!r}: give seconds between 1 and 3600")
    return value


def write_timeout_s() -> float:
    """How long a sender's write into the receiver's memory may take before it gives up: below the receiver's
    quarantine, so a write never lands in blocks already given to another request."""
    return quarantine_s() * 2 / 3


class Transport(ABC):
    """Writes a chunk's rows into the receiver's blocks itself (`write_rows`), then sends the header with the
    token frames; the receiver checks the header. After a failure the blocks wait for the sender's word that
    nothing more is written (the peer client's quarantine)."""

    name: str
    maps_receiver_file = False  # senders open the receive buffers' file by name: it must keep its name
    # The receiver's own thread copies each write's rows in (zmq): with `check_finite` set (receivers whose every
    # row is a value) it refuses rows holding NaN or inf; one-sided writes cannot be refused.
    copies_rows_in = False
    check_finite = False
    # Its `write_rows` takes rows by plane [m, parts, part width] (a view of whole rows: one rank's heads) and
    # copies them in as they are; others get rows of their own.
    writes_planes = False
    # Its `write_rows` also puts rows anywhere in the run (`first_row`) and some planes only (`first_plane`): a
    # prefill engine writes each layer's keys and values as the layer is computed (kv_connector.prefill).
    # Others take whole rows from the run's first slot.
    writes_layers = False

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None):
        """`host`: this process's address as peers reach it (transports with their own listener use it);
        `secret`: the deployment's --disagg-secret (a transport with sockets of its own secures them with it)."""
        self.host = host
        self.framer = Framer(SenderToReceiver)

    def target(self, buffers: TransferBuffers) -> TransferTarget:
        """Receiver side, once: what a sender needs to write into `buffers`."""
        raise NotImplementedError(f"the {self.name} transport of this process receives nothing")

    def register(self, buffers) -> TransferTarget:
        """`target`, also for a KV cache kept by several ranks (engine.ranked_kv.RankedKV): each rank's file
        registered on its own, the whole rows' layout around them."""
        shards = getattr(buffers, "shards", None)
        if shards is None:
            return self.target(buffers)
        ranks = [self.target(s) for s in shards]
        return TransferTarget(self.name, buffers.layout, heads=list(buffers.heads), shards=[
            RankTarget(t.layout, t.session, t.base_address, t.agent_metadata) for t in ranks])

    def write(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
              first_plane: int = 0) -> int:
        """`write_rows`, also into a KV cache kept by several ranks: each rank gets its heads of the rows (in the
        rank's own write, checked like any). Rows are whole [m, width], or some planes [m, planes, part width]
        from `first_plane` on (a transport that `writes_layers`), put at run rows first_row.. ."""
        if (first_row or first_plane or rows.dim() != 2) and not self.writes_layers:
            raise ValueError(f"the {self.name} transport writes whole rows from the run's first slot only")
        if not target.shards:
            return self.write_rows(target, block_ids, rows, first_row, first_plane)
        if rows.dim() not in (2, 3):
            raise ValueError(f"rows are [m, width] or [m, planes, part width], got {tuple(rows.shape)}")
        # first: the whole rows' width is then the rows' own
        check_run(target.layout, block_ids, rows, first_row, first_plane)
        head_dim = check_shards(target)
        planes = target.layout.parts if rows.dim() == 2 else rows.shape[1]
        num_heads = target.layout.part_width // head_dim
        written = 0
        for rank, (first, count) in zip(target.shards, target.heads):
            heads = shard_rows(rows.reshape(rows.shape[0], -1), planes, num_heads, first, count)
            whole = rows.dim() == 2 and not self.writes_planes
            written += self.write_rows(TransferTarget(target.backend, rank.layout, rank.session, rank.base_address,
                                                      rank.agent_metadata, grant=target.grant), block_ids,
                                       heads.reshape(heads.shape[0], -1) if whole else heads, first_row,
                                       first_plane)
        return written

    async def send(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk, data: ChunkData,
                   target: TransferTarget | None) -> int:
        """Sender side: deliver `data` into the receiver's `header.block_ids`; returns the payload bytes."""
        target = check_target(target, self.name)
        check_chunk(header, data, target.layout.width)
        if data.rows.numel():
            await in_thread(self.write, target, header.block_ids, data.rows)
        await self.send_header(sock, peer, header, data)
        return data.nbytes

    async def send_header(self, sock: zmq.asyncio.Socket, peer: bytes, header: TransferChunk,
                          data: ChunkData) -> None:
        """The header and the chunk's tokens, once its rows are in the receiver's blocks (written by `send`, or
        by another process of this instance: a prefill engine writes its KV itself)."""
        tensors: list[torch.Tensor] = []
        header.fill_ids, header.positions = tensor_ref(data.fill_ids, tensors), tensor_ref(data.positions, tensors)
        await sock.send_multipart([peer, *self.framer.encode(header, tensors)], copy=False)

    @abstractmethod
    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        """Puts `rows` [m, width] into the receiver's run `block_ids` from its first slot (a transport that
        `writes_layers`: from run row `first_row`, and [m, planes, part width] into planes first_plane..),
        blocking until they have landed (callers run it off the event loop); returns the bytes written."""

    async def receive(self, header: TransferChunk, frames: list, buffers: TransferBuffers) -> ChunkTokens:
        """Receiver side: the chunk's rows are in `header.block_ids` already; returns its fill ids and positions.
        Raises ValueError for a malformed chunk."""
        if header.rows is not None or len(frames) > 3:
            raise ValueError(f"a {self.name} chunk's rows are written in place; it must not carry them as frames")
        fill_ids, positions = chunk_tokens(header, frames)
        return ChunkTokens(fill_ids, positions, header_nbytes(header, buffers.layout))

    def close(self) -> None:
        pass


class HeadersOnly(Transport):
    """The sending front end of a prefill instance whose engine process writes the KV rows itself
    (transports.row_writer): it sends the chunks' headers under the backend's name and never touches a row, so it
    needs none of the backend's own machinery (no Mooncake engine, no NIXL agent) in this process."""

    def __init__(self, name: str, host: str = "127.0.0.1"):
        super().__init__(host)
        self.name = name

    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        raise RuntimeError(f"the {self.name} rows of this instance are written by its engine process")


async def in_thread(fn, *args):
    """`fn(*args)` on a worker thread, so a copy that grows with a request never holds up the event loop. A
    caller cancelled meanwhile still returns only once `fn` has ended, then raises CancelledError: a write into
    receive blocks must land before anyone may free those blocks or say that nothing more is written."""
    return await finish(asyncio.get_running_loop().run_in_executor(None, fn, *args))


def check_target(target: TransferTarget | None, backend: str) -> TransferTarget:
    if target is None or target.backend != backend:
        have = "frames (an older vlserve)" if target is None else target.backend
        raise ValueError(f"this peer sends with --transfer-backend {backend}, the receiver expects "
                         f"{have}: start every role with the same backend")
    return target


MAX_SHARDS = 64  # ranks of a receiving KV cache a target may name


def check_shards(target: TransferTarget) -> int:
    """A target of several ranks' files (a receiver's word, so checked; its whole rows' layout checked against the
    rows first): each rank's file holds its heads of every plane of the whole rows, and every head is kept
    somewhere. Returns the head size."""
    whole = target.layout
    if not 0 < len(target.shards) == len(target.heads) <= MAX_SHARDS:
        raise ValueError(f"a target of {len(target.shards)} ranks naming heads of {len(target.heads)}")
    if any(lay.parts <= 0 or lay.width <= 0 or lay.width % lay.parts for lay in
           [whole, *(rank.layout for rank in target.shards)]):
        raise ValueError("a KV file's layout does not split its rows into planes")
    first_count = target.heads[0][1]
    if first_count <= 0 or target.shards[0].layout.part_width % first_count:
        raise ValueError("a rank's KV file does not hold whole heads")
    head_dim = target.shards[0].layout.part_width // first_count
    if whole.part_width % head_dim:
        raise ValueError("a rank's KV file does not hold whole heads")
    num_heads = whole.part_width // head_dim
    for rank, (_, count) in zip(target.shards, target.heads):
        lay = rank.layout
        if lay.part_width != count * head_dim or lay.parts != whole.parts \
                or (lay.num_blocks, lay.block_tokens, lay.dtype) != (whole.num_blocks, whole.block_tokens,
                                                                      whole.dtype):
            raise ValueError(f"a rank's KV file {lay} does not fit the whole rows' layout {whole}")
    if not heads_cover(target.heads, num_heads):
        raise ValueError(f"the ranks' KV files hold heads {target.heads}, not each of {num_heads}")
    return head_dim


def check_run(layout, block_ids: list[int], rows: torch.Tensor, first_row: int = 0, first_plane: int = 0) -> None:
    """`rows` [m, width] (or by plane, [m, planes, part width] for planes first_plane..) fit the receiver's run
    `block_ids` from its row `first_row` (every transport that writes a receiver's memory checks this first:
    nothing outside its blocks is ever touched)."""
    if not block_ids or any(not 0 <= b < layout.num_blocks for b in block_ids):
        raise ValueError(f"block ids outside the receiver's {layout.num_blocks} blocks")
    span = len(block_ids) * layout.block_tokens
    if layout.parts <= 0 or layout.width % layout.parts:
        raise ValueError(f"a layout of {layout.parts} planes does not split rows of width {layout.width}")
    whole = rows.dim() == 2 and rows.shape[1] == layout.width and first_plane == 0
    by_plane = rows.dim() == 3 and rows.shape[2] == layout.part_width and rows.shape[1] > 0 \
        and 0 <= first_plane and first_plane + rows.shape[1] <= layout.parts
    if not (whole or by_plane) or first_row < 0 or first_row + rows.shape[0] > span:
        raise ValueError(f"{tuple(rows.shape)} rows from row {first_row} (plane {first_plane}) do not fit the "
                         f"{span} slots of {layout.parts} planes of width {layout.part_width} of their blocks")


def write_run(buffers: TransferBuffers, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
              first_plane: int = 0) -> int:
    """`rows` into the run `block_ids` of `buffers` from its row `first_row` (and plane `first_plane`), checked to
    fit; returns the bytes."""
    check_run(buffers.layout, block_ids, rows, first_row, first_plane)
    buffers.write_rows(block_ids, torch.arange(first_row, first_row + rows.shape[0]), rows, first_plane)
    return rows.numel() * buffers.element_size


MAX_POSITION_ROWS = 4  # rows of positions a token may carry (the model's `position_rows`: 1 or 3 today)


def positions_fit(positions: torch.Tensor, num_tokens: int) -> bool:
    """[num_tokens, k] with 1 <= k <= MAX_POSITION_ROWS (the engine checks k against its model when it admits the
    prompt)."""
    return positions.dim() == 2 and positions.shape[0] == num_tokens and 1 <= positions.shape[1] <= MAX_POSITION_ROWS


def chunk_tokens(header: TransferChunk, frames: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's fill ids [n] and positions [n, k], as they came in frames, checked."""
    if header.fill_ids is None or header.positions is None:
        raise ValueError("a chunk must carry its fill ids and positions as frames")
    fill_ids, positions = tensor_from(header.fill_ids, frames), tensor_from(header.positions, frames)
    if fill_ids.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("fill ids and positions must be int64")
    if tuple(fill_ids.shape) != (header.num_tokens,) or not positions_fit(positions, header.num_tokens):
        raise ValueError(f"a chunk of {header.num_tokens} tokens carries fill ids {tuple(fill_ids.shape)} and "
                         f"positions {tuple(positions.shape)}")
    return fill_ids, positions


def check_chunk(header: TransferChunk, data: ChunkData, width: int) -> None:
    if data.fill_ids.shape != (header.num_tokens,) or not positions_fit(data.positions, header.num_tokens):
        raise ValueError(f"a chunk of {header.num_tokens} tokens carries {tuple(data.fill_ids.shape)} fill ids and "
                         f"{tuple(data.positions.shape)} positions")
    rows = chunk_num_rows(header)
    if data.rows.numel() and (data.rows.dim() != 2 or data.rows.shape[1] != width):
        raise ValueError(f"embedding rows must be [{rows}, {width}], got {tuple(data.rows.shape)}")
    if (data.rows.shape[0] if data.rows.numel() else 0) != rows:
        raise ValueError(f"the segments name {rows} embedding rows, the chunk carries {tuple(data.rows.shape)}")


def chunk_num_rows(header: TransferChunk) -> int:
    """Rows the chunk puts in its run (slots 0 .. rows - 1), in the order of its segments."""
    return sum(s.num_rows for s in header.segments)


def header_nbytes(header: TransferChunk, layout) -> int:
    """The payload a chunk whose rows were written in place stands for (what a frame transport would carry)."""
    itemsize = torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
    return header.num_tokens * 4 * 8 + chunk_num_rows(header) * layout.width * itemsize
