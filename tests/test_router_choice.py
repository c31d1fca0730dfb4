"""The router's choice, with a fake view of the replicas: round-robin and least-load do as named, cache-aware
follows the cached prefix against load, and a KV index that lost events falls back to load."""

from __future__ import annotations

import pytest

from vlserve.core.kv_events import BlockStored, KVEventBatch
from vlserve.disagg.kv_index import KVIndex
from vlserve.router.choice import Chooser, ReplicaLoad


def loads(**kw) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, in_flight=v) for name, v in kw.items()]


def test_round_robin_takes_turns_whatever_the_load_or_cache():
    c = Chooser("round-robin")
    picks = [c.choose(loads(a=9, b=0, c=0), {"a": 5}).name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_load_picks_the_fewest_and_spreads_ties():
    c = Chooser("least-load")
    assert c.choose([ReplicaLoad("a", 1, running=2), ReplicaLoad("b", 2)]).name == "b"
    assert {c.choose(loads(a=0, b=0)).name for _ in range(4)} == {"a", "b"}
    assert c.choose(loads(a=0, b=3), {"b": 100}).decision == "load"


def test_cache_aware_weighs_overlap_against_load():
    c = Chooser("cache-aware", cache_weight=1.0)
    choice = c.choose(loads(a=0, b=2), {"b": 10})
    assert (choice.name, choice.decision, choice.overlap) == ("b", "cache-hit", 10)
    assert c.choose(loads(a=0, b=20), {"b": 10}).name == "a"  # too busy: its cache is not worth the wait
    assert Chooser("cache-aware", cache_weight=3.0).choose(loads(a=0, b=20), {"b": 10}).name == "b"
    # nothing cached anywhere: spread like least-load
    assert {c.choose(loads(a=0, b=0), {}).name for _ in range(4)} == {"a", "b"}


def test_no_replica_is_a_lookup_error():
    with pytest.raises(LookupError):
        Chooser().choose([])
    with pytest.raises(ValueError):
        Chooser("random")


def _batch(seq: int, hashes: list[bytes]) -> KVEventBatch:
    return KVEventBatch("pub-b", seq, 0.0, [BlockStored(hashes, None, 16)])


def test_lost_or_reordered_events_fall_back_to_load():
    index = KVIndex()
    index.add_replica("a")
    prompt = [b"h1", b"h2", b"h3"]
    index.apply("b", _batch(0, prompt))
    c = Chooser("cache-aware")
    assert c.choose(loads(a=0, b=1), index.longest_prefixes(prompt)).name == "b"
    index.apply("b", _batch(2, []))  # seq 1 lost: b's view is forgotten, cold
    assert index.is_cold("b")
    overlaps = index.longest_prefixes(prompt)
    assert overlaps == {"a": 0, "b": 0}
    choice = c.choose(loads(a=0, b=1), overlaps)
    assert (choice.name, choice.decision) == ("a", "load")
    index.apply("b", _batch(1, prompt))  # late (reordered): ignored, still no false hit
    assert index.longest_prefixes(prompt)["b"] == 0
    index.apply("b", _batch(3, prompt))  # in order again: hits come back
    assert c.choose(loads(a=0, b=1), index.longest_prefixes(prompt)).name == "b"
