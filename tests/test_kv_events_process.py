"""The engine process publishes KV cache events on a real tcp:// endpoint: keepalives while idle (so a router does
not take an idle replica for a dead one), then the blocks of a request, which a subscriber's `KVIndex` reflects."""

from __future__ import annotations

import asyncio
import time

import torch

from vlserve.core.block_hash import prompt_block_hashes
from vlserve.core.config import EngineArgs
from vlserve.core.processes import free_port
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import prompt_to_wire
from vlserve.disagg.kv_events_subscriber import KVEventSubscriber
from vlserve.disagg.kv_index import KVIndex
from vlserve.engine.core_client import EngineCoreClient
from vlserve.model.facts import resolve_model_facts


def test_engine_process_publishes_keepalives_and_blocks(tiny_ckpt):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = KVIndex(silence_timeout_s=3.0)
    sub = KVEventSubscriber(index)
    sub.add("replica-0", endpoint)  # before the engine binds: ZeroMQ connects when it appears
    ids = list(range(5, 45))  # 40 tokens: two full blocks of 16
    prompt = ProcessedPrompt(ids, [], torch.arange(len(ids)).expand(3, -1).contiguous(), 0)
    hashes = prompt_block_hashes(prompt, 16)

    async def until(cond, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not cond() and time.monotonic() < deadline:
            sub.poll(0)
            await asyncio.sleep(0.05)
        return cond()

    async def run():
        args = EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=32,
                          kv_events_endpoint=endpoint)
        client = EngineCoreClient(args, resolve_model_facts(args), on_outputs=lambda msg: None)
        await client.start()
        try:
            # idle: keepalives only, at least two of them a second or so apart, in sequence
            assert await until(lambda: (index.view("replica-0").next_seq or 0) >= 2, 10), "no keepalives"
            client.send(*prompt_to_wire("r", prompt, SamplingParams(max_tokens=2, temperature=0), 0.0))
            assert await until(lambda: index.longest_prefix("replica-0", hashes) == 2, 10)
        finally:
            await client.shutdown()

    try:
        asyncio.run(run())
        assert not index.is_cold("replica-0") and index.view("replica-0").gaps == 0
        assert index.view("replica-0").block_size == 16
    finally:
        sub.close()
