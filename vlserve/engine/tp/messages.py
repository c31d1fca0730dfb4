"""Typed messages between the tensor-parallel leader (rank 0, where the scheduler runs) and the other ranks.

Steps travel over ZeroMQ (rank 0 binds a ROUTER, each rank connects a DEALER named by its rank), not over
torch.distributed: a rank waiting for the next step must be able to wait for hours without a collective timing
out, and notice when rank 0 is gone. The model's own collectives (all-reduce, all-gather) run on the
torch.distributed group.
"""

from __future__ import annotations

import msgspec

from vlserve.core.wire import TensorRef
from vlserve.engine.forward_batch import WireForwardBatch


# ---- rank 0 -> the others -------------------------------------------------------------------------------------
class RunForward(msgspec.Struct, tag="forward"):
    batch: WireForwardBatch


class RunEncode(msgspec.Struct, tag="encode"):
    grids: list[tuple[int, int, int]]
    pixels: TensorRef  # every item's patches, or (data-parallel encoder) this rank's share


class Stop(msgspec.Struct, tag="stop"):
    pass


LeaderMessage = RunForward | RunEncode | Stop


# ---- the others -> rank 0 -------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    rank: int


class Ready(msgspec.Struct, tag="ready"):
    rank: int


class Failed(msgspec.Struct, tag="failed"):
    rank: int
    why: str


FollowerMessage = Hello | Ready | Failed
