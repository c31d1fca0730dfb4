"""How the router picks a replica for one request: pure functions over what it knows of each replica.

- round-robin: the next replica in turn;
- least-load: the fewest requests (this router's in flight to it, plus the running and waiting ones its /metrics
  showed beyond those);
- cache-aware: costs in one unit, prompt tokens to prefill, in two cases.
  * The request continues a conversation some replica holds (cached blocks past the prefix that different
    conversations share, router/shared_prefixes.py): a replica's gain is `weight x (tokens of the request's
    leading blocks it holds)` minus its queue: the prompt tokens not cached there of this router's requests it
    has not started answering, plus other clients' requests (from its /metrics) at the average prompt size.
    Weight 1: a cached token is worth one queued token of prefill (a cache hit also skips the vision tower, so
    >1 is defensible on picture-heavy traffic); 0: the shortest prefill queue. Highest gain wins; ties go to
    the fewer requests, then in turn.
  * A new conversation (nothing past the shared prefix cached anywhere): it goes where it costs least to place:
    the queue, plus the prefill work sent there recently (a decaying sum, so that requests arriving one at a
    time, with nothing ever in flight, still spread), plus what it would evict there (all its tokens x the share of
    that replica's cache already holding blocks). A shared template cached on one replica attracts nothing.
  A replica far busier in requests than the least busy one (decoding requests, which the prefill queue does not
  count) is passed over for least-load, as SGLang's router does when load is imbalanced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vlserve.router.shared_prefixes import SharedPrefixes

POLICIES = ("cache-aware", "least-load", "round-robin")
# Imbalance beyond which cache-aware gives way to least-load: more than BALANCE_ABS requests over the least
# busy replica's and more than BALANCE_REL times them.
BALANCE_ABS, BALANCE_REL = 4, 2.0
AVG_DECAY = 0.9  # of the running average prompt size (tokens)
RECENT_DECAY = 0.8  # per routed request, of each replica's recent prefill work: about the last 5 requests count


@dataclass
class ReplicaLoad:
    """What the chooser needs of one replica."""

    name: str
    in_flight: int = 0  # this router's requests to it, not yet finished
    others: int = 0  # running + waiting on it beyond this router's in flight (its last /metrics scrape)
    prefill_tokens: int = 0  # uncached prompt tokens of this router's requests it has not started answering
    cached_blocks: int = 0  # blocks its prefix cache holds (the router's index of its KV events)
    capacity_blocks: int = 0  # its KV cache in blocks (its /metrics; 0: not known)

    @property
    def load(self) -> int:
        return self.in_flight + self.others

    @property
    def occupancy(self) -> float:
        """Share of its cache holding blocks: what a new prompt placed there would evict, roughly."""
        return min(1.0, self.cached_blocks / self.capacity_blocks) if self.capacity_blocks else 0.0


@dataclass(frozen=True)
class Choice:
    name: str
    decision: str  # "cache-hit" (chosen for a cached prefix), "load" (no overlap decided it), "round-robin"
    overlap: int  # leading blocks of the request cached on the chosen replica
    new_tokens: int  # prompt tokens the chosen replica must prefill (estimated): its queue grows by these


class Chooser:
    def __init__(self, policy: str = "cache-aware", cache_weight: float = 1.0, block_size: int = 16):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not cache_weight >= 0:
            raise ValueError(f"the cache weight must be >= 0, got {cache_weight}")
        self.policy, self.cache_weight, self.block_size = policy, cache_weight, block_size
        self.avg_tokens = 0.0  # prompt size of recent hashed requests: what a request of unknown size counts
        self.recent: dict[str, float] = {}  # replica -> prefill tokens sent there lately (decaying)
        self.shared = SharedPrefixes()
        self._turn = 0

    def observe(self, hashes: Sequence[bytes], whole: bool = True) -> int:
        """Records a request's block hashes (once per request) and returns its leading blocks that other
        conversations share: pass it to `choose` as `common`."""
        return self.shared.observe(hashes, whole)

    def choose(self, replicas: Sequence[ReplicaLoad], overlaps: Mapping[str, int] | None = None,
               blocks: int = 0, common: int = 0, whole: bool = True) -> Choice:
        """`replicas`: the candidates (already without failed ones), in a stable order; `overlaps`: leading cached
        blocks of the request per replica (missing: 0); `blocks`: the request's hashed full blocks (0: unknown);
        `whole`: they are all of it (else they stop before a picture not seen yet, and it counts at least at the
        average size); `common`: its leading blocks shared with other conversations (`observe`). Raises
        LookupError when there is none."""
        if not replicas:
            raise LookupError("no replica to send the request to")
        turn = self._turn
        self._turn += 1
        overlaps = overlaps or {}
        if blocks and whole:
            self.avg_tokens = AVG_DECAY * self.avg_tokens + (1 - AVG_DECAY) * blocks * self.block_size
            size = blocks * self.block_size
        else:  # at least what was hashed and one block more (the picture it stopped at)
            size = max(round(self.avg_tokens), (blocks + 1) * self.block_size if blocks else 0)

        def made(pick: ReplicaLoad, decision: str, work: int | None = None) -> Choice:
            """`work`: the recent work it counts for (default: the tokens it prefills there)."""
            overlap = overlaps.get(pick.name, 0)
            choice = Choice(pick.name, decision, overlap, max(0, size - overlap * self.block_size))
            self._sent(pick.name, choice.new_tokens if work is None else work, {r.name for r in replicas})
            return choice

        if self.policy == "round-robin":
            return made(replicas[turn % len(replicas)], "round-robin")
        n = len(replicas)
        rotated = [replicas[(turn + i) % n] for i in range(n)]  # ties broken in turn
        least = min(rotated, key=lambda r: r.load)
        if self.policy == "least-load":
            return made(least, "load")

        def queue(r: ReplicaLoad) -> float:
            return r.prefill_tokens + r.others * self.avg_tokens

        if not any(overlaps.get(r.name, 0) > common for r in replicas):
            # Every replica is charged the chat's whole work: the shared prefix one of them holds (or will) saves
            # little and must not make it look cheaper, or it takes every new chat again.
            def placement(r: ReplicaLoad) -> tuple[float, int]:
                return queue(r) + self.recent.get(r.name, 0.0) + size * r.occupancy, r.load

            pick = min(rotated, key=placement)
            if pick.load > least.load + BALANCE_ABS and pick.load > BALANCE_REL * least.load:
                pick = least
            return made(pick, "load", work=max(size, self.block_size))

        def gain(r: ReplicaLoad) -> tuple[float, int]:
            return self.cache_weight * overlaps.get(r.name, 0) * self.block_size - queue(r), -r.load

        pick = max(rotated, key=gain)
        if pick.load > least.load + BALANCE_ABS and pick.load > BALANCE_REL * least.load:
            return made(least, "load")
        overlap = overlaps.get(pick.name, 0)
        # A cached prefix decided it if the conversation was there and it won over a shorter queue or a
        # smaller overlap.
        decided = overlap > common and (queue(pick) > min(queue(r) for r in replicas)
                                        or overlap > min(overlaps.get(r.name, 0) for r in replicas))
        return made(pick, "cache-hit" if decided else "load")

    def _sent(self, name: str, tokens: int, present: set[str]) -> None:
        """Recent work: every replica's decays by one request, the chosen one's grows by its prefill."""
        self.recent = {k: v * RECENT_DECAY for k, v in self.recent.items() if k in present and v >= 1.0}
        self.recent[name] = self.recent.get(name, 0.0) + tokens
