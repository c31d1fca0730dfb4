"""Qwen2-Audio through the engine: greedy outputs equal transformers' token for token (fp32) alone, batched in any
order, with audio split across prefill steps, after preemption and on prefix / encoder cache hits; bad audio is a
clear error and the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from tests.audio_samples import noise, sine
from tests.conftest import assert_pool_full, first_step_logprobs
from tests.engine_probes import metric_delta, record_chunks
from tests.hf_reference import HFAudioReference
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError

AUD = "<|audio_bos|><|AUDIO|><|audio_eos|>"
RATE = 16000
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PREAMBLE = "You are a careful listener. Listen to the recording below and answer in one short sentence: "

# Every clip gives >= 2 audio tokens: with fewer, transformers falls back to a legacy merge.
CLIP_A = noise(24000, seed=1)  # 1.5 s: 37 tokens
CLIP_B = sine(2.0)  # 50 tokens
CLIP_C = noise(20800, seed=3)  # 1.3 s: 32 tokens
CLIP_C2 = sine(1.3, freqs=(300.0,))  # the same length as CLIP_C, another sound


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "one": (chat(f"{AUD}What is this sound?"), [CLIP_A]),
    "text": (chat("Tell me about whales."), []),
    "two": (chat(f"Audio 1: {AUD}\nAudio 2: {AUD}\nWhich one is louder?"), [CLIP_B, CLIP_C]),
    "code": ("def fibonacci(n):", []),
    "late": (chat(f"{PREAMBLE}{AUD} Thanks."), [CLIP_C]),  # its audio starts after two full blocks of text
}
MIXED = ["one", "text", "two", "code", "late"]


def _req(prompt: str, clips: list):
    return {"prompt": prompt, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} if clips else prompt


def _run(llm: LLM, prompts: list[tuple[str, list]]):
    return llm.generate([_req(p, clips) for p, clips in prompts], GREEDY, use_tqdm=False)


def _check(outs, expected: list[tuple[list[int], list[int]]], names) -> None:
    for out, (prompt_ids, gen), name in zip(outs, expected, names, strict=True):
        assert out.prompt_token_ids == prompt_ids, f"{name}: expanded prompt ids differ"
        assert out.outputs[0].token_ids == gen, f"{name}: generated tokens differ"


def _run_and_check(llm: LLM, ref, names) -> None:
    _check(_run(llm, [PROMPTS[n] for n in names]), [ref.expected[n] for n in names], names)


def _metrics(llm: LLM) -> dict:
    return dict(llm.get_metrics())


class Ref:
    """transformers' reference and its expected (prompt ids, new ids) for every prompt of PROMPTS."""

    def __init__(self, path):
        self.path = path
        self.hf = HFAudioReference(path)
        self.expected = {n: self.greedy(p, clips) for n, (p, clips) in PROMPTS.items()}

    def greedy(self, prompt: str, clips: list):
        return self.hf.greedy(prompt, clips, MAX_NEW)


@pytest.fixture(scope="module")
def ref(tiny_ckpt) -> Ref:
    return Ref(tiny_ckpt("qwen2_audio"))


@pytest.fixture(scope="module")
def llm(ref) -> LLM:
    """One engine shared by the tests that only compare outputs and metric deltas (at most 3 clips a prompt)."""
    return LLM(ref.path, dtype="float32", num_kv_blocks=256, limit_mm_per_prompt={"audio": 3})


def _audio_splits(seen) -> int:
    """How many chunks begin strictly inside an audio item (the item's tokens span several steps)."""
    return sum(1 for items, start, _ in seen for it in items if it.modality == "audio" and it.offset < start < it.end)


# ---- 1, 2: alone and batched ---------------------------------------------------------------------------------------
def test_each_prompt_alone(llm, ref):
    for name in PROMPTS:
        _run_and_check(llm, ref, [name])
    assert_pool_full(llm)


def test_mixed_batches_in_both_orders(llm, ref):
    _run_and_check(llm, ref, MIXED)
    _run_and_check(llm, ref, MIXED[::-1])
    _run_and_check(llm, ref, ["two", "one", "two"])  # the same clips twice in one batch
    assert_pool_full(llm)


def test_clips_of_one_step_share_one_audio_tower_call(ref):
    """Three clips prefilled in one step go through the audio tower together (one call, three outputs)."""
    llm = LLM(ref.path, dtype="float32", num_kv_blocks=256)
    encoders = llm.engine.core.runner.encoders
    calls: list[int] = []
    orig = encoders.model.encode_audio

    def encode_audio(features, lengths):
        calls.append(len(features))
        return orig(features, lengths)

    encoders.model.encode_audio = encode_audio
    _run_and_check(llm, ref, ["one", "two"])
    assert calls == [3], f"audio tower calls (clips per call): {calls}"
    assert_pool_full(llm)


# ---- 3: chunked prefill ------------------------------------------------------------------------------------------
def test_chunked_prefill_splits_audio(ref):
    """A 7-token budget cuts every audio item (>= 32 tokens) across several steps."""
    llm = LLM(ref.path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=7)
    seen = record_chunks(llm)
    _run_and_check(llm, ref, MIXED)
    assert _audio_splits(seen) >= 4 * 4, "each of the four audio items should start at least 4 chunks inside it"
    assert max(end - start for _, start, end in seen) <= 7
    assert_pool_full(llm)


def test_unsplit_audio_when_chunked_mm_input_is_off(ref):
    """disable_chunked_mm_input: a budget the largest item (50 tokens) fits keeps every item in one step."""
    llm = LLM(ref.path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=56, disable_chunked_mm_input=True)
    seen = record_chunks(llm)
    _run_and_check(llm, ref, MIXED)
    assert _audio_splits(seen) == 0
    assert len({start for _, start, _ in seen if start > 0}) > 1, "the budget was meant to chunk the prompts"
    assert_pool_full(llm)


# ---- 4: preemption -----------------------------------------------------------------------------------------------
def test_preemption_recomputes_identically(ref):
    llm = LLM(ref.path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    preempted: list = []
    record_chunks(llm, preempted)
    _run_and_check(llm, ref, MIXED)
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert any(it.modality == "audio" for items in preempted for it in items), "a request with audio was to be " \
        "preempted and recomputed"
    assert_pool_full(llm)


# ---- 5, 6: caches, and the audio matters ---------------------------------------------------------------------------
def test_same_audio_prompt_hits_the_prefix_cache(llm, ref):
    prompt, clips = PROMPTS["late"]
    fresh = noise(20800, seed=31)  # not encoded by an earlier test
    expected = ref.greedy(prompt, [fresh])
    before = _metrics(llm)
    _check(_run(llm, [(prompt, [fresh])]), [expected], ["first"])
    mid = _metrics(llm)
    (second,) = _run(llm, [(prompt, [fresh])])
    d = metric_delta(mid, _metrics(llm))
    _check([second], [expected], ["second"])
    ids, bs = second.prompt_token_ids, llm.config.block_size
    assert d["prefix_cache_hits_total"] >= len(ids) - bs, f"only {d['prefix_cache_hits_total']} of {len(ids)} reused"
    audio_end = len(ids) - ids[::-1].index(llm.config.model.audio_token_id)
    assert d["prefix_cache_hits_total"] >= audio_end, "the clip's blocks should all be cached"
    assert d["encoder_cache_queries_total"] == 0, "nothing of the clip is computed again: no encoder query"
    assert metric_delta(before, mid)["encoder_cache_hits_total"] == 0


def test_other_clip_of_the_same_length_hits_only_the_text_before_it(llm, ref):
    prompt, _ = PROMPTS["late"]
    _run(llm, [(prompt, [CLIP_C])])  # cached (the shared engine may hold it already)
    before = _metrics(llm)
    (out,) = _run(llm, [(prompt, [CLIP_C2])])
    d = metric_delta(before, _metrics(llm))
    expected = ref.greedy(prompt, [CLIP_C2])
    _check([out], [expected], ["other clip"])
    assert out.prompt_token_ids == ref.expected["late"][0], "same length: the same ids, only the sound differs"
    offset, bs = out.prompt_token_ids.index(llm.config.model.audio_token_id), llm.config.block_size
    assert offset >= 2 * bs, "the preamble should fill at least two blocks"
    assert d["prefix_cache_hits_total"] == (offset // bs) * bs, "a block holding the other clip was reused"
    assert d["encoder_cache_hits_total"] == 0 and d["encoder_cache_queries_total"] == 1
    assert expected[1] != ref.expected["late"][1], "another clip should change the output"


def test_the_audio_changes_the_output_and_a_repeat_hits_the_encoder_cache(llm, ref):
    """Guards against vacuous parity; the same clip after other text skips the audio tower."""
    prompt, _ = PROMPTS["one"]
    other = noise(24000, seed=41)  # the length of CLIP_A
    (changed,) = _run(llm, [(prompt, [other])])
    assert first_step_logprobs(llm, _req(prompt, [other])) != first_step_logprobs(llm, _req(*PROMPTS["one"]))
    _check([changed], [ref.greedy(prompt, [other])], ["other clip"])

    again = chat(f"Now a new question about the same recording: {AUD} Is it music?")
    before = _metrics(llm)
    (out,) = _run(llm, [(again, [other])])
    d = metric_delta(before, _metrics(llm))
    assert d["encoder_cache_queries_total"] == 1 and d["encoder_cache_hits_total"] == 1
    _check([out], [ref.greedy(again, [other])], ["same clip, other text"])
    assert_pool_full(llm)


def test_shortest_clips(llm, ref):
    """0.1 s (2 tokens) still equals transformers; 25 ms gives one token (transformers would take its legacy merge
    there, so no reference) and is served."""
    prompt = chat(f"{AUD}?")
    _check(_run(llm, [(prompt, [noise(1600, seed=51)])]), [ref.greedy(prompt, [noise(1600, seed=51)])], ["0.1 s"])
    (out,) = _run(llm, [(prompt, [noise(400, seed=52)])])
    assert out.prompt_token_ids.count(llm.config.model.audio_token_id) == 1
    assert len(out.outputs[0].token_ids) == MAX_NEW
    assert_pool_full(llm)


# ---- 8: bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,clips,match", [
    (AUD, [np.zeros(0, np.float32)], "no samples"),
    (AUD, [noise(100)], "too short"),  # 6 ms: no audio token
    (AUD * 4, [noise(8000, seed=i) for i in range(4)], "at most 3 allowed"),
    (AUD, [CLIP_A, CLIP_C], "placeholder"),
    (AUD, [np.full(8000, np.nan, np.float32)], "NaN"),
])
def test_bad_audio_is_a_clear_error_and_the_engine_keeps_serving(llm, ref, prompt, clips, match):
    with pytest.raises(InvalidInputError, match=match):
        _run(llm, [(prompt, clips)])
    with pytest.raises(InvalidInputError, match=match):  # in a batch with a good prompt
        _run(llm, [PROMPTS["one"], (prompt, clips)])
    assert_pool_full(llm)
    _run_and_check(llm, ref, ["two", "text"])
    assert_pool_full(llm)


def test_audio_to_a_picture_only_model_is_refused(tiny_ckpt):
    vl = LLM(tiny_ckpt("qwen2_5_vl"), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidInputError, match="audio"):
        vl.generate(_req("Listen: <|vision_start|><|image_pad|><|vision_end|>", [CLIP_A]), GREEDY, use_tqdm=False)
    (out,) = vl.generate("Hello, how are you?", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_NEW
    assert_pool_full(vl)


# ---- 7: nothing left behind ----------------------------------------------------------------------------------------
def test_pool_full_and_encoder_cache_unreferenced_at_the_end(llm):
    llm.engine.core.step()  # freed encoder keys reach the runner at the next step
    runner_keys = set(llm.engine.core.runner.encoders.outputs)
    assert runner_keys <= set(llm.engine.core.scheduler.encoder_cache._size), "the runner holds forgotten outputs"
    assert_pool_full(llm)
