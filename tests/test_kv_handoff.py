"""Prefill on one engine, decode on another (the engine half of E→P→D): the prefill engine holds a finished
request's KV blocks until they are exported, the decode engine takes them into its own blocks and goes on,
token for token what one engine gives: greedy and seeded sampling, penalties, grammars, pictures, a decode
engine short of blocks that preempts and recomputes, one without room that queues the handoff; both pools full
afterwards."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError

PROMPTS = ["Hello, how are you?", "def fibonacci(n):", "The quick brown fox"]


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def prefill(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def decode(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def whole(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


def handoff(prefill: LLM, decode: LLM, prompt, params: SamplingParams, rid: str) -> list[int]:
    """Runs `prompt` through prefill (first token) then decode (the rest); the output token ids."""
    p_core, d_core = prefill.engine.core, decode.engine.core
    processed = prefill.engine.input_processor.process(prompt)
    p_core.add_request(rid, processed, params.for_prefill(), hold_kv=True)
    first = []
    while p_core.has_unfinished:
        for out in p_core.step():
            first += out.new_token_ids
            finished = out.finish_reason
    if finished != "length":  # the answer ended at its first token: nothing to hand over
        p_core.release_held(rid)
        return first
    handed = p_core.export_held(rid)
    d_core.add_prefilled(rid, processed, params, handed)
    tokens = list(first)
    while d_core.has_unfinished:
        for out in d_core.step():
            tokens += out.new_token_ids
    return tokens


def _whole(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    "top-p and penalties": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, presence_penalty=1.5,
                                          repetition_penalty=1.3, ignore_eos=True),
    "grammar": SamplingParams(temperature=0.9, seed=5, max_tokens=30,
                              structured_outputs={"regex": "[a-z]{4}-[0-9]{3}( ok)?"}),
    "min_tokens": SamplingParams(temperature=0, max_tokens=6, min_tokens=4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", [PROMPTS[0], {"prompt": f"{IMG} Describe it.",
                                                 "multi_modal_data": {"image": noise_image(72, 56, 4)}}],
                         ids=["text", "picture"])
def test_prefill_then_decode_equals_one_engine(prefill, decode, whole, prompt, case):
    params = CASES[case]
    assert handoff(prefill, decode, prompt, params, f"r-{case}") == _whole(whole, prompt, params)
    for llm in (prefill, decode):
        assert_pool_full(llm)
        assert not llm.engine.core.held


def test_decode_engine_short_of_blocks_preempts_and_stays_exact(path, prefill, whole):
    """Several handed-over requests on a decode engine whose pool cannot hold them all: recomputed, exact."""
    tight = LLM(path, dtype="float32", num_kv_blocks=30, block_size=4)  # 27 blocks hold the three prompts
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=20, ignore_eos=True)
    p_core, d_core = prefill.engine.core, tight.engine.core
    prompts = [p * 3 for p in PROMPTS]
    got = {}
    for i, prompt in enumerate(prompts):
        processed = prefill.engine.input_processor.process(prompt)
        p_core.add_request(f"t{i}", processed, params.for_prefill(), hold_kv=True)
        got[f"t{i}"] = []
        while p_core.has_unfinished:
            for out in p_core.step():
                got[f"t{i}"] += out.new_token_ids
        d_core.add_prefilled(f"t{i}", processed, params, p_core.export_held(f"t{i}"))
    while d_core.has_unfinished:
        for out in d_core.step():
            got[out.request_id] += out.new_token_ids
    assert d_core.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to force preemptions"
    for i, prompt in enumerate(prompts):
        assert got[f"t{i}"] == _whole(whole, prompt, params)
    assert_pool_full(tight)


def test_a_decode_engine_without_room_queues_the_handoff_until_there_is(path, prefill):
    full = LLM(path, dtype="float32", num_kv_blocks=12, block_size=4, max_model_len=48)
    p_core = prefill.engine.core
    processed = prefill.engine.input_processor.process(PROMPTS[1] * 3)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    p_core.add_request("big", processed, params.for_prefill(), hold_kv=True)
    while p_core.has_unfinished:
        p_core.step()
    handed = p_core.export_held("big")
    blocker = full.engine.input_processor.process("x " * 20)
    full.engine.core.add_request("blocker", blocker, SamplingParams(max_tokens=2, ignore_eos=True))
    core = full.engine.core
    core.step()  # the blocker now holds most blocks
    core.add_prefilled("big", processed, params, handed)
    core.step()
    assert [r.request_id for r in core.scheduler.waiting] == ["big"]  # no room yet: it waits, KV not written
    got = []
    while core.has_unfinished:
        got += [o for o in core.step() if o.request_id == "big"]
    assert sum(len(o.new_token_ids) for o in got) == 1 and got[-1].finish_reason == "length"  # 2 with its first
    assert_pool_full(full)


def test_bad_handoffs_are_refused(prefill, decode):
    p_core, d_core = prefill.engine.core, decode.engine.core
    processed = prefill.engine.input_processor.process(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    p_core.add_request("h", processed, params.for_prefill(), hold_kv=True)
    while p_core.has_unfinished:
        p_core.step()
    handed = p_core.export_held("h")
    with pytest.raises(InvalidInputError, match="nothing held"):
        p_core.export_held("h")
    short = dataclasses.replace(handed, kv=handed.kv[:, :, :-1])
    with pytest.raises(InvalidInputError, match="KV for"):
        d_core.add_prefilled("h", processed, params, short)
    wrong = dataclasses.replace(handed, kv=handed.kv[:1])
    with pytest.raises(InvalidInputError, match="layers"):
        d_core.add_prefilled("h", processed, params, wrong)
    assert_pool_full(decode)
    assert_pool_full(prefill)


def test_holds_never_leak(prefill, decode):
    """An id that is held cannot be reused; an abort releases a hold; a hold nobody takes expires; a handover
    that has nothing left to decode, or whose random state does not fit, is refused with nothing kept."""
    p_core, d_core = prefill.engine.core, decode.engine.core
    processed = prefill.engine.input_processor.process(PROMPTS[0])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)

    def prefilled(rid):
        p_core.add_request(rid, processed, params.for_prefill(), hold_kv=True)
        while p_core.has_unfinished:
            p_core.step()

    prefilled("a")
    with pytest.raises(InvalidInputError, match="already in use"):
        p_core.add_request("a", processed, params.for_prefill(), hold_kv=True)
    p_core.abort_requests(["a"])
    assert not p_core.held
    prefilled("b")
    assert p_core.scheduler.release_stale_held(ttl=-1) == ["b"]
    prefilled("c")
    handed = p_core.export_held("c")
    with pytest.raises(InvalidInputError, match="nothing to decode"):
        d_core.add_prefilled("c", processed, msgspec.structs.replace(params, max_tokens=1), handed)
    with pytest.raises(InvalidInputError, match="random state"):
        d_core.add_prefilled("c", processed, params, dataclasses.replace(handed,
                                                                          generator_state=handed.generator_state[:7]))
    assert not d_core.has_unfinished
    assert_pool_full(prefill)
    assert_pool_full(decode)


def test_a_failed_kv_write_fails_that_request_and_leaves_nothing(prefill, decode, monkeypatch):
    p_core, d_core = prefill.engine.core, decode.engine.core
    processed = prefill.engine.input_processor.process(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    p_core.add_request("w", processed, params.for_prefill(), hold_kv=True)
    while p_core.has_unfinished:
        p_core.step()
    handed = p_core.export_held("w")

    def broken(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(d_core.runner, "write_kv", broken)
    d_core.add_prefilled("w", processed, params, handed)
    while d_core.has_unfinished:
        assert not d_core.step()  # nothing comes out for it
    (rid, why, status), = d_core.take_failed()
    assert (rid, status) == ("w", 500) and "could not be written" in why
    assert "w" not in d_core.scheduler.requests
    assert_pool_full(decode)
    assert_pool_full(prefill)
