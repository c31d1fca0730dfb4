"""The router's choice, with a fake view of the replicas: round-robin and least-load do as named, cache-aware
weighs cached tokens against the prefill queue (tokens), and a KV index that lost events falls back to load."""

from __future__ import annotations

import pytest

from vlserve.core.kv_events import BlockStored, KVEventBatch
from vlserve.disagg.kv_index import KVIndex
from vlserve.router.choice import Chooser, ReplicaLoad


def loads(**kw) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, in_flight=v) for name, v in kw.items()]


def queued(**kw) -> list[ReplicaLoad]:
    """Replicas with this many prompt tokens queued for prefill (one request in flight each)."""
    return [ReplicaLoad(name, in_flight=1, prefill_tokens=v) for name, v in kw.items()]


def test_round_robin_takes_turns_whatever_the_load_or_cache():
    c = Chooser("round-robin")
    picks = [c.choose(loads(a=9, b=0, c=0), {"a": 5}).name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_load_picks_the_fewest_and_spreads_ties():
    c = Chooser("least-load")
    assert c.choose([ReplicaLoad("a", 1, others=2), ReplicaLoad("b", 2)]).name == "b"
    assert {c.choose(loads(a=0, b=0)).name for _ in range(4)} == {"a", "b"}
    assert c.choose(loads(a=0, b=3), {"b": 100}).decision == "load"


def test_cache_aware_weighs_cached_tokens_against_the_prefill_queue_in_tokens():
    c = Chooser("cache-aware", cache_weight=1.0, block_size=16)
    # b holds 10 blocks (160 tokens) of the request; its queue of 100 tokens is worth less
    choice = c.choose(queued(a=0, b=100), {"b": 10}, blocks=20)
    assert (choice.name, choice.decision, choice.overlap, choice.new_tokens) == ("b", "cache-hit", 10, 160)
    assert c.choose(queued(a=0, b=200), {"b": 10}, blocks=20).name == "a"  # a longer wait than the cache saves
    choice = c.choose(queued(a=0, b=200), {"b": 10}, blocks=20)
    assert (choice.decision, choice.new_tokens) == ("load", 320)  # a prefills all of it
    # the weight: a cached token worth 2 queued ones
    assert Chooser("cache-aware", 2.0, 16).choose(queued(a=0, b=200), {"b": 10}, blocks=20).name == "b"
    # weight 0: the shortest prefill queue, whatever is cached
    assert Chooser("cache-aware", 0.0, 16).choose(queued(a=50, b=0), {"a": 10}, blocks=20).name == "b"
    # nothing cached anywhere: spread in turn
    assert {c.choose(queued(a=0, b=0), {}, blocks=4).name for _ in range(4)} == {"a", "b"}
    # equal overlap everywhere (a shared system prompt): the shorter queue, decided by load
    choice = c.choose(queued(a=30, b=10), {"a": 2, "b": 2}, blocks=8)
    assert (choice.name, choice.decision) == ("b", "load")


def test_other_clients_requests_count_at_the_average_prompt_size():
    c = Chooser("cache-aware", block_size=16)
    for _ in range(50):
        c.choose(queued(a=0, b=0), {}, blocks=10)
    assert 150 < c.avg_tokens <= 160
    # b: 2 requests from elsewhere (~310 tokens) outweigh 10 cached blocks (160 tokens)
    assert c.choose([ReplicaLoad("a"), ReplicaLoad("b", others=2)], {"b": 10}, blocks=12).name == "a"
    assert c.choose([ReplicaLoad("a"), ReplicaLoad("b", others=1)], {"b": 11}, blocks=12).name == "b"
    # a request the router could not hash counts at the average
    assert c.choose(queued(a=0, b=0), {}, blocks=0).new_tokens == round(c.avg_tokens)


def test_a_far_busier_replica_is_passed_over_whatever_it_caches():
    c = Chooser("cache-aware", block_size=16)
    busy = [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=12)]  # b: decoding, nothing queued
    choice = c.choose(busy, {"b": 50}, blocks=50)
    assert (choice.name, choice.decision) == ("a", "load")
    assert c.choose([ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=6)], {"b": 50}, blocks=50).name == "b"


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
    assert c.choose(loads(a=0, b=1), index.longest_prefixes(prompt), 3).name == "b"
    index.apply("b", _batch(2, []))  # seq 1 lost: b's view is forgotten, cold
    assert index.is_cold("b")
    overlaps = index.longest_prefixes(prompt)
    assert overlaps == {"a": 0, "b": 0}
    choice = c.choose(loads(a=0, b=1), overlaps, 3)
    assert (choice.name, choice.decision) == ("a", "load")
    index.apply("b", _batch(1, prompt))  # late (reordered): ignored, still no false hit
    assert index.longest_prefixes(prompt)["b"] == 0
    index.apply("b", _batch(3, prompt))  # in order again: hits come back
    assert c.choose(loads(a=0, b=1), index.longest_prefixes(prompt), 3).name == "b"
