"""A prefill engine sends a prompt's KV as it computes the prompt (engine.kv_connector.layer_sends): each layer's
keys and values go into the decode engine's blocks right after that layer ran, over a transport that writes some
planes of some rows (shm here), and what no layer write covered (a prefix from the prefix cache) plus a hybrid
model's state rows follow at the finish; over one that cannot (zmq) the whole prompt goes at the finish, still
without the front end asking. Either way the decode engine then goes on token for token as one engine would. A send
whose request is aborted mid-prompt, or whose deadline passed, is answered with why once nothing of it is written
any more; an engine with no writer refuses a send."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from tests.conftest import assert_pool_full, noise_image
from tests.test_kv_row_writes import (BLOCK_ROWS, NEVER, PICTURE, WritingPrefill, decode,  # noqa: F401 - a fixture
                                      prefill_with_send)
from tests.test_pd_handoff import Prefill, _whole
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import Handoff
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.wire import KVSend, KVWritten, ReleaseKV
from vlserve.disagg.transports.row_writer import decode_target, encode_destination, kv_receiver_maker, row_writer_maker
from vlserve.engine.state_rows import state_row_count

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
STEP_TOKENS = 8


class SpyWriter:
    """The engine's row writer, noting each write's (first row, first plane, planes) as it goes through, and the
    whole rows it writes."""

    def __init__(self, inner):
        self.inner, self.keep_s, self.writes_layers = inner, inner.keep_s, inner.writes_layers
        self.calls: list[tuple[int, int, int]] = []
        self.rows: list[torch.Tensor] = []

    def write(self, destination, rows, first_row=0, first_plane=0):
        self.calls.append((first_row, first_plane, rows.shape[1] if rows.dim() == 3 else 0))
        if rows.dim() == 2:
            self.rows.append(rows.clone())
        return self.inner.write(destination, rows, first_row, first_plane)

    def planes_of(self, destination):
        return self.inner.planes_of(destination)

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_5"])
def path(tiny_ckpt, request):  # Qwen3.5: linear layers between the KV layers, and state rows after the KV rows
    return tiny_ckpt(request.param)


@pytest.fixture(scope="module")
def whole(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def prefill(path):
    """Computing at most 8 tokens a step: a picture prompt takes several steps, each sending its layers."""
    p = WritingPrefill(path, max_num_batched_tokens=STEP_TOKENS)
    p.spy = p.connector.writer = SpyWriter(p.writer)
    p.connector.by_layer = True  # as where torch's threads leave a core free (else decided off: spare_core)
    yield p
    p.connector.close()


def poisoned(decode, blocks: list[int], rows: int) -> list[int]:
    """Reserved blocks filled with NaN first: a row no write covered fails the decode engine's finite check."""
    decode.kv_file.write_rows(blocks, torch.arange(rows), torch.full((rows, decode.kv_file.layout.width), float("nan")))
    return blocks


def _decode(decode, processed, blocks, rid, first, kv, params) -> list[int]:
    items = [MultiModalItem(it.offset, it.num_tokens, None, it.layout, it.mm_hash) for it in processed.mm_items]
    arrived = ProcessedPrompt(processed.prompt_token_ids, items, processed.positions, processed.position_delta,
                              block_rows=blocks, kv_in_blocks=True)
    decode.blocks[rid] = blocks
    decode.add(rid, arrived, params, Handoff(first, kv.generator_state))
    tokens = []
    while decode.core.has_unfinished:
        tokens += [t for out in decode.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


@pytest.mark.parametrize("by_layer", [True, False], ids=["by-layer", "at-the-finish"])
def test_the_prompt_goes_out_as_it_is_computed_and_decodes_as_one_engine(prefill, decode, whole, by_layer):
    processed = prefill.input_processor.process(PICTURE)
    n = len(processed.prompt_token_ids)
    tail = state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    layers = prefill.core.cfg.model.text.num_kv_layers
    assert n > BLOCK_ROWS > STEP_TOKENS  # more than one run of the receiver's (the prefill asked for the rest)
    blocks = poisoned(decode, decode.reserve("s", n + tail), n + tail)
    prefill.connector.by_layer, prefill.spy.calls = by_layer, []
    try:
        first, kv = prefill_with_send(prefill, "s", processed, GREEDY, KVSend(
            5, n, encode_destination(decode.target, blocks, "shm"), NEVER))
    finally:
        prefill.connector.by_layer = True
    row_bytes = decode.kv_file.layout.width * 4
    assert prefill.written(1) == [KVWritten("s", 5, (n + tail) * row_bytes)]
    states = [(n, 0, 0)] if tail else []  # a hybrid model's state rows, after the last token's, at the finish
    if by_layer:  # each step's tokens, every layer's keys and values on their own; nothing else but the states
        steps = range(0, n, STEP_TOKENS)
        assert sorted(prefill.spy.calls) == sorted([(s, 2 * k, 2) for s in steps for k in range(layers)] + states)
    else:
        assert prefill.spy.calls == [(0, 0, 0)]  # the whole prompt (and its states), once, when it is done
    assert prefill.connector.num_kept == 0 and not prefill.connector.owns("s")  # the send has ended: nothing kept
    assert _decode(decode, processed, blocks, "s", first, kv, GREEDY) == list(_whole(whole, PICTURE, GREEDY))
    assert decode.nothing_held()
    assert_pool_full(prefill)
    assert_pool_full(decode)


def test_a_cached_prefix_and_the_state_rows_follow_at_the_finish(prefill, decode, whole):
    """The same prompt again: its prefix comes from the prefix cache, so no layer write covers it; it is written
    from the kept blocks when the prompt is done, and (Qwen3.5) the state rows after the last token's row."""
    processed = prefill.input_processor.process(PICTURE)
    n = len(processed.prompt_token_ids)
    tail = state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    for rid in ("a", "b"):
        blocks = poisoned(decode, decode.reserve(rid, n + tail), n + tail)
        prefill.spy.calls = []
        first, kv = prefill_with_send(prefill, rid, processed, GREEDY, KVSend(
            0, n, encode_destination(decode.target, blocks, "shm"), NEVER))
        (answer,) = prefill.written(1)
        assert answer.error is None and answer.nbytes == (n + tail) * decode.kv_file.layout.width * 4, answer
        whole_rows = [c for c in prefill.spy.calls if c[1] == 0 and c[2] == 0]
        if rid == "b":  # its cached prefix, from row 0 (and at the finish the state rows, from row n)
            assert first.num_cached_tokens > 0 and (0, 0, 0) in whole_rows
        if tail:
            assert (n, 0, 0) in whole_rows
        prefill.core.abort_requests([rid])
        assert _decode(decode, processed, blocks, rid, first, kv, GREEDY) == list(_whole(whole, PICTURE, GREEDY))
    assert decode.nothing_held()
    assert_pool_full(prefill)


def test_over_zmq_the_whole_run_goes_at_the_finish(prefill, decode, whole):
    """A transport that writes whole rows from the run's start only: no layer writes; the engine writes the run
    through the decode engine's row socket when the prompt is done, still without being asked."""
    hybrid = decode.core.cfg.model.is_hybrid
    receiver = kv_receiver_maker("zmq", "127.0.0.1")(decode.kv_file, check_finite=not hybrid)
    zmq_writer = row_writer_maker("zmq", "127.0.0.1", 120.0)()
    assert not zmq_writer.writes_layers
    spy, prefill.connector.writer = prefill.connector.writer, zmq_writer
    prefill.connector.by_layer = False  # as bind() decides for this writer
    target = msgspec.structs.replace(decode_target(receiver.target), grant="z")
    processed = prefill.input_processor.process(PICTURE)
    n, tail = len(processed.prompt_token_ids), state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    try:
        blocks = poisoned(decode, decode.reserve("z", n + tail), n + tail)
        first, kv = prefill_with_send(prefill, "z", processed, GREEDY, KVSend(
            1, n, encode_destination(target, blocks, "zmq"), NEVER))
        (answer,) = prefill.written(1)
        assert answer.error is None and answer.nbytes > 0, answer
        prefill.core.abort_requests(["z"])
        assert _decode(decode, processed, blocks, "z", first, kv, GREEDY) == list(_whole(whole, PICTURE, GREEDY))
    finally:
        prefill.connector.writer, prefill.connector.by_layer = spy, True
        zmq_writer.close()
        receiver.close()
    assert decode.nothing_held()
    assert_pool_full(prefill)


def test_an_aborted_or_late_send_is_answered_once_nothing_more_is_written(prefill, decode):
    # a picture no test before sent: nothing of it is in the prefix cache
    processed = prefill.input_processor.process({**PICTURE, "multi_modal_data": {"image": noise_image(72, 56, 23)}})
    n, tail = len(processed.prompt_token_ids), state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    blocks = decode.reserve("x", n + tail)
    destination = encode_destination(decode.target, blocks, "shm")
    # aborted after its first step: its queued layer writes are cancelled, the answer says so
    prefill.core.add_request("x", processed, GREEDY.for_prefill(), kv_send=KVSend(2, n, destination, NEVER))
    prefill.core.step()
    assert prefill.core.has_unfinished and prefill.connector.sends["x"].futures  # its first layers queued
    prefill.core.abort_requests(["x"])
    (answer,) = prefill.written(1)
    assert answer.write_id == 2 and "released" in answer.error and answer.nbytes == 0
    assert not prefill.connector.owns("x") and not prefill.connector.writes_in_flight
    # past its deadline: nothing is written, the prompt is still computed
    prefill.core.add_request("y", processed, GREEDY.for_prefill(),
                             kv_send=KVSend(3, n, destination, time.time() - 1))
    while prefill.core.has_unfinished:
        prefill.core.step()
    prefill.connector.take_exported()
    (answer,) = prefill.written(1)
    assert answer.write_id == 3 and "deadline" in answer.error
    prefill.core.abort_requests(["y"])
    decode.core.connector.release(ReleaseKV("x"))
    assert decode.nothing_held()
    assert_pool_full(prefill)


def test_a_send_the_engine_cannot_make_is_refused_at_admission(path, prefill):
    processed = prefill.input_processor.process({"prompt": "Hello there"})
    n = len(processed.prompt_token_ids)
    plain = Prefill(path)  # a prefill engine without a row writer
    send = KVSend(0, n, b"", NEVER)
    with pytest.raises(InvalidInputError, match="writes no KV rows"):
        plain.core.add_request("p", processed, GREEDY.for_prefill(), kv_send=send)
    with pytest.raises(InvalidInputError, match="cannot be sent"):
        prefill.core.add_request("q", processed, GREEDY.for_prefill(), kv_send=KVSend(0, n + 1, b"", NEVER))
    assert not prefill.core.has_unfinished and not prefill.connector.owns("q")


def test_layers_are_sent_as_computed_only_where_a_core_is_spare(monkeypatch):
    """On a CPU whose every core computes, a writer thread copying beside each layer slowed the prompt more than
    it saved (benchmarks/layer_sends.py): the send then waits for the prompt's end. A GPU computes by itself."""
    from types import SimpleNamespace

    from vlserve.engine.kv_connector import prefill as prefill_module

    cpu = torch.device("cpu")
    monkeypatch.setattr(prefill_module.torch, "get_num_threads", lambda: 2)
    for cpus, spare in ((2, False), (1, False), (3, True)):
        monkeypatch.setattr(prefill_module, "cpu_budget", lambda cpus=cpus: SimpleNamespace(cpus=cpus))
        assert prefill_module.spare_core(cpu) is spare
        assert prefill_module.spare_core(torch.device("cuda", 0))


def test_receive_blocks_take_the_whole_run_at_the_finish(prefill, decode):
    """Receive blocks (a decode instance on a GPU, or at ranks torchrun started) keep a row in one plane: a
    layer's keys and values cannot go alone, so the run goes whole when the prompt is done."""
    from vlserve.disagg.transports.shm import ShmTransport
    from vlserve.engine.transfer_buffers import TransferBuffers

    processed = prefill.input_processor.process({**PICTURE, "multi_modal_data": {"image": noise_image(72, 56, 31)}})
    n, tail = len(processed.prompt_token_ids), state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    cfg = prefill.core.cfg
    receive = TransferBuffers.create(64, 16, cfg.model.kv_row_width, cfg.dtype)
    try:
        blocks = receive.allocate(n + tail)
        receive.write_rows(blocks, torch.arange(n + tail), torch.full((n + tail, receive.layout.width), float("nan")))
        prefill.spy.calls, prefill.spy.rows = [], []
        prefill_with_send(prefill, "w", processed, GREEDY, KVSend(
            4, n, encode_destination(ShmTransport().target(receive), blocks, "shm"), NEVER))
        (answer,) = prefill.written(1)
        assert answer.error is None, answer
        assert prefill.spy.calls == [(0, 0, 0)]
        assert torch.equal(receive.read_rows(blocks, 0, n + tail), prefill.spy.rows[0])
        prefill.core.abort_requests(["w"])
    finally:
        receive.unlink()
    assert_pool_full(prefill)


def test_what_layer_writes_cover_follows_the_steps_and_a_preemption_starts_it_afresh():
    from vlserve.engine.kv_connector.layer_sends import LayerSend

    send = LayerSend(KVSend(0, 24, b"", NEVER), "r", by_layer=True)
    assert send.rest() == [(0, 24)]
    assert send.computed(0, 8) == (0, 8) and send.computed(8, 16) == (8, 16)
    assert send.rest() == [(16, 24)]
    assert send.computed(16, 40) == (16, 24) and send.rest() == [] and send.computed(24, 30) is None
    send.restart()  # preempted (PrefillConnector.move_kv): recomputed from a cached prefix of 8 tokens
    assert send.computed(8, 20) == (8, 20) and send.rest() == [(0, 8), (20, 24)]
    assert send.computed(4, 12) == (4, 12) and send.rest() == [(0, 4), (12, 24)]  # a step that does not follow


def test_a_request_the_engine_process_does_not_admit_answers_its_send(prefill):
    """Refused at admission, or aborted while it waited for its LoRA adapter: its send is answered as not
    admitted (else its front end would wait for ever to acknowledge the receiver's abort)."""
    from vlserve.core.wire import EngineInput, Framer, prompt_to_wire
    from vlserve.engine.core_process import EngineCoreLoop, Progress

    loop = EngineCoreLoop(prefill.core, None, None, Progress(), 0)
    processed = prefill.input_processor.process({"prompt": "Hello there"})
    n = len(processed.prompt_token_ids)

    def add(rid: str, end: int) -> None:
        msg, tensors = prompt_to_wire(rid, processed, GREEDY.for_prefill(), time.time())
        msg.kv_send = KVSend(9, end, b"", NEVER)
        loop._handle(msg, Framer(EngineInput).encode(msg, tensors))

    add("past", n + 1)
    assert [r.request_id for r in loop.rejected] == ["past"]
    assert loop.refused_writes == [KVWritten("past", 9, error=loop.refused_writes[0].error)]
    assert "not admitted" in loop.refused_writes[0].error and "cannot be sent" in loop.refused_writes[0].error

    class WaitingForAdapter:  # what lora_loader.AdapterLoader does with a request whose adapter is being read
        held: list = []

        def must_wait(self, lora):
            return True

        def hold(self, request_id, lora, params, admit):
            self.held.append(admit)

        def drop(self, engine_ids):
            held, self.held = self.held, []
            return held

    loop.rejected, loop.refused_writes, loop.loader = [], [], WaitingForAdapter()
    add("held", n)
    from vlserve.core.wire import FinishRequests

    loop._handle(FinishRequests(["held"]), [])
    assert [(r.request_id, r.status) for r in loop.rejected] == [("held", 400)]
    assert [(w.request_id, w.write_id) for w in loop.refused_writes] == [("held", 9)]
    assert not prefill.core.has_unfinished and not prefill.connector.owns("held")


def test_an_abort_is_acknowledged_once_the_send_has_ended():
    """While the engine may still write the prompt's rows (its send not answered yet) the receiver's abort waits;
    an engine that stopped answering leaves it unacknowledged (the receiver's quarantine frees the blocks)."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from vlserve.disagg.messages import AbortTransfer
    from vlserve.disagg.metrics import TransferMetrics
    from vlserve.disagg.sender import TransferSender
    from vlserve.disagg.transports.base import HeadersOnly

    replies = []

    class Socket:
        async def send_multipart(self, frames, **kw):
            replies.append(frames)

    async def main():
        sender = TransferSender(Socket(), HeadersOnly("shm"),
                                TransferMetrics(CollectorRegistry(), None, "prefill", "kv"), 8.0)
        for rid, unsettled in (("settles", False), ("stuck", True)):
            key = (b"peer", rid, 0)
            settling = sender.settling[key] = asyncio.get_running_loop().create_future()
            before = len(replies)
            abort = asyncio.create_task(sender.abort(b"peer", AbortTransfer(rid, 0)))
            await asyncio.sleep(0.05)
            assert not abort.done() and len(replies) == before  # the engine may still be writing
            if unsettled:
                sender.unsettle(key)
            settling.set_result(None)
            await asyncio.wait_for(abort, 5)
        assert len(replies) == 1  # "settles" only

    asyncio.run(main())


def test_the_writes_of_a_send_start_within_what_the_receiver_waits_out():
    """The receiver keeps a failed KV transfer's blocks until the time it gave the sender (from when it asked)
    and its quarantine after it; the sender starts no write after that time counted from the request's
    arrival (later than the asking). A nonsense budget from a peer falls back to the sender's own timeout."""
    from types import SimpleNamespace

    from vlserve.disagg.peer_client import PeerClient
    from vlserve.disagg.peer_kinds import ENCODER_PEERS, PREFILL_PEERS
    from vlserve.disagg.transports.row_writer import send_deadline

    assert send_deadline(100.0, 8.0, 120.0) == 108.0
    for nonsense in (0.0, -1.0, float("nan"), float("inf"), 500.0):
        assert send_deadline(100.0, nonsense, 120.0) == 220.0
    receiver = SimpleNamespace(kind=PREFILL_PEERS, opts=SimpleNamespace(transfer_timeout=8.0), quarantine_s=6.0)
    now = time.monotonic()
    assert PeerClient._quarantine_until(receiver, now - 1.0) == pytest.approx(now + 13.0, abs=0.5)
    assert PeerClient._quarantine_until(receiver, now - 60.0) == pytest.approx(now + 6.0, abs=0.5)
    receiver.kind = ENCODER_PEERS  # an encoder writes only when asked: its quarantine alone
    assert PeerClient._quarantine_until(receiver, now - 1.0) == pytest.approx(now + 6.0, abs=0.5)


def test_a_prefill_asks_for_every_row_before_it_computes_so_one_chunk_fills_them(tiny_ckpt):
    """The prompt's rows (Qwen3.5: its state rows after the last token's) in the first run and what the prefill
    instance asks for beyond it, filled in order by one send and one chunk. Before, a prompt whose tokens fit the
    first run but not its state rows went in two chunks with a gap at the end of the first run, where the decode
    engine then read the state rows."""
    import asyncio
    from types import SimpleNamespace

    from vlserve.core.config import EngineArgs
    from vlserve.disagg.peer_kinds import PREFILL_PEERS
    from vlserve.disagg.prefill_service import PrefillService
    from vlserve.disagg.row_map import RowMap
    from vlserve.frontend.config import FrontendConfig
    from vlserve.model.facts import resolve_model_facts

    args = EngineArgs(model=str(tiny_ckpt("qwen3_5")), dtype="float32")
    cfg = FrontendConfig.of(resolve_model_facts(args, announce=False), args)
    tail, block = PREFILL_PEERS.tail_rows(cfg), 16
    assert tail > 0
    asked: list[int] = []

    async def ask_rows(key, rows: int) -> list[int]:
        asked.append(rows)
        return [100 + i for i in range(-(-rows // block))]

    service = SimpleNamespace(engine=SimpleNamespace(cfg=cfg), sender=SimpleNamespace(ask_rows=ask_rows))
    for total, more in ((20, []), (2 * block - tail, []), (2 * block - tail + 1, [1]), (100, [100 + tail - 32])):
        asked.clear()
        req = SimpleNamespace(block_ids=[7, 8], block_tokens=block)
        prompt = SimpleNamespace(num_tokens=total, mm_items=[])
        blocks, since = asyncio.run(PrefillService._blocks(service, ("peer", "r", 0), req, prompt, 5.0))
        assert asked == more and blocks[:2] == [7, 8] and len(blocks) * block >= total + tail
        assert (since == 5.0) is not bool(more)  # the writing time counts from the receiver's answer
        assert RowMap([], True, tail).chunk_end(0, len(blocks) * block, total) == total  # one chunk for all


def test_a_preempted_sends_bytes_count_each_row_once():
    """After a preemption every row is written again (recomputed layers, the rest at the finish): the answer
    reports the bytes of the writes after it, not those it replaced too."""
    from concurrent.futures import Future

    from vlserve.engine.kv_connector.layer_sends import LayerSend

    def done(nbytes: int) -> Future:
        f = Future()
        f.set_result(nbytes)
        return f

    send = LayerSend(KVSend(3, 24, b"", NEVER), "r", by_layer=True)
    send.futures += [done(100), done(100)]  # two layers of tokens 0..8
    send.restart()
    send.futures += [done(100), done(100), done(200)]  # again, and the rest at the finish
    send.finished = True
    assert send.answer() == KVWritten("r", 3, 400)
