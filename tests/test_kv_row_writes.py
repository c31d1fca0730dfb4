"""A prefill engine that writes its KV rows into a decode instance's blocks itself (#47: no KV byte through the
front end): with an in-place transport (here shared memory, the same writer the prefill instance's engine process
makes) the rows stay in the engine, which writes them where the request's `KVSend` says, and the decode engine goes
on token for token as one engine would. A send into bad blocks, past its deadline or released is answered with an
error for that send only; what the engine kept goes once the send has ended, on release or on expiry."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import msgspec
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.test_pd_handoff import Decode, _cfg, _whole, run
from vlserve import LLM, SamplingParams
from vlserve.core.errors import ConfigurationError, EngineDeadError
from vlserve.core.messages import Handoff
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.wire import CancelReserveKV, KVReserved, KVSend, KVWritten, ReleaseKV, ReserveKV
from vlserve.disagg.messages import AbortTransfer
from vlserve.disagg.metrics import TransferMetrics
from vlserve.disagg.sender import TransferSender
from vlserve.disagg.transports.base import HeadersOnly
from vlserve.disagg.transports.row_writer import decode_target, encode_destination, kv_receiver_maker, row_writer_maker
from vlserve.disagg.transports.shm import ShmTransport
from vlserve.engine.core import EngineCore
from vlserve.engine.kv_connector import make_connector
from vlserve.engine.kv_connector.layer_sends import LayerSend
from vlserve.engine.kv_connector.prefill import KeptKV
from vlserve.engine.state_rows import state_row_count
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.kv_writes import KVWrites, KVWriteUnsettled

BLOCK_ROWS = 16
NEVER = float("inf")  # a send's deadline that never passes
PICTURE = {"prompt": f"{IMG} Describe it in detail, please.", "multi_modal_data": {"image": noise_image(72, 56, 9)}}


class WritingPrefill:
    """A prefill engine with the shm row writer, as `vlserve prefill --transfer-backend shm` makes it."""

    def __init__(self, path, **kw):
        cfg = _cfg(path, num_kv_blocks=256, **kw)
        self.writer = row_writer_maker("shm", "127.0.0.1", 120.0)()
        self.core = EngineCore(cfg, connector=make_connector("prefill", cfg, self.writer))
        self.connector = self.core.connector
        self.input_processor = InputProcessor.for_model(cfg)

    @property
    def engine(self):  # what assert_pool_full looks at
        return self

    def written(self, count: int) -> list[KVWritten]:
        """The next `count` answers (the writes run on the connector's thread)."""
        got: list[KVWritten] = []
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            got += self.connector.take_written()
            time.sleep(0.001)
        assert len(got) == count, got
        return got


def prefill_with_send(prefill, rid: str, processed, params, send: KVSend):
    """The prompt computed with its KV sent where `send` says: (its first token's output, its export)."""
    prefill.core.add_request(rid, processed, params.for_prefill(), kv_send=send)
    outs, exported = [], []
    while prefill.core.has_unfinished:
        outs += prefill.core.step()
        exported += prefill.connector.take_exported()
    (kv,) = exported
    return outs[-1], kv


class SharedDecode(Decode):
    """A decode engine as a decode instance has it at one rank on the CPU: its KV cache in a shared-memory file,
    which the prefill engine's shm writer writes into, in blocks the engine reserved for the transfer."""

    def __init__(self, path):
        super().__init__(path, in_place=True)
        self.kv_file = self.core.runner.kv_buffers
        self.target = ShmTransport().target(self.kv_file)

    def reserve(self, holder: str, rows: int) -> list[int]:
        return self.core.connector.reserve(ReserveKV(holder, 0, rows)).block_ids

    @property
    def engine(self):  # what assert_pool_full looks at
        return self


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_5"])
def path(tiny_ckpt, request):  # Qwen3.5: its linear states follow the KV rows, written with the last chunk
    return tiny_ckpt(request.param)


@pytest.fixture(scope="module")
def whole(path):  # one engine doing all of it: the reference
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def prefill(path):
    p = WritingPrefill(path)
    yield p
    p.connector.close()


@pytest.fixture(scope="module")
def decode(path):
    d = SharedDecode(path)
    yield d
    d.core.shutdown()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_rows_sent_with_the_request_decode_as_one_engine(prefill, decode, whole, params):
    _write_and_decode(prefill, decode, whole, params, decode.target, "shm")


def test_over_zmq_the_rows_land_through_the_decode_engines_row_socket(prefill, decode, whole):
    """--transfer-backend zmq: the prefill engine's writer sends each chunk to the row socket the decode engine
    process serves (`TransportKVReceiver`, a thread copying into its KV cache): no front end in between. The socket
    checks the rows are finite unless the model's state rows (bytes, not values) follow them."""
    hybrid = decode.core.cfg.model.is_hybrid
    receiver = kv_receiver_maker("zmq", "127.0.0.1")(decode.kv_file, check_finite=not hybrid)
    assert receiver.rows_checked is not hybrid
    shm_writer, prefill.connector.writer = prefill.connector.writer, row_writer_maker("zmq", "127.0.0.1", 120.0)()
    try:
        target = decode_target(receiver.target)
        assert target.backend == "zmq" and target.session.startswith("ipc://")
        target = msgspec.structs.replace(target, grant="r")  # the transfer's: its blocks are reserved under "r"
        _write_and_decode(prefill, decode, whole, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          target, "zmq")
    finally:
        prefill.connector.writer.close()
        prefill.connector.writer = shm_writer
        receiver.close()


def test_a_rogue_holding_the_secret_writes_nothing_into_the_decode_kv_cache(prefill, decode, whole):
    """Before, the decode engine's row socket took a write anywhere in its KV cache (every block, prefix-cached
    ones too: the same greedy request then answered differently, from the poisoned cache). Now only blocks reserved
    under the write's grant take it: every other write is answered with why, and not a byte of the cache moves."""
    from vlserve.disagg.auth import PeerAuth
    from vlserve.disagg.transports.zmq import RowWrite, RowWritten

    secret, greedy = "s3cret", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    receiver = kv_receiver_maker("zmq", "127.0.0.1", secret)(decode.kv_file)
    shm_writer, prefill.connector.writer = prefill.connector.writer, row_writer_maker("zmq", "127.0.0.1", 120.0,
                                                                                      secret)()
    target = decode_target(receiver.target)
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.linger = 0
    PeerAuth(secret).secure_client(rogue)
    rogue.connect(target.session)
    try:
        _write_and_decode(prefill, decode, whole, greedy, msgspec.structs.replace(target, grant="r"), "zmq")
        layout = decode.kv_file.layout
        live = decode.reserve("live", 2 * layout.block_tokens)  # a transfer under way (its grant is "live")
        others = [b for b in range(layout.num_blocks) if b not in live]  # the prefix-cached prompt's among them
        before = decode.kv_file.storage.clone()
        now = time.time()
        for header in (RowWrite(1, "live", others, len(others) * layout.block_tokens, now),
                       RowWrite(2, "r", others[:2], 2 * layout.block_tokens, now),  # "r" is over
                       RowWrite(3, "guessed", live, len(live) * layout.block_tokens, now),
                       RowWrite(4, "live", live, len(live) * layout.block_tokens, float("nan"))):
            rows = torch.full((header.num_rows, layout.width), 3.0)
            rogue.send_multipart([msgspec.msgpack.encode(header), rows.numpy().tobytes()])
            assert rogue.poll(30000), "the row socket did not answer"
            reply = msgspec.msgpack.decode(rogue.recv(), type=RowWritten)
            assert reply.write_id == header.write_id and "nothing written" in reply.error, reply
        rogue.send_multipart([b"\x00" * (5 * 2**20), b""])  # an oversized header is answered too
        assert rogue.poll(30000) and "header has" in msgspec.msgpack.decode(rogue.recv(), type=RowWritten).error
        assert torch.equal(decode.kv_file.storage, before), "a refused write landed in the KV cache"
        decode.core.connector.release(ReleaseKV("live"))
        _write_and_decode(prefill, decode, whole, greedy, msgspec.structs.replace(target, grant="r"), "zmq")
    finally:
        rogue.close(0)
        prefill.connector.writer.close()
        prefill.connector.writer = shm_writer
        receiver.close()


def _write_and_decode(prefill, decode, whole, params, target, backend: str) -> None:
    """The prompt prefilled, its rows written as its `KVSend` says into blocks the decode engine reserved, then
    decoded there: token for token what one engine generates."""
    processed = prefill.input_processor.process(PICTURE)
    n, tail = len(processed.prompt_token_ids), state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    assert n > BLOCK_ROWS
    blocks = decode.reserve("r", n + tail)
    first, kv = prefill_with_send(prefill, "r", processed, params,
                                  KVSend(0, n, encode_destination(target, blocks, backend), NEVER))
    assert kv.rows is None and prefill.connector.num_kept == 1  # the KV stayed in the engine
    row_bytes = decode.kv_file.layout.width * 4
    assert prefill.written(1) == [KVWritten("r", 0, (n + tail) * row_bytes)]
    # its send has ended: what the engine kept of the request is gone, its blocks are free
    pool = prefill.core.scheduler.kv.pool
    assert prefill.connector.num_kept == 0 and not prefill.connector.owns("r")
    assert pool.num_free == pool.num_blocks

    items = [MultiModalItem(it.offset, it.num_tokens, None, it.layout, it.mm_hash) for it in processed.mm_items]
    arrived = ProcessedPrompt(processed.prompt_token_ids, items, processed.positions, processed.position_delta,
                              block_rows=blocks, kv_in_blocks=True)
    decode.blocks["r"] = blocks
    decode.add("r", arrived, params, Handoff(first, kv.generator_state))
    tokens = []
    while decode.core.has_unfinished:
        tokens += [t for out in decode.step() if out.request_id == "r" for t in out.new_token_ids]
    assert tokens == list(_whole(whole, PICTURE, params))
    assert decode.nothing_held()
    assert_pool_full(prefill)
    assert_pool_full(decode)


def test_a_bad_send_fails_alone_and_unsent_rows_expire(prefill, decode):
    processed = prefill.input_processor.process({"prompt": "Hello, how are you?"})
    n, tail = len(processed.prompt_token_ids), state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    params = SamplingParams(temperature=0, max_tokens=4)
    blocks = decode.reserve("b", n + tail)
    try:
        outside = encode_destination(decode.target, [10**6], "shm")
        prefill_with_send(prefill, "b1", processed, params, KVSend(1, n, outside, NEVER))
        (bad,) = prefill.written(1)
        assert bad.write_id == 1 and "outside the receiver" in bad.error and bad.nbytes == 0
        prefill_with_send(prefill, "b2", processed, params,
                          KVSend(2, n, encode_destination(decode.target, blocks, "shm"), NEVER))
        (good,) = prefill.written(1)
        assert good.error is None and good.nbytes == (n + tail) * decode.kv_file.layout.width * 4
        assert prefill.connector.num_kept == 0
        with pytest.raises(ValueError, match="backend"):  # a receiver of another backend is refused up front
            encode_destination(None, blocks, "shm")
        # a prompt computed without a send (an engine driven directly): its rows wait for nobody, then expire
        prefill.core.add_request("b3", processed, params.for_prefill())
        while prefill.core.has_unfinished:
            prefill.core.step()
        prefill.connector.take_exported()
        assert prefill.connector.num_kept == 1
        prefill.connector.keep_s = -1.0
        prefill.connector.start_step()
        assert prefill.connector.num_kept == 0
    finally:
        prefill.connector.keep_s = prefill.writer.keep_s
        decode.core.connector.release(ReleaseKV("b"))
    assert decode.nothing_held()
    assert_pool_full(prefill)


class RecordingWriter:
    """A row writer that keeps what it was given to write (whole rows only, as zmq's)."""

    keep_s, writes_layers = 120.0, False

    def __init__(self):
        self.written: list[torch.Tensor] = []

    def write(self, destination: bytes, rows: torch.Tensor, first_row: int = 0, first_plane: int = 0) -> int:
        self.written.append(rows.clone())
        return rows.numel() * rows.element_size()

    def planes_of(self, destination: bytes) -> int:
        return 1

    def close(self) -> None:
        pass


def test_a_prefill_engine_writes_no_kv_rows_holding_nan_but_writes_state_rows_as_bytes(path):
    """#67: the prefill engine checks a send's token rows on its writer thread before it writes them: rows
    holding NaN or inf are not written and the send fails (its transfer fails, retried on another prefill
    instance). A hybrid model's state rows after the last token's are float32 bytes in the KV dtype, which may
    read as NaN: they are not values, and go as they are."""
    cfg = _cfg(path, num_kv_blocks=64)
    writer = RecordingWriter()
    connector = make_connector("prefill", cfg, writer)
    width = cfg.model.kv_row_width
    clean, poisoned, infinite = torch.randn(8, width), torch.randn(8, width), torch.randn(8, width)
    poisoned[5, 3], infinite[1, 0] = float("nan"), float("inf")
    states = torch.full((2, width), float("nan"))  # as bytes
    connector.kept.update({"nan": KeptKV.of_rows(poisoned, 8), "inf": KeptKV.of_rows(infinite, 8),
                           "states": KeptKV(8, lambda start, end: clean[start:end], states, None, time.monotonic())})
    try:
        for write_id, rid in enumerate(("nan", "inf", "states")):  # as each request's end sends what is left
            connector.sends[rid] = LayerSend(KVSend(write_id, 8, b"to", NEVER), rid)
            connector._send_rest(rid, connector.kept[rid])
        answers: dict[int, KVWritten] = {}
        deadline = time.monotonic() + 30
        while len(answers) < 3 and time.monotonic() < deadline:
            answers.update({w.write_id: w for w in connector.take_written()})
            time.sleep(0.001)
        for refused in (answers[0], answers[1]):
            assert "NaN or infinite values" in refused.error and "not written" in refused.error, refused
        assert answers[2].error is None
        assert [len(rows) for rows in writer.written] == [10]  # the refused ones never reached the writer
        assert torch.equal(writer.written[0][:8], clean) and writer.written[0][8:].isnan().all()
        assert connector.num_kept == 0  # every send ended: nothing kept
    finally:
        connector.close()


def test_a_decode_engine_fails_a_request_whose_kv_rows_hold_nan_as_it_admits_it(path, decode):
    """#67: shm, Mooncake and NIXL write one-sided (nothing on the decode side can refuse a write), and over zmq
    a hybrid model's rows carry state bytes its row socket cannot judge: the decode engine checks a prompt's KV
    rows, its blocks in place or in receive blocks (a GPU), on a thread of its own from the request's arrival
    (its blocks take no more writes by then), and takes the answer when it admits the request. A NaN fails that
    request alone, as the server's fault (503: its prefill instance sent garbage, the client did nothing wrong);
    the other request of the step goes on, and every block goes back."""
    from vlserve.core.messages import EngineCoreOutput

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cfg = decode.core.cfg
    processed = InputProcessor.for_model(cfg).process({"prompt": "Hello, how are you?"})
    n, tail = len(processed.prompt_token_ids), state_row_count(cfg.model, cfg.dtype)
    for engine in (decode, Decode(path, num_kv_blocks=32, in_place=False)):
        for rid in ("poisoned", "fine"):
            rows = torch.randn(n + tail, cfg.model.kv_row_width)
            if rid == "poisoned":
                rows[n // 2, 5] = float("nan")
            engine.add(rid, engine.receive(rid, processed, rows), params, Handoff(EngineCoreOutput(rid, [7])))
        assert engine.core.connector._checker is not None  # checked off the engine's thread
        got = run(engine, ["poisoned", "fine"])
        assert len(got["fine"]) == 3 and got["poisoned"] == [7]  # (its first token came with it)
        failed = {rid: (why, status) for rid, why, status in engine.core.take_failed()}
        assert failed["poisoned"][1] == 503 and "NaN or infinite values" in failed["poisoned"][0], failed
        assert "fine" not in failed
        assert not engine.core.connector.owns("poisoned")
        assert engine.nothing_held()
        if engine is not decode:
            engine.core.shutdown()


def test_a_finite_check_that_breaks_fails_its_request_alone(path, decode, monkeypatch):
    """The check runs on its own thread; whatever it raises fails that request (500) when it is admitted, never
    the engine: the next request goes on."""
    from vlserve.core.messages import EngineCoreOutput

    def broken(*_):
        raise OSError("the file went away")

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cfg = decode.core.cfg
    processed = InputProcessor.for_model(cfg).process({"prompt": "Hello, how are you?"})
    n, tail = len(processed.prompt_token_ids), state_row_count(cfg.model, cfg.dtype)
    with monkeypatch.context() as patch:
        patch.setattr(decode.core.runner.kv_buffers, "rows_finite", broken)
        rows = torch.randn(n + tail, cfg.model.kv_row_width)
        arrived = decode.receive("broken", processed, rows)
        decode.add("broken", arrived, params, Handoff(EngineCoreOutput("broken", [7])))
        run(decode, ["broken"])
    assert [(rid, status) for rid, _, status in decode.core.take_failed()] == [("broken", 500)]
    decode.add("next", decode.receive("next", processed, rows), params, Handoff(EngineCoreOutput("next", [7])))
    assert len(run(decode, ["next"])["next"]) == 3
    assert decode.nothing_held()


def test_only_a_prefill_engine_takes_a_writer(path):
    cfg = _cfg(path, num_kv_blocks=64)
    writer = row_writer_maker("shm", "127.0.0.1", 120.0)()
    try:
        with pytest.raises(ConfigurationError, match="only a prefill engine"):
            make_connector("decode", cfg, writer)
    finally:
        writer.close()


class SlowWriter:
    """A row writer whose writes wait for `go`: what a slow transport looks like to the connector."""

    keep_s, writes_layers = 120.0, False

    def __init__(self):
        self.go, self.started, self.written = threading.Event(), threading.Event(), []

    def write(self, destination: bytes, rows, first_row: int = 0, first_plane: int = 0) -> int:
        self.started.set()
        assert self.go.wait(30)
        self.written.append((destination, first_row))
        return rows.numel()

    def planes_of(self, destination: bytes) -> int:
        return 1

    def close(self) -> None:
        self.go.set()


def test_a_released_sends_queued_writes_never_start_and_late_ones_are_refused(path):
    cfg = _cfg(path, num_kv_blocks=64)
    writer = SlowWriter()
    connector = make_connector("prefill", cfg, writer)
    rows = torch.zeros(8, cfg.model.kv_row_width)
    connector.kept.update({rid: KeptKV.of_rows(rows, 8) for rid in "ab"})
    try:
        first = connector.sends["a"] = LayerSend(KVSend(0, 8, b"first", NEVER), "a")
        first.covered = (2, 4)  # layer writes covered tokens 2..4: two writes are left, 0..2 and 4..8
        connector.sends["b"] = LayerSend(KVSend(1, 8, b"late", time.time() - 1), "b")
        connector._send_rest("a", connector.kept["a"])  # the first starts and waits for `go`, the second queues
        connector._send_rest("b", connector.kept["b"])
        assert writer.started.wait(30)
        connector.forget(["a"])  # its request left: what has not started never will
        writer.go.set()
        deadline = time.monotonic() + 30
        answers: dict[int, KVWritten] = {}
        while len(answers) < 2 and time.monotonic() < deadline:
            answers.update({w.write_id: w for w in connector.take_written()})
            time.sleep(0.001)
        assert "released before it was written" in answers[0].error and answers[0].nbytes == 0
        assert "deadline passed" in answers[1].error
        assert writer.written == [(b"first", 0)] and not connector.writes_in_flight
    finally:
        connector.close()
    connector.close()  # once is enough: a second close does nothing


def test_sends_of_an_engine_that_stopped_answering_stay_unsettled():
    """The front end's side: a send the engine may still make fails as unsettled, and the sender then never
    tells the receiver its blocks are free (its quarantine does); a dead engine is sent nothing."""
    sent_to_engine, alive = [], [True]
    writes = KVWrites(sent_to_engine.append, lambda: alive[0])

    async def go():
        _, pending = writes.expect("r")
        writes.fail_all("stuck in a step")
        with pytest.raises(KVWriteUnsettled):
            await pending
        writes.release("r")
        alive[0] = False
        writes.release("r")

    asyncio.run(go())
    assert [type(m).__name__ for m in sent_to_engine] == ["FinishRequests"]

    replies = []

    class Socket:
        async def send_multipart(self, frames, **kw):
            replies.append(frames)

    sender = TransferSender(Socket(), HeadersOnly("shm"), TransferMetrics(CollectorRegistry(), None, "prefill", "kv"),
                            8.0)
    asyncio.run(sender.abort(b"peer", AbortTransfer("settled", 1)))
    assert len(replies) == 1  # acknowledged: nothing more is written
    sender.unsettle((b"peer", "unsettled", 1))
    asyncio.run(sender.abort(b"peer", AbortTransfer("unsettled", 1)))
    assert len(replies) == 1


def test_kv_reservations_answer_their_askers_and_give_back_what_nobody_takes():
    """The decode front end's side of reserving KV blocks: an answer goes to its asker; a reservation whose asker
    was cancelled, or that the engine answers only after it stopped answering, is released by exactly the blocks
    it got (the holder's other blocks may still be written by its peer); an engine that refuses says why."""
    from vlserve.core.errors import ServiceUnavailableError
    from vlserve.frontend.kv_reservations import KVReservations

    sent, alive = [], [True]
    res = KVReservations(sent.append, lambda: alive[0])

    async def go():
        ask = asyncio.create_task(res.reserve("h1", 40))
        await asyncio.sleep(0)
        (msg,) = sent
        assert (msg.holder, msg.num_rows) == ("h1", 40)
        res.settle([KVReserved(msg.reserve_id, [3, 4, 5])])
        assert await ask == [3, 4, 5]
        never = asyncio.create_task(res.reserve("h2", 10**6))
        await asyncio.sleep(0)
        res.settle([KVReserved(sent[-1].reserve_id, error="it never fits")])
        with pytest.raises(ServiceUnavailableError, match="never fits"):
            await never
        sent.clear()
        gone = asyncio.create_task(res.reserve("h1", 8))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert sent[1] == CancelReserveKV(sent[0].reserve_id)  # it waits in the engine no more
        res.settle([KVReserved(sent[0].reserve_id, [9])])  # it came after all: those blocks only go back
        assert [(m.holder, m.block_ids) for m in sent[2:]] == [("h1", [9])]
        sent.clear()
        cancelled = asyncio.create_task(res.reserve("h1", 8))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        res.settle([KVReserved(sent[0].reserve_id)])  # the engine's answer to the cancel: nothing to give back
        assert len(sent) == 2 and not res._unwanted
        sent.clear()
        late = asyncio.create_task(res.reserve("h3", 8))
        await asyncio.sleep(0)
        res.fail_all("not answering")
        with pytest.raises(EngineDeadError):
            await late
        res.settle([KVReserved(sent[0].reserve_id, [11, 12])])
        assert [(m.holder, m.block_ids) for m in sent[1:] if isinstance(m, ReleaseKV)] == [("h3", [11, 12])]
        alive[0] = False
        with pytest.raises(EngineDeadError):
            await res.reserve("h4", 8)

    asyncio.run(go())


def test_a_reservation_the_kv_cache_is_short_for_waits_in_the_engine_until_blocks_are_freed(tiny_ckpt):
    """Before, the front end asked the engine again after 20 ms, doubling up to 0.5 s: a round trip per ask, and
    blocks freed meanwhile taken up to half a second late. Now the engine process keeps the reservation (first
    come, first served) and answers it after the step or release that freed the blocks, asked once; its asker's
    cancel drops it. Over the engine core's loop (vlserve.engine.core_process), on in-process sockets."""
    from vlserve.core.wire import EngineInput, EngineMessage, EngineOutputs, Framer, Shutdown
    from vlserve.engine.core_process import EngineCoreLoop, Progress

    decode = Decode(tiny_ckpt("qwen2_vl"), num_kv_blocks=32, max_num_seqs=4, in_place=True)
    ctx = zmq.Context()
    send, inputs, outputs, recv = (ctx.socket(t) for t in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    send.bind(f"inproc://in-{id(ctx)}")
    inputs.connect(f"inproc://in-{id(ctx)}")
    outputs.bind(f"inproc://out-{id(ctx)}")
    recv.connect(f"inproc://out-{id(ctx)}")
    loop = EngineCoreLoop(decode.core, inputs, outputs, Progress(), os.getppid())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    framer, answers, got = Framer(EngineInput), Framer(EngineMessage), {}

    def tell(*msgs) -> None:
        for msg in msgs:
            send.send_multipart(framer.encode(msg))

    def read(until: float) -> None:
        while (left := until - time.monotonic()) > 0 and recv.poll(left * 1000):
            msg = answers.decode(recv.recv_multipart())
            if isinstance(msg, EngineOutputs):
                got.update((a.reserve_id, a) for a in msg.reserved)

    try:
        tell(*(ReserveKV(h, i, n * 8) for i, (h, n) in enumerate([("big", 33), ("a", 30), ("b", 3), ("c", 1),
                                                                  ("d", 1)])), CancelReserveKV(4))
        read(time.monotonic() + 1.0)
        assert sorted(got) == [0, 1, 4], "a reservation the pool was short for was answered without blocks"
        assert "the KV cache has 32" in got[0].error and len(got[1].block_ids) == 30 and got[4] == KVReserved(4)
        tell(ReleaseKV("a", got[1].block_ids[:10]))  # b, then c (1 block would have fitted before b's 3)
        deadline = time.monotonic() + 30
        while not {2, 3} <= set(got) and time.monotonic() < deadline:
            read(time.monotonic() + 0.1)
        assert [len(got[i].block_ids) for i in (2, 3)] == [3, 1]
        tell(ReleaseKV("a"), ReleaseKV("b"), ReleaseKV("c"))
    finally:
        tell(Shutdown())
        thread.join(30)
        for sock in (send, inputs, outputs, recv):
            sock.close(0)
        ctx.term()
    assert decode.nothing_held()
    decode.core.shutdown()


def test_a_transfer_asks_for_kv_blocks_once_and_gives_up_with_a_503_at_its_timeout():
    from vlserve.core.errors import ServiceUnavailableError
    from vlserve.disagg.receive_pool import EngineKVBlocks
    from vlserve.frontend.kv_reservations import KVReservations

    sent = []

    async def go():
        with pytest.raises(ServiceUnavailableError, match="stayed taken"):
            await asyncio.wait_for(EngineKVBlocks(KVReservations(sent.append, lambda: True), 64).allocate("h", 8, 0.2),
                                   10)

    asyncio.run(go())
    assert [type(m) for m in sent] == [ReserveKV, CancelReserveKV] and sent[1].reserve_id == sent[0].reserve_id


def test_the_engine_thread_reads_no_kv_and_blocks_a_write_reads_outlive_its_release(prefill, monkeypatch):
    """One CPU rank: a finished prompt's KV is read out on the writer thread, never on the engine's (whose other
    requests would wait meanwhile); a request released while a write still reads its blocks frees them only
    once that write has ended, so no new request's KV can be read in their place."""
    readers = []
    read = prefill.core.runner.read_kv_rows

    def spy(slots, scratch=False):
        readers.append(threading.current_thread().name)
        return read(slots, scratch)

    monkeypatch.setattr(prefill.core.runner, "read_kv_rows", spy)
    slow = SlowWriter()
    monkeypatch.setattr(prefill.connector, "writer", slow)
    monkeypatch.setattr(prefill.connector, "by_layer", False)  # all of it from the kept blocks, at the finish
    processed = prefill.input_processor.process(PICTURE)
    n = len(processed.prompt_token_ids)
    prefill.core.add_request("s", processed, SamplingParams(temperature=0, max_tokens=1).for_prefill(),
                             kv_send=KVSend(0, n, b"where", NEVER))
    while prefill.core.has_unfinished:
        prefill.core.step()
    (kv,) = prefill.connector.take_exported()
    assert kv.rows is None and slow.started.wait(30)
    pool = prefill.core.scheduler.kv.pool
    held = pool.num_blocks - pool.num_free
    assert held > 0
    prefill.core.abort_requests(["s"])  # released while the write is under way
    assert pool.num_blocks - pool.num_free == held  # still read by that write
    slow.go.set()
    deadline = time.monotonic() + 30
    answers = []
    while not answers and time.monotonic() < deadline:
        answers += prefill.connector.take_written()
        time.sleep(0.001)
    assert answers[0].write_id == 0 and readers and all(name.startswith("vlserve-kv-write") for name in readers)
    assert pool.num_free == pool.num_blocks and not prefill.connector.writes_in_flight
    assert_pool_full(prefill)
