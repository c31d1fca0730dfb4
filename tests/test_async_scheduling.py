"""Async scheduling: the next step is scheduled and launched before the last one's tokens are read. On a CPU it is
off by default (nothing to overlap: the host is the device) and VLSERVE_ASYNC_SCHEDULING=1 forces it, so its logic
is checked here: by hand on the scheduler (a step scheduled while the one before is in flight: budgets, blocks,
max_tokens, stop tokens, preemption and aborts of requests whose token is still being sampled) and through the
engine (transformers' tokens, and the synchronous engine's for sampling with seeds, n, logprobs and stops)."""

from __future__ import annotations

import pytest

from tests.conftest import assert_pool_full
from tests.hf_reference import prompt_references
from tests.test_parity import _check, _prompts, _run
from tests.test_scheduler_units import TOKEN, _assert_all_free, _cfg, _req
from vlserve import LLM, SamplingParams
from vlserve.core.config import EngineArgs
from vlserve.core.request import RequestStatus
from vlserve.engine.config import ASYNC_ENV, resolve_config
from vlserve.engine.scheduler import Scheduler

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


# ---- the scheduler, stepped by hand --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_ckpt):
    return resolve_config(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), num_kv_blocks=64, device="cpu"))


def _drain(s: Scheduler, overlap: bool, sample=lambda req: TOKEN, between=None, max_steps=1000):
    """Runs every request to its end; with `overlap`, each step is scheduled before the one before it is
    updated (its sampled tokens applied), as the engine does under async scheduling. Returns every output."""
    outputs, inflight = [], None
    for step in range(max_steps):
        if not (s.has_unfinished or inflight):
            return outputs
        out = s.schedule()
        _check_step(s, out)
        if between is not None:
            between(s, step)
        sampled = {c.req.request_id: sample(c.req) for c in out.chunks if c.samples}
        if not overlap:
            outputs += s.update_from_output(out, sampled)
            continue
        if inflight is not None:
            outputs += s.update_from_output(*inflight)
        inflight = (out, sampled) if out.chunks else None
    raise AssertionError("requests never finished")


def _check_step(s: Scheduler, out) -> None:
    cfg = s.cfg
    assert out.num_tokens <= cfg.max_num_batched_tokens and len(s.running) <= cfg.max_num_seqs
    assert len({c.req.request_id for c in out.chunks}) == len(out.chunks)
    for c in out.chunks:
        req = c.req
        assert c.end == req.num_computed_tokens
        assert c.end <= req.num_tokens + req.num_pending  # never past the token being sampled
        assert req.num_pending <= 2
        # the chunk that reads output token j samples token j + 1: none may read the last one
        assert c.end <= req.num_prompt_tokens + req.params.max_tokens - 1, "scheduled past max_tokens"
        assert len(req.block_ids) * s.kv.block_size >= c.end
    s.kv.pool.check_integrity()


def _results(outputs) -> dict:
    tokens, reasons = {}, {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason is not None:
            reasons[o.request_id] = (o.finish_reason, o.stop_reason)
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def _requests(spec):
    return [_req(n, max_tokens=m, rid=f"q{i}", **kw) for i, (n, m, kw) in enumerate(spec)]


SPEC = [(30, 5, {}), (3, 1, {}), (9, 7, {}), (17, 2, {}), (1, 9, {}), (12, 4, {"stop_token_ids": [TOKEN + 1]}),
        (6, 6, {"stop_token_ids": [TOKEN]}), (5, 3, {}), (22, 8, {})]


@pytest.mark.parametrize("pool", [64, 12], ids=["roomy", "preempting"])
def test_overlapped_steps_give_the_synchronous_results(base, pool):
    """The same requests, the same sampled tokens: every request ends with the tokens and the finish reason the
    synchronous schedule gives it, none is scheduled past its max_tokens, and every block comes back. In a pool
    too small for all of them, requests whose token is in flight are preempted."""
    cfg = _cfg(base, num_kv_blocks=pool, block_size=4, max_num_batched_tokens=16)
    results = []
    for overlap in (False, True):
        s = Scheduler(cfg)
        for r in _requests(SPEC):
            s.add_request(r)
        results.append(_results(_drain(s, overlap)))
        if pool == 12:
            assert s.num_preemptions > 0
        _assert_all_free(s)
    assert results[0] == results[1]
    assert results[1]["q6"] == ([TOKEN], ("stop", TOKEN))  # a stop token ends it; the step after is dropped


def test_an_abort_of_a_request_whose_token_is_in_flight(base):
    s = Scheduler(_cfg(base))
    reqs = _requests([(5, 8, {}), (7, 8, {})])
    for r in reqs:
        s.add_request(r)

    def abort(s, step):
        if step == 3:
            assert reqs[0].num_pending  # its token is being sampled
            s.finish_requests([reqs[0].request_id])

    outputs = _results(_drain(s, True, between=abort))
    assert reqs[0].status == RequestStatus.FINISHED_ABORTED and len(outputs["q1"][0]) == 8
    _assert_all_free(s)


# ---- the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    return prompt_references(tiny_ckpt, _prompts(), MAX_NEW)


@pytest.fixture
def async_on(monkeypatch):
    monkeypatch.setenv(ASYNC_ENV, "1")


@pytest.mark.parametrize("arch,engine_args", [
    ("qwen2_vl", {}),
    ("qwen2_vl", {"max_num_batched_tokens": 7}),  # pictures split across steps
    ("qwen2_vl", {"num_kv_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64}),  # preemption
    ("qwen2_vl", {"cuda_graph_sizes": [1, 2, 4, 8, 16]}),  # padded decode steps
    ("qwen3_5", {}),  # linear-attention states
], ids=["batched", "chunked", "preempting", "graphs", "hybrid"])
def test_transformers_tokens_under_async_scheduling(expected, async_on, arch, engine_args):
    path, _, want = expected(arch)
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 256, **engine_args})
    core = llm.engine.core
    assert core.async_scheduling
    _check(_run(llm, _prompts(), GREEDY), want, range(len(_prompts())))
    assert core.overlapped_steps > MAX_NEW // 2
    if "num_kv_blocks" in engine_args and engine_args["num_kv_blocks"] < 100:
        assert llm.get_metrics()["num_preemptions_total"] > 0
    assert_pool_full(llm)


def test_sampling_stops_and_logprobs_as_without_it(tiny_ckpt, monkeypatch):
    """Seeded random sampling with n=2, logprobs, stop tokens found in the synchronous run and several
    max_tokens: the same outputs; a request with penalties runs with every step waited for."""
    path = str(tiny_ckpt("qwen2_vl"))
    prompts = ["Hello, how are you?", "def fibonacci(n):", "A list and a tuple", "Tell me a story"]
    sync = LLM(path, dtype="float32", num_kv_blocks=256)
    probe = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].token_ids[3] for o in probe]  # each one appears in its own greedy answer
    params = [SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stops[0]], logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[stops[3]], ignore_eos=True)]

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, c.stop_reason,
                  [sorted(lp.items()) for lp in c.logprobs] if c.logprobs else None) for c in o.outputs]
                for o in outs]

    want = run(sync)
    monkeypatch.setenv(ASYNC_ENV, "1")
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    got = run(llm)
    assert [[c[:3] for c in o] for o in got] == [[c[:3] for c in o] for o in want]
    for g, w in zip(got[0][0][3], want[0][0][3]):  # logprobs within float noise
        assert [t for t, _ in g] == [t for t, _ in w]
    assert got[0][0][1] == "stop" and llm.engine.core.overlapped_steps > 0
    before = llm.engine.core.overlapped_steps
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3), use_tqdm=False)
    assert llm.engine.core.overlapped_steps == before  # its sampling needs every token on the host
    assert_pool_full(llm)
