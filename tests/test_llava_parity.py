"""LLaVA-OneVision and LLaVA-NeXT-Video through the engine: greedy outputs (fp32, EOS ignored) equal transformers'
`generate` token for token (each token's log-probability within 1e-4), and the expanded prompt ids equal its
processor's: one picture of each shape (other anyres grids), several pictures, a video, a picture with a video,
text alone; batched in two orders, with pictures split across prefill steps, after preemption, on prefix-cache hits
(one ending inside a picture; and with the cache off), at two tensor-parallel ranks (both mm_encoder_tp_mode
values), and through `LLM.chat` with a data URL against transformers' chat template and processor.

transformers' side (tests/hf_reference.py `HFLlavaReference`): its own processor over the checkpoint's files with
the PIL image processor; its video processors need torchvision (not installed), so video frames are vlserve's
pixel values (equal to transformers' torchvision pipeline: tests/test_llava_processor.py) while the processor's own
`replace_video_token` counts the video's tokens."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from transformers.image_processing_utils import select_best_resolution

from tests.conftest import assert_pool_full, noise_image
from tests.engine_probes import metric_delta, record_chunks
from tests.hf_reference import HFLlavaReference
from vlserve import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-4
FAMILIES = ("llava_onevision", "llava_next_video")
# a chat turn as each family's template lays it out (vlserve/model/families/llava/tiny.py)
TURN = {"llava_onevision": "<|im_start|>user {}<|im_end|>\n<|im_start|>assistant\n",
        "llava_next_video": "USER: {} ASSISTANT:"}


def frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


# name -> (text inside the turn, or None for a raw prompt; pictures; videos). (height, width) of the single
# pictures: tall, wide, square, small, big (OneVision: 4 x 4 tiles, then its anyres_max_9 downscale)
SINGLE = {"tall": (200, 60), "wide": (60, 200), "square": (100, 100), "small": (20, 30), "big": (300, 280)}
PROMPTS = {
    **{name: ("<image>\nWhat is in the picture?", [noise_image(w, h, seed=i)], [])
       for i, (name, (h, w)) in enumerate(SINGLE.items())},
    "two": ("Picture 1: <image>\nPicture 2: <image>\nWhich one is brighter?",
            [noise_image(130, 90, seed=11), noise_image(160, 40, seed=12)], []),
    "video": ("<video>\nWhat happens in this video?", [], [frames(6, 60, 80, seed=13)]),
    "both": ("<image><video>\nDoes the video show the picture?", [noise_image(70, 50, seed=14)],
             [frames(4, 48, 64, seed=15)]),
    "text": ("Tell me about whales.", [], []),
    "code": (None, [], []),  # "def fibonacci(n):" without a chat turn
}
PREAMBLE = "You are a careful viewer. Look at the picture below and answer in one short sentence: "
MIXED = ["tall", "text", "two", "video", "wide", "code", "both", "square", "small", "big"]


class Family:
    """One checkpoint: transformers' reference and its (prompt ids, new ids) for every prompt of PROMPTS."""

    def __init__(self, name: str, path):
        self.name, self.path = name, path
        self.hf = HFLlavaReference(path)
        self.expected = {n: self.greedy(*self.parts(n)) for n in PROMPTS}

    def text(self, body: str | None) -> str:
        return "def fibonacci(n):" if body is None else TURN[self.name].format(body)

    def parts(self, name: str) -> tuple[str, list, list]:
        body, images, videos = PROMPTS[name]
        return self.text(body), images, videos

    def greedy(self, text: str, images=(), videos=()) -> tuple[list[int], list[int], list[float]]:
        return self.hf.greedy(text, MAX_NEW, images, videos)


@pytest.fixture(scope="module", params=FAMILIES, ids=["onevision", "next_video"])
def fam(request, tiny_ckpt) -> Family:
    return Family(request.param, tiny_ckpt(request.param))


@pytest.fixture(scope="module")
def llm(fam) -> LLM:
    """One engine per family for the tests that compare outputs and metric deltas."""
    return LLM(str(fam.path), dtype="float32", num_kv_blocks=256)


def _req(text: str, images: list, videos: list):
    media = {k: v for k, v in (("image", images), ("video", videos)) if v}
    return {"prompt": text, "multi_modal_data": media} if media else text


def _run(llm: LLM, prompts: list[tuple[str, list, list]]):
    return llm.generate([_req(*p) for p in prompts], GREEDY, use_tqdm=False)


def _check(outs, expected, names) -> None:
    """Prompt ids and new tokens equal transformers'; each token's log-probability too, within fp32 noise (the
    tokens of a tiny random model can hide a small error: the log-probabilities do not)."""
    for out, (prompt_ids, gen, logprobs), name in zip(outs, expected, names, strict=True):
        assert out.prompt_token_ids == prompt_ids, f"{name}: expanded prompt ids differ"
        assert out.outputs[0].token_ids == gen, f"{name}: generated tokens differ"
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, gen, strict=True)]
        np.testing.assert_allclose(ours, logprobs, rtol=0, atol=LOGPROB_ATOL, err_msg=f"{name}: log-probabilities")


def _run_and_check(llm: LLM, fam: Family, names) -> None:
    _check(_run(llm, [fam.parts(n) for n in names]), [fam.expected[n] for n in names], names)


def _splits(seen, modality: str) -> int:
    """How many chunks begin strictly inside an item of `modality` (its tokens span several steps)."""
    return sum(1 for items, start, _ in seen for it in items if it.modality == modality and it.offset < start < it.end)


# ---- alone, batched -----------------------------------------------------------------------------------------
def test_each_prompt_alone(fam, llm):
    for name in PROMPTS:
        _run_and_check(llm, fam, [name])
    pinpoints = fam.hf.processor.image_processor.image_grid_pinpoints
    grids = {tuple(select_best_resolution(size, pinpoints)) for size in SINGLE.values()}
    assert len(grids) >= 4, f"the single pictures were meant to take different anyres grids: {grids}"
    assert_pool_full(llm)


def test_the_media_change_the_output(fam, llm):
    """Guards against vacuous parity: another picture or video of the same size changes the answer."""
    for name, media in (("tall", lambda: ([noise_image(60, 200, seed=21)], [])),
                        ("video", lambda: ([], [frames(6, 60, 80, seed=22)]))):
        text = fam.parts(name)[0]
        images, videos = media()
        expected = fam.greedy(text, images, videos)
        assert expected[1] != fam.expected[name][1], f"{name}: other media, same answer"
        _check(_run(llm, [(text, images, videos)]), [expected], [name])


def test_mixed_batches_in_both_orders(fam, llm):
    _run_and_check(llm, fam, MIXED)
    _run_and_check(llm, fam, MIXED[::-1])
    _run_and_check(llm, fam, ["two", "video", "two", "video"])  # the same media twice in one batch
    assert_pool_full(llm)


# ---- chunked prefill, preemption ------------------------------------------------------------------------------
def test_chunked_prefill_splits_pictures_and_videos(fam):
    llm = LLM(str(fam.path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=12)
    seen = record_chunks(llm)
    _run_and_check(llm, fam, MIXED)
    assert _splits(seen, "image") >= 20, "pictures should start many chunks inside them"
    assert _splits(seen, "video") >= 2, "videos should be split across steps too"
    assert max(end - start for _, start, end in seen) <= 12
    assert_pool_full(llm)


def test_preemption_recomputes_identically(fam):
    llm = LLM(str(fam.path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    preempted: list = []
    record_chunks(llm, preempted)
    _run_and_check(llm, fam, MIXED)
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert any(it.modality == "image" for items in preempted for it in items), "a request with a picture was to " \
        "be preempted and recomputed"
    assert_pool_full(llm)


# ---- prefix cache ---------------------------------------------------------------------------------------------
def test_same_picture_and_prompt_hit_the_prefix_cache(fam, llm):
    text = fam.text("<image>\nDescribe the colours of this picture in a few careful words, please.")
    fresh = [noise_image(150, 70, seed=31)]  # not encoded by an earlier test
    expected = fam.greedy(text, fresh)
    image_id = llm.config.model.image_token_id
    image_end = len(expected[0]) - expected[0][::-1].index(image_id)
    bs = llm.config.block_size
    assert (len(expected[0]) - 1) // bs * bs >= image_end, "the text after the picture should fill its last block"
    _check(_run(llm, [(text, fresh, [])]), [expected], ["first"])
    before = llm.get_metrics()
    _check(_run(llm, [(text, fresh, [])]), [expected], ["second"])
    d = metric_delta(before, llm.get_metrics())
    assert d["prefix_cache_hits_total"] >= image_end, "the picture's blocks should all be cached"
    assert d["encoder_cache_queries_total"] == 0, "nothing of the picture is computed again: no encoder query"

    off = LLM(str(fam.path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    _check(_run(off, [(text, fresh, [])] * 2), [expected] * 2, ["no prefix cache"] * 2)
    assert off.get_metrics()["prefix_cache_hits_total"] == 0
    assert_pool_full(off)
    assert_pool_full(llm)


def test_other_picture_of_the_same_size_hits_only_the_text_before_it(fam, llm):
    text = fam.text(PREAMBLE + "<image> Thanks.")
    first, other = [noise_image(110, 80, seed=51)], [noise_image(110, 80, seed=52)]
    _run(llm, [(text, first, [])])
    before = llm.get_metrics()
    (out,) = _run(llm, [(text, other, [])])
    d = metric_delta(before, llm.get_metrics())
    _check([out], [fam.greedy(text, other)], ["other picture"])
    offset, bs = out.prompt_token_ids.index(llm.config.model.image_token_id), llm.config.block_size
    assert offset >= 2 * bs, "the preamble should fill at least two blocks"
    assert d["prefix_cache_hits_total"] == (offset // bs) * bs, "a block holding the other picture was reused"
    assert d["encoder_cache_hits_total"] == 0 and d["encoder_cache_queries_total"] == 1
    assert_pool_full(llm)


def test_a_prefix_hit_that_ends_inside_the_picture(fam, llm):
    """A prompt that ends with the picture reuses the blocks of an earlier, longer prompt up to inside the
    picture: the rest of the picture's rows come from the encoder cache."""
    picture = [noise_image(120, 90, seed=61)]
    _run(llm, [(PREAMBLE + "<image> What is it?", picture, [])])
    text = PREAMBLE + "<image>"  # raw: the picture is the prompt's end
    expected = fam.greedy(text, picture)
    before = llm.get_metrics()
    (out,) = _run(llm, [(text, picture, [])])
    d = metric_delta(before, llm.get_metrics())
    _check([out], [expected], ["ends with the picture"])
    offset = out.prompt_token_ids.index(llm.config.model.image_token_id)
    assert offset < d["prefix_cache_hits_total"] < len(out.prompt_token_ids), "the hit should end inside the picture"
    assert d["encoder_cache_queries_total"] == 1 and d["encoder_cache_hits_total"] == 1
    assert_pool_full(llm)


# ---- chat -----------------------------------------------------------------------------------------------------
def test_chat_with_a_data_url_equals_transformers_chat_template(fam, llm):
    picture = noise_image(90, 120, seed=41)
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = "What colour is the top left corner?"
    ours = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]
    theirs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = fam.hf.processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
    assert text.count("<image>") == 1
    (out,) = llm.chat(ours, GREEDY, use_tqdm=False)
    _check([out], [fam.greedy(text, [picture])], ["chat"])
    assert_pool_full(llm)


# ---- tensor parallelism ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["weights", "data"])
def test_two_ranks_match_transformers(fam, mode):
    llm = LLM(str(fam.path), dtype="float32", num_kv_blocks=256, tensor_parallel_size=2, mm_encoder_tp_mode=mode)
    try:
        _run_and_check(llm, fam, MIXED)
        assert_pool_full(llm)
    finally:
        llm.shutdown()
