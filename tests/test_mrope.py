"""vlserve.model.families.qwen.mrope against transformers 5.23 `get_rope_index` on tiny Qwen2-VL / Qwen2.5-VL models."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel

from vlserve.core.errors import InvalidInputError
from vlserve.model.families.processor import expand_placeholders
from vlserve.model.families.qwen.mrope import MRopeItem, mrope_positions

IMAGE, VIDEO, V_START, V_END = 290, 291, 292, 293
MERGE = 2
TOKENS_PER_SECOND = 25
TEXT = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
)
SPECIAL = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)


@pytest.fixture(scope="module")
def qwen2_vl() -> Qwen2VLModel:
    vision = dict(embed_dim=32, hidden_size=64, depth=1, num_heads=2, spatial_merge_size=MERGE)
    return Qwen2VLModel(Qwen2VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL)).eval()


@pytest.fixture(scope="module")
def qwen2_5_vl() -> Qwen2_5_VLModel:
    vision = dict(
        hidden_size=32,
        out_hidden_size=64,
        intermediate_size=64,
        depth=1,
        num_heads=2,
        fullatt_block_indexes=[0],
        spatial_merge_size=MERGE,
        tokens_per_second=TOKENS_PER_SECOND,
    )
    return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL)).eval()


def build_prompt(
    segments: list[int | tuple[str, tuple[int, int, int]]], seed: int = 0
) -> tuple[list[int], list[tuple[str, tuple[int, int, int], int]]]:
    """Segments are text lengths or ("image"|"video", grid_thw). Returns expanded ids and (kind, grid, offset)."""
    rnd = random.Random(seed)
    ids: list[int] = []
    media: list[tuple[str, tuple[int, int, int], int]] = []
    for seg in segments:
        if isinstance(seg, int):
            ids += [rnd.randrange(3, 250) for _ in range(seg)]
        else:
            kind, (t, h, w) = seg
            media.append((kind, (t, h, w), len(ids)))
            ids += [IMAGE if kind == "image" else VIDEO] * (t * h * w // MERGE**2)
    return ids, media


def hf_positions(model, ids: list[int], media, second_per_grid_ts=None) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == IMAGE] = 1
    types[input_ids == VIDEO] = 2
    images = [g for k, g, _ in media if k == "image"]
    videos = [g for k, g, _ in media if k == "video"]
    kwargs = dict(
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
    )
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(second_per_grid_ts, dtype=torch.float32)
    pos, delta = model.get_rope_index(input_ids, types, **kwargs)
    return pos[:, 0], int(delta.item())


def ours(ids: list[int], media, intervals: dict[int, float] | None = None) -> tuple[torch.Tensor, int]:
    intervals = intervals or {}
    items = [MRopeItem(off, grid, intervals.get(i, 1.0)) for i, (_, grid, off) in enumerate(media)]
    return mrope_positions(ids, items, MERGE)


CASES = {
    "text_only": [17],
    "one_image": [5, ("image", (1, 8, 12)), 9],
    "two_images": [3, ("image", (1, 4, 4)), 6, ("image", (1, 10, 6)), 4],
    "image_at_start": [("image", (1, 6, 8)), 7],
    "image_at_end": [4, ("image", (1, 12, 4))],
    "only_image": [("image", (1, 2, 2))],
    "video": [3, ("video", (3, 4, 6)), 5],
    "long_video": [2, ("video", (9, 2, 2)), 3],  # temporal extent > spatial: 5.23 resume rule matters
    "image_and_video": [2, ("image", (1, 4, 8)), 3, ("video", (2, 6, 4)), 2],
}


@pytest.mark.parametrize("name", CASES)
def test_matches_qwen2_vl(qwen2_vl, name: str) -> None:
    ids, media = build_prompt(CASES[name])
    expected, expected_delta = hf_positions(qwen2_vl, ids, media)
    got, delta = ours(ids, media)
    assert got.dtype == torch.long and got.shape == (3, len(ids))
    assert torch.equal(got, expected)
    assert delta == expected_delta


@pytest.mark.parametrize("name", ["one_image", "two_images", "image_at_start", "image_at_end", "text_only"])
def test_matches_qwen2_5_vl_images(qwen2_5_vl, name: str) -> None:
    ids, media = build_prompt(CASES[name])
    expected, expected_delta = hf_positions(qwen2_5_vl, ids, media)
    got, delta = ours(ids, media)
    assert torch.equal(got, expected)
    assert delta == expected_delta


@pytest.mark.parametrize("seconds", [0.5, 1.0, 2 / 3, 0.07])
def test_matches_qwen2_5_vl_video(qwen2_5_vl, seconds: float) -> None:
    ids, media = build_prompt([3, ("image", (1, 4, 4)), 2, ("video", (4, 6, 8)), 5])
    expected, expected_delta = hf_positions(qwen2_5_vl, ids, media, second_per_grid_ts=[seconds])
    # The caller computes the interval the way transformers does (float32 seconds times an int).
    interval = float(TOKENS_PER_SECOND * torch.tensor(seconds, dtype=torch.float32))
    got, delta = ours(ids, media, intervals={1: interval})
    assert torch.equal(got, expected)
    assert delta == expected_delta


def test_resume_rule_and_decode_positions() -> None:
    # Video of 9 merged frames on a 1x1 merged grid: text resumes at start + 1, not start + 9.
    ids = [7, 7] + [VIDEO] * 9 + [7]
    pos, delta = mrope_positions(ids, [MRopeItem(2, (9, 2, 2))], MERGE)
    assert pos[:, 2:11].tolist() == [list(range(2, 11)), [2] * 9, [2] * 9]
    assert pos[:, 11].tolist() == [3, 3, 3]
    assert delta == 10 + 1 - len(ids)  # delta uses the true max position (t of the last frame)
    # Image: the next generated token at index len(ids) gets position len(ids) + delta.
    ids = [5] * 3 + [IMAGE] * 6 + [5] * 2  # grid (1, 4, 6) -> 2x3 merged
    pos, delta = mrope_positions(ids, [MRopeItem(3, (1, 4, 6))], MERGE)
    assert pos[:, -1].max().item() + 1 == len(ids) + delta


def test_adjacent_items_and_validation() -> None:
    ids = [IMAGE] * 8
    pos, delta = mrope_positions(ids, [MRopeItem(0, (1, 4, 4)), MRopeItem(4, (1, 4, 4))], MERGE)
    assert pos.tolist() == [[0, 0, 0, 0, 2, 2, 2, 2], [0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 2, 3, 2, 3]]
    assert delta == 4 - 8
    assert mrope_positions([], [], MERGE)[0].shape == (3, 0)
    with pytest.raises(ValueError):
        mrope_positions(ids, [MRopeItem(0, (1, 4, 4)), MRopeItem(2, (1, 4, 4))], MERGE)  # overlap
    with pytest.raises(ValueError):
        mrope_positions(ids, [MRopeItem(6, (1, 4, 4))], MERGE)  # past the end
    with pytest.raises(ValueError):
        mrope_positions(ids, [MRopeItem(0, (1, 3, 4))], MERGE)  # not divisible by merge


def test_long_prompt_is_fast() -> None:
    import time

    ids = [5] * 30_000
    items = [MRopeItem(1000 * k + 10, (1, 20, 20)) for k in range(20)]
    start = time.perf_counter()
    pos, _ = mrope_positions(ids, items, MERGE)
    assert time.perf_counter() - start < 0.5
    assert pos.shape == (3, 30_000)


def test_expand_placeholders() -> None:
    ids, offsets = expand_placeholders([1, IMAGE, 2, 3, IMAGE, 4], IMAGE, [3, 2])
    assert ids == [1, IMAGE, IMAGE, IMAGE, 2, 3, IMAGE, IMAGE, 4]
    assert offsets == [1, 6]
    ids, offsets = expand_placeholders([IMAGE, IMAGE], IMAGE, [2, 1])
    assert (ids, offsets) == ([IMAGE] * 3, [0, 2])
    assert expand_placeholders([1, 2], IMAGE, []) == ([1, 2], [])
    with pytest.raises(InvalidInputError, match=r"2 placeholder.*1 media item"):
        expand_placeholders([IMAGE, 5, IMAGE], IMAGE, [4])
    with pytest.raises(InvalidInputError, match=r"0 placeholder.*2 media item"):
        expand_placeholders([5, 6], IMAGE, [4, 4])
    with pytest.raises(InvalidInputError):
        expand_placeholders([IMAGE], IMAGE, [0])


def test_expand_placeholders_linear_time() -> None:
    import time

    ids = ([7] * 50 + [IMAGE]) * 2000
    start = time.perf_counter()
    out, offsets = expand_placeholders(ids, IMAGE, [500] * 2000)
    assert time.perf_counter() - start < 0.5
    assert len(out) == 50 * 2000 + 500 * 2000 and offsets[1] == 50 + 500 + 50
