"""Typed messages between language servers and encoders (msgspec msgpack; tensors travel as raw frames).

Language -> encoder (DEALER -> ROUTER): EncodeRequest, ResumeRequest, AbortTransfer, Ping.
Encoder -> language (the same connection back): TransferChunk (+ tensor frames), TransferFailed, Pong.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class TransferState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # picking an encoder, allocating receive blocks
    WAITING_FOR_INPUT = "waiting_for_input"  # request sent; the encoder fetches, preprocesses and encodes
    TRANSFERRING = "transferring"  # chunks arriving
    SUCCESS = "success"
    FAILED = "failed"


class EncodeRequest(msgspec.Struct, tag="encode"):
    request_id: str
    transfer_id: int  # distinguishes a retry of the same request
    prompt: str  # rendered prompt text with one placeholder per media item
    media: dict[str, list[Any]]  # kind -> URLs / data URLs (fetched by the encoder) or embedding entries
    uuids: dict[str, list[Any]]
    mm_processor_kwargs: dict[str, Any]
    block_ids: list[int]  # receiver blocks for the first chunk
    block_tokens: int


class ResumeRequest(msgspec.Struct, tag="resume"):
    """The receiver kept `start_token` tokens and has fresh blocks for the rest."""

    request_id: str
    transfer_id: int
    start_token: int
    block_ids: list[int]


class AbortTransfer(msgspec.Struct, tag="abort"):
    request_id: str
    transfer_id: int


class Ping(msgspec.Struct, tag="ping"):
    nonce: int


LanguageToEncoder = EncodeRequest | ResumeRequest | AbortTransfer | Ping


class ItemMeta(msgspec.Struct, array_like=True):
    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    mm_hash: str


class TransferChunk(msgspec.Struct, tag="chunk"):
    """Tokens [start_token, start_token + num_tokens) of the encoder output, written into `block_ids`.

    Frames after the header: embeddings [n, hidden], fill ids [n], M-RoPE positions [3, n] (raw bytes,
    dtypes below). `partial` means more tokens follow once the receiver asks to resume.
    """

    request_id: str
    transfer_id: int
    start_token: int
    num_tokens: int
    total_tokens: int  # aux: the true prompt length after expansion
    mrope_delta: int  # aux
    items: list[ItemMeta]
    block_ids: list[int]
    partial: bool
    embed_dtype: str
    hidden: int


class TransferFailed(msgspec.Struct, tag="failed"):
    request_id: str
    transfer_id: int
    message: str
    status: int = 503  # 400 when the request itself is bad (not an image, too many items, ...)


class Pong(msgspec.Struct, tag="pong"):
    nonce: int
    load: int


EncoderToLanguage = TransferChunk | TransferFailed | Pong
