"""The engine-core process answers every request it is sent, even ones it cannot decode or check, and keeps
serving afterwards: nothing a peer sends can drop a request silently or crash the engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
import torch

from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError, VlserveError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import EngineMessage, EngineOutputs, EngineStats, Framer, Heartbeat, prompt_to_wire
from vlserve.engine import core_client
from vlserve.engine.core_client import EngineCoreClient
from vlserve.frontend.async_llm import AsyncLLM
from vlserve.frontend.prepared_prompt import PreparedPrompt
from vlserve.model.facts import resolve_model_facts


def _text_prompt(ids: list[int]) -> ProcessedPrompt:
    return ProcessedPrompt(ids, [], torch.arange(len(ids)).expand(3, -1).contiguous(), 0)


def test_bad_messages_are_answered_and_the_engine_survives(tiny_ckpt):
    got: list[EngineOutputs] = []

    async def run():
        args = EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=32)
        client = EngineCoreClient(args, resolve_model_facts(args), on_outputs=got.append)
        await client.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0)
            # 1. a header msgspec cannot decode into an AddRequest (a bool where an int belongs), naming its id
            msg, tensors = prompt_to_wire("undecodable", _text_prompt([5, 6, 7]), params, 0.0)
            raw = msgspec.to_builtins(msg)
            raw["type"] = "add"
            raw["position_delta"] = True
            client.in_sock.send_multipart([msgspec.msgpack.encode(raw)]
                                          + [memoryview(t.contiguous().view(torch.uint8).numpy()) for t in tensors])
            # 2. a decodable prompt the engine must refuse: token ids beyond the vocabulary
            client.send(*prompt_to_wire("bad-ids", _text_prompt([5, 10**6]), params, 0.0))
            # 3. tensor frames that do not match their shapes
            msg, tensors = prompt_to_wire("bad-frames", _text_prompt([5, 6]), params, 0.0)
            client.send(msg, [tensors[0][:, :1]])
            # 4. a good request after all that
            client.send(*prompt_to_wire("good", _text_prompt([5, 6, 7]), params, 0.0))
            for _ in range(200):
                done = {o.request_id for m in got for o in m.outputs if o.finish_reason}
                if "good" in done:
                    break
                await asyncio.sleep(0.05)
        finally:
            await client.shutdown()

    asyncio.run(run())
    rejected = {r.request_id: r for m in got for r in m.rejected}
    assert set(rejected) == {"undecodable", "bad-ids", "bad-frames"}
    assert all(r.status == 400 for r in rejected.values())
    assert "vocabulary" in rejected["bad-ids"].message
    assert "good" in {o.request_id for m in got for o in m.outputs if o.finish_reason}
    assert "good" in {rid for m in got for rid in m.released}


# ---- the front end's output loop must not die silently (issue #43) ---------------------------------------------
class _Outputs:
    """The engine's output socket as the client's loop reads it: the queued messages, then nothing."""

    def __init__(self, *messages):
        self.frames = [Framer(EngineMessage).encode(m) for m in messages]

    async def recv_multipart(self):
        if self.frames:
            return self.frames.pop(0)
        await asyncio.Event().wait()


def test_an_output_loop_that_cannot_go_on_marks_the_engine_dead():
    """Before: one exception out of `on_outputs` ended the loop while heartbeats kept /health green, and every
    stream waited for ever. Now the engine is marked dead: /health goes red, waiting requests get a 503 and the
    server exits for its supervisor to restart it."""
    failures: list[str] = []
    handled: list[EngineOutputs] = []

    def on_outputs(msg):
        handled.append(msg)
        raise RuntimeError("the front end's bookkeeping is broken")

    client = EngineCoreClient(EngineArgs(model="unused"), None, on_outputs=on_outputs, on_failure=failures.append)
    client.out_sock = _Outputs(EngineOutputs([EngineCoreOutput("a", [1])], [], EngineStats()))
    asyncio.run(asyncio.wait_for(client._output_loop(), 10))
    assert len(handled) == 1
    assert not client.available and "RuntimeError" in client.dead_reason, client.dead_reason
    assert failures == [client.dead_reason]


@pytest.fixture(scope="module")
def front_end(tiny_ckpt):
    """An AsyncLLM that is not started: what it sends the engine is kept in `sent`."""
    llm = AsyncLLM(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32"), "m", log_requests=False)
    llm.sent = []
    llm.core.send = lambda msg, tensors=None: llm.sent.append(msg)
    yield llm
    llm.executor.shutdown(wait=False)
    llm.grammar_compiler.shutdown()


def test_a_request_whose_output_cannot_be_handled_fails_alone(front_end, monkeypatch):
    """Before: one request's failure (here its detokenizer) escaped `_handle` and ended the output loop. Now that
    request fails with a 500 and leaves the engine; the others in the same message get their outputs."""
    llm = front_end
    params = SamplingParams(max_tokens=4, temperature=0)

    async def go():
        good = llm.generate(PreparedPrompt(_text_prompt([5, 6, 7]), 0.0), params, "good")
        bad = llm.generate(PreparedPrompt(_text_prompt([5, 6, 8]), 0.0), params, "bad")
        detok = llm.output_processor._parents["bad"].children["bad"].detok

        def broken(token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a bug in the detokenizer")

        monkeypatch.setattr(detok, "update", broken)
        llm.sent.clear()
        llm._handle(EngineOutputs([EngineCoreOutput("bad", [9]), EngineCoreOutput("good", [9])], [], EngineStats()))
        out = await asyncio.wait_for(good.__anext__(), 10)
        assert out.outputs[0].token_ids == [9] and not out.finished
        with pytest.raises(VlserveError, match="internal error") as failed:
            await asyncio.wait_for(bad.__anext__(), 10)
        assert failed.value.http_status == 500
        assert [(m.request_ids, m.reason) for m in llm.sent] == [(["bad"], "abort")]
        assert "bad" not in llm.streams and llm.output_processor.parent_of("bad") is None
        llm._handle(EngineOutputs([EngineCoreOutput("good", [10], finish_reason="length")], [], EngineStats()))
        out = await asyncio.wait_for(good.__anext__(), 10)
        assert out.finished and out.outputs[0].token_ids == [9, 10]

    asyncio.run(go())
    assert not llm.streams


class _Beats:
    """The heartbeat socket: the engine's answers, in order (raw frames), then silence."""

    def __init__(self, *answers):
        self.answers = list(answers)

    async def send_multipart(self, frames):
        pass

    async def poll(self, timeout_ms):
        if self.answers:
            return True
        await asyncio.sleep(timeout_ms / 1000)
        return False

    async def recv_multipart(self):
        return self.answers.pop(0)


def test_a_heartbeat_it_cannot_decode_does_not_end_the_liveness_watch(monkeypatch):
    """Before: one undecodable heartbeat ended the watch, and nothing noticed the engine freeze or die after it.
    Now that answer is skipped; here the watch goes on and notices the process exit."""
    monkeypatch.setattr(core_client, "HEARTBEAT_INTERVAL_S", 0.01)
    client = EngineCoreClient(EngineArgs(model="unused"), None)
    checks = []
    client.proc = SimpleNamespace(is_alive=lambda: checks.append(1) or len(checks) < 3, exitcode=-9)
    client.hb_sock = _Beats([b"\xc1 not msgpack"], Framer(Heartbeat).encode(Heartbeat(0, 1, False)))
    asyncio.run(asyncio.wait_for(client._watch(), 10))
    assert client.dead_reason == "the engine process died (exit code -9)"


def test_a_prompt_freed_early_keeps_its_id_until_the_engine_lets_go_of_the_request(front_end):
    """A decode engine that copied a prompt's KV in says so while the request still runs (`inputs_released`):
    its buffers are freed then, once; the id stays taken until the final `released`, so an aborted request's id
    reused meanwhile can never have the new prompt's buffers freed by the old request's report."""
    llm = front_end
    freed = []
    llm._send(None, [], "x", lambda: freed.append("x"))
    llm._handle(EngineOutputs([], [], EngineStats(), inputs_released=["x"]))
    assert freed == ["x"]
    with pytest.raises(InvalidInputError, match="already in use"):
        llm._check_id_free("x")
    llm._handle(EngineOutputs([], [], EngineStats(), released=["x"]))
    assert freed == ["x"]  # not again
    llm._check_id_free("x")  # free now
    llm._send(None, [], "y", lambda: freed.append("y"))  # both reports in one message: freed once
    llm._handle(EngineOutputs([], [], EngineStats(), released=["y"], inputs_released=["y"]))
    assert freed == ["x", "y"] and not llm._freed_early
    llm.sent.clear()
