"""The cache-aware router's view of replicas' prefix caches (disagg/kv_index.py): longest prefixes, sequence gaps and
silence turning a replica cold, the memory bound; and the subscriber over real ZeroMQ sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from vlserve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from vlserve.disagg.kv_events_subscriber import KVEventSubscriber
from vlserve.disagg.kv_index import KVIndex
from vlserve.engine.kv_events import KVEventPublisher, KVEventRecorder


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(*ids) -> list[bytes]:
    return [h(i) for i in ids]


class Replica:
    """Batches as one publisher run would number them."""

    def __init__(self, run: str = "run-a"):
        self.run, self.seq = run, 0

    def batch(self, *events) -> KVEventBatch:
        b = KVEventBatch(self.run, self.seq, time.time(), list(events))
        self.seq += 1
        return b


def stored(*ids) -> BlockStored:
    return BlockStored(chain(*ids), None, 16)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def index(clock):
    return KVIndex(silence_timeout_s=5.0, max_blocks_per_replica=100, clock=clock)


def test_longest_prefix_per_replica(index):
    a, b = Replica(), Replica("run-b")
    index.apply("a", a.batch(stored(1, 2, 3, 4)))
    index.apply("b", b.batch(stored(1, 2), stored(7)))
    index.add_replica("c")
    request = chain(1, 2, 3, 5)
    assert index.longest_prefixes(request) == {"a": 3, "b": 2, "c": 0}
    assert [index.longest_prefix(r, request) for r in ("a", "b", "c", "unknown")] == [3, 2, 0, 0]
    assert index.longest_prefix("b", chain(7)) == 1
    assert index.longest_prefixes(chain(9, 1)) == {"a": 0, "b": 0, "c": 0}  # a prefix, not any overlap
    # removal in the middle of a chain cuts the prefix there
    index.apply("a", a.batch(BlockRemoved(chain(2))))
    assert index.longest_prefixes(request)["a"] == 1
    index.apply("b", b.batch(AllBlocksCleared()))
    assert index.longest_prefixes(request) == {"a": 1, "b": 0, "c": 0}
    assert not index.is_cold("a") and not index.is_cold("b") and index.is_cold("c")


def test_lost_batch_makes_replica_cold_then_it_rebuilds(index):
    a = Replica()
    index.apply("a", a.batch(stored(1, 2, 3)))
    a.batch(BlockRemoved(chain(3)))  # lost on the way
    index.apply("a", a.batch(stored(8)))
    view = index.view("a")
    assert view.gaps == 1 and "expected 1, got 2" in view.cold_reason
    # blocks from before the gap are forgotten (block 3's removal was missed), what came after is kept
    assert index.longest_prefix("a", chain(1, 2, 3)) == 0
    assert index.longest_prefix("a", chain(8)) == 1
    index.apply("a", a.batch(stored(1)))  # in sequence again: warm, with what it learned since
    assert not index.is_cold("a")
    assert index.longest_prefix("a", chain(1, 2)) == 1


def test_reordered_batch_is_a_gap_and_the_late_one_is_ignored(index):
    a = Replica()
    first, second, third = a.batch(stored(1)), a.batch(stored(2)), a.batch(BlockRemoved(chain(2)))
    index.apply("a", first)
    index.apply("a", third)
    assert index.is_cold("a")
    index.apply("a", second)  # arrives late: applying it would resurrect block 2
    assert index.view("a").gaps == 2
    assert index.longest_prefix("a", chain(2)) == 0 and index.longest_prefix("a", chain(1)) == 0


def test_restarted_replica_starts_clean(index):
    index.apply("a", Replica("run-1").batch(stored(1, 2)))
    restarted = Replica("run-2")
    index.apply("a", restarted.batch(stored(5)))  # new run, seq 0: its cache is empty, we see all of it
    assert not index.is_cold("a") and index.view("a").gaps == 1
    assert index.longest_prefixes(chain(1)) == {"a": 0}
    assert index.longest_prefix("a", chain(5)) == 1


def test_joining_mid_stream_is_cold_until_in_sequence(index):
    a = Replica()
    a.seq = 41
    index.apply("a", a.batch(stored(1)))
    assert index.is_cold("a") and index.longest_prefix("a", chain(1)) == 1
    index.apply("a", a.batch())
    assert not index.is_cold("a") and index.view("a").gaps == 0


def test_silent_replica_goes_cold_after_timeout(index, clock):
    a, b = Replica(), Replica("run-b")
    index.apply("a", a.batch(stored(1, 2)))
    index.apply("b", b.batch(stored(1)))
    clock.now += 4.0
    index.apply("b", b.batch())  # b's keepalive; a says nothing
    assert index.longest_prefixes(chain(1, 2)) == {"a": 2, "b": 1}
    clock.now += 1.5  # a: 5.5 s silent > 5; b: 1.5 s
    assert index.longest_prefixes(chain(1, 2)) == {"a": 0, "b": 1}
    assert "silent" in index.view("a").cold_reason and not index.is_cold("b")
    index.apply("a", a.batch())  # back, in sequence (a long engine step, say): warm with what it had
    assert not index.is_cold("a") and index.longest_prefixes(chain(1, 2)) == {"a": 2, "b": 1}
    clock.now += 6.0
    assert index.longest_prefix("a", chain(1)) == 0 and index.is_cold("b")
    a.seq += 1  # one batch lost
    index.apply("a", a.batch())  # back after the lost batch: what it had is forgotten
    assert "gap" in index.view("a").cold_reason and index.longest_prefix("a", chain(1)) == 0


def test_memory_bound_drops_oldest(clock):
    index = KVIndex(max_blocks_per_replica=3, clock=clock)
    a = Replica()
    index.apply("a", a.batch(stored(1, 2, 3)))
    index.apply("a", a.batch(stored(1)))  # stored again: now the newest
    index.apply("a", a.batch(stored(4, 5)))  # drops 2 then 3
    view = index.view("a")
    assert list(view.blocks) == chain(1, 4, 5) and view.dropped_by_bound == 2
    assert index.longest_prefix("a", chain(1, 2)) == 1
    assert index._holders.keys() == set(chain(1, 4, 5))  # the shared map forgets them too


def test_removed_replica_leaves_no_hashes(index):
    index.apply("a", Replica().batch(stored(1, 2)))
    index.apply("b", Replica("run-b").batch(stored(1)))
    index.remove_replica("a")
    assert index.replicas == ["b"] and index._holders.keys() == {h(1)}


def test_recorder_merges_chains_and_batch_roundtrip():
    rec = KVEventRecorder(block_size=16)
    root = b"vlserve-prefix-root"
    rec.stored(h(1), root)
    rec.stored(h(2), h(1))
    rec.stored(h(9), h(5))  # another request's chain
    rec.removed(h(3))
    rec.removed(h(4))
    events = rec.take()
    assert events == [BlockStored(chain(1, 2), None, 16), BlockStored(chain(9), h(5), 16), BlockRemoved(chain(3, 4))]
    assert rec.take() == []
    batch = KVEventBatch("r", 3, 1.5, events + [AllBlocksCleared()])
    assert decode_batch(encode_batch(batch)) == batch


def test_subscriber_over_zmq_detects_a_dropped_batch(clock):
    """A real PUB socket per replica; a batch the publisher numbered but never sent shows as a gap."""
    index = KVIndex(clock=clock)
    sub = KVEventSubscriber(index)
    pubs = {name: KVEventPublisher("tcp://127.0.0.1:*", block_size=16) for name in ("a", "b")}
    try:
        for name, pub in pubs.items():
            sub.add(name, pub.endpoint)
        _until_heard(sub, pubs)
        pubs["a"].recorder.stored(h(1), b"vlserve-prefix-root")
        pubs["a"].recorder.stored(h(2), h(1))
        pubs["a"].flush()
        pubs["b"].recorder.stored(h(1), b"vlserve-prefix-root")
        pubs["b"].flush()
        _poll_until(sub, lambda: index.longest_prefixes(chain(1, 2)) == {"a": 2, "b": 1})
        assert not index.is_cold("a") and index.view("a").publisher == pubs["a"].replica_id
        pubs["a"]._seq += 1  # as if a batch had been dropped at the high-water mark
        pubs["a"].recorder.stored(h(7), b"vlserve-prefix-root")
        pubs["a"].flush()
        _poll_until(sub, lambda: index.view("a").gaps == 1)
        assert index.is_cold("a") and index.longest_prefixes(chain(1, 2)) == {"a": 0, "b": 1}
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()


def test_subscriber_ignores_undecodable_messages(clock):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KVIndex(clock=clock)
    sub = KVEventSubscriber(index)
    try:
        sub.add("a", f"tcp://127.0.0.1:{port}")
        deadline, seq = time.monotonic() + 5, 0
        while index.view("a").publisher is None and time.monotonic() < deadline:  # the SUB joins late: repeat
            pub.send(b"\x93garbage")
            pub.send(encode_batch(KVEventBatch("run", seq, 0.0, [stored(1)])))  # in sequence: two may arrive
            seq += 1
            sub.poll(20)
        assert sub.undecodable >= 1 and index.longest_prefix("a", chain(1)) == 1
    finally:
        sub.close()
        pub.close(linger=0)


def _until_heard(sub, pubs) -> None:
    """SUB sockets join after a moment: keepalives until every replica is heard (joined mid-stream: cold until its
    next batch)."""
    deadline = time.monotonic() + 5
    while unheard := [n for n in pubs if sub.index.view(n).publisher is None]:
        if time.monotonic() > deadline:
            raise AssertionError("the subscriber never heard the publishers")
        for name in unheard:
            pubs[name]._last_sent = float("-inf")  # a keepalive is due
            pubs[name].flush()
        sub.poll(20)


def _poll_until(sub, cond) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        sub.poll(20)


def test_option_is_checked_and_each_decode_instance_gets_its_port():
    from vlserve.core.config import EngineArgs, Options
    from vlserve.core.errors import InvalidInputError
    from vlserve.disagg.launcher import plan_children

    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "tcp://h:port"):
        with pytest.raises(InvalidInputError, match="tcp://HOST:PORT"):
            EngineArgs(model="/m", kv_events_endpoint=bad).check()
    EngineArgs(model="/m", kv_events_endpoint="tcp://0.0.0.0:*").check()
    opts = Options()
    opts.engine.model, opts.engine.kv_events_endpoint = "/m", "tcp://127.0.0.1:7100"
    opts.disagg.num_encoders, opts.disagg.num_prefill, opts.disagg.num_decode = 1, 1, 2
    endpoints = {c.name: c.argv[c.argv.index("--kv-events-endpoint") + 1]
                 for c in plan_children(opts, "INFO") if "--kv-events-endpoint" in c.argv}
    assert endpoints == {"decode-0": "tcp://127.0.0.1:7100", "decode-1": "tcp://127.0.0.1:7101"}
    assert sum(c.argv.count("--kv-events-endpoint") for c in plan_children(opts, "INFO")) == 2
