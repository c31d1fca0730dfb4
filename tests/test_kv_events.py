"""KV cache events from the engine (`--kv-events-endpoint`): a picture prompt's stored blocks are exactly the hashes
a router computes from the processed prompt (`prompt_block_hashes`); a shared prefix is stored once; eviction and
a reset are published; the events, replayed, are the pool's cached hashes; over the real socket a `KVIndex`
reflects them; with the option off nothing is published."""

from __future__ import annotations

import time

import pytest

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.block_hash import prompt_block_hashes
from vlserve.core.errors import InvalidInputError
from vlserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vlserve.disagg.kv_events_subscriber import KVEventSubscriber
from vlserve.disagg.kv_index import KVIndex

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)  # no generated token is computed: only prompt blocks
BLOCK = 16
NUM_BLOCKS = 12  # 192 tokens: a few picture prompts fill it


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen2_vl"), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
              kv_events_endpoint="tcp://127.0.0.1:*")
    yield llm
    llm.shutdown()


@pytest.fixture
def batches(llm, monkeypatch):
    """Every batch the engine publishes during the test (the socket send itself is tested below)."""
    pub = llm.engine.core.kv_events
    sent, flush = [], pub.flush

    def recording_flush(keepalive: bool = True):
        batch = flush(keepalive)
        if batch is not None:
            sent.append(batch)
        return batch

    monkeypatch.setattr(pub, "flush", recording_flush)
    return sent


def _events(batches, kind):
    return [e for b in batches for e in b.events if isinstance(e, kind)]


def _stored(batches) -> list[bytes]:
    return [h for e in _events(batches, BlockStored) for h in e.block_hashes]


def _picture_prompt(text: str, seed: int, question: str = "Describe the picture in detail please.") -> dict:
    return {"prompt": f"{text} {IMG} {question}", "multi_modal_data": {"image": [noise_image(120, 120, seed)]}}


def _replay(batches) -> set[bytes]:
    cached: set[bytes] = set()
    for e in (e for b in batches for e in b.events):
        if isinstance(e, BlockStored):
            cached |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached -= set(e.block_hashes)
        else:
            cached.clear()
    return cached


def _pool_hashes(llm) -> set[bytes]:
    return set(llm.engine.core.scheduler.kv.pool._cached)


def test_picture_prompt_stores_the_router_hashes_and_a_shared_prefix_once(llm, batches):
    system = "You are a careful assistant who looks closely at every picture it is shown."
    first = _picture_prompt(system, seed=1)
    llm.generate([first], ONE_TOKEN, use_tqdm=False)
    expected = prompt_block_hashes(llm.engine.input_processor.process(first), BLOCK)
    assert len(expected) >= 3 and _stored(batches) == expected
    events = _events(batches, BlockStored)
    assert events[0].parent_hash is None and {e.block_size for e in events} == {BLOCK}
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))

    # the same system text and picture, another question: only the blocks after the shared prefix are new
    batches.clear()
    second = _picture_prompt(system, seed=1, question="Which colours do you see there, and how many of each "
                             "kind, counted carefully one by one?")
    llm.generate([second], ONE_TOKEN, use_tqdm=False)
    hashes2 = prompt_block_hashes(llm.engine.input_processor.process(second), BLOCK)
    shared = next(i for i, (a, b) in enumerate(zip(expected, hashes2)) if a != b)
    assert 0 < shared < len(hashes2) and _stored(batches) == hashes2[shared:]
    assert _events(batches, BlockStored)[0].parent_hash == hashes2[shared - 1]
    assert llm.get_metrics()["prefix_cache_hits_total"] >= shared * BLOCK


def test_the_picture_is_part_of_the_hashes(llm):
    processed = llm.engine.input_processor.process(_picture_prompt("Same words", seed=2))
    other = llm.engine.input_processor.process(_picture_prompt("Same words", seed=3))
    assert processed.prompt_token_ids == other.prompt_token_ids
    mine, theirs = prompt_block_hashes(processed, BLOCK), prompt_block_hashes(other, BLOCK)
    first_media_block = processed.mm_items[0].offset // BLOCK
    assert mine[:first_media_block] == theirs[:first_media_block] and mine[-1] != theirs[-1]
    with pytest.raises(ValueError):
        prompt_block_hashes(processed, 0)


def test_eviction_and_reset_are_published(llm, batches):
    llm.engine.core.reset_prefix_cache()
    batches.clear()
    # more distinct prompts than the pool holds: idle cached blocks are reused, their hashes published as removed
    for seed in range(10, 16):
        llm.generate([_picture_prompt(f"Question number {seed}:", seed)], ONE_TOKEN, use_tqdm=False)
    removed = [h for e in _events(batches, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(_stored(batches))
    assert _replay(batches) == _pool_hashes(llm) != set()
    assert_pool_full(llm)

    batches.clear()
    assert llm.engine.core.reset_prefix_cache()
    assert [e for b in batches for e in b.events] == [AllBlocksCleared()] and _pool_hashes(llm) == set()


def test_reset_is_refused_while_blocks_are_in_use(llm, batches):
    llm.engine.add_request(_picture_prompt("Still running", seed=20), SamplingParams(max_tokens=4))
    llm.engine.step()
    try:
        assert not llm.engine.core.reset_prefix_cache() and _pool_hashes(llm)
        assert not _events(batches, AllBlocksCleared)
    finally:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def test_index_follows_the_engine_over_zmq(llm):
    """The engine's real PUB socket on tcp://127.0.0.1, a subscriber and its index: the router's hashes match."""
    pub = llm.engine.core.kv_events
    index = KVIndex()
    sub = KVEventSubscriber(index)
    try:
        sub.add("replica-0", pub.endpoint)
        deadline = time.monotonic() + 10
        while index.view("replica-0").publisher != pub.replica_id:  # the SUB joins after a moment
            if time.monotonic() > deadline:
                raise AssertionError("no keepalive reached the subscriber")
            pub._last_sent = float("-inf")  # a keepalive is due
            llm.engine.core.publish_kv_events()
            sub.poll(20)
        prompt = _picture_prompt("Over the wire", seed=30)
        llm.generate([prompt], ONE_TOKEN, use_tqdm=False)
        hashes = prompt_block_hashes(llm.engine.input_processor.process(prompt), BLOCK)
        while index.longest_prefix("replica-0", hashes) < len(hashes) and time.monotonic() < deadline:
            sub.poll(20)
        assert index.longest_prefix("replica-0", hashes) == len(hashes)
        assert not index.is_cold("replica-0") and index.view("replica-0").gaps == 0
        assert set(index.view("replica-0").blocks) <= _pool_hashes(llm)
    finally:
        sub.close()


def test_off_by_default_and_checked(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen2_vl"), dtype="float32", num_kv_blocks=NUM_BLOCKS)
    try:
        assert llm.engine.core.kv_events is None and llm.engine.core.scheduler.kv.pool.events is None
        llm.generate(["nothing to publish"], ONE_TOKEN, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(InvalidInputError, match="needs prefix caching"):
        LLM(tiny_ckpt("qwen2_vl"), kv_events_endpoint="tcp://127.0.0.1:*", enable_prefix_caching=False)
    with pytest.raises(InvalidInputError, match="tcp://"):
        LLM(tiny_ckpt("qwen2_vl"), kv_events_endpoint="127.0.0.1:5557")
