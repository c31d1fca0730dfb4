"""The encoder's budgets follow the largest item the server's bounds allow (issue #74 item 3): left unset, no
item a request may send without mm_processor_kwargs fails on them, in the front end or in the engine; set, an
item over them is refused at the front door with a 400 naming the option."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError
from vlserve.engine.config import resolve_config
from vlserve.engine.encoder_cache import EncoderCacheManager
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.input_processor import InputProcessor
from vlserve.model.encoder_budgets import DEFAULT_ENCODER_BUDGET, largest_item_tokens, media_bounds_of
from vlserve.model.facts import resolve_model_facts

QWEN3_VL_MAX_PIXELS = 16777216  # Qwen3-VL's own preprocessor_config.json: 16384 tokens of 32x32 pixels


@pytest.fixture(scope="module")
def qwen3_vl_full_size(tiny_ckpt, tmp_path_factory):
    """The tiny Qwen3-VL with the real checkpoints' picture bounds (its DeepStack levels: 3 cache rows a token)."""
    folder = tmp_path_factory.mktemp("qwen3-vl-full-size") / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_vl"), folder)
    path = folder / "preprocessor_config.json"
    raw = json.loads(path.read_text())
    raw["max_pixels"] = raw["size"]["longest_edge"] = QWEN3_VL_MAX_PIXELS
    path.write_text(json.dumps(raw))
    return folder


def processor_for(args: EngineArgs) -> InputProcessor:
    return InputProcessor.for_model(FrontendConfig.of(resolve_model_facts(args, announce=False), args))


def picture_prompt(side: int) -> dict:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return {"prompt": "<|vision_start|><|image_pad|><|vision_end|>look",
            "multi_modal_data": {"image": [Image.fromarray(pixels)]}}


def test_defaults_take_the_largest_picture_a_deepstack_model_allows(qwen3_vl_full_size):
    args = EngineArgs(model=str(qwen3_vl_full_size), dtype="float32")
    facts = resolve_model_facts(args, announce=False)
    rows = facts.model.rows_per_media_token
    assert rows == 3
    largest = largest_item_tokens(facts.model, facts.path, media_bounds_of(args))
    assert largest == QWEN3_VL_MAX_PIXELS // 32**2 == DEFAULT_ENCODER_BUDGET
    # 16384 cache rows would have held pictures of 5461 tokens at most: the cache grows to the largest item's rows
    assert (facts.encoder_cache_size, facts.max_num_encoder_input_tokens) == (largest * rows, largest)
    engine = resolve_config(args, facts)  # the engine process reads the same budgets
    assert (engine.encoder_cache_size, engine.max_num_encoder_input_tokens) == (largest * rows, largest)

    # a 2400x2400 picture: 75x75 = 5625 tokens, 16875 cache rows; refused before, taken now by both sides
    (item,) = processor_for(args).layout(picture_prompt(2400)).mm_items
    assert item.num_tokens == 5625 > DEFAULT_ENCODER_BUDGET // rows
    assert EncoderCacheManager.for_model(engine.encoder_cache_size, engine.model).fits_ever(item.num_tokens)
    assert item.num_tokens <= engine.max_num_encoder_input_tokens


def test_a_budget_the_operator_sets_is_kept_and_named_at_the_front_door(qwen3_vl_full_size):
    args = EngineArgs(model=str(qwen3_vl_full_size), dtype="float32", encoder_cache_size=16384)
    facts = resolve_model_facts(args, announce=False)
    assert (facts.encoder_cache_size, facts.max_num_encoder_input_tokens) == (16384, DEFAULT_ENCODER_BUDGET)
    with pytest.raises(InvalidInputError, match=r"would take 5625 embedding tokens, more than the 5461 one item may "
                                                r"take here \(encoder_cache_size=16384 rows at 3 per token\)"):
        processor_for(args).layout(picture_prompt(2400))
    args = EngineArgs(model=str(qwen3_vl_full_size), dtype="float32", max_num_encoder_input_tokens=4096)
    with pytest.raises(InvalidInputError, match=r"\(max_num_encoder_input_tokens=4096\)"):
        processor_for(args).layout(picture_prompt(2400))


def test_the_step_budget_follows_the_frame_bound(tiny_ckpt):
    """LLaVA-NeXT-Video encodes a video as one item: more frames allowed, a larger largest item."""
    folder = tiny_ckpt("llava_next_video")
    few = resolve_model_facts(EngineArgs(model=str(folder), dtype="float32"), announce=False)
    assert (few.encoder_cache_size, few.max_num_encoder_input_tokens) == (DEFAULT_ENCODER_BUDGET,) * 2
    args = EngineArgs(model=str(folder), dtype="float32", max_video_frames=8192)
    many = resolve_model_facts(args, announce=False)
    largest = largest_item_tokens(many.model, many.path, media_bounds_of(args))
    assert largest > DEFAULT_ENCODER_BUDGET
    assert (many.encoder_cache_size, many.max_num_encoder_input_tokens) == (largest, largest)


def test_an_internvl_video_is_bounded_frame_by_frame(tiny_ckpt):
    """Its frames are items of one tile each: a clip of more tokens than the step budget is encoded over several
    steps, not refused; the clip as a whole is bounded by the context."""
    folder = tiny_ckpt("internvl3")
    frames = np.random.default_rng(1).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    probe = processor_for(EngineArgs(model=str(folder), dtype="float32"))
    per_frame = probe.processor.rows_per_tile
    clip = {"prompt": "<video>what happens", "multi_modal_data": {"video": [frames]}}
    args = EngineArgs(model=str(folder), dtype="float32", max_num_encoder_input_tokens=2 * per_frame)
    items = processor_for(args).layout(clip).mm_items
    assert [it.num_tokens for it in items] == [per_frame] * 5
    short = EngineArgs(model=str(folder), dtype="float32", max_model_len=4 * per_frame)
    with pytest.raises(InvalidInputError, match=r"video of 5 frames .* \(max_model_len="):
        processor_for(short).layout(clip)
