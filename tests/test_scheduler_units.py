"""Scheduler and KV manager on their own: no model, hand-made requests, steps simulated by hand."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.block_pool import BlockPool
from vlserve.engine.config import resolve_config
from vlserve.engine.kv_cache_manager import KVCacheManager
from vlserve.engine.scheduler import Scheduler

TOKEN = 7  # what every simulated step "samples"; never an EOS id of the tiny model


@pytest.fixture(scope="module")
def base_cfg(tiny_ckpt):
    return resolve_config(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), num_kv_blocks=64, device="cpu"))


def _cfg(base_cfg, **kw):
    defaults = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                    max_model_len=256, max_num_encoder_input_tokens=64, disable_chunked_mm_input=False,
                    encoder_cache_size=0, enable_prefix_caching=False)  # caches: tests/test_caching.py
    return dataclasses.replace(base_cfg, **{**defaults, **kw})


_ids = itertools.count()


def _req(num_prompt: int, max_tokens: int | None = 4, items: list[tuple[int, int]] = (), rid: str | None = None,
         **params) -> Request:
    """A request of `num_prompt` dummy tokens; `items` are (offset, num_tokens) placeholder runs."""
    mm = [MultiModalItem(off, n, torch.zeros(4 * n, 8), (1, 2, 2 * n)) for off, n in items]
    return Request(rid or f"r{next(_ids)}", _prompt(num_prompt, mm),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=(1002,))


def _prompt(num_prompt: int, mm: list[MultiModalItem] = ()) -> ProcessedPrompt:
    return ProcessedPrompt([1] * num_prompt, list(mm), torch.zeros(3, num_prompt, dtype=torch.long), 0)


def _step(s: Scheduler, check=None):
    """schedule() -> (optional invariant check) -> update_from_output() with a token for every sampling chunk."""
    out = s.schedule()
    if check:
        check(s, out)
    sampled = {c.req.request_id: TOKEN for c in out.chunks if c.samples}
    finished = s.update_from_output(out, sampled)
    return out, finished


def _drain(s: Scheduler, check=None, max_steps=1000):
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return steps
        steps.append(_step(s, check))
    raise AssertionError("requests never finished")


def _assert_all_free(s: Scheduler):
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert not s.running and not s.waiting and not s.requests
    assert len(s.encoder_cache) == 0


def _budget_check(s: Scheduler, out):
    cfg = s.cfg
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(s.running) <= cfg.max_num_seqs
    assert len({c.req.request_id for c in out.chunks}) == len(out.chunks), "a request scheduled twice in one step"
    for c in out.chunks:
        assert c.num_tokens >= 1
        assert c.end == c.req.num_computed_tokens  # advanced when scheduled (the next step starts there)
        assert c.end <= c.req.num_tokens
        assert len(c.req.block_ids) * s.kv.block_size >= c.end, "KV slots missing for scheduled tokens"
    assert sum(r.mm_items[i].num_tokens for r, i in out.encode) <= cfg.max_num_encoder_input_tokens
    s.kv.pool.check_integrity()
    used = sum(len(r.block_ids) for r in s.requests.values())
    assert used == s.kv.pool.num_blocks - s.kv.pool.num_free


# ---- packing -------------------------------------------------------------------------------------------------
def test_budget_packing_and_max_num_seqs(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=16, max_num_seqs=3))
    reqs = [_req(n, max_tokens=5) for n in (30, 3, 9, 17, 1, 12)]
    for r in reqs:
        s.add_request(r)
    produced: dict[str, int] = {}
    for out, finished in _drain(s, _budget_check):
        # decodes come first: every running request past its prompt gets exactly one token before prefills
        for o in finished:
            produced[o.request_id] = produced.get(o.request_id, 0) + 1
    assert all(produced[r.request_id] == 5 for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [TOKEN] * 5 for r in reqs)
    _assert_all_free(s)


def test_decodes_are_scheduled_before_new_prefills(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=10, max_num_seqs=8))
    a, b = _req(6, max_tokens=8), _req(6, max_tokens=8)
    s.add_request(a)
    _step(s)  # a: whole prompt, samples
    s.add_request(b)
    c = _req(40, max_tokens=2)
    s.add_request(c)
    out, _ = _step(s)
    assert [(ch.req, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 6), (c, 3)]
    out, _ = _step(s)
    assert [(ch.req, ch.num_tokens) for ch in out.chunks] == [(a, 1), (b, 1), (c, 8)]
    _drain(s, _budget_check)
    _assert_all_free(s)


def test_max_num_seqs_holds_back_admission(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64, max_num_seqs=2))
    reqs = [_req(4, max_tokens=3) for _ in range(4)]
    for r in reqs:
        s.add_request(r)
    out, _ = _step(s)
    assert [c.req for c in out.chunks] == reqs[:2]
    assert list(s.waiting) == reqs[2:]
    _drain(s, _budget_check)
    _assert_all_free(s)


def test_chunked_prefill_progression(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=16))
    r = _req(40, max_tokens=3)
    s.add_request(r)
    chunks = []

    def record(s, out):
        _budget_check(s, out)
        assert len(out.chunks) == 1
        c = out.chunks[0]
        chunks.append((c.start, c.num_tokens, c.samples))

    finished = [len(fin) for _, fin in _drain(s, record)]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True), (41, 1, True)]
    assert finished == [0, 0, 1, 1, 1]
    assert r.status == RequestStatus.FINISHED_LENGTH
    _assert_all_free(s)


def test_blocks_grow_with_computed_tokens(base_cfg):
    s = Scheduler(_cfg(base_cfg, block_size=4, max_num_batched_tokens=6))
    r = _req(10, max_tokens=5)
    s.add_request(r)
    seen = []
    while s.has_unfinished:
        out, _ = _step(s)
        seen.append(len(r.block_ids))
        if r.block_ids:
            assert len(r.block_ids) == -(-r.num_computed_tokens // 4)
    assert seen[:3] == [2, 3, 3]  # 6 tokens -> 2 blocks, 10 -> 3, 11 -> 3
    _assert_all_free(s)


# ---- preemption ----------------------------------------------------------------------------------------------
def test_preemption_picks_last_admitted_and_returns_blocks(base_cfg):
    # 6 blocks of 4 tokens: a and b (8-token prompts) get 2 blocks each, c (4 tokens) 1 block; then they grow.
    s = Scheduler(_cfg(base_cfg, num_kv_blocks=6, block_size=4, max_num_batched_tokens=64))
    a, b, c = _req(8, max_tokens=8), _req(8, max_tokens=8), _req(4, max_tokens=8)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = _step(s)
    assert [ch.req for ch in out.chunks] == [a, b, c]
    assert s.kv.pool.num_free == 1
    # a and b each need a 3rd block for token 9: a takes the last free one, b's need preempts c (admitted last)
    out, _ = _step(s)
    assert out.preempted == [c.request_id]
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert c.num_tokens == 5  # the token it already generated is kept and recomputed later
    assert list(s.waiting) == [c] and c not in s.running
    assert [ch.req for ch in out.chunks] == [a, b]  # c, back in the queue, is not re-admitted in this step
    assert s.kv.pool.num_free == 0
    s.kv.pool.check_integrity()
    _drain(s, _budget_check)
    # c was recomputed: its already generated token is kept and it still ends with max_tokens outputs
    assert all(r.num_output_tokens == 8 for r in (a, b, c))
    _assert_all_free(s)


def test_last_request_preempts_itself(base_cfg):
    """When the request that needs a block is itself the last admitted one, it is the one that goes."""
    s = Scheduler(_cfg(base_cfg, num_kv_blocks=4, block_size=4, max_num_batched_tokens=64))
    a, b = _req(6, max_tokens=9), _req(8, max_tokens=7)
    s.add_request(a)
    s.add_request(b)
    _step(s, _budget_check)  # a: 2 blocks, b: 2 blocks -> pool full
    assert s.kv.pool.num_free == 0
    out, _ = _step(s, _budget_check)  # a's 7th token fits its blocks; b's 9th needs a 3rd block -> b goes
    assert out.preempted == [b.request_id]
    assert [c.req for c in out.chunks] == [a]
    assert b.block_ids == [] and s.waiting[0] is b and s.running == [a]
    while a.status == RequestStatus.RUNNING:
        out, _ = _step(s, _budget_check)
        assert b not in [c.req for c in out.chunks]  # its 9 tokens need 3 blocks; a never leaves 3 free
    _drain(s, _budget_check)
    assert a.num_output_tokens == 9 and b.num_output_tokens == 7
    _assert_all_free(s)


def test_preemption_releases_encoder_cache(base_cfg):
    s = Scheduler(_cfg(base_cfg, num_kv_blocks=8, block_size=4, max_num_batched_tokens=12,
                       max_num_encoder_input_tokens=64))
    a = _req(12, max_tokens=16)  # 28 tokens: 7 blocks at the end
    b = _req(20, max_tokens=4, items=[(2, 16)])  # 24 tokens: 6 blocks at the end
    s.add_request(a)
    s.add_request(b)
    _step(s, _budget_check)  # a: its 12-token prompt
    out, _ = _step(s, _budget_check)  # a: 1 decode token, b: 11 tokens -> b's item encoded, only partly computed
    assert out.encode == [(b, 0)] and b.mm_items[0].mm_hash in s.encoder_cache
    out = s.schedule()  # b needs 2 more blocks for its last 9 prompt tokens, 1 is free: b (last) is preempted
    assert out.preempted == [b.request_id]
    assert b.mm_items[0].mm_hash in out.free_encoder_keys and b.mm_items[0].mm_hash not in s.encoder_cache
    assert [c.req for c in out.chunks] == [a]
    s.update_from_output(out, {a.request_id: TOKEN})
    steps = _drain(s, _budget_check)
    # encoded again after each recompute (b may be preempted more than once while a grows)
    assert sum((b, 0) in o.encode for o, _ in steps) == 1 + sum(b.request_id in o.preempted for o, _ in steps)
    assert a.num_output_tokens == 16 and b.num_output_tokens == 4
    _assert_all_free(s)


# ---- finishing and aborting ----------------------------------------------------------------------------------
def test_block_accounting_after_finish_and_abort(base_cfg):
    s = Scheduler(_cfg(base_cfg, num_kv_blocks=32, block_size=4, max_num_batched_tokens=16))
    reqs = [_req(n, max_tokens=6, items=[(1, 4)] if i % 2 else []) for i, n in enumerate((10, 12, 7, 20, 5))]
    for r in reqs:
        s.add_request(r)
    _step(s)
    _step(s)
    running, waiting = list(s.running), list(s.waiting)
    assert running and waiting
    # abort one running and one waiting request
    s.finish_requests([running[0].request_id, waiting[-1].request_id])
    assert running[0].status == RequestStatus.FINISHED_ABORTED and running[0].block_ids == []
    assert waiting[-1].status == RequestStatus.FINISHED_ABORTED
    s.finish_requests(["no-such-request", running[0].request_id])  # unknown / already gone: ignored
    s.kv.pool.check_integrity()
    _drain(s, _budget_check)
    _assert_all_free(s)


def test_abort_while_step_runs_ignores_its_result(base_cfg):
    s = Scheduler(_cfg(base_cfg))
    r = _req(6, max_tokens=4, items=[(1, 3)])
    s.add_request(r)
    out = s.schedule()
    s.finish_requests([r.request_id])
    assert s.update_from_output(out, {r.request_id: TOKEN}) == []
    assert r.num_output_tokens == 0
    # the runner is told to drop the encoder output on the next step
    assert r.mm_items[0].mm_hash in s.schedule().free_encoder_keys
    _assert_all_free(s)


def test_stop_token_and_eos_finish(base_cfg):
    s = Scheduler(_cfg(base_cfg))
    a = _req(4, max_tokens=10, stop_token_ids=[TOKEN])
    b = Request("eos", _prompt(4), SamplingParams(temperature=0.0, max_tokens=10), eos_token_ids=(TOKEN,))
    c = _req(4, max_tokens=10, stop_token_ids=[TOKEN], min_tokens=3)
    for r in (a, b, c):
        s.add_request(r)
    outs = [o for _, fin in _drain(s) for o in fin]
    final = {o.request_id: o for o in outs if o.finish_reason}
    assert final[a.request_id].finish_reason == "stop" and final[a.request_id].stop_reason == TOKEN
    assert final["eos"].finish_reason == "stop" and final["eos"].stop_reason is None
    assert a.num_output_tokens == b.num_output_tokens == 1
    assert c.num_output_tokens == 3
    _assert_all_free(s)


def test_max_model_len_finishes_unbounded_request(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_model_len=12, num_kv_blocks=8, block_size=4))
    r = _req(5, max_tokens=None)
    s.add_request(r)
    _drain(s, _budget_check)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 12
    _assert_all_free(s)


# ---- multimodal items ----------------------------------------------------------------------------------------
def _no_split_check(s: Scheduler, out):
    _budget_check(s, out)
    for c in out.chunks:
        for it in c.req.mm_items:
            assert not (it.offset < c.start < it.end), f"chunk starts inside item {it}"
            assert not (it.offset < c.end < it.end), f"chunk ends inside item {it}"


def test_disable_chunked_mm_input_never_splits_an_item(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=10, disable_chunked_mm_input=True))
    reqs = [_req(30, max_tokens=3, items=[(6, 8), (16, 10), (27, 2)]), _req(12, max_tokens=3, items=[(0, 9)]),
            _req(5, max_tokens=3)]
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    c = first.chunks[0]
    assert (c.start, c.end) == (0, 6), "must stop right at the first item's start"
    s.update_from_output(first, {})
    _drain(s, _no_split_check)
    assert all(r.num_output_tokens == 3 for r in reqs)
    _assert_all_free(s)


def test_chunked_mm_input_may_split_items(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=10))
    r = _req(30, max_tokens=2, items=[(6, 8), (16, 10)])
    s.add_request(r)
    out, _ = _step(s)
    assert (out.chunks[0].start, out.chunks[0].end) == (0, 10)
    assert out.encode == [(r, 0)]
    out, _ = _step(s)  # rest of item 0 (cached, not encoded again) and the start of item 1
    assert out.encode == [(r, 1)]
    _drain(s, _budget_check)
    _assert_all_free(s)


def test_encoder_budget_limits_items_per_step(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64, max_num_encoder_input_tokens=10))
    r = _req(40, max_tokens=2, items=[(2, 8), (12, 8), (22, 8)])
    s.add_request(r)
    encoded_per_step = []
    for out, _ in _drain(s, _budget_check):
        encoded_per_step.append([idx for _, idx in out.encode])
        if out.chunks and out.encode:
            # the chunk stops before the next item that is neither cached nor affordable
            c = out.chunks[0]
            nxt = [it for it in r.mm_items if it.offset >= c.end]
            assert not nxt or c.end == nxt[0].offset or c.end == r.num_tokens
    assert encoded_per_step[:3] == [[0], [1], [2]]
    _assert_all_free(s)


def test_encoder_budget_is_shared_between_requests(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64, max_num_encoder_input_tokens=12))
    a, b = _req(12, max_tokens=2, items=[(1, 8)]), _req(12, max_tokens=2, items=[(1, 8)])
    s.add_request(a)
    s.add_request(b)
    out, _ = _step(s, _budget_check)
    assert out.encode == [(a, 0)]
    assert [(c.req, c.num_tokens) for c in out.chunks] == [(a, 12), (b, 1)]  # b waits before its item
    out, _ = _step(s, _budget_check)
    assert out.encode == [(b, 0)]
    _drain(s, _budget_check)
    _assert_all_free(s)


def test_encoder_outputs_released_once_item_is_computed(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=6))
    r = _req(20, max_tokens=2, items=[(2, 8)])
    s.add_request(r)
    key = r.mm_items[0].mm_hash
    out, _ = _step(s)  # tokens 0..6: item encoded, partly computed
    assert out.encode == [(r, 0)] and key in s.encoder_cache
    out, _ = _step(s)  # tokens 6..12: item finished
    assert out.encode == [] and key not in s.encoder_cache
    assert key in s.schedule().free_encoder_keys


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,req_kw,match", [
    (dict(max_model_len=32), dict(num_prompt=33, max_tokens=None), "context length"),
    (dict(max_model_len=32), dict(num_prompt=20, max_tokens=13), "context length"),
    (dict(num_kv_blocks=4, block_size=4), dict(num_prompt=10, max_tokens=7), "KV cache"),
    (dict(num_kv_blocks=4, block_size=4, max_model_len=256), dict(num_prompt=4, max_tokens=None), "KV cache"),
    (dict(max_num_encoder_input_tokens=16), dict(num_prompt=30, items=[(2, 17)]), "max_num_encoder_input_tokens"),
    (dict(disable_chunked_mm_input=True, max_num_batched_tokens=16), dict(num_prompt=30, items=[(2, 17)]),
     "max_num_batched_tokens"),
])
def test_check_fits_refusals(base_cfg, overrides, req_kw, match):
    s = Scheduler(_cfg(base_cfg, **overrides))
    with pytest.raises(InvalidInputError, match=match):
        s.add_request(_req(**req_kw))
    assert not s.requests and not s.waiting
    _assert_all_free(s)


@pytest.mark.parametrize("overrides,req_kw", [
    (dict(max_model_len=32), dict(num_prompt=20, max_tokens=12)),
    (dict(num_kv_blocks=4, block_size=4), dict(num_prompt=10, max_tokens=6)),
    (dict(num_kv_blocks=4, block_size=4, max_model_len=16), dict(num_prompt=4, max_tokens=None)),
    (dict(max_num_encoder_input_tokens=16), dict(num_prompt=30, items=[(2, 16)])),
    (dict(disable_chunked_mm_input=True, max_num_batched_tokens=16), dict(num_prompt=30, items=[(2, 16)])),
])
def test_check_fits_accepts_the_limit(base_cfg, overrides, req_kw):
    s = Scheduler(_cfg(base_cfg, **overrides))
    r = _req(**req_kw)
    s.add_request(r)
    _drain(s, _budget_check)
    assert r.status.finished
    _assert_all_free(s)


# ---- block pool / KV manager ---------------------------------------------------------------------------------
def test_block_pool_integrity_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)
    pool.free(a)
    pool.check_integrity()
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_kv_manager_all_or_nothing(base_cfg):
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req(20)
    assert not kv.allocate_slots(r, 13)  # needs 4 blocks: nothing taken
    assert r.block_ids == [] and kv.pool.num_free == 3
    assert kv.allocate_slots(r, 12)
    assert len(r.block_ids) == 3 and kv.usage == 1.0
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 0)
    assert not kv.allocate_slots(r, 1)
    kv.free(r)
    assert r.block_ids == [] and kv.pool.num_free == 3 and kv.usage == 0.0
    kv.pool.check_integrity()
