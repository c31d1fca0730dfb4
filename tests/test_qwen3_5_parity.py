"""Qwen3.5 and Qwen3.5-MoE (hybrid: Gated DeltaNet linear attention + full attention): greedy output equal to
transformers' `generate` token for token (fp32) for text, pictures, a video, mixed batches in two orders, chunked
prefill that splits pictures, preemption, and prefix hits resumed from linear-attention state snapshots (equal to
the answer without prefix caching); structured outputs and int8 run."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.hf_reference import prompt_references
from tests.test_parity import _check, _prompts
from tests.test_parity import _run as run_prompts
from tests.test_qwen3_vl import hf_video_greedy, laid_out_ids, video_timestamps
from tests.test_video import VID, clip_frames, encode_video
from vlserve import LLM, SamplingParams, StructuredOutputsParams
from vlserve.tools.tiny_arches import TINY_ARCHES

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
# The prefix-hit tests ask one request at a time (each waits for the snapshots of the one before): 6 new tokens
# each, enough for a resumed state that is wrong to show (test_a_resumed_request_needs_the_copied_state).
SNAP_NEW = 6
SNAP_GREEDY = SamplingParams(temperature=0.0, max_tokens=SNAP_NEW, min_tokens=SNAP_NEW)
ARCHES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """arch -> (path, transformers reference, expected outputs of `_prompts()`)."""
    made = prompt_references(tiny_ckpt, _prompts(), MAX_NEW)

    def get(arch):
        if arch not in TINY_ARCHES:
            pytest.skip(f"make-tiny-model has no {arch} yet")
        return made(arch)

    return get


@pytest.fixture(scope="module", params=ARCHES)
def setup(request, references):
    return references(request.param)


def _run(llm: LLM, prompts, params=GREEDY):
    return run_prompts(llm, prompts, params)


def assert_states_free(llm: LLM) -> None:
    """Every KV block and running state slot is back; no snapshot slot is held."""
    assert_pool_full(llm)
    state = llm.engine.core.scheduler.state
    state.check_integrity()
    assert not state.slot_of and state.snapshots.num_free == state.snapshots.num_blocks


def test_mixed_requests_batched_together(setup):
    """Text, one picture, several pictures: nine requests in one batch, then in another order."""
    path, _, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    assert llm.engine.core.scheduler.state is not None
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    order = [8, 2, 5, 0, 7, 1, 3, 6, 4]
    _check(_run(llm, [_prompts()[i] for i in order]), expected, order)
    assert_states_free(llm)


def test_chunked_prefill_splits_pictures(setup):
    """A 7-token budget cuts every picture (and every prompt) across steps: the states carry over."""
    path, _, expected = setup
    llm = LLM(path, dtype="float32", max_num_batched_tokens=7, num_kv_blocks=256)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert_states_free(llm)


def test_preemption_recomputes_identically(setup):
    path, _, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert_states_free(llm)


def test_video_matches_transformers(references):
    path, hf, _ = references("qwen3_5")
    from vlserve.media.video import load_video
    from vlserve.model.families.qwen.video_rules import preprocess_video

    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=5)
    mp4 = encode_video(clip_frames(12, seed=1), fps=4)
    proc = llm.engine.input_processor.processor
    p = preprocess_video(load_video(mp4, proc.video_opts), proc.image_cfg, proc.video_opts,
                         proc.image_cfg.min_pixels, proc.image_cfg.max_pixels)
    prompt = f"<|im_start|>user\nWhat happens in {VID}?<|im_end|>\n<|im_start|>assistant\n"
    ids = laid_out_ids(hf, prompt, video_timestamps(path, [(12, 4.0)]), [p.layout])
    expected = hf_video_greedy(hf, ids, p.pixel_values, [p.layout])
    for engine in (llm, chunked):
        out = engine.generate({"prompt": prompt, "multi_modal_data": {"video": [mp4]}}, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == expected
        assert_states_free(engine)


# ---- prefix caching with state snapshots -----------------------------------------------------------------------
def _chat(question: str, picture: bool = True) -> str:
    return f"<|im_start|>user\n{IMG if picture else ''}{question}<|im_end|>\n<|im_start|>assistant\n"


def _request(prompt: str, image):
    return {"prompt": prompt, "multi_modal_data": {"image": [image]}} if image is not None else prompt


def _generate(llm: LLM, prompt: str, image) -> tuple[list[int], list[int]]:
    out = llm.generate(_request(prompt, image), SNAP_GREEDY, use_tqdm=False)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


@pytest.mark.parametrize("arch", ARCHES)
def test_prefix_hits_resume_from_state_snapshots(references, arch):
    """The same picture with another question, the same prompt again, and a follow-up turn: each resumes from a
    snapshot (the counters say so) and answers exactly as with prefix caching off and as transformers; a small step
    budget puts the snapshots inside chunks."""
    path, hf, _ = references(arch)
    image = noise_image(224, 160, 21)  # 7 x 5 merged tokens: the picture ends inside a block
    first = _chat("What is in it?")
    follow_up = first + "Noise.<|im_end|>\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    text = "A plain text prompt, long enough to fill a few KV blocks of sixteen tokens each, twice over. " * 2
    asks = [(first, image), (_chat("Why is it so grey?"), image), (first, image), (follow_up, image), (text, None),
            (text, None)]
    expected = [hf.greedy(p, [img] if img is not None else [], SNAP_NEW) for p, img in asks]
    assert expected[3][0][:len(expected[0][0])] == expected[0][0], "the follow-up must extend the first prompt"
    off = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    outs = off.generate([_request(p, img) for p, img in asks], SNAP_GREEDY, use_tqdm=False)  # nothing to share
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == expected
    assert off.get_metrics()["state_snapshot_queries_total"] == 0 and off.config.num_state_snapshots == 0
    for budget in (2048, 9):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16, max_num_batched_tokens=budget)
        for i, (p, img) in enumerate(asks):
            before = llm.get_metrics()
            assert _generate(llm, p, img) == expected[i], f"ask {i} (budget {budget})"
            after = llm.get_metrics()
            hit = after["state_snapshot_hits_total"] - before["state_snapshot_hits_total"]
            assert after["state_snapshot_queries_total"] - before["state_snapshot_queries_total"] == 1
            assert hit == (i in (1, 2, 3, 5)), f"ask {i}: snapshot hit {hit}"
            if hit:
                assert after["prefix_cache_hits_total"] > before["prefix_cache_hits_total"]
        assert_states_free(llm)
        assert llm.engine.core.reset_prefix_cache()
        assert llm.engine.core.scheduler.state.num_snapshots == 0
        assert _generate(llm, *asks[2]) == expected[2]
        assert llm.get_metrics()["state_snapshot_hits_total"] == after["state_snapshot_hits_total"]


def test_a_resumed_request_needs_the_copied_state(references, monkeypatch):
    """Guard against vacuous parity: a prefix hit that skips the snapshot copy (zero state, not fresh) answers
    differently within the SNAP_NEW tokens the prefix-hit tests compare."""
    from vlserve.engine.model_shard import ModelShard

    path, _, _ = references("qwen3_5")
    image = noise_image(224, 160, 21)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    right = [_generate(llm, _chat(q), image) for q in ("A?", "Why B?")]
    forward = ModelShard.forward

    def without_copies(self, batch):
        if batch.state_copies:
            for _, dst in batch.state_copies:
                for st in self.kv_caches:
                    if not isinstance(st, torch.Tensor):
                        st.conv[dst].zero_()
                        st.recurrent[dst].zero_()
            batch.state_copies = []
        return forward(self, batch)

    monkeypatch.setattr(ModelShard, "forward", without_copies)
    wrong = _generate(llm, _chat("Why B?"), image)
    assert llm.get_metrics()["state_snapshot_hits_total"] == 2
    assert wrong[0] == right[1][0] and wrong[1] != right[1][1]


def test_no_snapshots_means_no_hits(references):
    path, hf, _ = references("qwen3_5")
    image = noise_image(224, 160, 21)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, max_state_snapshots=0)
    for q in ("What is in it?", "Why is it so grey?"):  # test_prefix_hits_resume_from_state_snapshots' first two
        assert _generate(llm, _chat(q), image) == hf.greedy(_chat(q), [image], SNAP_NEW)
    m = llm.get_metrics()
    assert m["state_snapshot_hits_total"] == 0 and m["prefix_cache_hits_total"] == 0
    assert_states_free(llm)


def test_preemption_then_resume_from_snapshot(references):
    """Preempted requests come back from their own snapshots (or token 0): the same tokens."""
    path, hf, _ = references("qwen3_5")
    image = noise_image(224, 160, 21)
    prompts = [(_chat(f"Question number {k}?"), [image]) for k in range(6)]
    expected = [hf.greedy(p, imgs, SNAP_NEW) for p, imgs in prompts]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    _check(_run(llm, prompts, SNAP_GREEDY), expected, range(len(prompts)))
    m = llm.get_metrics()
    assert m["num_preemptions_total"] > 0 and m["state_snapshot_hits_total"] > 0
    assert_states_free(llm)


# ---- other engine paths ----------------------------------------------------------------------------------------
def test_structured_output_runs(references):
    path, _, _ = references("qwen3_5")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    with_picture = {"prompt": _chat("And here?"), "multi_modal_data": {"image": [noise_image(64, 64, 3)]}}
    outs = llm.generate([_chat("JSON please", picture=False), with_picture], params, use_tqdm=False)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text)["a"], int)
        assert out.outputs[0].token_ids
    assert_states_free(llm)


def test_int8_runs(references):
    path, _, _ = references("qwen3_5_moe" if "qwen3_5_moe" in TINY_ARCHES else "qwen3_5")
    llm = LLM(str(path), dtype="float32", quantization="int8", num_kv_blocks=128)
    outs = _run(llm, _prompts()[:3])
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert_states_free(llm)

