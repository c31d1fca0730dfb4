"""--mm-processor-cache-gb: a picture or video sent again (every turn of a chat resends it) is a lookup in the
family processor's cache of processed items, keyed by its bytes and the settings, bounded by bytes; the prompt it
gives equals a fresh decode's, so answers and block hashes cannot change."""

from __future__ import annotations

import pytest
import torch

from tests.test_router_hashes import chat_prompt, fetched, picture_url, video_url
from vlserve.cli import build_parser
from vlserve.core.block_hash import prompt_block_hashes
from vlserve.core.config import SERVE, EngineArgs, ServerArgs
from vlserve.core.errors import ConfigurationError, InvalidInputError
from vlserve.core.options import options_from
from vlserve.engine.config import resolve_config
from vlserve.frontend.input_processor import InputProcessor
from vlserve.model.families.processor import MediaItemCache, item_nbytes


def processor(ckpt, cache_bytes: int) -> InputProcessor:
    cfg = resolve_config(EngineArgs(model=str(ckpt), dtype="float32"), announce=False)
    return InputProcessor.for_model(cfg, processed_cache_bytes=cache_bytes)


def same_prompt(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert prompt_block_hashes(a, 4) == prompt_block_hashes(b, 4)
    for x, y in zip(a.mm_items, b.mm_items, strict=True):
        assert (x.offset, x.num_tokens, x.layout, x.mm_hash) == (y.offset, y.num_tokens, y.layout, y.mm_hash)
        assert torch.equal(x.pixel_values, y.pixel_values)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava_onevision"])
def test_a_resent_picture_and_video_are_not_processed_again(tiny_ckpt, arch):
    cached, uncached = processor(tiny_ckpt(arch), 2**30), processor(tiny_ckpt(arch), 0)
    parts = [{"type": "image_url", "image_url": {"url": picture_url(7)}},
             {"type": "video_url", "video_url": {"url": video_url(8)}}, {"type": "text", "text": "Same scene?"}]
    prompt = fetched(chat_prompt(cached, parts))
    cache = cached.processor.processed
    first = cached.process(prompt)
    assert (cache.hits, cache.misses) == (0, 2)
    again = cached.process(prompt)
    assert (cache.hits, cache.misses) == (2, 2)
    same_prompt(again, first)
    same_prompt(again, uncached.process(prompt))
    assert uncached.processor.processed.misses == 0  # 0 GiB: nothing kept, nothing counted
    # other resize bounds are another entry, as the result differs
    small = cached.process(prompt, {"max_pixels": 56 * 56} if arch == "qwen2_vl" else None)
    assert cache.misses == (4 if arch == "qwen2_vl" else 2)
    same_prompt(small, uncached.process(prompt, {"max_pixels": 56 * 56} if arch == "qwen2_vl" else None))


def test_the_processed_cache_is_bounded_by_bytes():
    class Item:
        def __init__(self, n):
            self.pixel_values = torch.zeros(n)

    cache = MediaItemCache(3 * (400 + 256), weigh=item_nbytes)  # three 100-float items
    keys = [MediaItemCache.key("image", bytes([k]), {}) for k in range(4)]
    for k in keys:
        cache.get_or_make(k, lambda: Item(100))
    assert cache.weight == 3 * 656 and cache.misses == 4
    cache.get_or_make(keys[1], lambda: Item(100))  # still there
    assert cache.hits == 1
    cache.get_or_make(keys[0], lambda: Item(100))  # the first went out for the fourth
    assert cache.misses == 5
    big = MediaItemCache.key("image", b"big", {})
    cache.get_or_make(big, lambda: Item(10_000))  # over the whole bound: made, never kept
    assert cache.weight <= 3 * 656 and cache.get_or_make(big, lambda: "made again") == "made again"


def test_the_option_is_checked_and_reaches_the_processor(tiny_ckpt):
    ckpt = str(tiny_ckpt("qwen2_vl"))
    ns = build_parser().parse_args(["serve", "--model", ckpt, "--mm-processor-cache-gb", "0.5"])
    assert options_from(ns, SERVE).server.media_bounds()["processed_cache_bytes"] == 2**29
    ns = build_parser().parse_args(["serve", "--model", ckpt, "--mm-processor-cache-gb", "-1"])
    with pytest.raises(ConfigurationError, match="--mm-processor-cache-gb"):  # the flag's range, at start
        options_from(ns, SERVE)
    with pytest.raises(InvalidInputError, match="mm_processor_cache_gb"):  # and in the Python API
        ServerArgs(mm_processor_cache_gb=-1).media_bounds()
