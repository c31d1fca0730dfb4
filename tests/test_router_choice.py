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
    # nothing cached anywhere: spread
    fresh = Chooser("cache-aware", block_size=16)
    assert {fresh.choose(queued(a=0, b=0), {}, blocks=4).name for _ in range(4)} == {"a", "b"}
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


def _conversations(chooser: Chooser, users: int, turns: int, template: int = 3, per_turn: int = 6,
                   concurrent: bool = False, capacity: int = 0) -> tuple[dict[str, int], dict[int, set[str]], int, int]:
    """`users` chats taking turns one request at a time over replicas a and b, each replica's cache holding what
    it served (no eviction). Every prompt starts with the same template blocks; a chat's first turn stops at its
    new picture (the router has not laid it out: partial hashes). Returns requests per replica, the replicas
    each chat went to after its first turn, the prompt blocks found cached, and the cacheable bound (every turn
    finding its previous turn)."""
    cached: dict[str, set[bytes]] = {"a": set(), "b": set()}
    served = {"a": 0, "b": 0}
    homes: dict[int, set[str]] = {u: set() for u in range(users)}
    found = bound = 0
    for turn in range(turns):
        for u in range(users):
            prompt = [b"t%d" % i for i in range(template)]
            prompt += [b"u%d-%d" % (u, i) for i in range(per_turn * (turn + 1))]
            whole = turn > 0
            hashes = prompt if whole else prompt[:template]
            overlaps = {}
            for name, held in cached.items():
                overlaps[name] = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            common = chooser.observe(hashes, whole)
            replicas = [ReplicaLoad(name, in_flight=int(concurrent), cached_blocks=len(cached[name]),
                                    capacity_blocks=capacity) for name in ("a", "b")]
            choice = chooser.choose(replicas, overlaps, len(hashes), common, whole)
            served[choice.name] += 1
            found += next((i for i, h in enumerate(prompt) if h not in cached[choice.name]), len(prompt))
            bound += template + per_turn * turn
            cached[choice.name].update(prompt)
            if turn:
                homes[u].add(choice.name)
    return served, homes, found, bound


def test_low_traffic_new_chats_spread_and_each_chat_stays_where_it_is_cached():
    """One request at a time: nothing is ever in flight, and the shared template cached on the first replica
    must not pull every new chat there (it did: all 15 requests on one replica)."""
    served, homes, found, bound = _conversations(Chooser("cache-aware", block_size=16), users=5, turns=3)
    assert min(served.values()) >= 5, served  # both replicas used (5 chats: 3 and 2, 3 turns each)
    assert all(len(h) == 1 for h in homes.values()), homes  # each chat's later turns on one replica
    assert found >= bound - 3 * 2, (found, bound)  # every turn finds its previous turn (one template miss each)


def test_low_traffic_spreads_when_the_size_of_new_chats_is_not_known_yet():
    """A router that has seen only short whole requests (a warm-up) cannot size a new chat (its picture is not
    laid out yet). The replica holding the template must still not look cheaper for it: placement charges every
    replica the chat's whole estimated work (before, its uncached part was 0 on the template's holder, which then
    took every new chat)."""
    chooser = Chooser("cache-aware", block_size=16)
    for _ in range(2):
        chooser.choose([ReplicaLoad("a"), ReplicaLoad("b")], {}, 1)
    served, homes, found, bound = _conversations(chooser, users=5, turns=3, capacity=40)
    assert min(served.values()) >= 6, served  # 3 chats and 2
    assert all(len(h) == 1 for h in homes.values()), homes


def test_a_shared_template_is_common_once_two_chats_fork_from_it():
    c = Chooser("cache-aware", block_size=16)
    template = [b"t1", b"t2", b"t3"]
    assert c.observe(template, whole=False) == 0  # the first chat: nothing seen two ways yet
    choice = c.choose(queued(a=0, b=0), {"a": 3}, 0, 0)
    assert (choice.name, choice.decision) == ("a", "cache-hit")
    assert c.observe(template, whole=False) == 3  # a second new chat forks after the template
    choice = c.choose(queued(a=0, b=0), {"a": 3}, 0, 3)
    assert (choice.name, choice.decision) == ("b", "load")  # placed by recent work, not by the template
    # a chat that continues: its own blocks past the template decide
    assert c.observe([*template, b"c1", b"c2"]) == 3
    choice = c.choose(queued(a=0, b=0), {"a": 5, "b": 3}, 5, 3)
    assert (choice.name, choice.decision) == ("a", "cache-hit")


def test_a_new_chat_goes_where_it_evicts_least():
    c = Chooser("cache-aware", block_size=16)
    full = ReplicaLoad("a", cached_blocks=100, capacity_blocks=100)
    empty = ReplicaLoad("b", cached_blocks=10, capacity_blocks=100)
    assert {c.choose([full, empty], {}, 20).name for _ in range(1)} == {"b"}
    c = Chooser("cache-aware", block_size=16)
    assert [c.choose([full, empty], {}, 20).name for _ in range(3)].count("a") >= 1  # recent work still spreads


def test_shared_prefixes_are_bounded_and_forget_the_oldest():
    from vlserve.router.shared_prefixes import SharedPrefixes

    s = SharedPrefixes(max_hashes=4)
    assert s.observe([b"x", b"y"]) == 0 and s.observe([b"x", b"z"]) == 1  # x forks
    assert s.observe([b"x", b"y", b"w"]) == 1  # y went on once: not a fork
    s.observe([b"p", b"q", b"r"])
    assert len(s) == 4  # x and y forgotten first
    assert s.observe([b"x", b"z2"]) == 0
    with pytest.raises(ValueError):
        SharedPrefixes(0)


def test_a_replicas_cache_size_is_read_from_its_metrics():
    from vlserve.router.replicas import parse_load

    text = ('# HELP x\nvlserve:num_requests_running{model_name="m"} 2.0\n'
            'vlserve:num_requests_waiting{model_name="m"} 1.0\nvlserve:kv_cache_blocks{model_name="m"} 160.0\n')
    assert parse_load(text) == {"running": 2, "waiting": 1, "capacity": 160}
    index = KVIndex()
    index.apply("b", _batch(0, [b"h1", b"h2"]))
    assert index.num_blocks("b") == 2 and index.num_blocks("a") == 0
