"""Bad input is refused up front with InvalidInputError, and nothing is lost or leaked afterwards."""

from __future__ import annotations

import io
import threading

import pytest

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GOOD = ["Hello, how are you?", {"prompt": f"Look {IMG} here", "multi_modal_data": {"image": noise_image(56, 84, 1)}}]


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return str(tiny_ckpt("qwen2_vl"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64,
               limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def expected(llm):
    """Greedy tokens of the good prompts on a clean engine."""
    return _tokens(llm.generate(GOOD, GREEDY, use_tqdm=False))


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _still_serves(llm, expected):
    assert_pool_full(llm)
    assert _tokens(llm.generate(GOOD, GREEDY, use_tqdm=False)) == expected
    assert_pool_full(llm)


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _img_prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


BAD_PROMPTS = {
    "too_long": "word " * 40,  # > 64 tokens
    "too_long_token_ids": {"prompt_token_ids": [5] * 65},
    "plus_max_tokens_too_long": ({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=15)),
    "more_images_than_placeholders": _img_prompt(f"one {IMG}", [noise_image(56, 56, 1), noise_image(56, 56, 2)]),
    "more_placeholders_than_images": _img_prompt(f"{IMG} and {IMG}", [noise_image(56, 56, 1)]),
    "placeholder_without_images": f"just text {IMG}",
    "images_without_placeholder": _img_prompt("no placeholder", [noise_image(56, 56, 1)]),
    "too_many_images": _img_prompt(IMG * 3, [noise_image(56, 56, i) for i in range(3)]),
    "garbage_bytes": _img_prompt(IMG, [b"\x00\x01garbage, not an image" * 10]),
    "truncated_png": _img_prompt(IMG, [_png_bytes(noise_image(64, 64, 5))[:200]]),
    "extreme_aspect_ratio": _img_prompt(IMG, [noise_image(2000, 5, 3)]),
    "missing_image_file": _img_prompt(IMG, ["/nonexistent/dir/picture.png"]),
    "bad_data_url": _img_prompt(IMG, ["data:image/png;base64,!!!notbase64!!!"]),
    "remote_url": _img_prompt(IMG, ["https://example.com/cat.png"]),
    "not_an_image_object": _img_prompt(IMG, [12345]),
    "unknown_mm_kind": {"prompt": "a video", "multi_modal_data": {"video": [b"..."]}},
    "empty_prompt": "",
    "empty_token_ids": {"prompt_token_ids": []},
    "token_ids_out_of_vocab": {"prompt_token_ids": [5, 10**6]},
    "negative_token_id": {"prompt_token_ids": [5, -1]},
    "non_int_token_id": {"prompt_token_ids": [5, "7"]},
    "prompt_dict_without_text": {"text": "hello"},
    "prompt_not_str_or_dict": [42],
    "bad_mm_processor_kwargs": (GOOD[1], None, {"max_pixels": -5}),
    "unknown_mm_processor_kwargs": (GOOD[1], None, {"resize_mode": "crop"}),
}


def _unpack(case):
    prompt, params, kwargs = case, None, None
    if isinstance(case, tuple):
        prompt, params, *rest = case
        kwargs = rest[0] if rest else None
    return prompt, params or GREEDY, kwargs


@pytest.mark.parametrize("name", sorted(BAD_PROMPTS))
def test_bad_prompt_refused_and_engine_intact(llm, expected, name):
    prompt, params, kwargs = _unpack(BAD_PROMPTS[name])
    with pytest.raises(InvalidInputError) as e:
        llm.generate(prompt, params, use_tqdm=False, mm_processor_kwargs=kwargs)
    assert str(e.value)
    assert_pool_full(llm)


def test_still_serves_after_all_those_errors(llm, expected):
    _still_serves(llm, expected)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_one_bad_prompt_in_a_batch(llm, expected, position):
    """Whatever its place in the batch, one bad prompt fails the call and the good ones leave no trace."""
    batch = list(GOOD)
    batch.insert(position, BAD_PROMPTS["extreme_aspect_ratio"])
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    _still_serves(llm, expected)


def test_bad_prompt_among_n_samples(llm, expected):
    batch = [GOOD[0], GOOD[1], "word " * 40]
    with pytest.raises(InvalidInputError, match="context length"):
        llm.generate(batch, SamplingParams(n=3, temperature=1.0, max_tokens=4), use_tqdm=False)
    _still_serves(llm, expected)


def test_messages(llm):
    with pytest.raises(InvalidInputError, match="maximum context length"):
        llm.generate("word " * 40, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=15), use_tqdm=False)
    # the limit itself is allowed: prompt + max_tokens == max_model_len
    out = llm.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=14, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 14
    with pytest.raises(InvalidInputError, match="placeholder"):
        llm.generate(BAD_PROMPTS["more_images_than_placeholders"], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="limit_mm_per_prompt"):
        llm.generate(BAD_PROMPTS["too_many_images"], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="not found"):
        llm.generate(BAD_PROMPTS["missing_image_file"], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="video"):
        llm.generate(BAD_PROMPTS["unknown_mm_kind"], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="vocabulary"):
        llm.generate(BAD_PROMPTS["token_ids_out_of_vocab"], GREEDY, use_tqdm=False)
    assert_pool_full(llm)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                    dict(top_k=-2), dict(n=0), dict(min_tokens=5, max_tokens=2),
                                    dict(logprobs=100), dict(presence_penalty=5), dict(stop=[""]),
                                    dict(temperature=float("nan"))])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kwargs)


def test_sampling_params_of_wrong_type_or_count(llm, expected):
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        llm.generate(GOOD[0], {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(InvalidInputError):
        llm.generate(GOOD, {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        llm.generate(GOOD, [GREEDY, {"temperature": 0.0}], use_tqdm=False)
    with pytest.raises(InvalidInputError, match="sampling params"):
        llm.generate(GOOD, [GREEDY], use_tqdm=False)
    _still_serves(llm, expected)


def test_request_larger_than_kv_pool(path):
    small = LLM(path, dtype="float32", num_kv_blocks=8, block_size=4)  # 32 tokens in all
    with pytest.raises(InvalidInputError, match="KV cache"):
        small.generate("Hello, how are you?", SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert_pool_full(small)
    # what fits still runs, also several requests that only fit one after another
    outs = small.generate(["Hello"] * 3, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert_pool_full(small)


def _run_with_timeout(fn, seconds=15):
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below in the test thread
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "generate() hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_unbounded_request_larger_than_kv_pool_does_not_hang(path):
    """max_tokens=None means 'up to max_model_len': if that can never fit the pool, refuse it up front."""
    small = LLM(path, dtype="float32", num_kv_blocks=8, block_size=4)
    with pytest.raises(InvalidInputError, match="KV cache"):
        _run_with_timeout(lambda: small.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True),
                                                 use_tqdm=False))
    assert_pool_full(small)
    # with max_model_len inside the pool an unbounded request runs to the length limit
    fits = LLM(path, dtype="float32", num_kv_blocks=8, block_size=4, max_model_len=32)
    out = _run_with_timeout(lambda: fits.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True),
                                                  use_tqdm=False))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert_pool_full(fits)


def test_image_larger_than_encoder_budget_is_refused(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_encoder_input_tokens=16)
    big = _img_prompt(f"{IMG} describe", [noise_image(224, 224, 4)])  # 8x8 merged = 64 embedding tokens
    with pytest.raises(InvalidInputError, match="max_num_encoder_input_tokens"):
        _run_with_timeout(lambda: llm.generate(big, GREEDY, use_tqdm=False))
    assert_pool_full(llm)
    small = _img_prompt(f"{IMG} describe", [noise_image(56, 56, 4)])  # 2x2 merged = 4 tokens
    out = _run_with_timeout(lambda: llm.generate(small, GREEDY, use_tqdm=False))[0]
    assert len(out.outputs[0].token_ids) == 6
    assert_pool_full(llm)


def test_unsplittable_image_larger_than_token_budget_is_refused(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, disable_chunked_mm_input=True)
    big = _img_prompt(f"{IMG}", [noise_image(224, 224, 4)])  # 64 tokens, cannot be split over 32-token steps
    with pytest.raises(InvalidInputError, match="max_num_batched_tokens"):
        _run_with_timeout(lambda: llm.generate(big, GREEDY, use_tqdm=False))
    assert_pool_full(llm)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="not_a_real_arg"):
        LLM("whatever", not_a_real_arg=1)


@pytest.mark.parametrize("kwargs", [dict(max_model_len=0), dict(num_kv_blocks=-1), dict(block_size=0),
                                    dict(max_num_seqs=0), dict(num_kv_blocks=1)])
def test_bad_engine_arguments(path, kwargs):
    with pytest.raises(InvalidInputError):
        LLM(path, **kwargs)
