"""A hybrid model's linear-attention state slots and prefix-cache snapshots, on their own: the scheduler with a
hand-made hybrid config (no model), steps simulated by hand; the step's tensors and their wire form; the memory
budget and the roles that refuse hybrid models."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest
import torch

from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.request import Request
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine import config as engine_config
from vlserve.engine.config import kv_bytes_per_token, resolve_config
from vlserve.engine.forward_batch import attention_metadata, batch_from_wire, batch_to_wire
from vlserve.engine.kv_connector import make_connector
from vlserve.engine.block_tables import BlockTables
from vlserve.engine.model_runner import ModelRunner
from vlserve.engine.scheduler import Scheduler
from vlserve.model.config_types import LinearAttentionConfig
from vlserve.model.layers.linear_state import state_bytes_per_slot

TOKEN = 7
BS = 4


@pytest.fixture(scope="module")
def base_cfg(tiny_ckpt):
    return resolve_config(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), num_kv_blocks=64, device="cpu"))


def hybrid(model):
    """The same model with every other layer linear attention."""
    n = model.text.num_layers
    text = dataclasses.replace(model.text, layer_types=tuple("full_attention" if i % 2 else "linear_attention"
                                                             for i in range(n)),
                               linear_attention=LinearAttentionConfig(4, 2, 4, 8, 8))
    return dataclasses.replace(model, text=text)


def _cfg(base_cfg, **kw):
    defaults = dict(num_kv_blocks=64, block_size=BS, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256,
                    max_num_encoder_input_tokens=64, encoder_cache_size=0, enable_prefix_caching=True,
                    num_state_snapshots=8, model=hybrid(base_cfg.model))
    return dataclasses.replace(base_cfg, **{**defaults, **kw})


_ids = itertools.count()


def _req(tokens: list[int], items: list[tuple[int, int, str]] = (), max_tokens: int = 3) -> Request:
    """`items`: (offset, num_tokens, content hash) media placeholder runs."""
    mm = [MultiModalItem(off, n, torch.zeros(4 * n, 8), (1, 2, 2 * n), mm_hash=h) for off, n, h in items]
    prompt = ProcessedPrompt(list(tokens), mm, torch.zeros(3, len(tokens), dtype=torch.long), 0)
    return Request(f"r{next(_ids)}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=(1002,))


def _step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, {c.req.request_id: TOKEN for c in out.chunks if c.samples})
    return out


def _drain(s: Scheduler) -> list:
    steps = []
    while s.has_unfinished:
        steps.append(_step(s))
        s.state.check_integrity()
        assert len(steps) < 500
    return steps


def _all_free(s: Scheduler):
    s.kv.pool.check_integrity()
    s.state.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks and not s.state.slot_of
    assert s.state.snapshots.num_free == s.state.snapshots.num_blocks, "a snapshot slot is still held"


PICTURE = [100 + i for i in range(10)]


def _picture_prompt(question: list[int]) -> tuple[list[int], list[tuple[int, int, str]]]:
    """3 text tokens, a 10-token picture (ends at 13), then the question."""
    return [1, 2, 3] + PICTURE + question, [(3, 10, "pic")]


# ---- running slots -------------------------------------------------------------------------------------------
def test_each_running_request_holds_its_own_slot_until_it_finishes(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_seqs=3, enable_prefix_caching=False, num_state_snapshots=0))
    for k in range(5):
        s.add_request(_req([10 + k] * 5))
    out = s.schedule()
    assert len(out.chunks) == 3 and out.state is not None
    assert sorted(out.state.slots.values()) == [0, 1, 2]
    assert not out.state.copies and not any(out.state.checkpoints.values())  # no prefix caching: no snapshots
    s.update_from_output(out, {c.req.request_id: TOKEN for c in out.chunks if c.samples})
    _drain(s)
    _all_free(s)
    assert s.state.queries == 0


def test_preemption_drops_the_state_and_readmission_starts_at_token_zero(base_cfg):
    s = Scheduler(_cfg(base_cfg, num_kv_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False,
                       num_state_snapshots=0))
    reqs = [_req([20 + k] * 10, max_tokens=6) for k in range(2)]
    for r in reqs:
        s.add_request(r)
    seen = []
    while s.has_unfinished:
        out = _step(s)
        seen.append(out)
        assert len(s.state.slot_of) == len(s.running)
        for c in out.chunks:  # a chunk from token 0 is the only one that starts from a zero state
            assert c.req.request_id in out.state.slots
    assert s.num_preemptions > 0
    restarts = [c for out in seen for c in out.chunks if c.start == 0]
    assert len(restarts) == 2 + s.num_preemptions
    _all_free(s)


# ---- snapshots -------------------------------------------------------------------------------------------------
def test_snapshots_at_the_end_of_the_picture_and_of_the_prompt(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=16))
    tokens, items = _picture_prompt([50, 51, 52, 53, 54, 55, 56, 57, 58])  # 22 tokens
    r = _req(tokens, items)
    s.add_request(r)
    first = s.schedule()
    assert first.state.checkpoints[r.request_id] == [(12, 4)]  # boundary 12 (picture ends at 13); slot 4 + 0
    assert s.state.num_snapshots == 0, "registered before the step that writes it ran"
    s.update_from_output(first, {})
    assert s.state.num_snapshots == 1
    second = _step(s)
    assert second.chunks[0].start == 16
    assert second.state.checkpoints[r.request_id] == [(4, 5)]  # boundary 20: the last before the prompt's end
    assert not second.state.copies
    _drain(s)
    assert s.state.num_snapshots == 2
    _all_free(s)


def test_a_second_question_on_the_same_picture_resumes_after_it(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64))
    a = _req(*_picture_prompt([50, 51, 52, 53, 54, 55, 56, 57, 58]))
    s.add_request(a)
    _drain(s)
    b = _req(*_picture_prompt([60, 61, 62]))  # same picture, another question
    s.add_request(b)
    out = s.schedule()
    chunk = out.chunks[0]
    assert chunk.start == 12 and b.num_cached_tokens == 12  # the KV blocks up to the picture's last boundary
    assert out.state.copies == [(s.state.num_running + 0, out.state.slots[b.request_id])]
    assert (s.state.queries, s.state.hits) == (2, 1)
    # the snapshot is held while the step runs: it can be neither evicted nor reset
    assert s.state.snapshots.ref_counts[0] == 1 and not s.state.reset()
    s.update_from_output(out, {b.request_id: TOKEN})
    _drain(s)
    _all_free(s)


def test_the_hit_is_cut_back_to_the_last_snapshot(base_cfg):
    """KV blocks are cached further than any snapshot: the hit ends at the longest prefix with one."""
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64))
    text = list(range(200, 240))
    s.add_request(_req(text))  # 40 tokens: snapshots at 36 (its prompt's last boundary before the end)
    _drain(s)
    s.add_request(r := _req(text[:30] + [7, 7, 7, 7, 7, 7]))  # 7 blocks of KV shared, no snapshot at 28
    out = s.schedule()
    assert out.chunks[0].start == 0 and not out.state.copies
    assert s.kv.prefix_hits == 0 and (s.state.queries, s.state.hits) == (2, 0)
    s.update_from_output(out, {r.request_id: TOKEN})
    _drain(s)
    s.add_request(again := _req(text[:30] + [7, 7, 7, 7, 7, 7]))  # now its own snapshot (at 32) is there
    out = s.schedule()
    assert out.chunks[0].start == 32 and out.state.copies
    s.update_from_output(out, {again.request_id: TOKEN})
    _drain(s)
    _all_free(s)


def test_snapshots_are_bounded_and_the_least_recently_used_goes(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64, num_state_snapshots=2))
    prompts = [[300 + 10 * k + i for i in range(9)] for k in range(3)]  # one snapshot each, at 8
    for p in prompts:
        s.add_request(_req(p))
        _drain(s)
    assert s.state.num_snapshots == 2
    s.add_request(_req(prompts[0]))  # evicted: computed from 0 (and snapshotted again)
    out = _step(s)
    assert out.chunks[0].start == 0
    _drain(s)
    s.add_request(_req(prompts[2]))  # still there
    out = _step(s)
    assert out.chunks[0].start == 8 and out.state.copies
    _drain(s)
    _all_free(s)


def test_a_copy_source_is_never_evicted_in_its_step(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64, num_state_snapshots=1))
    p = list(range(400, 409))
    s.add_request(_req(p))
    _drain(s)
    s.add_request(_req(p))  # resumes from the only snapshot ...
    s.add_request(other := _req(list(range(500, 509))))  # ... while this one would like a snapshot of its own
    out = s.schedule()
    assert out.state.copies and other.request_id in out.state.slots
    assert not out.state.checkpoints.get(other.request_id)
    s.update_from_output(out, {c.req.request_id: TOKEN for c in out.chunks if c.samples})
    _drain(s)
    _all_free(s)


def test_same_prefix_twice_in_one_step_is_snapshotted_once(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64))
    p = list(range(600, 609))
    s.add_request(a := _req(p))
    s.add_request(b := _req(p))
    out = s.schedule()
    assert out.state.checkpoints[a.request_id] == [(8, 4)] and not out.state.checkpoints[b.request_id]
    s.update_from_output(out, {a.request_id: TOKEN, b.request_id: TOKEN})
    _drain(s)
    assert s.state.num_snapshots == 1
    _all_free(s)


def test_reset_prefix_cache_drops_the_snapshots(base_cfg):
    s = Scheduler(_cfg(base_cfg, max_num_batched_tokens=64))
    p = list(range(700, 709))
    s.add_request(_req(p))
    _drain(s)
    assert s.state.num_snapshots == 1 and s.reset_prefix_cache()
    assert s.state.num_snapshots == 0
    s.add_request(_req(p))
    assert _step(s).chunks[0].start == 0
    _drain(s)


# ---- the step's tensors ------------------------------------------------------------------------------------
def test_forward_batch_carries_the_states_in_batch_order_and_over_the_wire(base_cfg):
    cfg = _cfg(base_cfg, max_num_batched_tokens=64)
    s = Scheduler(cfg)
    p = list(range(800, 809))
    s.add_request(_req(p, max_tokens=4))
    _drain(s)
    s.add_request(_req(list(range(900, 903)), max_tokens=4))  # decoding by the time the next ones arrive
    _step(s)
    s.add_request(_req(p))  # resumes from the snapshot at 8
    s.add_request(_req(list(range(950, 960))))  # fresh, one snapshot at 8
    out = s.schedule()
    runner = ModelRunner.__new__(ModelRunner)
    runner.cfg, runner.block_size, runner.device = cfg, BS, torch.device("cpu")
    runner.block_tables = BlockTables(cfg.max_num_seqs, cfg.max_model_len // BS + 2)
    ordered, batch = runner._prepare(out.chunks, out.state)
    assert [c.num_tokens for c in ordered] == [1, 1, 10]  # decode rows first (the resumed one: 1 token left)
    assert batch.state_slots.tolist() == [out.state.slots[c.req.request_id] for c in ordered]
    assert batch.state_fresh.tolist() == [False, False, True]
    assert batch.state_checkpoints == [[(8, cfg.max_num_seqs + 1)]]
    assert batch.state_copies == [(cfg.max_num_seqs + 0, out.state.slots[ordered[1].req.request_id])]
    meta = attention_metadata(batch, BS, torch.device("cpu"))
    assert torch.equal(meta.linear.slots, batch.state_slots) and meta.linear.checkpoints == batch.state_checkpoints
    tensors: list[torch.Tensor] = []
    wire = batch_to_wire(batch, tensors)
    back = batch_from_wire(wire, [b""] + [t.numpy().tobytes() for t in tensors])
    assert torch.equal(back.state_fresh, batch.state_fresh) and torch.equal(back.state_slots, batch.state_slots)
    assert back.state_checkpoints == batch.state_checkpoints and back.state_copies == batch.state_copies
    s.update_from_output(out, {c.req.request_id: TOKEN for c in out.chunks if c.samples})
    _drain(s)
    _all_free(s)


def test_other_models_carry_no_state(base_cfg):
    cfg = dataclasses.replace(_cfg(base_cfg), model=base_cfg.model, num_state_snapshots=0)
    s = Scheduler(cfg)
    s.add_request(_req(list(range(10))))
    out = s.schedule()
    assert s.state is None and out.state is None
    runner = ModelRunner.__new__(ModelRunner)
    runner.cfg, runner.block_size, runner.device = cfg, BS, torch.device("cpu")
    runner.block_tables = BlockTables(cfg.max_num_seqs, cfg.max_model_len // BS + 2)
    _, batch = runner._prepare(out.chunks, out.state)
    assert batch.state_slots is None and attention_metadata(batch, BS, torch.device("cpu")).linear is None


# ---- memory and roles --------------------------------------------------------------------------------------
def test_state_pool_comes_out_of_the_kv_memory_budget(base_cfg, monkeypatch):
    model = hybrid(base_cfg.model)
    t = model.text
    full = sum(not t.is_linear_layer(i) for i in range(t.num_layers))
    assert kv_bytes_per_token(model, torch.float32) * t.num_layers == kv_bytes_per_token(base_cfg.model,
                                                                                          torch.float32) * full
    facts = msgspec.structs.replace(base_cfg.facts, model=model)
    args = EngineArgs(model=str(base_cfg.model_path), device="cpu", kv_cache_memory_gb=0.01, max_num_seqs=8,
                      max_state_snapshots=24, block_size=BS)
    cfg = resolve_config(args, facts)
    per_slot = state_bytes_per_slot(t, cfg.dtype)
    assert cfg.num_state_slots == 32 and cfg.state_bytes == 32 * per_slot
    per_block = kv_bytes_per_token(model, cfg.dtype) * BS
    assert cfg.num_kv_blocks == (int(0.01 * 2**30) - 32 * per_slot) // per_block
    off = resolve_config(dataclasses.replace(args, enable_prefix_caching=False), facts)
    assert off.num_state_snapshots == 0 and off.num_state_slots == 8
    monkeypatch.setattr(engine_config, "state_bytes_per_slot", lambda *a: 2**30)
    with pytest.raises(InvalidInputError, match="state pool"):
        resolve_config(args, facts)


def test_tensor_parallel_needs_evenly_split_linear_heads_and_kv_moving_roles_take_hybrids(base_cfg):
    facts = msgspec.structs.replace(base_cfg.facts, model=hybrid(base_cfg.model))  # 2 key heads, 4 value heads
    with pytest.raises(InvalidInputError, match=r"linear-attention heads \(2 key, 4 value\) .* 4"):
        resolve_config(EngineArgs(model=str(base_cfg.model_path), device="cpu", tensor_parallel_size=4), facts)
    cfg = _cfg(base_cfg)
    for role in ("prefill", "decode"):  # their states travel with the KV (tests/test_qwen3_5_disagg.py)
        assert make_connector(role, cfg) is not None
    assert make_connector(None, cfg) is None
    with pytest.raises(InvalidInputError, match="max_state_snapshots"):
        EngineArgs(model="x", max_state_snapshots=-1).check()


def test_the_state_pool_is_logged_and_exported(base_cfg):
    from vlserve.core.wire import EngineStats
    from vlserve.engine.core import _state_pool_text
    from vlserve.frontend.metrics import ENGINE_METRICS

    cfg = _cfg(base_cfg)
    text = _state_pool_text(cfg)
    assert f"{cfg.state_bytes / 2**30:.3f} GiB" in text and "4 running + 8 snapshot slots" in text
    assert _state_pool_text(base_cfg) == ""
    for name in ("state_snapshot_queries_total", "state_snapshot_hits_total", "state_cache_usage_perc"):
        assert name in ENGINE_METRICS and name in EngineStats.__struct_fields__
