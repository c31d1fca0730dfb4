"""E->P->D for a hybrid model (Qwen3.5): the prefill hands the decode instance, besides the KV of its full-attention
layers, the linear-attention states its prompt reached, as rows after the prompt's KV rows (engine.state_rows).

The state rows carry float32 bytes through bfloat16 rows exactly; the transfer's row map puts them after the last
token's row; through the KV connectors a decode engine answers exactly as one engine (text, a picture, seeded
sampling, dense and MoE), a prefix already cached on the decode side is shared, a preemption swaps the state out
with the KV, a NaN state fails its request only. Then real processes: encoder -> prefill -> decode over ZeroMQ, the
KV arriving in several runs (resumes), equal to the aggregated engine."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.test_pd_handoff import Decode, Prefill, _whole, hand_over, prefilled, run
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.disagg.messages import RowSegment, TransferChunk
from vlserve.disagg.peer_kinds import ENCODER_PEERS, PREFILL_PEERS
from vlserve.disagg.received import ReceivedChunks
from vlserve.disagg.row_map import RowMap
from vlserve.disagg.sender import every_token_segments
from vlserve.disagg.transports.base import ChunkTokens
from vlserve.engine.state_rows import pack_state, state_row_count, unpack_state
from vlserve.model.config_types import LinearAttentionConfig
from vlserve.model.layers.linear_state import new_layer_states

PICTURE = {"prompt": f"{IMG} Describe it.", "multi_modal_data": {"image": noise_image(72, 56, 4)}}
TEXT = "The quick brown fox jumps over the lazy dog, again and again."
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def path(tiny_ckpt, request):
    return tiny_ckpt(request.param)


@pytest.fixture(scope="module")
def prefill(path):
    return Prefill(path)


@pytest.fixture(scope="module")
def whole(path):
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


def _states(cfg, slots=3, dtype=torch.bfloat16):
    return new_layer_states(cfg.model.text, slots, dtype, "cpu")


def test_state_rows_carry_float32_bytes_exactly_and_refuse_bad_ones(prefill):
    cfg = prefill.core.cfg
    width = cfg.model.kv_row_width
    states = _states(cfg)
    for st in states:
        if st is not None:
            st.conv.normal_()
            st.recurrent.normal_().mul_(1e-3).add_(1.0 / 3)  # values bfloat16 cannot hold
    rows = pack_state(states, 1, width, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and rows.shape == (state_row_count(cfg.model, torch.bfloat16), width)
    copy = _states(cfg)
    unpack_state(rows, copy, 2)
    for a, b in zip(states, copy):
        if a is not None:
            assert torch.equal(a.conv[1], b.conv[2]) and torch.equal(a.recurrent[1], b.recurrent[2])
            assert not b.recurrent[0].any()  # other slots untouched
    with pytest.raises(InvalidInputError, match="bytes"):
        unpack_state(rows[:-1], copy, 0)
    nan = next(st for st in states if st is not None)
    nan.recurrent[1, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="NaN"):
        unpack_state(pack_state(states, 1, width, torch.bfloat16), copy, 0)
    assert not any(st.recurrent[0].any() for st in copy if st is not None)  # refused: nothing written


def test_state_rows_follow_the_last_tokens_row():
    row_map = RowMap([], every_token=True, tail_rows=3)
    assert (row_map.rows_through(9, 10), row_map.rows_through(10, 10)) == (9, 13)
    assert row_map.chunk_end(0, 13, 10) == 10  # everything fits
    assert row_map.chunk_end(0, 12, 10) == 9  # the last token goes only with its state rows
    assert [(s.token, s.num_rows) for s in every_token_segments(9, 10, 10, 3)] == [(9, 1), (10, 3)]
    assert [(s.token, s.num_rows) for s in every_token_segments(0, 9, 10, 3)] == [(0, 9)]
    # The receiver holds a prefill to the same cut.
    def chunk(start, end, segments, run):
        return TransferChunk("r", 0, start, end - start, 10, 0, [], run, [RowSegment(*s) for s in segments],
                             partial=end < 10)
    received = ReceivedChunks(every_token=True, block_tokens=4, max_model_len=64, tail_rows=3)
    first = chunk(0, 8, [(0, 8)], [0, 1])
    assert received.problems(first, [0, 1]) == []
    received.add(first, _tokens(0, 8))
    assert received.rows_left == 5
    assert received.problems(chunk(8, 10, [(8, 2)], [2, 3]), [2, 3]) == [
        "rows that do not match this chunk's tokens"]  # the state rows are missing
    last = chunk(8, 10, [(8, 2), (10, 3)], [2, 3])
    assert received.problems(last, [2, 3]) == []
    received.add(last, _tokens(8, 10))
    assert (received.rows, received.rows_left) == (13, 0)


def _tokens(start, end):
    return ChunkTokens(torch.arange(start, end), torch.zeros(end - start, 3, dtype=torch.int64), 0)


def test_a_prefill_instance_pairs_only_with_the_same_state_rows(prefill):
    cfg = prefill.core.cfg
    assert PREFILL_PEERS.tail_rows(cfg) == state_row_count(cfg.model, cfg.dtype) > 0
    assert ENCODER_PEERS.tail_rows(cfg) == 0
    assert PREFILL_PEERS.expects(cfg)[-1] == PREFILL_PEERS.tail_rows(cfg)
    la = cfg.model.text.linear_attention
    assert isinstance(la, LinearAttentionConfig)
    assert cfg.model.kv_row_width == cfg.model.text.num_kv_layers * 2 * cfg.model.text.num_kv_heads * \
        cfg.model.text.head_dim < cfg.model.text.num_layers * 2 * cfg.model.text.num_kv_heads * cfg.model.text.head_dim


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", [TEXT, PICTURE], ids=["text", "picture"])
def test_handoff_carries_the_states_and_equals_one_engine(path, prefill, whole, prompt, params):
    decode = Decode(path)
    processed, handoff, rows = prefilled(prefill, prompt, params, "r")
    n = len(processed.prompt_token_ids)
    assert rows.shape[0] == n + state_row_count(prefill.core.cfg.model, prefill.core.cfg.dtype)
    decode.add("r", decode.receive("r", processed, rows), params, handoff)
    assert run(decode, ["r"])["r"] == _whole(whole, prompt, params)
    assert decode.nothing_held()
    assert_pool_full(prefill)
    state = decode.core.scheduler.state
    state.check_integrity()
    assert not state.slot_of and not prefill.core.scheduler.state.slot_of


def test_a_prefix_cached_on_the_decode_side_is_shared_and_stays_exact(path, prefill, whole):
    """Two handed-over requests with the same picture and question: the second shares the first's KV blocks on
    the decode instance (its state still comes from its own prefill)."""
    decode = Decode(path)
    for rid in ("a", "b"):
        processed, handoff, rows = prefilled(prefill, PICTURE, GREEDY, rid)
        decode.add(rid, decode.receive(rid, processed, rows), GREEDY, handoff)
        assert run(decode, [rid])[rid] == _whole(whole, PICTURE, GREEDY)
    assert decode.core.scheduler.kv.prefix_hits > 0
    assert not decode.blocks


def test_preempted_handoffs_swap_their_states_with_their_kv(path, prefill, whole):
    decode = Decode(path, num_kv_blocks=16)
    prompts = [PICTURE, TEXT, "def fibonacci(n):", "Hello, how are you?"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rids = hand_over(prefill, decode, prompts, params)
    swapped = []
    connector = decode.core.connector
    original = connector.move_kv
    connector.move_kv = lambda sched: (swapped.extend(slot for *_, slot in sched.kv_out), original(sched))[1]
    got = run(decode, rids)
    assert got == {rid: _whole(whole, p, params) for rid, p in zip(rids, prompts)}
    assert swapped and all(slot is not None for slot in swapped), "the pool was meant to force preemptions"
    state = decode.core.scheduler.state
    state.check_integrity()
    assert not state.slot_of and not decode.blocks


def test_a_nan_state_fails_its_request_only(path, prefill, whole):
    decode = Decode(path)
    processed, handoff, rows = prefilled(prefill, TEXT, GREEDY, "bad")
    n = len(processed.prompt_token_ids)
    rows = rows.clone()
    conv_bytes = rows[n:].view(torch.uint8).view(-1)
    conv_bytes[:4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # a float32 NaN at the first value
    decode.add("bad", decode.receive("bad", processed, rows), GREEDY, handoff)
    processed, handoff, good = prefilled(prefill, TEXT, GREEDY, "good")
    decode.add("good", decode.receive("good", processed, good), GREEDY, handoff)
    got = run(decode, ["bad", "good"])
    assert got["good"] == _whole(whole, TEXT, GREEDY)
    failed = decode.core.take_failed()
    assert [rid for rid, *_ in failed] == ["bad"] and "NaN" in failed[0][1]
    assert not decode.core.has_unfinished and decode.nothing_held()
    kv = decode.core.scheduler.kv.pool
    kv.check_integrity()
    assert kv.num_free == kv.num_blocks  # the refused request's KV was written, then freed with it
    decode.core.scheduler.state.check_integrity()
    assert not decode.core.scheduler.state.slot_of


def test_e_p_d_processes_hand_over_states_and_match_aggregated(tiny_ckpt):
    """Encoder -> prefill -> decode as processes over ZeroMQ; the decode instance's first run of receive blocks
    holds 32 rows, so a picture prompt's KV and states arrive in several runs (resumes)."""
    from tests.test_disagg import CASES, Cluster, ask, expected_text, picture_chat, wait_encoder_idle
    from tests.test_pd_disagg import sampled, wait_nothing_held

    ckpt = tiny_ckpt("qwen3_5")
    offline = LLM(str(ckpt), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4})
    pd = Cluster(ckpt, {"main": ["--kv-allocate-tokens", "32"]}, prefills={"P": []},
                 extra=("--transfer-timeout", "8"))
    try:
        pd.wait_prefills("main", 1)
        client = pd.client("main")
        for name, messages in CASES.items():
            assert ask(client, messages) == expected_text(offline, messages), name
        chat = picture_chat(5, 6)
        assert ask(client, chat) == ask(client, chat) == expected_text(offline, chat)  # again: a prefix hit
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, presence_penalty=0.5, max_tokens=8)
        want = offline.chat(CASES["one image"], params, use_tqdm=False)[0].outputs[0].text
        assert sampled(client, CASES["one image"], 5) == want
        m = pd.metrics("main")
        assert m['vlserve:kv_transfer_resumes_total{role="decode"}'] > 0, "long prompts were meant to resume"
        wait_nothing_held(pd)
        wait_encoder_idle(pd.encoders["A"].metrics_url)
    finally:
        pd.close()
