"""InternVL3 through the engine: greedy outputs (fp32, EOS ignored) equal transformers' `generate` token for token
(each token's log-probability within 1e-4), and the expanded prompt ids equal its processor's: pictures of each
tiling (one tile, several with a thumbnail, the most), several pictures, a video (every frame its own item), a
picture with a video, text alone; batched in two orders, with pictures split across prefill steps, after
preemption, on prefix-cache hits (one ending inside a picture; and with the cache off), from token ids, at two
tensor-parallel ranks, and through `LLM.chat` with a data URL against transformers' chat template.

transformers' side: its own InternVLProcessor over the checkpoint's files with the PIL image processor
(GotOcr2ImageProcessorPil); its video processor needs torchvision (not installed), so video frames are vlserve's
pixel values (torch's resize, the one torchvision runs) while the processor's own `replace_video_token` lays the
video out (tests/hf_reference.py `HFInternVLReference`)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from tests.conftest import assert_pool_full, noise_image
from tests.engine_probes import metric_delta, record_chunks
from tests.hf_reference import HFInternVLReference
from vlserve import LLM, SamplingParams
from vlserve.model.families.internvl.tiles import canvas

ARCH = "internvl3"
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-4
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


# (height, width) of the single pictures: tall, wide, square, small (one tile), big (the most tiles)
SINGLE = {"tall": (200, 60), "wide": (60, 200), "square": (100, 100), "small": (30, 30), "big": (300, 280)}
PROMPTS = {
    **{name: ("<IMG_CONTEXT>\nWhat is in the picture?", [noise_image(w, h, seed=i)], [])
       for i, (name, (h, w)) in enumerate(SINGLE.items())},
    "two": ("Picture 1: <IMG_CONTEXT>\nPicture 2: <IMG_CONTEXT>\nWhich one is brighter?",
            [noise_image(130, 90, seed=11), noise_image(160, 40, seed=12)], []),
    "video": ("<video>\nWhat happens in this video?", [], [frames(5, 60, 80, seed=13)]),
    "both": ("<IMG_CONTEXT>\n<video>\nDoes the video show the picture?", [noise_image(70, 50, seed=14)],
             [frames(3, 48, 64, seed=15)]),
    "text": ("Tell me about whales.", [], []),
    "code": (None, [], []),  # "def fibonacci(n):" without a chat turn
}
PREAMBLE = "You are a careful viewer. Look at the picture below and answer in one short sentence: "
MIXED = ["tall", "text", "two", "video", "wide", "code", "both", "square", "small", "big"]


class Reference(HFInternVLReference):
    """transformers' reference with its answer to every prompt of PROMPTS."""

    def __init__(self, path, model=None):
        super().__init__(path, model)
        self.expected = {n: self.greedy(*self.parts(n)) for n in PROMPTS}

    @staticmethod
    def text(body: str | None) -> str:
        return "def fibonacci(n):" if body is None else TURN.format(body)

    def parts(self, name: str) -> tuple[str, list, list]:
        body, images, videos = PROMPTS[name]
        return self.text(body), images, videos

    def greedy(self, text: str, images=(), videos=()) -> tuple[list[int], list[int], list[float]]:
        return super().greedy(text, MAX_NEW, images, videos)


@pytest.fixture(scope="module")
def ref(tiny_ckpt) -> Reference:
    return Reference(tiny_ckpt(ARCH))


@pytest.fixture(scope="module")
def llm(ref) -> LLM:
    return LLM(str(ref.path), dtype="float32", num_kv_blocks=256)


def _req(text: str, images: list, videos: list):
    media = {k: v for k, v in (("image", images), ("video", videos)) if v}
    return {"prompt": text, "multi_modal_data": media} if media else text


def _run(llm: LLM, prompts: list[tuple[str, list, list]]):
    return llm.generate([_req(*p) for p in prompts], GREEDY, use_tqdm=False)


def _check(outs, expected, names) -> None:
    for out, (prompt_ids, gen, logprobs), name in zip(outs, expected, names, strict=True):
        assert out.prompt_token_ids == prompt_ids, f"{name}: expanded prompt ids differ"
        assert out.outputs[0].token_ids == gen, f"{name}: generated tokens differ"
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, gen, strict=True)]
        np.testing.assert_allclose(ours, logprobs, rtol=0, atol=LOGPROB_ATOL, err_msg=f"{name}: log-probabilities")


def _run_and_check(llm: LLM, ref: Reference, names) -> None:
    _check(_run(llm, [ref.parts(n) for n in names]), [ref.expected[n] for n in names], names)


def _splits(seen, modality: str) -> int:
    return sum(1 for items, start, _ in seen for it in items if it.modality == modality and it.offset < start < it.end)


# ---- alone, batched -----------------------------------------------------------------------------------------
def test_each_prompt_alone(ref, llm):
    for name in PROMPTS:
        _run_and_check(llm, ref, [name])
    s = ref.processor.image_processor
    grids = {canvas(h, w, s.size["height"], s.min_patches, s.max_patches) for h, w in SINGLE.values()}
    assert len(grids) >= 4 and (1, 1) in grids, f"the single pictures were meant to take different tilings: {grids}"
    assert_pool_full(llm)


def test_every_frame_is_its_own_item(llm):
    text, _, videos = Reference.text(PROMPTS["video"][0]), [], PROMPTS["video"][2]
    prompt = llm.engine.input_processor.process({"prompt": text, "multi_modal_data": {"video": videos}})
    assert [it.modality for it in prompt.mm_items] == ["video"] * 5
    assert len({it.mm_hash for it in prompt.mm_items}) == 5


def test_the_media_change_the_output(ref, llm):
    """Guards against vacuous parity: another picture or video of the same size changes the answer."""
    for name, media in (("tall", lambda: ([noise_image(60, 200, seed=21)], [])),
                        ("video", lambda: ([], [frames(5, 60, 80, seed=22)]))):
        text = ref.parts(name)[0]
        images, videos = media()
        expected = ref.greedy(text, images, videos)
        assert expected[2] != ref.expected[name][2], f"{name}: other media, same log-probabilities"
        _check(_run(llm, [(text, images, videos)]), [expected], [name])


def test_mixed_batches_in_both_orders(ref, llm):
    _run_and_check(llm, ref, MIXED)
    _run_and_check(llm, ref, MIXED[::-1])
    _run_and_check(llm, ref, ["two", "video", "two", "video"])  # the same media twice in one batch
    assert_pool_full(llm)


def test_prompts_given_as_token_ids(ref, llm):
    """Token ids with `<IMG_CONTEXT>` laid out in ids: the same ids as transformers' text path for pictures."""
    for name in ("two", "square"):
        text, images, _ = ref.parts(name)
        ids = ref.tokenizer.encode(text)
        (out,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY,
                              use_tqdm=False)
        _check([out], [ref.expected[name]], [name])


# ---- chunked prefill, preemption ------------------------------------------------------------------------------
def test_chunked_prefill_splits_pictures_and_videos(ref):
    llm = LLM(str(ref.path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=6)
    seen = record_chunks(llm)
    _run_and_check(llm, ref, MIXED)
    assert _splits(seen, "image") >= 10, "pictures should start many chunks inside them"
    assert max(end - start for _, start, end in seen) <= 6
    assert_pool_full(llm)


def test_preemption_recomputes_identically(ref):
    llm = LLM(str(ref.path), dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    preempted: list = []
    record_chunks(llm, preempted)
    _run_and_check(llm, ref, MIXED)
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert any(it.modality == "image" for items in preempted for it in items), "a request with a picture was to " \
        "be preempted and recomputed"
    assert_pool_full(llm)


# ---- prefix cache ---------------------------------------------------------------------------------------------
def test_same_picture_and_prompt_hit_the_prefix_cache(ref, llm):
    text = ref.text("<IMG_CONTEXT>\nDescribe the colours of this picture in a few careful words, please.")
    fresh = [noise_image(150, 70, seed=31)]
    expected = ref.greedy(text, fresh)
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

    off = LLM(str(ref.path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    _check(_run(off, [(text, fresh, [])] * 2), [expected] * 2, ["no prefix cache"] * 2)
    assert off.get_metrics()["prefix_cache_hits_total"] == 0
    assert_pool_full(off)
    assert_pool_full(llm)


def test_other_picture_of_the_same_size_hits_only_the_text_before_it(ref, llm):
    text = ref.text(PREAMBLE + "<IMG_CONTEXT> Thanks.")
    first, other = [noise_image(110, 80, seed=51)], [noise_image(110, 80, seed=52)]
    _run(llm, [(text, first, [])])
    before = llm.get_metrics()
    (out,) = _run(llm, [(text, other, [])])
    d = metric_delta(before, llm.get_metrics())
    _check([out], [ref.greedy(text, other)], ["other picture"])
    offset, bs = out.prompt_token_ids.index(llm.config.model.image_token_id), llm.config.block_size
    assert offset >= 2 * bs, "the preamble should fill at least two blocks"
    assert d["prefix_cache_hits_total"] == (offset // bs) * bs, "a block holding the other picture was reused"
    assert d["encoder_cache_hits_total"] == 0 and d["encoder_cache_queries_total"] == 1
    assert_pool_full(llm)


def test_a_prefix_hit_that_ends_inside_the_picture(ref, llm):
    picture = [noise_image(200, 90, seed=61)]
    _run(llm, [(PREAMBLE + "<IMG_CONTEXT> What is it?", picture, [])])
    text = PREAMBLE + "<IMG_CONTEXT>"  # raw: the picture (and its </img>) is the prompt's end
    expected = ref.greedy(text, picture)
    before = llm.get_metrics()
    (out,) = _run(llm, [(text, picture, [])])
    d = metric_delta(before, llm.get_metrics())
    _check([out], [expected], ["ends with the picture"])
    offset = out.prompt_token_ids.index(llm.config.model.image_token_id)
    assert offset < d["prefix_cache_hits_total"] < len(out.prompt_token_ids) - 1, \
        "the hit should end inside the picture"
    assert d["encoder_cache_queries_total"] == 1 and d["encoder_cache_hits_total"] == 1
    assert_pool_full(llm)


# ---- chat -----------------------------------------------------------------------------------------------------
def test_chat_with_a_data_url_equals_transformers_chat_template(ref, llm):
    picture = noise_image(90, 120, seed=41)
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = "What colour is the top left corner?"
    ours = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]
    theirs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = ref.processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
    assert text.count("<IMG_CONTEXT>") == 1
    (out,) = llm.chat(ours, GREEDY, use_tqdm=False)
    _check([out], [ref.greedy(text, [picture])], ["chat"])
    assert_pool_full(llm)


# ---- tensor parallelism ---------------------------------------------------------------------------------------
def test_two_ranks_match_transformers(ref):
    llm = LLM(str(ref.path), dtype="float32", num_kv_blocks=256, tensor_parallel_size=2)
    try:
        _run_and_check(llm, ref, MIXED)
        assert_pool_full(llm)
    finally:
        llm.shutdown()


# ---- InternViT-6B's options ----------------------------------------------------------------------------------
def test_a_tower_with_rms_norms_qk_norms_and_a_final_norm(ref, tmp_path):
    """InternVL3-38B/78B's InternViT-6B: RMSNorm blocks, q/k RMSNorm, a LayerNorm after the last block (no mean
    pooling) and no q/k/v biases; a checkpoint of the tiny one's shapes with those options, random like it."""
    import json
    import shutil

    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from vlserve.model.families.internvl.tiny import randomize

    raw = json.loads((ref.path / "config.json").read_text())
    raw["vision_config"] |= {"norm_type": "rms_norm", "use_qk_norm": True, "use_mean_pooling": False,
                             "attention_bias": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = InternVLForConditionalGeneration(InternVLConfig(**{k: v for k, v in raw.items()
                                                                   if k != "architectures"})).eval()
        randomize(model, 0.15)
        for name, p in model.named_parameters():  # the norms' weights random too (transformers sets them to 1)
            if "norm" in name and name.endswith("weight"):
                with torch.no_grad():
                    p.normal_(1.0, 0.15)
    model.save_pretrained(tmp_path)
    for f in ref.path.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, tmp_path / f.name)
    variant = Reference(tmp_path, model)
    names = ["tall", "two", "video", "text"]
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=128)
    tower = llm.engine.core.runner.model.visual.vision_tower
    assert tower.layernorm is not None and tower.layers[0].attn.q_norm is not None
    _run_and_check(llm, variant, names)
    assert variant.expected["tall"][2] != ref.expected["tall"][2]
    assert_pool_full(llm)
