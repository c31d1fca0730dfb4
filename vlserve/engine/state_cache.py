"""Per-sequence linear-attention states of a hybrid model (Qwen3.5), the counterpart of the KV block manager.

A hybrid model keeps, besides the KV cache of its full-attention layers, a fixed-size state per sequence for
its linear layers (`vlserve.model.layers.linear_state`). The state pool has `max_num_seqs` running slots, one
held by each running request from admission to finish, abort or preemption (preemption = recompute: the state is
dropped), then `num_snapshots` snapshot slots for prefix caching.

A KV prefix hit is worthless to a linear layer without the state after that prefix, so at a few block-aligned
checkpoints of a prompt (`checkpoints`) the model copies the state into a snapshot slot, keyed by the block hash
of the block ending there. A later request resumes from the longest cached KV prefix that ends at a snapshot: the
snapshot is copied into its running slot before the step. Snapshot slots use the KV blocks' own pool (a
`BlockPool`: ref counts, content-checked hash map, LRU free queue): a slot is held (ref 1) while a step writes it
or copies from it, so it can never be evicted meanwhile, and is registered under its hash only after the step ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlserve.core.block_hash import update_block_hashes
from vlserve.core.request import Request
from vlserve.engine.block_pool import BlockPool


@dataclass
class StateStep:
    """What one scheduler step asks of the state pool; the runner reads it, the scheduler closes it after the step."""

    slots: dict[str, int] = field(default_factory=dict)  # request id -> its running slot
    copies: list[tuple[int, int]] = field(default_factory=list)  # (snapshot slot, running slot), before the forward
    checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # request id -> (n, slot) in chunk
    held: list[int] = field(default_factory=list)  # snapshot pool indices held for this step (copy sources)
    written: list[tuple[int, bytes, tuple]] = field(default_factory=list)  # (pool index, hash, key) written now


class StateCache:
    def __init__(self, num_running: int, num_snapshots: int, block_size: int):
        self.block_size = block_size
        self.running = BlockPool(num_running)  # slot ids 0 .. num_running - 1
        self.snapshots = BlockPool(num_snapshots)  # slot ids num_running + pool index
        self.slot_of: dict[str, int] = {}
        self.queries = 0  # prefix lookups of a hybrid model (admissions with prefix caching on)
        self.hits = 0  # ... that resumed from a snapshot

    @property
    def num_running(self) -> int:
        return self.running.num_blocks

    # ---- running slots ----------------------------------------------------------------------------------------
    def slot(self, req: Request) -> int:
        """The request's running slot, taken on first use (the scheduler admits at most max_num_seqs)."""
        slot = self.slot_of.get(req.request_id)
        if slot is None:
            slot = self.slot_of[req.request_id] = self.running.allocate(1)[0]
        return slot

    def free(self, req: Request) -> None:
        slot = self.slot_of.pop(req.request_id, None)
        if slot is not None:
            self.running.free([slot])

    # ---- snapshots --------------------------------------------------------------------------------------------
    def resumable_blocks(self, req: Request, cached: list[int]) -> tuple[int, int | None]:
        """Of the `cached` leading KV blocks, how many to take: the longest run whose end has a snapshot, and that
        snapshot's pool index (None: resume nothing, start at token 0). Nothing is taken yet."""
        if not cached or not self.snapshots.num_blocks:
            return 0, None
        for k in range(len(cached), 0, -1):
            idx = self.snapshots.lookup(req.block_hashes[k - 1], req.block_keys[k - 1])
            if idx is not None:
                return k, idx
        return 0, None

    def record_lookup(self, hit: bool) -> None:
        """An admission looked for a snapshot (and found one)."""
        self.queries += 1
        self.hits += hit

    def resume(self, req: Request, snapshot: int, step: StateStep) -> None:
        """Copy `snapshot` into the request's running slot before this step's forward pass; it is held (not
        evictable) until the step ran, then becomes the most recently used."""
        self.snapshots.touch([snapshot])
        step.held.append(snapshot)
        step.copies.append((self.num_running + snapshot, self.slot(req)))

    def checkpoints(self, req: Request, start: int, end: int, step: StateStep) -> None:
        """Snapshots the model takes inside chunk [start, end) of `req` (a prefill span, more than one token).

        Where: the last block boundary at or before the end of each media item (a second question on the same
        picture resumes after it) and the last boundary at or before the prompt's end, or before its last token
        (a follow-up turn, or the same prompt again, which must leave one token to compute). A boundary whose
        snapshot exists, or that another request of this step already writes, is skipped."""
        if not self.snapshots.num_blocks or end - start < 2:
            return
        bs, p = self.block_size, req.num_prompt_tokens
        wanted = {it.end // bs * bs for it in req.mm_items} | {p // bs * bs, (p - 1) // bs * bs}
        points = sorted(b for b in wanted if start < b <= min(end, p))
        if not points:
            return
        update_block_hashes(req, bs)
        pending = {h for _, h, _ in step.written}
        out = step.checkpoints.setdefault(req.request_id, [])
        for b in points:
            h, key = req.block_hashes[b // bs - 1], req.block_keys[b // bs - 1]
            if h in pending or self.snapshots.lookup(h, key) is not None:
                continue
            if not self.snapshots.num_free:
                break  # every snapshot slot is held by this step
            idx = self.snapshots.allocate(1)[0]  # evicts the least recently used snapshot
            step.written.append((idx, h, key))
            pending.add(h)
            out.append((b - start, self.num_running + idx))

    def step_done(self, step: StateStep) -> None:
        """After the forward pass: what it wrote is registered (content-keyed, so a request aborted meanwhile
        still left a valid snapshot) and every slot the step held goes back to the LRU queue."""
        for idx, h, key in step.written:
            self.snapshots.cache(idx, h, key)
        self.snapshots.free([idx for idx, _, _ in step.written] + step.held)
        step.written, step.held = [], []

    def reset(self) -> bool:
        """Drops every snapshot (with the prefix cache); False while a step holds one."""
        return self.snapshots.reset_prefix_cache()

    @property
    def num_snapshots(self) -> int:
        return self.snapshots.num_cached

    @property
    def usage(self) -> float:
        """Share of the pool's slots holding a live state: running requests' and cached snapshots."""
        total = self.running.num_blocks + self.snapshots.num_blocks
        used = len(self.slot_of) + self.snapshots.num_cached
        return used / total if total else 0.0

    def check_integrity(self) -> None:
        self.running.check_integrity()
        self.snapshots.check_integrity()
        if self.running.num_blocks - self.running.num_free != len(self.slot_of):
            raise AssertionError("running state slots: held slots and requests disagree")
