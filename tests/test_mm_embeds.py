"""Precomputed image embeddings: our own ViT's output fed back gives the picture's tokens; safetensors only;
shapes, grids and values checked; content-hashed for the caches; off unless enabled."""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import save

from tests.conftest import IMG, assert_pool_full, noise_image
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.model.families.qwen.pixels import preprocess_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = f"<|im_start|>user\n{IMG}Describe it.<|im_end|>\n<|im_start|>assistant\n"


def vit_embeddings(llm: LLM, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    proc = llm.engine.input_processor.processor
    p = preprocess_image(image, proc.image_cfg)
    model = llm.engine.core.runner.model
    with torch.inference_mode():  # the engine's model may sit on a GPU; the caller compares on the CPU
        emb = model.encode_images(p.pixel_values.to(next(model.parameters()).device), [p.layout])[0]
    return emb.cpu().clone(), p.layout


def b64_safetensors(t: torch.Tensor, name: str = "image_embeds") -> str:
    return base64.b64encode(save({name: t.contiguous()})).decode()


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=128, enable_mm_embeds=True)


@pytest.fixture(autouse=True)
def pool_is_full_after(llm):
    yield
    assert_pool_full(llm)


def test_own_vit_embeddings_give_the_pictures_tokens(llm):
    image = noise_image(96, 64, 5)
    expected = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
    emb, grid = vit_embeddings(llm, image)
    # a tensor; base64 safetensors; a grid given as a tensor; a tensor under another name in the file
    for value, grid_value in ((emb, grid), (b64_safetensors(emb), list(grid)),
                              (b64_safetensors(emb), torch.tensor([grid])), (b64_safetensors(emb, name="x"), grid)):
        out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [
            {"image_embeds": value, "image_grid_thw": grid_value}]}}, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == expected.prompt_token_ids
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_embeddings_through_chat_and_mixed_with_pictures(llm):
    a, b = noise_image(64, 64, 1), noise_image(56, 84, 2)
    emb, grid = vit_embeddings(llm, b)
    with_pixels = llm.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": a}, {"type": "image_pil", "image_pil": b}, {"type": "text", "text": "?"}]}],
        GREEDY, use_tqdm=False)[0]
    with_embeds = llm.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": a},
        {"type": "image_embeds", "image_embeds": b64_safetensors(emb), "image_grid_thw": list(grid)},
        {"type": "text", "text": "?"}]}], GREEDY, use_tqdm=False)[0]
    assert with_embeds.outputs[0].token_ids == with_pixels.outputs[0].token_ids


def test_equal_embeddings_share_the_prefix_cache_and_skip_the_encoder(llm):
    """Content-hashed: equal embeddings share KV blocks; they never touch the vision encoder or its cache (the
    engine reads them straight from the request)."""
    emb, grid = vit_embeddings(llm, noise_image(70, 70, 8))
    data = {"image": [{"image_embeds": emb, "image_grid_thw": grid}]}
    before = llm.get_metrics()
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt": PROMPT, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    mid = llm.get_metrics()
    assert mid["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 16  # the picture's blocks
    assert mid["encoder_cache_queries_total"] == before["encoder_cache_queries_total"]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    other = emb.clone()
    other[0, 0] += 1.0  # one value differs: no sharing past the text before the picture
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [{"image_embeds": other, "image_grid_thw": grid}]}},
                 GREEDY, use_tqdm=False)
    after = llm.get_metrics()
    n_text_blocks = (len(first.prompt_token_ids) - 16) // llm.config.block_size  # generous: blocks before the picture
    assert after["prefix_cache_hits_total"] - mid["prefix_cache_hits_total"] <= n_text_blocks * llm.config.block_size


def _bad_entries(emb: torch.Tensor, grid: tuple[int, int, int]) -> dict:
    t, h, w = grid
    nan = emb.clone()
    nan[0, 0] = float("nan")
    return {
        "wrong shape": {"image_embeds": emb[:-1], "image_grid_thw": grid},
        "wrong width": {"image_embeds": emb[:, :-1], "image_grid_thw": grid},
        "grid not divisible by merge": {"image_embeds": emb, "image_grid_thw": (t, h + 1, w)},
        "grid of 2 numbers": {"image_embeds": emb, "image_grid_thw": (h, w)},
        "grid missing": {"image_embeds": emb},
        "nan": {"image_embeds": nan, "image_grid_thw": grid},
        "integer dtype": {"image_embeds": emb.to(torch.int32), "image_grid_thw": grid},
        "not base64": {"image_embeds": "%%%", "image_grid_thw": grid},
        "base64 but not safetensors": {"image_embeds": base64.b64encode(b"\x80\x04pickle?").decode(),
                                       "image_grid_thw": grid},
        "two tensors": {"image_embeds": base64.b64encode(save({"a": emb, "b": emb.clone()})).decode(),
                        "image_grid_thw": grid},
        "a list": {"image_embeds": emb.tolist(), "image_grid_thw": grid},
    }


@pytest.mark.parametrize("case", list(_bad_entries(torch.zeros(16, 4), (1, 8, 8))))
def test_bad_embeddings_are_refused(llm, case):
    emb, grid = vit_embeddings(llm, noise_image(64, 64, 3))
    entry = _bad_entries(emb, grid)[case]
    with pytest.raises(InvalidInputError):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [entry]}}, GREEDY, use_tqdm=False)


def test_embeddings_are_off_by_default(tiny_ckpt):
    plain = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidInputError, match="enable-mm-embeds"):
        plain.generate({"prompt": PROMPT, "multi_modal_data": {"image": [
            {"image_embeds": torch.zeros(4, 4), "image_grid_thw": (1, 4, 4)}]}}, GREEDY, use_tqdm=False)
    assert_pool_full(plain)
