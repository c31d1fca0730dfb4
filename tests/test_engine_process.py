"""The engine-core process answers every request it is sent, even ones it cannot decode or check, and keeps
serving afterwards: nothing a peer sends can drop a request silently or crash the engine."""

from __future__ import annotations

import asyncio

import msgspec
import torch

from vlserve.core.config import EngineArgs
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import EngineOutputs, prompt_to_wire
from vlserve.engine.core_client import EngineCoreClient
from vlserve.model.facts import resolve_model_facts


def _text_prompt(ids: list[int]) -> ProcessedPrompt:
    return ProcessedPrompt(ids, [], torch.arange(len(ids)).expand(3, -1).contiguous(), 0)


def test_bad_messages_are_answered_and_the_engine_survives(tiny_ckpt):
    got: list[EngineOutputs] = []

    async def run():
        args = EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=32)
        client = EngineCoreClient(args, resolve_model_facts(args), on_outputs=lambda msg, frames: got.append(msg))
        await client.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0)
            # 1. a header msgspec cannot decode into an AddRequest (a bool where an int belongs), naming its id
            msg, tensors = prompt_to_wire("undecodable", _text_prompt([5, 6, 7]), params, 0.0)
            raw = msgspec.to_builtins(msg)
            raw["type"] = "add"
            raw["mrope_delta"] = True
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
