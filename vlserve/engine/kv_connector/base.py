"""The KV connector: what an engine role does with KV besides computing it.

The aggregated engine computes every request's KV and frees it when the request ends; it has no connector. A role
that moves KV between instances plugs one in (our own take on vLLM v1's KV connector):
- the scheduler asks it, when it admits a waiting request, whether that request's KV is to be loaded rather than
  computed (`pending_kv`); when it preempts one, whether its KV must be kept because it cannot be recomputed here
  (`keeps_kv_on_preempt`); and when one finishes, whether the connector keeps its blocks (`request_finished`);
- the engine core lets it check and prepare a request as it arrives (`check_request`, `admit`), move KV around a
  step's forward pass (`move_kv`), and export KV after the step (`after_step`); the engine process takes the
  exports (`take_exported`) and the sends' ends (`take_written`), and passes the connector its own messages
  (`reserve`, `release`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from vlserve.core.messages import EngineCoreOutput, Handoff
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.core.wire import CancelReserveKV, KVReserved, KVSend, KVWritten, ReleaseKV, ReserveKV

if TYPE_CHECKING:
    from vlserve.engine.scheduler_output import SchedulerOutput

KVTransfer = Handoff  # what arrives with a request whose KV was computed elsewhere


@dataclass
class PendingKV:
    """KV a waiting request has written into its blocks when the scheduler (re)admits it, instead of computing it."""

    num_tokens: int  # tokens 0..num_tokens
    # start -> [layers, 2, num_tokens - start, kv_heads, head_dim]; None for KV written in place (`take_blocks`)
    read: Callable[[int], torch.Tensor] | None
    # From another instance: a prefix already cached here is shared rather than written, and the prompt's receive
    # blocks are released once it is written. (KV swapped out at a preemption is neither.)
    from_peer: bool = False
    # A hybrid model: its linear states after those tokens, as rows (engine.state_rows), written into its slot.
    state_rows: Callable[[], torch.Tensor] | None = None
    # Written in place: the peer wrote the KV straight into KV blocks reserved for it, which the request takes
    # (this returns them, in token order) instead of blocks to write into.
    take_blocks: Callable[[], list[int]] | None = None


@dataclass
class ExportedKV:
    """A finished request's prompt KV, one row per token (see kv_handoff.kv_to_rows), then a hybrid model's
    linear states as rows (engine.state_rows), and its random state. `rows` is None when they stay in the engine
    process, which writes them to the receiver itself (a connector with a `RowWriter`)."""

    request_id: str
    rows: torch.Tensor | None
    generator_state: bytes | None


class RowWriter(Protocol):
    """Puts rows into another instance's memory from the engine process (a transport that writes in place). Made
    by the disaggregation layer, which alone knows what `destination` encodes; called from a writer thread."""

    keep_s: float  # how long rows nobody asks for are kept (a backstop: the front end releases them)
    # It writes rows anywhere in the destination's run and some planes only (a layer's keys and values), so a
    # prefill engine sends each layer as it is computed (kv_connector.layer_sends).
    writes_layers: bool

    def write(self, destination: bytes, rows: torch.Tensor, first_row: int = 0, first_plane: int = 0) -> int:
        """Blocks until `rows` [m, width] (or planes first_plane.. of them, [m, planes, part width]) are at
        `destination`'s run rows first_row..; returns the bytes written."""

    def planes_of(self, destination: bytes) -> int:
        """The planes the destination's rows are stored in (a KV cache: one per layer and key/value; receive
        blocks: 1)."""

    def close(self) -> None:
        """Lets go of what it registered or mapped."""


@dataclass
class MovedKV:
    """What `move_kv` did: requests whose KV from a peer is in (their prompt's inputs may be released now), and
    requests whose KV could not be written or was refused (request id, why, status): they fail, the engine goes
    on."""

    loaded: list[str]
    failed: list[tuple[str, str, int]]  # (request id, why, HTTP status)


class KVConnector:
    """The hooks an engine calls; every one does nothing here, a role overrides the ones it needs."""

    def bind(self, scheduler, runner, transfer) -> None:
        """Called once by the engine core: the scheduler (its KV manager), the model runner (reads and writes KV
        by slot) and the receive buffers (or None) this connector works with."""
        self.scheduler, self.runner, self.transfer = scheduler, runner, transfer

    # ---- arrival (engine core) -----------------------------------------------------------------------------
    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams, kv_transfer: KVTransfer | None) -> None:
        """Refuses (InvalidInputError) a request this role cannot take, before anything is queued."""

    def admit(self, req: Request, kv_transfer: KVTransfer | None) -> EngineCoreOutput | None:
        """Prepares one sample before it is queued. Returns the output it arrived with (produced elsewhere), which
        the engine reports once the request is ready, or None."""
        return None

    def will_send(self, req: Request, send: KVSend) -> None:
        """The request's KV goes to another instance as it is computed (a prefill engine with a row writer);
        answered in `take_written`."""
        raise InvalidInputError("this engine sends no KV rows to other instances")

    def owns(self, request_id: str) -> bool:
        """True while the connector keeps state under this id (its id is not free)."""
        return False

    def forget(self, request_ids: list[str]) -> None:
        """These requests were aborted or stopped: drop whatever is kept for them."""

    # ---- scheduler -----------------------------------------------------------------------------------------
    def pending_kv(self, req: Request) -> PendingKV | None:
        return None

    def keeps_kv_on_preempt(self, req: Request) -> bool:
        return False

    @property
    def holds_blocks_for_waiting(self) -> bool:
        """A waiting request already holds the blocks its KV was written into (`PendingKV.take_blocks`): the
        scheduler looks for those first. False lets it skip that pass."""
        return False

    def request_finished(self, req: Request, status: RequestStatus) -> bool:
        """True: the connector keeps the request's blocks (it frees them later); False: the scheduler frees them."""
        return False

    # ---- a step ----------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Before scheduling: expire what nobody came for."""

    def move_kv(self, sched: SchedulerOutput) -> MovedKV:
        """Before the forward pass: KV out of blocks the step reuses (`sched.kv_out`), KV into blocks of requests
        admitted with pending KV (`sched.kv_in`)."""
        return MovedKV([], [])

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        """After the step: exports the KV of requests that finished and whose KV leaves this instance (taken by
        `take_exported`). A request whose KV cannot be exported is left out (its blocks freed) and reported by
        `take_failed`: one request's failure must never end the engine."""

    def take_exported(self) -> list[ExportedKV]:
        """What `after_step` exported since the last call (the engine process sends it to the front end)."""
        return []

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of requests the connector failed since the last call (after_step): they fail (500)."""
        return []

    # ---- the engine process's own messages (engine.core_process) ---------------------------------------------
    def take_written(self) -> list[KVWritten]:
        """Sends (`will_send`) that ended since the last call."""
        return []

    @property
    def writes_in_flight(self) -> bool:
        return False

    def reserve(self, msg: ReserveKV) -> KVReserved:
        """KV blocks a peer writes a prompt's KV into (a decode engine whose KV cache is in a shared file)."""
        return KVReserved(msg.reserve_id, error="this engine reserves no KV blocks for peers")

    def ask(self, msg: ReserveKV) -> KVReserved | None:
        """`reserve`, or None when the pool is short: the reservation then waits for `answer_waiting`."""
        return self.reserve(msg)

    def answer_waiting(self) -> list[KVReserved]:
        """Waiting reservations the pool has the blocks for now (each loop of the engine, after its step)."""
        return []

    def cancel(self, msg: CancelReserveKV) -> KVReserved | None:
        """A waiting reservation's asker gave up: its answer (with no blocks), or None if it was answered."""
        return None

    def release(self, msg: ReleaseKV) -> None:
        """Reserved blocks no request took go back to the pool."""

    @property
    def num_reserved_blocks(self) -> int:
        """KV blocks reserved for peers' writes that no request took yet."""
        return 0

    @property
    def num_kept(self) -> int:
        """Requests whose exported KV rows wait here to be written."""
        return 0

    def close(self) -> None:
        """The engine stops: waits for writes under way, lets go of the writer."""
