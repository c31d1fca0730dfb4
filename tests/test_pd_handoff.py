"""The engine half of E→P→D, through the KV connectors: a prefill engine (`PrefillConnector`) exports a finished
request's KV as one row per token (`connector.take_exported`), the rows land in receive blocks (what the
transports write), and a decode engine (`DecodeConnector`) takes the request through the one admission path,
`add_request(..., kv_transfer=Handoff)`. Its first output is the prefill's token, then decoding goes on token for
token as one engine would: greedy, seeded, penalties, grammars, pictures. Handed-over requests that must be
preempted swap their KV out to host memory (their pictures are not here to recompute from); the receive blocks
are released once the KV is copied in, and also when a request still waiting for room is aborted; every pool
ends full. An engine without a connector (aggregated) holds no role code and refuses handed-over KV."""

from __future__ import annotations

import ast
import dataclasses
import re
import time
from pathlib import Path

import msgspec
import pytest
import torch

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.config import DECODE, PREFILL, EngineArgs, kv_cache_shared
from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput, Handoff, TokenLogprobs
from vlserve.core.prompt import MultiModalItem, ProcessedPrompt
from vlserve.core.wire import ReleaseKV, ReserveKV
from vlserve.engine.config import resolve_config
from vlserve.engine.core import EngineCore
from vlserve.engine.kv_connector import DecodeConnector, make_connector
from vlserve.engine.kv_handoff import kv_to_rows, rows_to_kv
from vlserve.engine.ranked_kv import RankedKV
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.frontend.input_processor import InputProcessor

PICTURE = {"prompt": f"{IMG} Describe it.", "multi_modal_data": {"image": noise_image(72, 56, 4)}}
PROMPTS = ["Hello, how are you?", "def fibonacci(n):", "The quick brown fox"]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    "top-p and penalties": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, presence_penalty=1.5,
                                          repetition_penalty=1.3, ignore_eos=True),
    "grammar": SamplingParams(temperature=0.9, seed=5, max_tokens=30,
                              structured_outputs={"regex": "[a-z]{4}-[0-9]{3}( ok)?"}),
    "min_tokens": SamplingParams(temperature=0, max_tokens=6, min_tokens=4),
}


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


def _cfg(path, **kw):
    return resolve_config(EngineArgs(model=str(path), dtype="float32", block_size=8, **kw), announce=False)


class Prefill:
    """A prefill engine, as a prefill instance's engine process has it: every request's KV is exported."""

    def __init__(self, path, **kw):
        cfg = _cfg(path, num_kv_blocks=256, **kw)
        if kv_cache_shared(PREFILL, cfg.tensor_parallel_size, cfg.device.type):  # several ranks: each one's file
            cfg = dataclasses.replace(cfg, kv_cache_file=True)
        self.core = EngineCore(cfg, connector=make_connector("prefill", cfg))
        self.input_processor = InputProcessor.for_model(cfg)

    @property
    def engine(self):  # what assert_pool_full looks at
        return self


@pytest.fixture(scope="module")
def prefill(path):
    return Prefill(path)


@pytest.fixture(scope="module")
def whole(path):  # one engine doing all of it: the reference
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)


class Decode:
    """A decode engine as a decode instance's engine process has it: at one rank on the CPU its KV cache is in a
    shared file and peers write into blocks it reserves (`in_place`); else with receive blocks, copied from."""

    def __init__(self, path, num_kv_blocks: int = 256, max_num_seqs: int = 128, in_place: bool | None = None, **kw):
        cfg = _cfg(path, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, **kw)
        if in_place is None:
            in_place = kv_cache_shared(DECODE, cfg.tensor_parallel_size, cfg.device.type)
        self.in_place, self.buffers = in_place, None
        if in_place:
            cfg = dataclasses.replace(cfg, kv_cache_file=True)
            self.core = EngineCore(cfg, report_released=True, connector=DecodeConnector(cfg))
        else:
            self.buffers = TransferBuffers.create(64, 16, cfg.model.kv_row_width, cfg.dtype, shared=False)
            self.core = EngineCore(cfg, report_released=True, transfer=self.buffers, connector=DecodeConnector(cfg))
        self.blocks: dict[str, list[int]] = {}

    def receive(self, rid: str, processed: ProcessedPrompt, rows: torch.Tensor) -> ProcessedPrompt:
        """What a transport does: a KV row per token (then a hybrid model's state rows) into a run of blocks
        (token ids and positions travel beside); the prompt as it arrives."""
        n = rows.shape[0]
        if self.in_place:  # blocks of the KV cache itself, reserved for this transfer
            blocks = self.core.connector.reserve(ReserveKV(rid, 0, n)).block_ids
            self.core.runner.kv_buffers.write_rows(blocks, torch.arange(n), rows)
        else:
            blocks = self.buffers.allocate(n)
            self.buffers.write_rows(blocks, torch.arange(n), rows)
        self.blocks[rid] = blocks
        items = [MultiModalItem(it.offset, it.num_tokens, None, it.layout, it.mm_hash) for it in processed.mm_items]
        return ProcessedPrompt(processed.prompt_token_ids, items, processed.positions, processed.position_delta,
                               block_rows=blocks, kv_in_blocks=True)

    def add(self, rid: str, arrived: ProcessedPrompt, params: SamplingParams, handoff: Handoff) -> None:
        self.core.add_request(rid, arrived, params, kv_transfer=handoff)

    def step(self) -> list:
        outs = self.core.step()
        for rid in self.core.take_inputs_released() + self.core.take_released():
            self.free(rid)  # the second time for one request frees nothing
        return outs

    def free(self, rid: str) -> None:
        """What the front end does once the engine is done with a prompt's rows (or never took them)."""
        blocks = self.blocks.pop(rid, None)
        if blocks is None:  # computed here: it had nothing to release
            return
        if self.in_place:
            self.core.connector.release(ReleaseKV(rid))  # what the request took is its own
        else:
            self.buffers.free(blocks)

    def nothing_held(self) -> bool:
        """No receive block or reservation left, every KV block back in the pool."""
        pool = self.core.scheduler.kv.pool
        pool.check_integrity()
        received = self.core.connector.num_reserved_blocks if self.in_place else \
            self.buffers.num_blocks - self.buffers.num_free
        return not self.blocks and received == 0 and pool.num_free == pool.num_blocks


def prefilled(prefill: Prefill, prompt, params: SamplingParams, rid: str):
    """The prefill instance's part: (processed prompt, Handoff, KV rows)."""
    core = prefill.core
    processed = prefill.input_processor.process(prompt)
    core.add_request(rid, processed, params.for_prefill())
    outs, exported = [], []
    while core.has_unfinished:
        outs += core.step()
        exported += core.connector.take_exported()
    (kv,) = exported
    assert kv.request_id == rid and not core.connector.held
    return processed, Handoff(outs[-1], kv.generator_state), kv.rows


def hand_over(prefill: Prefill, decode: Decode, prompts: list, params: SamplingParams) -> list[str]:
    """Each prompt prefilled and handed to `decode` (ids s0, s1, ...), all waiting there at once."""
    rids = [f"s{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        processed, handoff, rows = prefilled(prefill, prompt, params, rid)
        decode.add(rid, decode.receive(rid, processed, rows), params, handoff)
    return rids


def run(decode: Decode, rids: list[str], max_steps: int = 2000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    for _ in range(max_steps):  # (a queue that never moves fails here rather than hanging)
        if not decode.core.has_unfinished:
            return tokens
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    waiting = [r.request_id for r in decode.core.scheduler.waiting]
    raise AssertionError(f"still unfinished after {max_steps} steps: {waiting} waiting")


def _whole(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_rows_round_trip():
    kv = torch.randn(3, 2, 5, 2, 4)
    rows = kv_to_rows(kv)
    assert rows.shape == (5, 3 * 2 * 2 * 4)
    assert torch.equal(rows[2], kv[:, :, 2].reshape(-1))  # a token's row holds only that token's KV
    assert torch.equal(rows_to_kv(rows, 3, 2, 4), kv)
    with pytest.raises(InvalidInputError, match="do not fit"):
        rows_to_kv(rows[:, :-1], 3, 2, 4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt", [PROMPTS[0], PICTURE], ids=["text", "picture"])
def test_handoff_through_receive_blocks_equals_one_engine(path, prefill, whole, prompt, case):
    params = CASES[case]
    decode = Decode(path)
    processed, handoff, rows = prefilled(prefill, prompt, params, "r")
    decode.add("r", decode.receive("r", processed, rows), params, handoff)
    assert run(decode, ["r"])["r"] == _whole(whole, prompt, params)
    assert decode.nothing_held()
    assert_pool_full(prefill)


@pytest.mark.parametrize("prompt", [PROMPTS[0], PICTURE], ids=["text", "picture"])
def test_handoff_through_receive_blocks_copied_in_equals_one_engine(path, prefill, whole, prompt):
    """The other path (a decode engine with tensor parallelism or on a GPU): KV rows in receive blocks, copied into
    the KV cache at admission."""
    params = CASES["seeded"]
    decode = Decode(path, in_place=False)
    processed, handoff, rows = prefilled(prefill, prompt, params, "r")
    decode.add("r", decode.receive("r", processed, rows), params, handoff)
    assert run(decode, ["r"])["r"] == _whole(whole, prompt, params)
    assert decode.nothing_held()


def test_a_request_that_ends_at_its_first_token_is_answered_without_admission(path, prefill):
    decode = Decode(path)
    params = SamplingParams(temperature=0, max_tokens=1)
    processed, handoff, rows = prefilled(prefill, PROMPTS[1], params, "one")
    decode.add("one", decode.receive("one", processed, rows), params, handoff)
    outs = decode.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == \
        [("one", handoff.first.new_token_ids, "length")]
    assert not decode.core.has_unfinished and not decode.blocks


def test_preempted_handoffs_swap_their_kv_and_stay_exact(path, prefill, whole):
    """A pool too small for all of them: requests are preempted, their KV goes to host memory and back."""
    decode = Decode(path, num_kv_blocks=26)
    prompts = [PICTURE, PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rids = hand_over(prefill, decode, prompts, params)
    swaps = []
    connector = decode.core.connector
    original = connector.move_kv
    connector.move_kv = lambda sched: (swaps.append((len(sched.kv_out), sum(
        not connector.pending_kv(r).from_peer for r, _ in sched.kv_in))), original(sched))[1]
    got = run(decode, rids)
    assert got == {rid: _whole(whole, p, params) for rid, p in zip(rids, prompts)}
    assert decode.core.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to force preemptions"
    assert sum(o for o, _ in swaps) > 0 and sum(o for o, _ in swaps) == sum(i for _, i in swaps)
    assert decode.nothing_held()


def test_handoffs_wait_for_room_and_an_abort_releases_their_blocks(path, prefill, whole):
    decode = Decode(path, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2])):
        processed, handoff, rows = prefilled(prefill, prompt, params, rid)
        decode.add(rid, decode.receive(rid, processed, rows), params, handoff)
    assert [r.request_id for r in decode.core.scheduler.waiting] == ["a", "b", "c"]  # they queue like any request
    with pytest.raises(InvalidInputError, match="already in use"):
        decode.add("c", decode.receive("c2", processed, rows), params, handoff)
    decode.free("c2")
    decode.core.abort_requests(["b"])
    assert [r.request_id for r in decode.core.scheduler.waiting] == ["a", "c"]
    early = decode.step()
    assert [r.request_id for r in decode.core.scheduler.running] == ["a"]  # one at a time: c waits for room
    got = run(decode, ["a", "b", "c"])
    for out in reversed(early):  # the first tokens, reported by that step
        got[out.request_id][:0] = out.new_token_ids
    assert got["a"] == _whole(whole, PROMPTS[0], params) and got["c"] == _whole(whole, PROMPTS[2], params)
    assert got["b"] == []  # aborted before its first token was reported
    assert decode.nothing_held()


def test_bad_handoffs_are_refused_with_nothing_kept(path, prefill):
    decode = Decode(path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], params, "x")
    arrived = decode.receive("x", processed, rows)
    first = handoff.first
    for bad, why in ((EngineCoreOutput("x", first.new_token_ids * 2), "exactly the one token"),
                     (EngineCoreOutput("x", [10**6]), "outside the vocabulary"),
                     (EngineCoreOutput("x", first.new_token_ids, [TokenLogprobs([1], [0.0], 1)]), "logprobs")):
        with pytest.raises(InvalidInputError, match=why):
            decode.add("x", arrived, params, Handoff(bad, None))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    with pytest.raises(InvalidInputError, match="random state"):
        decode.add("x", arrived, seeded, Handoff(first, None))
    with pytest.raises(InvalidInputError, match="samples once"):
        decode.add("x", arrived, SamplingParams(n=2, max_tokens=4), handoff)
    with pytest.raises(InvalidInputError, match="KV rows in this engine's blocks"):
        decode.add("x", ProcessedPrompt(arrived.prompt_token_ids, [], arrived.positions, 0),
                                params, handoff)
    assert not decode.core.has_unfinished
    decode.free("x")
    assert decode.nothing_held()


def test_a_decode_engine_shares_its_cached_prefix_and_stays_exact(path, prefill, whole):
    """The same picture twice: the second handoff takes the prefix blocks the first left in the cache and writes
    only the rest of its KV."""
    decode = Decode(path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rid in ("first", "again"):
        processed, handoff, rows = prefilled(prefill, PICTURE, params, rid)
        decode.add(rid, decode.receive(rid, processed, rows), params, handoff)
        assert run(decode, [rid])[rid] == _whole(whole, PICTURE, params)
    hits = decode.core.get_metrics()["prefix_cache_hits_total"]
    assert hits >= (len(processed.prompt_token_ids) // 8 - 1) * 8 > 0
    assert decode.nothing_held()


def test_a_handed_token_its_grammar_refuses_is_a_clean_400(path, prefill):
    """A prefill peer's token that the request's own grammar cannot accept: refused with 400, nothing reported
    for it, its receive blocks released, the engine idle again."""
    decode = Decode(path)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"regex": "a{3}"})
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), "g")
    bad = prefill.engine.input_processor.tokenizer.encode("zz", add_special_tokens=False)[:1]
    decode.add("g", decode.receive("g", processed, rows), params,
                            Handoff(EngineCoreOutput("g", bad), handoff.generator_state))
    outs, deadline = [], time.monotonic() + 30
    while decode.core.has_unfinished and time.monotonic() < deadline:
        outs += decode.step()
    assert not decode.core.has_unfinished and outs == []
    (rid, why, status), = decode.core.take_failed()
    assert (rid, status) == ("g", 400) and why
    assert decode.nothing_held()  # released once


def test_receive_blocks_are_released_as_the_kv_is_copied_in_and_the_id_once_the_request_leaves(path, prefill):
    """With receive blocks the engine says a prompt's inputs are free once its KV is copied in
    (`take_inputs_released`, while it still decodes) and again once it has left (`take_released`): the front end
    frees the blocks at the first and keeps the id taken until the second (no bookkeeping in the engine core)."""
    decode = Decode(path, in_place=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], params, "e")
    decode.add("e", decode.receive("e", processed, rows), params, handoff)
    early, final, steps = [], [], 0
    while decode.core.has_unfinished and steps < 100:
        decode.core.step()
        early.append(decode.core.take_inputs_released())
        final.append(decode.core.take_released())
        steps += 1
    first_early = next(i for i, ids in enumerate(early) if ids)
    assert early[first_early] == ["e"] and sum(early, []) == ["e"]
    assert sum(final, []) == ["e"] and final[-1] == ["e"] and first_early < len(final) - 1  # while it decoded
    decode.free("e")
    assert decode.nothing_held()


def test_the_engine_core_holds_no_role_code():
    """Roles live in their KV connectors: engine/core.py names none of them, nor what they do with KV (no export
    or write bookkeeping: the engine process takes those from the connector)."""
    tree = ast.parse((Path(__file__).parents[1] / "vlserve" / "engine" / "core.py").read_text())
    for node in ast.walk(tree):  # docstrings may explain what plugs in; the code may not know it
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                             ast.Constant):
            body[0] = ast.Pass()
    code = ast.unparse(tree)  # comments gone too
    found = re.findall(r"handoff|handed|hold_kv|held|swap|prefill|decode|pending_kv|export|Handoff|Prefill|Decode"
                       r"|ExportedKV|kept|written|early", code)
    assert not found, f"role-specific names in engine/core.py: {sorted(set(found))}"


def test_an_engine_without_a_connector_refuses_handed_over_kv(path, prefill):
    whole = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    assert whole.engine.core.connector is None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    processed, handoff, _ = prefilled(prefill, PROMPTS[0], params, "n")
    with pytest.raises(InvalidInputError, match="takes none from other instances"):
        whole.engine.core.add_request("n", processed, params, kv_transfer=handoff)
    assert_pool_full(whole)
    assert make_connector("serve", None) is None and make_connector(None, None) is None


def test_gathered_heads_put_every_ranks_heads_in_model_order_and_drop_copies():
    from vlserve.engine.model_shard import gathered_heads, kv_heads_of

    assert [kv_heads_of(4, 8, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    assert gathered_heads(4, 8, 2).tolist() == [0, 1, 2, 3]
    # two heads over four ranks: ranks 0-1 copy head 0, ranks 2-3 head 1; the gathered order is r0 r1 r2 r3
    assert [kv_heads_of(2, 8, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert gathered_heads(2, 8, 4).tolist() == [0, 2]


@pytest.fixture(scope="module")
def engines(path, prefill, whole, tiny_ckpt):
    """arch -> (checkpoint, a one-rank prefill engine, the one-engine reference): Qwen2-VL's, and a hybrid
    model's (Qwen3.5: its linear states follow the KV rows)."""
    made = {"qwen2_vl": (path, prefill, whole)}

    def get(arch: str):
        if arch not in made:
            ckpt = tiny_ckpt(arch)
            made[arch] = (ckpt, Prefill(ckpt), LLM(ckpt, dtype="float32", num_kv_blocks=256, block_size=8))
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_5"])
def test_tensor_parallel_instances_hand_over_exactly(engines, arch):
    """The rows hold the whole model's KV (every key/value head) and linear states (every head, in the one-rank
    layout) whatever the ranks: a prefill engine at two ranks reads its ranks' parts into them straight out of
    each rank's KV file (the same rows as its ranks gathered, and as one rank's up to the order of fp32 sums: so
    they also go to a one-rank decode engine, which every other test here shows), a decode engine at two ranks
    takes each rank's heads into that rank's KV file, in place; a picture prompt greedy and a text prompt
    seeded go on as one engine. (One process holds one tensor-parallel engine at a time: everything is prefilled
    before the decode engine starts, as two instances would have it.)"""
    path, prefill, whole = engines(arch)
    cases = [(PICTURE, CASES["greedy"]), (PROMPTS[1], CASES["seeded"])]
    pre = Prefill(path, tensor_parallel_size=2)
    try:
        runner = pre.core.runner  # every rank's KV file mapped at rank 0, read there off the engine's thread
        assert isinstance(runner.kv_buffers, RankedKV) and runner.reads_kv_off_thread
        handed = [prefilled(pre, prompt, params, f"t{i}") for i, (prompt, params) in enumerate(cases)]
        assert_pool_full(pre)
        slots = torch.arange(3, 70)  # what the prompts left in the cache: read straight out = gathered by the ranks
        assert torch.equal(runner.read_kv_rows(slots, scratch=True), kv_to_rows(runner.read_kv(slots)))
    finally:
        pre.core.shutdown()
    for i, (prompt, params) in enumerate(cases):
        torch.testing.assert_close(handed[i][2], prefilled(prefill, prompt, params, f"one{i}")[2], rtol=0, atol=1e-4)
    decode = Decode(path, tensor_parallel_size=2)
    assert decode.in_place and isinstance(decode.core.runner.kv_buffers, RankedKV)  # each rank's blocks written
    try:
        for i, ((prompt, params), (processed, handoff, rows)) in enumerate(zip(cases, handed)):
            decode.add(f"t{i}", decode.receive(f"t{i}", processed, rows), params, handoff)
            assert run(decode, [f"t{i}"])[f"t{i}"] == _whole(whole, prompt, params), prompt
        assert decode.nothing_held()
    finally:
        decode.core.shutdown()
    one = Decode(path)  # one rank: the rows written in place into its KV cache (and state rows after them)
    for i, ((prompt, params), (processed, handoff, rows)) in enumerate(zip(cases, handed)):
        one.add(f"t{i}", one.receive(f"t{i}", processed, rows), params, handoff)
        assert run(one, [f"t{i}"])[f"t{i}"] == _whole(whole, prompt, params), prompt
    assert one.nothing_held()


def test_prefill_holds_never_leak(prefill, path):
    """A held id cannot be reused; an abort releases a hold; a hold nobody takes expires; a second export finds
    nothing; a prefill engine refuses n > 1 and handed-over KV."""
    core = prefill.core
    connector = core.connector
    processed = prefill.input_processor.process(PROMPTS[0])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True).for_prefill()

    def run_until_held(rid):
        core.add_request(rid, processed, params)
        while core.has_unfinished:
            core.step()
        assert connector.owns(rid)

    connector.after_step = lambda outputs: None  # keep the holds: nobody exports them in this test
    try:
        run_until_held("a")
        with pytest.raises(InvalidInputError, match="already in use"):
            core.add_request("a", processed, params)
        core.abort_requests(["a"])
        assert not connector.held
        run_until_held("b")
        connector.ttl = -1
        connector.start_step()
        assert not connector.held
        connector.ttl = 120.0
        run_until_held("c")
        exported = connector.export("c")
        assert exported.rows.shape[0] == len(processed.prompt_token_ids)
        with pytest.raises(InvalidInputError, match="nothing held"):
            connector.export("c")
    finally:
        del connector.after_step
    with pytest.raises(InvalidInputError, match="samples once"):
        core.add_request("n2", processed, SamplingParams(n=2, max_tokens=1))
    with pytest.raises(InvalidInputError, match="takes no handed-over KV"):
        core.add_request("kv", processed, params, kv_transfer=Handoff(EngineCoreOutput("kv", [1])))
    assert_pool_full(prefill)


def test_a_handoff_that_cannot_go_on_is_refused_with_nothing_kept(path, prefill):
    decode = Decode(path)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], params, "c")
    arrived = decode.receive("c", processed, rows)
    with pytest.raises(InvalidInputError, match="random state"):
        decode.add("c", arrived, params, Handoff(handoff.first, handoff.generator_state[:7]))
    assert not decode.core.connector.owns("c") and not decode.core.has_unfinished
    decode.add("c", arrived, msgspec.structs.replace(params, max_tokens=1), handoff)  # ends at its first token
    assert [o.finish_reason for o in decode.step()] == ["length"]
    assert not decode.core.connector.owns("c") and decode.nothing_held()


def test_a_failed_kv_write_fails_that_request_and_leaves_nothing(path, prefill, monkeypatch):
    decode = Decode(path, in_place=False)  # (in place nothing is written at admission)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[1], params, "w")

    def broken(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(decode.core.runner, "write_kv", broken)
    decode.add("w", decode.receive("w", processed, rows), params, handoff)
    outs = []
    while decode.core.has_unfinished:
        outs += decode.step()
    assert [o.new_token_ids for o in outs] == [handoff.first.new_token_ids]  # its first token, nothing after
    (rid, why, status), = decode.core.take_failed()
    assert (rid, status) == ("w", 500) and "could not be written" in why
    assert "w" not in decode.core.scheduler.requests and not decode.core.connector.owns("w")
    assert decode.nothing_held()


def test_a_failed_kv_export_fails_that_request_and_the_engine_goes_on(path, prefill, monkeypatch):
    """Before: one export that failed (out of memory copying a long prompt's KV) escaped `EngineCore.step` and
    ended the prefill engine. Now that request fails (500) with its blocks freed; the others are exported."""
    core, connector = prefill.core, prefill.core.connector
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True).for_prefill()
    real, calls = connector.runner.read_kv_rows, []

    def read_kv_rows(slots):
        calls.append(len(slots))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory copying the KV")
        return real(slots)

    monkeypatch.setattr(connector.runner, "read_kv_rows", read_kv_rows)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"x{i}", prefill.input_processor.process(prompt), params)
    exported, failed = [], []
    while core.has_unfinished:
        core.step()
        exported += core.connector.take_exported()
        failed += core.take_failed()
    assert len(calls) == 3
    ((rid, why, status),) = failed
    assert status == 500 and "could not be exported" in why and "OutOfMemoryError" in why
    assert sorted(e.request_id for e in exported) == sorted({"x0", "x1", "x2"} - {rid})
    assert not connector.held
    monkeypatch.undo()
    processed, _, rows = prefilled(prefill, PROMPTS[0], params, "after")  # it goes on
    assert rows.shape[0] == len(processed.prompt_token_ids)
    assert_pool_full(prefill)


def test_reserved_kv_blocks_are_their_transfers_until_a_request_takes_them(path, prefill, whole):
    """In place: the front end reserves KV blocks per transfer (a holder); what no request took goes back with
    the holder's release; a request arriving with blocks not reserved, of two holders, or claimed by another
    request already is refused; the one that takes them decodes exactly and frees them when it ends."""
    decode = Decode(path, num_kv_blocks=32, max_num_seqs=4)
    connector = decode.core.connector
    assert "the KV cache has 32" in connector.reserve(ReserveKV("big", 1, 33 * 8)).error  # never fits
    run_a = connector.reserve(ReserveKV("a", 2, 30 * 8)).block_ids
    assert len(run_a) == 30 and connector.num_reserved_blocks == 30
    assert connector.reserve(ReserveKV("b", 3, 3 * 8)).block_ids is None  # not now: ask again later
    connector.release(ReleaseKV("a", run_a[20:]))
    assert connector.num_reserved_blocks == 20
    connector.release(ReleaseKV("a"))
    connector.release(ReleaseKV("a"))  # twice, or a holder never seen: nothing happens
    assert decode.nothing_held()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], params, "x")
    arrived = decode.receive("x", processed, rows)
    other = connector.reserve(ReserveKV("other", 4, 8)).block_ids
    for blocks in ([b for b in range(32) if b not in arrived.block_rows + other][:len(arrived.block_rows)],
                   arrived.block_rows[:-1] + other, arrived.block_rows[:1]):
        with pytest.raises(InvalidInputError, match="not reserved for it|do not hold"):
            decode.add("y", dataclasses.replace(arrived, block_rows=blocks), params, handoff)
    decode.add("x", arrived, params, handoff)
    with pytest.raises(InvalidInputError, match="not reserved for it"):  # x claimed them
        decode.add("x2", arrived, params, handoff)
    assert run(decode, ["x"])["x"] == _whole(whole, PROMPTS[0], params)
    connector.release(ReleaseKV("other"))
    assert decode.nothing_held()


def test_an_automatic_kv_cache_in_shared_memory_fits_the_room_there(path, monkeypatch):
    """A decode engine's KV cache goes into /dev/shm: sized automatically, it takes at most 90 % of the free space
    there (a container's /dev/shm is often far smaller than its memory); a size the user set is kept (too big, it
    is refused at start: test_transfer_buffers); no room at all is a clear error."""
    import os
    from types import SimpleNamespace

    from vlserve.core.errors import ConfigurationError
    from vlserve.engine.config import fit_kv_in_shared_memory

    auto = dataclasses.replace(_cfg(path, kv_cache_memory_gb=None), kv_cache_file=True)
    per_block = auto.kv_bytes_per_token * auto.block_size
    room = [per_block * 50]
    monkeypatch.setattr(os, "statvfs", lambda folder: SimpleNamespace(f_bavail=room[0], f_frsize=1))
    assert auto.num_kv_blocks > 44
    assert fit_kv_in_shared_memory(auto).num_kv_blocks == 44  # 90 % of 50 blocks, less the scratch block
    fixed = dataclasses.replace(_cfg(path, num_kv_blocks=200), kv_cache_file=True)
    assert fit_kv_in_shared_memory(fixed).num_kv_blocks == 200
    # At two ranks each rank's file holds half the heads (`kv_bytes_per_token` is one rank's), and the room is the
    # two files': as many blocks as one rank's whole cache, not twice as many (which would not fit).
    two = dataclasses.replace(auto, tensor_parallel_size=2)
    assert two.kv_bytes_per_token * 2 == per_block // auto.block_size
    assert fit_kv_in_shared_memory(two).num_kv_blocks == 44
    room[0] = per_block
    with pytest.raises(ConfigurationError, match="--shm-size"):
        fit_kv_in_shared_memory(auto)


def test_a_request_waiting_for_blocks_never_holds_back_one_that_holds_its_own(path, prefill, whole):
    """In place, a handed-over request holds its KV blocks while it waits. Ahead of it in the queue, a request that
    needs new blocks (computed here) and cannot get them while that one holds its blocks: the holder goes first,
    ends, and frees what the other needs (before, the queue's head waited for ever). Reservations leave that
    head its room meanwhile."""
    decode = Decode(path, num_kv_blocks=12, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    processed, handoff, rows = prefilled(prefill, PROMPTS[0], params, "x")
    reserved = decode.core.connector.reserve(ReserveKV("x", 0, 16)).block_ids  # two blocks: 10 free
    decode.core.runner.kv_buffers.write_rows(reserved, torch.arange(rows.shape[0]), rows)
    decode.blocks["x"] = reserved
    local = {"prompt_token_ids": list(range(5, 93))}  # 88 tokens: 11 blocks
    decode.core.add_request("local", prefill.input_processor.process(local), params)
    items = [MultiModalItem(it.offset, it.num_tokens, None, it.layout, it.mm_hash) for it in processed.mm_items]
    decode.add("x", ProcessedPrompt(processed.prompt_token_ids, items, processed.positions, processed.position_delta,
                                    block_rows=reserved, kv_in_blocks=True), params, handoff)
    assert decode.core.connector.reserve(ReserveKV("y", 1, 8)).block_ids is None  # the head's room is kept
    got = run(decode, ["local", "x"])
    assert got["x"] == _whole(whole, PROMPTS[0], params)
    assert got["local"] == _whole(whole, local, params)
    assert decode.nothing_held()


def test_reserved_blocks_claimed_by_a_queued_request_stay_with_it():
    """A holder's release gives back only what no queued request claimed: a release that comes early (a confused
    front end) cannot free blocks a request is about to take; a claim gone (the request left) frees with the
    holder again."""
    from vlserve.engine.block_pool import BlockPool
    from vlserve.engine.kv_connector.reserved_blocks import ReservedBlocks

    pool = BlockPool(8)
    reserved = ReservedBlocks(pool, block_size=4)
    run_a = reserved.reserve("a", 3)
    reserved.claim("r1", run_a[:2], rows=7)
    reserved.release("a")
    assert reserved.num_blocks == 2 and pool.num_free == 6  # the unclaimed third block went back
    assert reserved.take("r1") == run_a[:2] and reserved.num_blocks == 0
    pool.free(run_a[:2])  # (what the request's end does)
    run_b = reserved.reserve("b", 2)
    reserved.claim("r2", run_b, rows=8)
    with pytest.raises(InvalidInputError, match="not reserved for it"):
        reserved.claim("r3", run_b, rows=8)  # claimed already
    reserved.unclaim("r2")
    reserved.release("b")
    assert reserved.num_blocks == 0 and pool.num_free == 8
    pool.check_integrity()


def test_kv_read_straight_into_rows_equals_the_gathered_kv(prefill):
    """A one-rank CPU engine reads KV into handoff rows with a slice copy per run of slots and layer: the same
    rows as gathering the KV and laying it out (`kv_to_rows(read_kv)`), over runs that break mid-way."""
    runner = prefill.core.runner
    for cache in runner.kv_caches:  # what a few requests left there
        cache.copy_(torch.randn(cache.shape))
    slots = torch.tensor([5, 6, 7, 40, 41, 3, 100, 101, 102, 103, 8])
    assert torch.equal(runner.read_kv_rows(slots), kv_to_rows(runner.read_kv(slots)))
    assert runner.read_kv_rows(torch.arange(0)).shape == (0, prefill.core.cfg.model.kv_row_width)
