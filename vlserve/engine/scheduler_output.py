"""What one scheduler step decided, handed to the model runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vlserve.core.request import Request
from vlserve.engine.state_cache import StateStep


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first token index computed this step (= num_computed_tokens when scheduled)
    num_tokens: int
    # It reaches the request's last token (known or still being sampled): it produces the next one. Decided when
    # scheduled, since the request's known tokens grow while the step runs under async scheduling.
    samples: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    encode: list[tuple[Request, int]] = field(default_factory=list)  # (request, mm item index) to run the ViT on
    free_encoder_keys: list[str] = field(default_factory=list)  # encoder outputs the runner may drop now
    preempted: list[str] = field(default_factory=list)
    # Preempted requests whose KV the connector keeps (their prompt cannot be recomputed here): (request, its
    # blocks, tokens, a hybrid model's state slot or None) to read before the forward pass writes anything.
    kv_out: list[tuple[Request, list[int], int, int | None]] = field(default_factory=list)
    # Admitted requests whose pending KV (the connector's) is written now: (request, first token to write; the
    # ones before are shared from the prefix cache). They compute from the next step on.
    kv_in: list[tuple[Request, int]] = field(default_factory=list)
    # A hybrid model's linear-attention states this step: running slots, snapshot copies and checkpoints.
    state: StateStep | None = None
    # Set by a KV connector (move_kv): called after each layer with a KV cache (ForwardBatch.after_kv_layer).
    after_kv_layer: Callable[[int], None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
