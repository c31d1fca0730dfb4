"""The encode service's own bookkeeping, in process (no sockets): a vision call that fails leaves nothing behind
in the encoder cache (the next request for that picture encodes it again instead of finding an entry with no
output), every waiter fails with it, and each call's time lands in the latency histogram, not in a list that
grows for ever. Its tower loads through the engine's executor: two ranks (split weights, or a data-parallel
encoder) encode what one does, and what the ranks cannot split is refused at start."""

from __future__ import annotations

import argparse
import asyncio
import gc
import threading

import pytest
import torch
from prometheus_client import generate_latest

from tests.conftest import noise_image
from tests.test_disagg import data_url
from vlserve.core.config import ENCODE, DisaggArgs, EngineArgs, Options
from vlserve.core.errors import ConfigurationError
from vlserve.disagg.encode_service import EncodeService

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
SECRET = DisaggArgs(disagg_secret="test-encode-secret")  # an encoder starts only with the deployment's secret


@pytest.fixture(scope="module")
def service(tiny_ckpt):
    svc = EncodeService(Options(engine=EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32"), disagg=SECRET))
    yield svc
    asyncio.run(svc.aclose())


class FailingTower:
    """The model's encode_images, failing the next `failures` calls."""

    def __init__(self, model, failures: int):
        self.model, self.failures, self.calls = model, failures, 0

    def encode_images(self, pixels, grids):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the tower broke")
        return self.model.encode_images(pixels, grids)


def _metric(service: EncodeService, name: str) -> float:
    """The sum over the metric's label sets."""
    values = [float(line.split()[-1]) for line in generate_latest(service.registry).decode().splitlines()
              if line.startswith((name + " ", name + "{"))]
    if not values:
        raise KeyError(name)
    return sum(values)


async def _prompt(service: EncodeService, seed: int):
    prompt = {"prompt": f"{IMG}Describe.", "multi_modal_data": {"image": [data_url(noise_image(56, 56, seed))]}}
    return (await service.prompts.encode(prompt, {}, "r")).prompt


def _run(coro, unretrieved: list):
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context.get("message")))
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
        gc.collect()  # an exception never retrieved is reported when its future is collected


def test_a_failed_vision_call_leaves_no_entry_and_the_next_request_encodes_again(service, monkeypatch):
    tower = FailingTower(service.encoders.model, failures=1)
    monkeypatch.setattr(service.encoders, "model", tower)
    unretrieved: list = []

    async def scenario():
        prompt = await _prompt(service, 1)
        with pytest.raises(RuntimeError, match="the tower broke"):
            await service._embeddings(prompt, "first")
        assert prompt.mm_items[0].mm_hash not in service.cache, "the failed encoding's entry is still cached"
        service.cache.release_all("first", prompt.mm_items)  # what the transfer's end does
        rows = await service._embeddings(prompt, "second")  # a miss: encoded again, not a KeyError
        assert rows[0].shape[0] == prompt.mm_items[0].num_tokens
        service.encoders.free(service.cache.release_all("second", prompt.mm_items))

    _run(scenario(), unretrieved)
    assert tower.calls == 2 and not unretrieved, unretrieved
    service.cache.check_integrity()


def test_waiters_on_a_failed_call_fail_too_and_nothing_is_held(service, monkeypatch):
    tower = FailingTower(service.encoders.model, failures=1)
    monkeypatch.setattr(service.encoders, "model", tower)
    unretrieved: list = []

    async def scenario():
        prompt = await _prompt(service, 2)
        results = await asyncio.gather(service._embeddings(prompt, "a"), service._embeddings(prompt, "b"),
                                       return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results), results
        for holder in ("a", "b"):
            service.cache.release_all(holder, prompt.mm_items)
        assert prompt.mm_items[0].mm_hash not in service.cache and not service.encoding
        assert (await service._embeddings(prompt, "c"))[0] is not None
        service.encoders.free(service.cache.release_all("c", prompt.mm_items))

    _run(scenario(), unretrieved)
    assert not unretrieved, unretrieved
    service.cache.check_integrity()
    assert not any(service.cache._holders.values())


def test_a_full_cache_refusal_leaves_no_half_started_encoding(service, monkeypatch):
    """Refused for lack of room after an earlier item of the prompt was set up to encode: that item's entry and
    its 'in flight' mark go too (a later request would otherwise wait on an encoding that never runs)."""
    unretrieved: list = []

    async def scenario():
        prompt = await _prompt(service, 3)
        other = await _prompt(service, 4)
        prompt.mm_items.append(other.mm_items[0])  # two pictures; the second finds no room
        monkeypatch.setattr(service.cache, "can_allocate", lambda n, protect=frozenset(): not service.encoding)
        with pytest.raises(Exception, match="encoder cache is full"):
            await service._embeddings(prompt, "full")
        monkeypatch.undo()
        service.cache.release_all("full", prompt.mm_items)
        assert not service.encoding and prompt.mm_items[0].mm_hash not in service.cache

    _run(scenario(), unretrieved)
    service.cache.check_integrity()


class GatedTower:
    """The model's encode_images, held at its start until `gate` is set (the vision call "still running")."""

    def __init__(self, model):
        self.model, self.started, self.gate = model, threading.Event(), threading.Event()

    def encode_images(self, pixels, grids):
        self.started.set()
        if not self.gate.wait(30):
            raise RuntimeError("the test never opened the gate")
        return self.model.encode_images(pixels, grids)


async def _evicted_while_encoding(service: EncodeService, monkeypatch, seed: int):
    """A vision call for a new picture is held running; the request that started it leaves (its entry is now
    unreferenced) and a full cache evicts that entry. Returns (the prompt, the gated tower, the call's future)."""
    tower = GatedTower(service.encoders.model)
    monkeypatch.setattr(service.encoders, "model", tower)
    prompt = await _prompt(service, seed)
    mm_hash = prompt.mm_items[0].mm_hash
    first = asyncio.create_task(service._embeddings(prompt, "left"))
    while not tower.started.is_set():
        await asyncio.sleep(0.01)
    running = service.encoding[mm_hash]
    first.cancel()  # the transfer failed or its receiver went away: the vision call goes on regardless
    with pytest.raises(asyncio.CancelledError):
        await first
    service.cache.release_all("left", prompt.mm_items)  # what the transfer's end does
    other = await _prompt(service, seed + 1000)
    with monkeypatch.context() as m:  # room for one picture only: the unreferenced entry is evicted
        m.setattr(service.cache, "capacity", other.mm_items[0].num_tokens * service.cache.rows_per_token)
        service.encoders.free(service.cache.allocate(("evictor", 0), other.mm_items[0]))
        service.cache.release(("evictor", 0), other.mm_items[0])
    assert mm_hash not in service.cache and mm_hash in service.encoding
    return prompt, tower, running


def test_a_request_for_a_picture_evicted_while_encoding_waits_for_that_encoding(service, monkeypatch):
    """Before: neither encoded nor awaited, the new request read an output that was not there yet (KeyError ->
    503). Now it awaits the vision call already running, and its entry accounts for the output."""
    unretrieved: list = []

    async def scenario():
        prompt, tower, _ = await _evicted_while_encoding(service, monkeypatch, 30)
        second = asyncio.create_task(service._embeddings(prompt, "second"))
        try:
            for _ in range(3):  # it runs up to its first wait (before: to its end, the KeyError)
                await asyncio.sleep(0)
            assert not second.done() or second.exception() is None, second.exception()
        finally:
            tower.gate.set()
        rows = await second
        assert rows[0].shape[0] == prompt.mm_items[0].num_tokens
        mm_hash = prompt.mm_items[0].mm_hash
        assert mm_hash in service.cache and mm_hash in service.encoders.outputs
        service.encoders.free(service.cache.release_all("second", prompt.mm_items))

    _run(scenario(), unretrieved)
    assert not unretrieved, unretrieved
    service.cache.check_integrity()
    assert not service.encoding and not any(service.cache._holders.values())


def test_a_late_output_whose_entry_was_evicted_is_not_kept(service, monkeypatch):
    """Before: the vision call stored its output after its entry had gone, outside the cache's accounting, for
    good (a leak). Now an output nobody's entry accounts for is dropped when the call ends."""
    unretrieved: list = []

    async def scenario():
        prompt, tower, running = await _evicted_while_encoding(service, monkeypatch, 31)
        tower.gate.set()
        await running  # the vision call ended
        return prompt.mm_items[0].mm_hash

    mm_hash = _run(scenario(), unretrieved)
    assert not unretrieved, unretrieved
    assert mm_hash not in service.encoders.outputs, "an evicted picture's rows are kept outside the cache"
    assert set(service.encoders.outputs) <= {h for h in service.cache._size}
    service.cache.check_integrity()


def test_each_vision_call_is_observed_once_and_not_kept(service):
    before = _metric(service, "vlserve:encoder_latency_seconds_count")

    async def scenario():
        for seed in (10, 11, 12):
            prompt = await _prompt(service, seed)
            await service._embeddings(prompt, f"m{seed}")
            service.encoders.free(service.cache.release_all(f"m{seed}", prompt.mm_items))

    _run(scenario(), [])
    assert _metric(service, "vlserve:encoder_latency_seconds_count") == before + 3
    assert service.encoders.timers == [], "vision-call times pile up in the encode service"


# ---- the tower loads like the engine's model: tensor-parallel ranks, or a data-parallel encoder ----------------
def _rows(service: EncodeService, seeds: tuple[int, ...]) -> list:
    """Each picture's rows, all pictures in one vision call (the data-parallel encoder spreads them)."""

    async def scenario():
        prompts = [await _prompt(service, seed) for seed in seeds]
        prompts[0].mm_items.extend(item for p in prompts[1:] for item in p.mm_items)
        rows = [r.clone() for r in await service._embeddings(prompts[0], "tp")]
        service.encoders.free(service.cache.release_all("tp", prompts[0].mm_items))
        return rows

    return _run(scenario(), [])


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_two_ranks_encode_what_one_does(service, tiny_ckpt, mode):
    """`vlserve encode --tensor-parallel-size 2 [--mm-encoder-tp-mode data]`: the tower's weights split over two
    rank processes (or whole on each, the pictures shared out), the rows the single-device service's."""
    two = EncodeService(Options(engine=EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32",
                                                  tensor_parallel_size=2, mm_encoder_tp_mode=mode), disagg=SECRET))
    try:
        assert two.tower.tp.size == 2 and two.encoders.whole_step == (mode == "data")
        assert two.cfg.num_kv_blocks == 0 and getattr(two.tower.model, "language_model", None) is None
        seeds = (20, 21, 22)
        for got, want in zip(_rows(two, seeds), _rows(service, seeds), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        asyncio.run(two.aclose())
    assert all(proc.poll() is not None for proc in two.tower.procs), "a rank outlived its encode service"


def test_a_tower_the_ranks_cannot_split_is_refused_at_start_naming_the_flags(tiny_ckpt):
    """The tiny tower has two heads: four ranks cannot split its weights, and say to share out pictures instead."""
    opts = Options(engine=EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32", tensor_parallel_size=4),
                   disagg=SECRET)
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size 4 does not divide the model's vision "
                                                 r"attention heads \(try mm_encoder_tp_mode data\)"):
        EncodeService(opts)


def test_encode_takes_the_tensor_parallel_flags():
    from vlserve.core.options import add_options, options_from

    parser = argparse.ArgumentParser()
    add_options(parser, ENCODE)
    ns = parser.parse_args(["--model", "m", "--tensor-parallel-size", "2", "--mm-encoder-tp-mode", "data"])
    engine = options_from(ns, ENCODE).engine
    assert (engine.tensor_parallel_size, engine.mm_encoder_tp_mode) == (2, "data")
