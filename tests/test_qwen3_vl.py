"""Qwen3-VL and Qwen3-VL-MoE with DeepStack: greedy output equal to transformers' `generate` token for token (fp32)
for text, pictures, mixed batches, chunked prefill that splits pictures, preemption and video; the MoE checkpoint
both as transformers 5 saves it and in the released (4.57) layout; breaking any DeepStack level must show."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.hf_reference import HFReference, prompt_references
from tests.test_parity import _check, _prompts
from tests.test_parity import _run as run_prompts
from tests.test_video import VID, clip_frames, encode_video
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.model.loader import expert_tensor

MAX_NEW = 12
# min_tokens: like transformers' min_new_tokens, end-of-sequence tokens are masked until then (not just ignored)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
# (variant, tiny checkpoint it comes from); "_457" is that checkpoint rewritten the way released ones are stored
VARIANTS = {"qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe", "qwen3_vl_moe_457": "qwen3_vl_moe"}


def released_layout(src, dst):
    """The same weights as Qwen's released Qwen3-VL-MoE files hold them (transformers 4.57): experts as
    `gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]`, RoPE settings in `rope_scaling` + `rope_theta`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = {**rope, "rope_type": "default"}
    text["num_experts"] = text.pop("num_local_experts")
    cfg["transformers_version"] = "4.57.1"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """tiny checkpoint arch -> (path, transformers reference, expected outputs of `_prompts()`)."""
    return prompt_references(tiny_ckpt, _prompts(), MAX_NEW)


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, references, tmp_path_factory):
    path, hf, expected = references(VARIANTS[request.param])
    if request.param.endswith("_457"):
        path = released_layout(path, tmp_path_factory.mktemp("released") / "ckpt")
    return str(path), hf, expected


def _run(llm: LLM, prompts):
    return run_prompts(llm, prompts, GREEDY)


def test_mixed_requests_batched_together(setup):
    """Text, one picture, several pictures of different sizes and modes: nine requests in one batch, twice."""
    path, _, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    order = [8, 2, 5, 0, 7, 1, 3, 6, 4]
    _check(_run(llm, [_prompts()[i] for i in order]), expected, order)
    sched = llm.engine.core.scheduler
    assert sched.encoder_cache.rows_per_token == 3  # embedding + 2 DeepStack levels, all held in the cache
    assert_pool_full(llm)


def test_chunked_prefill_splits_pictures(setup):
    """A 7-token budget cuts every picture across steps: each chunk must add the right DeepStack rows."""
    path, _, expected = setup
    llm = LLM(path, dtype="float32", max_num_batched_tokens=7)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert_pool_full(llm)


def test_preemption_recomputes_identically(setup):
    path, _, expected = setup
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    _check(_run(llm, _prompts()), expected, range(len(_prompts())))
    assert llm.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for all at once"
    assert_pool_full(llm)


@pytest.mark.parametrize("broken", ["level 0", "level 1", "all levels"])
def test_breaking_deepstack_changes_the_output(references, monkeypatch, broken):
    """Guard against vacuous parity: dropping any one DeepStack level (or all) must change some picture's tokens."""
    from vlserve.model.decoder import DecoderModel

    path, _, expected = references("qwen3_vl")
    forward = DecoderModel.forward

    def without(self, embeds, positions, kv_caches, meta, deepstack=None):
        if deepstack is not None and broken != "all levels":
            features = deepstack.features.clone()
            features[int(broken[-1])] = 0
            deepstack = type(deepstack)(deepstack.rows, features)
        return forward(self, embeds, positions, kv_caches, meta, None if broken == "all levels" else deepstack)

    monkeypatch.setattr(DecoderModel, "forward", without)
    outs = _run(LLM(str(path), dtype="float32", num_kv_blocks=256), _prompts())
    changed = [i for i, (out, (_, gen)) in enumerate(zip(outs, expected)) if out.outputs[0].token_ids != gen]
    assert changed and all(_prompts()[i][1] for i in changed), f"changed: {changed}"  # only prompts with pictures


def test_picture_changes_the_output(references):
    path, _, _ = references("qwen3_vl_moe")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    a, b = _run(llm, [(f"Look: {IMG}", [noise_image(120, 90, 11)]), (f"Look: {IMG}", [noise_image(120, 90, 12)])])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_prefix_cache_hit_that_ends_inside_a_picture(references):
    """A second question on the same picture reuses the KV blocks up to the middle of the picture; the rest of its
    tokens (and their DeepStack rows) are computed from the encoder cache: same tokens as transformers."""
    path, hf, _ = references("qwen3_vl")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16)
    image = noise_image(224, 160, 21)  # 7 x 5 merged tokens: the picture ends inside a block
    first, second = (f"<|im_start|>user\n{IMG}{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("A?", "Why B?"))
    for prompt in (first, second):
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf.greedy(prompt, [image], MAX_NEW)
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits_total"] >= 32 and metrics["encoder_cache_hits_total"] >= 1
    assert_pool_full(llm)


# ---- video --------------------------------------------------------------------------------------------------------
def video_timestamps(path, videos: list[tuple[int, float]]) -> list[list[float]]:
    """Each video's temporal-patch times by transformers' own frame sampling and timestamp rule."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    vp = Qwen3VLVideoProcessor.from_pretrained(path)
    return [Qwen3VLProcessor._calculate_timestamps(None, vp.sample_frames(VideoMetadata(total_num_frames=n, fps=fps)),
                                                    fps, 2) for n, fps in videos]


def laid_out_ids(hf: HFReference, prompt: str | list[int], stamps: list[list[float]], grids) -> list[int]:
    """The prompt as transformers 4.57 renders it: per temporal patch `<t seconds>` and its own vision block. A text
    prompt is rewritten then tokenized; token ids are rewritten in place, each timestamp tokenized alone."""
    tok = hf.tokenizer
    blocks = []
    for times, (t, h, w) in zip(stamps, grids):
        assert len(times) == t
        blocks.append([(f"<{s:.1f} seconds>", ["<|vision_start|>"] + ["<|video_pad|>"] * (h * w // 4) +
                        ["<|vision_end|>"]) for s in times])
    if isinstance(prompt, str):
        for video in blocks:
            prompt = prompt.replace(VID, "".join(stamp + "".join(block) for stamp, block in video), 1)
        return tok.encode(prompt)
    vid = tok.convert_tokens_to_ids(["<|vision_start|>", "<|video_pad|>", "<|vision_end|>"])
    out, videos, i = [], iter(blocks), 0
    while i < len(prompt):
        if prompt[i : i + 3] == vid:
            for stamp, block in next(videos):
                out += tok.encode(stamp) + tok.convert_tokens_to_ids(block)
            i += 3
        else:
            out.append(prompt[i])
            i += 1
    return out


def hf_video_greedy(hf: HFReference, ids: list[int], pixel_values, grids) -> list[int]:
    """transformers' generate on pixel_values_videos from our preprocessing."""
    input_ids = torch.tensor([ids])
    types = 2 * (input_ids == hf.model.config.video_token_id).int()
    with torch.no_grad():
        out = hf.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                                pixel_values_videos=pixel_values, video_grid_thw=torch.tensor(grids),
                                max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                pad_token_id=hf.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_vl_moe"])
def test_video_matches_transformers(references, arch):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from vlserve.media.video import load_video
    from vlserve.model.families.qwen.video_rules import preprocess_video

    path, hf, _ = references(arch)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, limit_mm_per_prompt={"video": 2})
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=5,
                  limit_mm_per_prompt={"video": 2})
    mp4 = encode_video(clip_frames(12, seed=1), fps=4)  # 3 s at 4 fps: 6 frames sampled at 2 fps
    frames = np.stack(clip_frames(7, h=84, w=56, seed=4))  # frames as an array: a clip at the sampling fps, odd count
    proc = llm.engine.input_processor.processor
    processed = [preprocess_video(load_video(v, proc.video_opts), proc.image_cfg, proc.video_opts,
                                  proc.image_cfg.min_pixels, proc.image_cfg.max_pixels) for v in (mp4, list(frames))]
    opts = proc.video_opts
    for p, (n, h0, w0) in zip(processed, [(6, 56, 84), (7, 84, 56)]):  # the resize rule is transformers' own
        h, w = smart_resize(n, h0, w0, 2, 32, opts.min_pixels, opts.total_pixels)
        assert p.layout == ((n + 1) // 2, h // 16, w // 16)
    prompt = f"<|im_start|>user\nA {VID} then {VID}.<|im_end|>\n<|im_start|>assistant\n"
    pixels, grids = torch.cat([p.pixel_values for p in processed]), [p.layout for p in processed]
    stamps = video_timestamps(path, [(12, 4.0), (7, 2.0)])
    expected_ids = laid_out_ids(hf, prompt, stamps, grids)
    expected = hf_video_greedy(hf, expected_ids, pixels, grids)
    for engine in (llm, chunked):
        out = engine.generate({"prompt": prompt, "multi_modal_data": {"video": [mp4, frames]}}, GREEDY,
                              use_tqdm=False)[0]
        assert out.prompt_token_ids == expected_ids
        assert out.outputs[0].token_ids == expected
        assert_pool_full(engine)
    # The prompt as token ids: the same layout, rewritten in ids.
    ids = llm.engine.input_processor.tokenizer.encode(prompt)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": [mp4, frames]}}, GREEDY,
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == laid_out_ids(hf, ids, stamps, grids)
    assert out.outputs[0].token_ids == hf_video_greedy(hf, out.prompt_token_ids, pixels, grids)
    other = encode_video([255 - f for f in clip_frames(12, seed=9)], fps=4)  # another picture altogether
    changed = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [other, frames]}}, GREEDY,
                           use_tqdm=False)[0]
    assert changed.outputs[0].token_ids != expected, "the video does not reach the model"


def test_video_placeholder_count_must_match(references):
    path, _, _ = references("qwen3_vl")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"video": 2})
    mp4 = encode_video(clip_frames(8, seed=2), fps=4)
    tokenizer = llm.engine.input_processor.tokenizer
    for prompt, videos in ((f"{VID}", [mp4, mp4]), (f"{VID}{VID}", [mp4])):
        for given in ({"prompt": prompt}, {"prompt_token_ids": tokenizer.encode(prompt)}):
            with pytest.raises(InvalidInputError, match="placeholder"):
                llm.generate({**given, "multi_modal_data": {"video": videos}}, GREEDY, use_tqdm=False)
    assert_pool_full(llm)


# ---- embeddings, cache, loading -----------------------------------------------------------------------------
def test_precomputed_embeddings_carry_deepstack_rows(references):
    """image_embeds for Qwen3-VL are the encoder's full rows (embedding + DeepStack levels side by side); the
    embedding alone is refused with an error that says so."""
    from vlserve.media.image import load_image
    from vlserve.model.families.qwen.pixels import preprocess_image

    path, _, expected = references("qwen3_vl")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_mm_embeds=True)
    prompt, images = _prompts()[1]
    proc = llm.engine.input_processor.processor
    cfg = proc.image_cfg
    p = preprocess_image(load_image(images[0]), cfg, cfg.min_pixels, cfg.max_pixels)
    runner = llm.engine.core.runner
    rows = runner.model.encode_images(p.pixel_values.to(runner.device), [p.layout])[0].cpu()
    assert rows.shape[1] == 3 * 64
    entry = {"image_embeds": rows, "image_grid_thw": list(p.layout)}
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [entry]}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[1][1]
    with pytest.raises(InvalidInputError, match="DeepStack"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [{**entry, "image_embeds": rows[:, :64]}]}},
                     GREEDY, use_tqdm=False)
    assert_pool_full(llm)


def test_encoder_cache_counts_deepstack_rows(references):
    path, _, _ = references("qwen3_vl")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, encoder_cache_size=100)
    cache = llm.engine.core.scheduler.encoder_cache
    out = _run(llm, [_prompts()[1]])[0]
    tokens = sum(1 for t in out.prompt_token_ids if t == llm.config.model.image_token_id)
    assert cache.used == 3 * tokens  # 12 media tokens take 36 of the 100 rows
    with pytest.raises(InvalidInputError, match="encoder"):  # 49 tokens x 3 rows > 100: refused up front
        _run(llm, [_prompts()[4]])
    assert_pool_full(llm)


def test_expert_layout_is_read_from_the_shape_and_the_version_breaks_ties():
    ours = torch.arange(2 * 6 * 4.0).view(2, 6, 4)  # [E, 2I, H]
    old = ours.transpose(1, 2).contiguous()  # [E, H, 2I]
    assert torch.equal(expert_tensor(old, ours.shape, None), ours)
    assert torch.equal(expert_tensor(ours, ours.shape, 4), ours)
    square = torch.arange(2 * 4 * 4.0).view(2, 4, 4)  # H == 2I: only the version can tell
    assert torch.equal(expert_tensor(square, square.shape, 5), square)
    assert torch.equal(expert_tensor(square, square.shape, 4), square.transpose(1, 2))


# ---- disaggregated ------------------------------------------------------------------------------------------------
def test_one_encoder_one_language_server_with_resumes(tiny_ckpt):
    """Qwen3-VL-MoE across processes: the encoder sends each media token's embedding and DeepStack rows in the
    receive blocks; a 4-row receive allocation makes every media request resume. Same text as one engine."""
    import base64

    from tests.test_disagg import Cluster, ask, data_url, expected_text, wait_encoder_idle, wait_language_blocks_free

    path = tiny_ckpt("qwen3_vl_moe")
    offline = LLM(str(path), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4, "video": 1})
    video = "data:video/mp4;base64," + base64.b64encode(encode_video(clip_frames(8, seed=3), fps=4)).decode()
    cases = {
        "one picture": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(noise_image(120, 90, 1))}},
            {"type": "text", "text": "What is this?"}]}],
        "two pictures and a video": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(noise_image(64, 200, 2))}},
            {"type": "video_url", "video_url": {"url": video}},
            {"type": "image_url", "image_url": {"url": data_url(noise_image(150, 150, 3))}},
            {"type": "text", "text": "Compare."}]}],
        "text only": [{"role": "user", "content": "Just text."}],
    }
    cluster = Cluster(path, {"small": ["--media-allocate-rows", "4", "--receive-block-rows", "4"]},
                      limits="image=4,video=1")
    try:
        cluster.wait_encoders("small", 1)
        before = cluster.metrics("small")
        for name, messages in cases.items():
            assert ask(cluster.client("small"), messages) == expected_text(offline, messages), name
        after = cluster.metrics("small")
        resumes = 'vlserve:embedding_transfer_resumes_total{role="language"}'
        success = 'vlserve:embedding_transfers_total{role="language",state="success"}'
        assert after[success] - before[success] == 2
        assert after[resumes] - before[resumes] >= 2  # 4 rows are never enough for these
        wait_language_blocks_free(lambda: cluster.metrics("small"))
        wait_encoder_idle(cluster.encoders["A"].metrics_url)
    finally:
        cluster.close()
