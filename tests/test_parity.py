"""Greedy outputs must equal transformers' generate token for token (fp32), however requests are batched."""

from __future__ import annotations

import pytest

from tests.conftest import ARCHES, IMG, assert_pool_full, noise_image
from tests.hf_reference import prompt_references
from vlserve import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts():
    """Mixed workload: text of several lengths, one picture, several pictures of different sizes and modes."""
    long_text = "Explain the difference between a list and a tuple in Python, with examples. " * 4
    return [
        ("Hello, how are you?", []),
        (f"Describe this picture: {IMG}", [noise_image(120, 90, 1)]),
        (f"{IMG} and {IMG} and {IMG}: what differs?",
         [noise_image(64, 200, 2, "RGBA"), noise_image(150, 150, 3, "L"), noise_image(90, 60, 4, "P")]),
        (long_text, []),
        (f"First {IMG} then text", [noise_image(224, 224, 5)]),
        ("def fibonacci(n):", []),
        (f"{IMG}", [noise_image(300, 100, 6)]),
        (f"Compare {IMG} with the same picture {IMG}", [noise_image(120, 90, 1), noise_image(120, 90, 1)]),
        ("A" * 3, []),
    ]


@pytest.fixture(scope="module", params=ARCHES)
def setup(request, tiny_ckpt):
    path, _, expected = prompt_references(tiny_ckpt, _prompts(), MAX_NEW)(request.param)
    return path, expected


def _run(llm: LLM, prompts, params: SamplingParams = GREEDY):
    reqs = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts]
    return llm.generate(reqs, params, use_tqdm=False)


def _check(outs, expected, indices):
    for out, i in zip(outs, indices):
        prompt_ids, gen = expected[i]
        assert out.prompt_token_ids == prompt_ids, f"prompt {i}: expanded prompt ids differ"
        assert out.outputs[0].token_ids == gen, f"prompt {i}: generated tokens differ"


def test_each_prompt_alone(setup):
    path, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    for i, prompt in enumerate(_prompts()):
        _check(_run(llm, [prompt]), expected, [i])
    assert_pool_full(llm)


def test_all_prompts_batched_together(setup):
    path, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    # a different order and a different batch mix must not change anything
    order = [8, 2, 5, 0, 7, 1, 3, 6, 4]
    _check(_run(llm, [_prompts()[i] for i in order]), expected, order)
    assert_pool_full(llm)


def test_chunked_prefill_splits_images(setup):
    """A 7-token budget cuts every picture's placeholder run across several steps."""
    path, expected = setup
    llm = LLM(path, dtype="float32", max_num_batched_tokens=7)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert_pool_full(llm)


def test_preemption_recomputes_identically(setup):
    path, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert_pool_full(llm)


def test_picture_changes_the_output(setup, tiny_ckpt):
    """Guard against a vacuous parity test: with this init a different picture gives different tokens."""
    path, _ = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    a, b = _run(llm, [(f"Look: {IMG}", [noise_image(120, 90, 11)]), (f"Look: {IMG}", [noise_image(120, 90, 12)])])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
