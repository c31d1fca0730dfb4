"""How the router picks a replica for one request: pure functions over what it knows of each replica.

- round-robin: the next replica in turn;
- least-load: the fewest requests (this router's in flight to it, plus its running and waiting ones as scraped);
- cache-aware: the highest `weight x overlap - load`, where overlap is how many leading blocks of the request
  the replica's prefix cache holds (from its KV events; a cold replica counts 0). Ties go to the lower load, then
  in turn, so requests with nothing cached spread like least-load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("cache-aware", "least-load", "round-robin")


@dataclass
class ReplicaLoad:
    """What the chooser needs of one replica."""

    name: str
    in_flight: int = 0  # this router's requests to it, not yet finished
    running: int = 0  # scraped from its /metrics
    waiting: int = 0

    @property
    def load(self) -> int:
        return self.in_flight + self.running + self.waiting


@dataclass(frozen=True)
class Choice:
    name: str
    decision: str  # "cache-hit" (chosen for a cached prefix), "load" (no overlap decided it), "round-robin"
    overlap: int  # leading blocks of the request cached on the chosen replica


class Chooser:
    def __init__(self, policy: str = "cache-aware", cache_weight: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if cache_weight < 0:
            raise ValueError(f"the cache weight must be >= 0, got {cache_weight}")
        self.policy, self.cache_weight = policy, cache_weight
        self._turn = 0

    def choose(self, replicas: Sequence[ReplicaLoad], overlaps: Mapping[str, int] | None = None) -> Choice:
        """`replicas`: the candidates (already without failed ones), in a stable order; `overlaps`: leading cached
        blocks of the request per replica (missing: 0). Raises LookupError when there is none."""
        if not replicas:
            raise LookupError("no replica to send the request to")
        turn = self._turn
        self._turn += 1
        overlaps = overlaps or {}
        if self.policy == "round-robin":
            pick = replicas[turn % len(replicas)]
            return Choice(pick.name, "round-robin", overlaps.get(pick.name, 0))
        n = len(replicas)
        rotated = [replicas[(turn + i) % n] for i in range(n)]  # ties broken in turn
        if self.policy == "least-load":
            pick = min(rotated, key=lambda r: r.load)
            return Choice(pick.name, "load", overlaps.get(pick.name, 0))

        def score(r: ReplicaLoad) -> tuple[float, int]:
            return self.cache_weight * overlaps.get(r.name, 0) - r.load, -r.load

        pick = max(rotated, key=score)
        overlap = overlaps.get(pick.name, 0)
        least = min(r.load for r in replicas)
        # A cached prefix decided it only if some overlap was there and it beat the least loaded choice.
        decided = overlap > 0 and (pick.load > least or overlap > min(overlaps.get(r.name, 0) for r in replicas))
        return Choice(pick.name, "cache-hit" if decided else "load", overlap)
