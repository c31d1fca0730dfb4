"""Typed messages between the tensor-parallel leader (rank 0, where the scheduler runs) and the other ranks.

Steps travel over ZeroMQ (rank 0 binds a ROUTER, each rank connects a DEALER named by its rank), not over
torch.distributed: a rank waiting for the next step must be able to wait for hours without a collective timing
out, and notice when rank 0 is gone. The model's own collectives (all-reduce, all-gather) run on the
torch.distributed group.
"""

from __future__ import annotations

import msgspec

from vlserve.core.lora import AdapterRef
from vlserve.core.wire import TensorRef, tensor_from, tensor_ref
from vlserve.engine.forward_batch import WireForwardBatch


# ---- rank 0 -> the others -------------------------------------------------------------------------------------
class SlotLoad(msgspec.Struct, array_like=True):
    """An adapter rank 0 put in `slot`: its whole pairs by target name (each rank cuts its part), in the frames."""

    slot: int
    pairs: dict[str, tuple[TensorRef, TensorRef]]


class LoRAStep(msgspec.Struct, array_like=True):
    """The LoRA adapters of a step: what each slot holds (rank 0 assigned them), the weights of those the other
    ranks do not hold yet (they never read adapter files), and which rows take which slot
    (vlserve.model.layers.lora_rows groups: rows as (start, stop) ranges, None for all)."""

    slots: list[AdapterRef | None]
    rows: list[tuple[int, list[tuple[int, int]] | None]]
    loads: list[SlotLoad] = []


class RunForward(msgspec.Struct, tag="forward"):
    batch: WireForwardBatch
    lora: LoRAStep | None = None


class RunEncode(msgspec.Struct, tag="encode"):
    grids: list[tuple[int, int, int]]
    pixels: TensorRef  # every item's patches, or (data-parallel encoder) this rank's share
    lora: LoRAStep | None = None


class ReadKV(msgspec.Struct, tag="read_kv"):
    """Every rank gathers the KV at these cache slots (a prefill instance hands it over)."""

    slots: TensorRef


class WriteKV(msgspec.Struct, tag="write_kv"):
    """Every rank writes its key/value heads of `kv` (all of them, as ModelShard.read_kv gives them) at these
    slots (a decode instance takes a handed-over prompt's KV)."""

    slots: TensorRef
    kv: TensorRef


class ReadState(msgspec.Struct, tag="read_state"):
    """Every rank gathers a hybrid model's linear states in `slot` into handoff rows of `width`."""

    slot: int
    width: int


class WriteState(msgspec.Struct, tag="write_state"):
    """Every rank writes its heads' part of the handed-over linear states (all of them, as rows) into `slot`."""

    slot: int
    rows: TensorRef


class Stop(msgspec.Struct, tag="stop"):
    pass


LeaderMessage = RunForward | RunEncode | ReadKV | WriteKV | ReadState | WriteState | Stop


# ---- the others -> rank 0 -------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    rank: int


class Ready(msgspec.Struct, tag="ready"):
    rank: int
    kv_layout: bytes | None = None  # a decode engine's: this rank's KV cache in a shared file (its BufferLayout)


class Failed(msgspec.Struct, tag="failed"):
    rank: int
    why: str


FollowerMessage = Hello | Ready | Failed


def lora_step(slots: list[AdapterRef | None], groups, loads: dict[int, dict], tensors: list) -> LoRAStep:
    """A step's adapters for the wire: `groups` as vlserve.model.layers.lora_rows holds them, `loads` slot ->
    whole pairs by target name (their tensors join `tensors`, the message's frames)."""
    return LoRAStep(list(slots), [(slot, None if rows is None else [(r.start, r.stop) for r in rows])
                                  for slot, rows in groups],
                    [SlotLoad(slot, {name: (tensor_ref(a, tensors), tensor_ref(b, tensors))
                                     for name, (a, b) in pairs.items()}) for slot, pairs in loads.items()])


def lora_groups(step: LoRAStep) -> tuple:
    """The groups back as lora_rows takes them."""
    return tuple((slot, None if rows is None else tuple(slice(a, b) for a, b in rows)) for slot, rows in step.rows)


def lora_loads(step: LoRAStep, frames: list) -> dict[int, dict]:
    """The loads back: slot -> whole pairs by target name."""
    return {load.slot: {name: (tensor_from(a, frames), tensor_from(b, frames)) for name, (a, b) in load.pairs.items()}
            for load in step.loads}
