"""Messages between the front-end and the engine-core process, and how they travel over ZeroMQ.

A message is a msgspec-msgpack header (a tagged union, so the receiver knows its type) followed by one raw
frame per tensor: pixel values and positions go as bytes without passing through the encoder.
Nothing here is pickled, so a socket only ever yields these typed structs or a decode error.
"""

from __future__ import annotations

import msgspec
import torch

from vlserve.core.lora import AdapterRef
from vlserve.core.messages import EngineCoreOutput, Handoff
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)}


class TensorRef(msgspec.Struct, array_like=True):
    """Where a tensor travels: frame `frame` of the multipart message holds its raw bytes."""

    dtype: str
    shape: list[int]
    frame: int


class WireMMItem(msgspec.Struct, array_like=True):
    offset: int
    num_tokens: int
    layout: tuple[int, int, int]
    mm_hash: str
    pixel_values: TensorRef | None
    embeddings: TensorRef | None = None
    modality: str = "image"
    audio_features: TensorRef | None = None
    audio_len: int = 0


# ---- front-end -> engine core ---------------------------------------------------------------------------
class KVSend(msgspec.Struct, array_like=True):
    """Prefill instance: the KV rows of the prompt's tokens [0, end) (and a hybrid model's state rows when `end`
    is its last token) go to `destination` from the engine process as the prompt is computed (opaque here: the
    disaggregation layer's encoding of the receiver's blocks for them), each write starting by `not_after`
    (time.time()) or never. Answered by a `KVWritten` with `write_id` once every write has ended
    (engine.kv_connector.layer_sends)."""

    write_id: int
    end: int
    destination: bytes
    not_after: float


class AddRequest(msgspec.Struct, tag="add"):
    """One API request; the engine fans it out into its n samples (see `fan_out`)."""

    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[WireMMItem]
    positions: TensorRef
    position_delta: int
    params: SamplingParams
    arrival_time: float
    block_rows: list[int] | None = None  # receive blocks holding the prompt's media rows, item after item
    handoff: Handoff | None = None  # decode instance: prefilled elsewhere; `block_rows` hold its KV rows
    lora: AdapterRef | None = None  # its LoRA adapter
    kv_send: KVSend | None = None  # prefill instance: where its KV goes as it is computed


class FinishRequests(msgspec.Struct, tag="finish"):
    """Abort (client gone) or stop (the front-end matched a stop string): the engine frees their blocks."""

    request_ids: list[str]
    reason: str = "abort"  # "abort" | "stop"


class ReserveKV(msgspec.Struct, tag="reserve_kv"):
    """Decode instance: KV blocks for `num_rows` rows of a prompt a peer computes (its KV, then a hybrid model's
    state rows), held under `holder` (one transfer) until a request arriving with them takes them
    (`AddRequest.block_rows`) or `ReleaseKV` lets them go. Answered once by a `KVReserved` with the same id: when
    the blocks are there (a reservation waits in the engine, in the order they came, as requests free blocks),
    at once when it never could be, or with none when `CancelReserveKV` came first."""

    holder: str
    reserve_id: int
    num_rows: int


class ReleaseKV(msgspec.Struct, tag="release_kv"):
    """Decode instance: `holder`'s reserved blocks go back to the pool (`block_ids`: those of them; None: all).
    Blocks a request has taken are its own by then and stay."""

    holder: str
    block_ids: list[int] | None = None


class CancelReserveKV(msgspec.Struct, tag="cancel_reserve_kv"):
    """Decode instance: the asker of a `ReserveKV` gave up (its transfer failed, or timed out waiting)."""

    reserve_id: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequest | FinishRequests | ReserveKV | ReleaseKV | CancelReserveKV | Shutdown


# ---- engine core -> front-end ---------------------------------------------------------------------------
class EngineStats(msgspec.Struct):
    """Scheduler state after a step; counters are cumulative since the engine started."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    kv_cache_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    state_snapshot_queries_total: int = 0
    state_snapshot_hits_total: int = 0
    state_cache_usage_perc: float = 0.0
    encoder_cache_queries_total: int = 0
    encoder_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    encoder_seconds: list[tuple[str, float]] = []  # (tower, seconds) of tower calls since the last message
    kv_rows_kept: int = 0  # prefill engine with a row writer: requests whose KV rows it keeps to write
    kv_blocks_reserved: int = 0  # decode engine: KV blocks reserved for peers' writes that no request took yet


class RequestRejected(msgspec.Struct, array_like=True):
    """The engine refused a request at admission (e.g. it can never fit the KV pool)."""

    request_id: str
    message: str
    status: int = 400


class HandedKV(msgspec.Struct, array_like=True):
    """A finished request exported by a prefill engine: its KV stays in the engine process, which writes it into
    the receiver itself (`KVSend`); this carries its random state."""

    request_id: str
    generator_state: bytes | None = None


class KVWritten(msgspec.Struct, array_like=True):
    """The answer to a `KVSend`: the bytes written, or why not all were."""

    request_id: str
    write_id: int
    nbytes: int = 0
    error: str | None = None


class KVReserved(msgspec.Struct, array_like=True):
    """The answer to a `ReserveKV`: the blocks, in row order; None with `error` when it never could be (more than
    the whole pool, an engine that reserves nothing), without when it was cancelled (or, from
    `KVConnector.reserve` itself, while the pool is short)."""

    reserve_id: int
    block_ids: list[int] | None = None
    error: str | None = None


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    rejected: list[RequestRejected]
    stats: EngineStats
    released: list[str] = []  # requests whose prompt buffers the engine no longer reads: they may be freed
    # Requests still running whose prompt buffers it stopped reading (a decode engine copied their KV in): freed
    # now; each comes in `released` too once it has left (after this, or in the same message).
    inputs_released: list[str] = []
    handed: list[HandedKV] = []  # prefill instance: KV of requests that finished (its KV connector's exports)
    written: list[KVWritten] = []  # prefill instance: the sends that ended since the last message
    reserved: list[KVReserved] = []  # decode instance: answers to `ReserveKV`


class EngineReady(msgspec.Struct, tag="ready"):
    num_kv_blocks: int
    max_model_len: int
    # A decode engine's KV cache in a shared file (msgspec-encoded engine.transfer_buffers.BufferLayout): the front
    # end maps it, and peers write prompts' KV into its blocks.
    kv_layout: bytes | None = None
    # and how peers write into it, when the engine process registered it with its own transport (the disagg
    # layer's encoding of a TransferTarget)
    kv_target: bytes | None = None


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine could not start, or hit an internal error and stopped."""

    message: str
    config_error: bool = False  # it cannot start with these options or this checkpoint (retrying will not help)


EngineMessage = EngineOutputs | EngineReady | EngineFailed


class Heartbeat(msgspec.Struct, array_like=True):
    """Ping (front-end -> engine) and its answer (engine -> front-end) on their own channel."""

    nonce: int
    steps: int = 0  # engine steps completed so far (a stuck step shows as a count that stops moving)
    busy: bool = False  # the engine had work at its last step


# ---- framing ----------------------------------------------------------------------------------------------
class Framer:
    """Encodes messages to multipart frames and back; one per socket direction (the decoder is typed)."""

    def __init__(self, message_type):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, msg, tensors: list[torch.Tensor] | None = None) -> list:
        frames = [self._encoder.encode(msg)]
        for t in tensors or []:
            # flat first: a "contiguous" [n, 1] tensor may keep a long stride on its size-1 axis
            frames.append(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        return frames

    def decode(self, frames: list) -> object:
        return self._decoder.decode(frames[0])


def tensor_ref(t: torch.Tensor, tensors: list[torch.Tensor]) -> TensorRef:
    """Registers `t` as the next tensor frame (frame 0 is the header)."""
    tensors.append(t.detach().cpu())
    return TensorRef(str(t.dtype).removeprefix("torch."), list(t.shape), len(tensors))


def tensor_from(ref: TensorRef, frames: list) -> torch.Tensor:
    dtype = DTYPES.get(ref.dtype)
    if dtype is None or not 0 < ref.frame < len(frames):
        raise ValueError(f"bad tensor reference {ref}")
    return tensor_from_bytes(frames[ref.frame], dtype, ref.shape)


def tensor_from_bytes(frame, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `shape` from raw bytes, which must be exactly that many elements (a peer cannot make us
    allocate more than it sent, or reinterpret a short frame)."""
    shape = tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"bad tensor shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != memoryview(frame).nbytes:
        raise ValueError(f"a tensor of shape {shape} ({dtype}) needs {numel * itemsize} bytes, the frame has "
                         f"{memoryview(frame).nbytes}")
    data = bytearray(frame)  # one copy into writable memory that the tensor then owns
    return torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)


def prompt_to_wire(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float,
                   handoff: Handoff | None = None) -> tuple[AddRequest, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def ref(t: torch.Tensor | None) -> TensorRef | None:
        return None if t is None else tensor_ref(t, tensors)

    items = [WireMMItem(it.offset, it.num_tokens, tuple(it.layout), it.mm_hash, ref(it.pixel_values),
                        ref(it.embeddings), it.modality, ref(it.audio_features), it.audio_len)
             for it in prompt.mm_items]
    msg = AddRequest(request_id, prompt.prompt_token_ids, items, tensor_ref(prompt.positions, tensors),
                     prompt.position_delta, params, arrival_time, prompt.block_rows, handoff, prompt.lora)
    return msg, tensors


def prompt_from_wire(msg: AddRequest, frames: list) -> ProcessedPrompt:
    def tensor(ref: TensorRef | None) -> torch.Tensor | None:
        return None if ref is None else tensor_from(ref, frames)

    items = [MultiModalItem(it.offset, it.num_tokens, tensor(it.pixel_values), tuple(it.layout), it.mm_hash,
                            tensor(it.embeddings), it.modality, tensor(it.audio_features), it.audio_len)
             for it in msg.mm_items]
    return ProcessedPrompt(msg.prompt_token_ids, items, tensor_from(msg.positions, frames), msg.position_delta,
                           block_rows=msg.block_rows, kv_in_blocks=msg.handoff is not None, lora=msg.lora)


class _AnyRequestId(msgspec.Struct):
    request_id: str


_request_id_decoder = msgspec.msgpack.Decoder(_AnyRequestId)


def request_id_of(header) -> str | None:
    """The request id of a message that failed to decode, if its header still names one."""
    try:
        return _request_id_decoder.decode(header).request_id
    except msgspec.DecodeError:
        return None
