"""Typed messages between a receiver of rows and the peer that sends them, framed like the engine's (core.wire): a
msgpack header, then raw tensor frames it refers to. Nothing is pickled.

Two pairings speak this protocol: a language server (or prefill instance) receiving media rows from an encoder,
and a decode instance receiving KV rows from a prefill instance (the request then carries the sampling
parameters, the chunks every prompt token's KV row, and the last chunk the prefill's first token: `handoff`).

Receiver -> sender (DEALER -> ROUTER): TransferRequest, ResumeRequest, RowsGiven, AbortTransfer, Ping.
Sender -> receiver (the same connection back): TransferChunk (+ tensor frames), RowsWanted, TransferFailed, Pong.

An encoder's rows follow a run at a time (a partial chunk, then the receiver resumes with the next run). A prefill
instance asks for the blocks beyond the first run before it computes the prompt (`RowsWanted` -> `RowsGiven`,
appended to the first run), so that its engine writes every row as it computes; one chunk's header follows.
Peers pair only when they speak the same `PROTOCOL` (a `Pong` says which): a mixed deployment in the middle of an
upgrade sends each request to a peer of its own version, or fails it over with a clear 503.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from vlserve.core.lora import PeerAdapter
from vlserve.core.messages import Handoff
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import TensorRef
from vlserve.engine.transfer_buffers import BufferLayout


PROTOCOL = 2  # 2: RowsWanted/RowsGiven (a prefill asks for its blocks first), no KV resume


class TransferState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # picking a peer, allocating receive blocks
    WAITING_FOR_INPUT = "waiting_for_input"  # request sent; the peer works on it (encodes, or prefills)
    TRANSFERRING = "transferring"  # chunks arriving
    SUCCESS = "success"
    FAILED = "failed"  # the peer or the transfer failed (retried elsewhere, or a 503)
    REJECTED = "rejected"  # the request itself was bad (a 4xx for the user); nothing failed


class RankTarget(msgspec.Struct, array_like=True):
    """One rank's file of a KV cache kept by several ranks: where a transport writes it (as `TransferTarget` says;
    its backend and grant are the whole target's)."""

    layout: BufferLayout
    session: str = ""
    base_address: int = 0
    agent_metadata: bytes = b""


class TransferTarget(msgspec.Struct):
    """Where a transport that writes the receiver's memory itself puts a chunk: the receive buffers' layout
    (shm: the shared file to map), and for Mooncake the receiver's session and the buffers' address."""

    backend: str
    layout: BufferLayout
    session: str = ""  # mooncake: "host:port" of the receiver's transfer engine; nixl: its agent name
    base_address: int = 0  # mooncake, nixl: address of the receiver's registered buffers
    agent_metadata: bytes = b""  # nixl: the receiver agent's metadata (its UCX address)
    # the transfer's grant, set per request: a zmq row socket takes a write only into blocks reserved under it
    grant: str = ""
    # A decode engine at several ranks (engine.ranked_kv): `layout` is its whole rows' and each rank's file is a
    # target of its own, holding heads `heads[r]` = (first, count) of each plane; a row is written to every rank.
    shards: list[RankTarget] = []
    heads: list[tuple[int, int]] = []


class TransferRequest(msgspec.Struct, tag="transfer"):
    """A prompt for a peer to work on, and the first run of receive blocks its rows go to."""

    request_id: str
    transfer_id: int  # distinguishes a retry of the same request
    prompt: str  # rendered prompt text with one placeholder per media item
    media: dict[str, list[Any]]  # kind -> URLs (fetched by the peer) or embedding entries
    uuids: dict[str, list[Any]]
    mm_processor_kwargs: dict[str, Any]
    block_ids: list[int]  # the receiver's blocks for rows 0, 1, ... (the first run)
    block_tokens: int  # rows per block
    target: TransferTarget | None = None  # None: the data travels as frames (zmq)
    params: SamplingParams | None = None  # to a prefill instance: how to sample the first token
    # the LoRA adapter: to an encoder, one of the towers to run the media with; to a prefill instance, the
    # request's (None: the base model). By name and content only: the peer applies it only if it serves it.
    lora: PeerAdapter | None = None
    # To a prefill instance: seconds from this request's arrival within which a write into these blocks may start
    # (its engine writes them while it computes the prompt); the receiver keeps them that long, then its
    # quarantine, when it gives up without the sender's word (0: the sender's own --transfer-timeout).
    write_within_s: float = 0.0


class ResumeRequest(msgspec.Struct, tag="resume"):
    """The receiver holds tokens [0, start_token) and has a fresh run of blocks for the rows of the rest."""

    request_id: str
    transfer_id: int
    start_token: int
    block_ids: list[int]


class RowsGiven(msgspec.Struct, tag="rows_given"):
    """The answer to a `RowsWanted`: the run of blocks for the rows asked for, which the sender's next chunk
    fills from its first slot."""

    request_id: str
    transfer_id: int
    block_ids: list[int]


class AbortTransfer(msgspec.Struct, tag="abort"):
    request_id: str
    transfer_id: int


class Ping(msgspec.Struct, tag="ping"):
    nonce: int


ReceiverToSender = TransferRequest | ResumeRequest | RowsGiven | AbortTransfer | Ping


class ItemMeta(msgspec.Struct, array_like=True):
    offset: int
    num_tokens: int
    layout: tuple[int, int, int]
    mm_hash: str
    modality: str = "image"


class RowSegment(msgspec.Struct, array_like=True):
    """`num_rows` rows for prompt tokens token..token+num_rows (all inside one media item, or any tokens for KV)."""

    token: int
    num_rows: int


class TransferChunk(msgspec.Struct, tag="chunk"):
    """Prompt tokens [start_token, start_token + num_tokens). Every token's fill id and positions travel as frames;
    the rows (`segments` say of which tokens, in order) fill the receiver's run `block_ids` from its first slot,
    as frames (zmq) or written in place. Text tokens take a row only for KV. The chunk ends where the run is full
    (disagg.row_map); `partial`: more follows once the receiver offers blocks for it (resume)."""

    request_id: str
    transfer_id: int
    start_token: int
    num_tokens: int
    total_tokens: int  # aux: the true prompt length after placeholder expansion
    position_delta: int  # aux
    items: list[ItemMeta]
    block_ids: list[int]
    segments: list[RowSegment]
    partial: bool
    fill_ids: TensorRef | None = None  # [num_tokens] int64 (set by the transport)
    positions: TensorRef | None = None  # [num_tokens, k] int64 (k: the model's position rows)
    rows: TensorRef | None = None  # [sum of segment rows, width]; None when the transport wrote them in place
    handoff: Handoff | None = None  # from a prefill instance, on the last chunk: its first token, random state


class RowsWanted(msgspec.Struct, tag="rows_wanted"):
    """From a prefill instance that knows its prompt's length: its rows need `num_rows` more than the first run
    holds (the rest of its tokens' KV rows, then a hybrid model's state rows). Answered by a `RowsGiven`."""

    request_id: str
    transfer_id: int
    num_rows: int


class TransferFailed(msgspec.Struct, tag="failed"):
    request_id: str
    transfer_id: int
    message: str
    status: int = 503  # 4xx when the request itself is bad (not an image, too many items, too large, ...)


class Pong(msgspec.Struct, tag="pong"):
    """Liveness, load, and what the peer produces, so a receiver never pairs with a mismatched one."""

    nonce: int
    load: int
    architecture: str
    hidden_size: int
    side_rows: int  # an encoder sends hidden_size x (1 + side_rows) columns per media token
    kv_width: int = 0  # a prefill instance: the KV row width it sends per token (0: an encoder)
    state_rows: int = 0  # a prefill instance of a hybrid model: rows of linear states after the prompt's KV rows
    modalities: list[str] = []  # an encoder: the media kinds its towers encode (a prefill instance: none)
    boot: str = ""  # random per process: a receiver tells a peer restarted at the same address by it
    protocol: int = 1  # the transfer protocol it speaks (`PROTOCOL`; before it was sent, 1)


SenderToReceiver = TransferChunk | RowsWanted | TransferFailed | Pong
