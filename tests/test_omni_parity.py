"""Qwen2.5-Omni's thinker through the engine, token-exact against transformers' `generate` (fp32, greedy) on the
tiny checkpoint: audio alone, audio + picture, two clips, a video heard with its sound (`use_audio_in_video`:
frames and sound interleaved in 2 s windows, each window its own media item) and the same video seen only, mixed
batches, a chunk budget that splits the heard video's items, a prefix-cache hit; once on the full Omni checkpoint.
Also what is refused: a model whose 2 s window does not fall on its audio tower's chunks, and a video whose
frames transformers would split over windows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.audio_samples import encode_video_with_audio, noise
from tests.conftest import assert_pool_full, first_step_logprobs, noise_image
from tests.hf_reference import HFOmniReference
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.media.audio import load_video_audio
from vlserve.media.video import load_video
from vlserve.model.families.qwen.video_rules import preprocess_video

RATE = 16000
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
HEAR = {"use_audio_in_video": True}
AUD = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMG = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VID = "<|vision_bos|><|VIDEO|><|vision_eos|>"
LIMITS = {"image": 2, "video": 2, "audio": 3}


def chat(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    path = tiny_ckpt("qwen2_5_omni")
    return HFOmniReference(path), LLM(str(path), dtype="float32", num_kv_blocks=256, limit_mm_per_prompt=LIMITS)


@pytest.fixture(scope="module")
def film() -> bytes:
    """5 s at 4 fps with a sound track: three 2 s windows of frames (taken at 2 fps) and of sound."""
    return encode_video_with_audio(5.0, fps=4, wave=noise(5 * RATE, seed=11, amp=0.2))


def video_inputs(llm: LLM, data: bytes) -> tuple:
    """(pixel_values, grid, seconds per grid, sound) as transformers gets them: our preprocessing (equal to its
    image path, see test_video.py) and our decoded sound track (its features come from transformers' extractor)."""
    proc = llm.engine.input_processor.processor
    cfg = proc.image_cfg
    p = preprocess_video(load_video(data, proc.video_opts), cfg, proc.video_opts, cfg.min_pixels, cfg.max_pixels)
    return p.pixel_values, p.layout, p.second_per_grid, load_video_audio(data, proc.video_audio_limits).waveform


CLIPS = {"one": noise(int(2.3 * RATE), seed=1), "two": noise(int(1.1 * RATE), seed=2)}
PICTURE = noise_image(90, 60, 3)


def cases(llm: LLM, film: bytes) -> dict:
    """name -> (our prompt, mm_processor_kwargs, transformers' prompt and media)."""
    heard = video_inputs(llm, film)
    return {
        "audio": ({"prompt": chat(f"{AUD}What is it?"), "multi_modal_data": {"audio": (CLIPS["one"], RATE)}}, {},
                  (chat(f"{AUD}What is it?"), {"audio": [CLIPS["one"]]})),
        "audio+picture": ({"prompt": chat(f"{AUD}{IMG}Both?"),
                           "multi_modal_data": {"audio": (CLIPS["two"], RATE), "image": PICTURE}}, {},
                          (chat(f"{AUD}{IMG}Both?"), {"audio": [CLIPS["two"]], "images": [PICTURE]})),
        "two clips": ({"prompt": chat(f"A {AUD} B {AUD} Same?"),
                       "multi_modal_data": {"audio": [(CLIPS["one"], RATE), (CLIPS["two"], RATE)]}}, {},
                      (chat(f"A {AUD} B {AUD} Same?"), {"audio": [CLIPS["one"], CLIPS["two"]]})),
        "heard video": ({"prompt": chat(f"{VID}What happens?"), "multi_modal_data": {"video": film}}, HEAR,
                        (chat(f"{VID}What happens?"), {"videos": [heard], "heard": True})),
        "seen video": ({"prompt": chat(f"{VID}What happens?"), "multi_modal_data": {"video": film}}, {},
                       (chat(f"{VID}What happens?"), {"videos": [heard]})),
        "heard video, clip, picture": (
            {"prompt": chat(f"{IMG}{AUD} then {VID}?"),
             "multi_modal_data": {"video": film, "audio": (CLIPS["two"], RATE), "image": PICTURE}}, HEAR,
            (chat(f"{IMG}{AUD} then {VID}?"), {"videos": [heard], "audio": [CLIPS["two"]], "images": [PICTURE],
                                              "heard": True})),
    }


@pytest.fixture(scope="module")
def expected(setup, film) -> dict:
    hf, llm = setup
    out = {}
    for name, (_, _, (prompt, media)) in cases(llm, film).items():
        out[name] = hf.greedy(prompt, MAX_NEW, **media)
    return out


def run_batch(llm: LLM, requests: list[tuple[dict, dict]]) -> list:
    """One batch whose requests each carry their own mm_processor_kwargs (a heard and a seen video together)."""
    ids = [llm.engine.add_request(prompt, GREEDY, mm_processor_kwargs=kwargs) for prompt, kwargs in requests]
    return llm._run(ids, use_tqdm=False)


# sound tracks of 506, 442 and 212 feature frames (AAC decodes whole 1024-sample frames): the first ends in a
# chunk holding frames past its last whole token, the second puts those in a chunk of their own
@pytest.mark.parametrize("seconds", [5.0, 4.37, 2.05])
def test_heard_windows_encode_to_the_whole_sound(setup, seconds):
    """Each 2 s window of the sound through our tower alone, concatenated: transformers' rows for the whole track
    (the last window keeps the frames past its last whole token, which the tower's last chunk reads)."""
    hf, llm = setup
    data = encode_video_with_audio(5.0, fps=4, wave=noise(int(seconds * RATE), seed=5))
    prompt = llm.engine.input_processor.process({"prompt": VID, "multi_modal_data": {"video": data}}, HEAR)
    model = llm.engine.core.runner.model
    device = next(model.parameters()).device  # the reference runs on the CPU, the engine maybe on a GPU
    feats, mask, tokens = hf._sound(video_inputs(llm, data)[3])
    with torch.no_grad():
        ours = torch.cat([model.encode_audio([it.audio_features.to(device)], [it.audio_len])[0].cpu()
                          for it in prompt.mm_items if it.modality == "audio"])
        theirs = hf.model.get_audio_features(feats, mask).last_hidden_state
    assert ours.shape[0] == tokens and sum(it.modality == "audio" for it in prompt.mm_items) == -(-tokens // 50)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["audio", "audio+picture", "two clips", "heard video", "seen video",
                                  "heard video, clip, picture"])
def test_single_prompt_matches_transformers(setup, film, expected, name):
    _, llm = setup
    prompt, kwargs, _ = cases(llm, film)[name]
    out = llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name]
    assert_pool_full(llm)


def test_heard_video_layout_and_its_sound_matter(setup, film, expected):
    hf, llm = setup
    ids, tokens = expected["heard video"]
    c = hf.cfg
    # V0 A0 V1 A1 V2 A2 between <|audio_bos|> and <|audio_eos|>: three runs of each
    inside = ids[ids.index(c.audio_start_token_id) + 1:ids.index(c.audio_end_token_id)]
    runs = [t for i, t in enumerate(inside) if i == 0 or inside[i - 1] != t]
    assert runs == [c.video_token_id, c.audio_token_id] * 3
    assert tokens != expected["seen video"][1]
    other = encode_video_with_audio(5.0, fps=4, wave=noise(5 * RATE, seed=12, amp=0.2))
    prompt = {"prompt": chat(f"{VID}What happens?"), "multi_modal_data": {"video": other}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=HEAR)[0]
    theirs = hf.greedy(chat(f"{VID}What happens?"), MAX_NEW, videos=[video_inputs(llm, other)], heard=True)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == theirs
    heard = {"prompt": chat(f"{VID}What happens?"), "multi_modal_data": {"video": film}}
    assert first_step_logprobs(llm, prompt, mm_processor_kwargs=HEAR) != \
        first_step_logprobs(llm, heard, mm_processor_kwargs=HEAR), "the video's sound does not reach the model"


@pytest.mark.parametrize("reverse", [False, True])
def test_mixed_batch_matches_transformers(setup, film, expected, reverse):
    _, llm = setup
    table = cases(llm, film)
    names = ["heard video", "audio+picture", "seen video", "two clips", "heard video, clip, picture"]
    names = names[::-1] if reverse else names
    outs = run_batch(llm, [table[n][:2] for n in names])
    for name, out in zip(names, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name], name
    assert_pool_full(llm)


def test_chunk_budget_splits_the_heard_video(setup, film, expected):
    _, llm = setup
    small = LLM(str(llm.config.model_path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16,
                limit_mm_per_prompt=LIMITS)
    names = ["heard video", "heard video, clip, picture"]
    table = cases(llm, film)
    outs = run_batch(small, [table[n][:2] for n in names])
    for name, out in zip(names, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name], name
    assert_pool_full(small)


def test_preemption_recomputes_the_heard_video_identically(setup, film, expected):
    """A pool that holds the longest prompt but not the batch: requests are preempted and recomputed, windows
    and all, with the same tokens."""
    _, llm = setup
    table = cases(llm, film)
    names = ["heard video, clip, picture", "heard video", "audio+picture", "two clips"]
    longest = max(len(expected[n][0]) for n in names) + MAX_NEW
    # 80 blocks of 4: the longest prompt (~203 tokens + 8 new) fits, the batch (~536 + 32) does not
    assert longest <= 4 * 80 < sum(len(expected[n][0]) + MAX_NEW for n in names)
    small = LLM(str(llm.config.model_path), dtype="float32", block_size=4, num_kv_blocks=80,
                max_num_batched_tokens=64, limit_mm_per_prompt=LIMITS)
    outs = run_batch(small, [table[n][:2] for n in names])
    for name, out in zip(names, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name], name
    assert small.get_metrics()["num_preemptions_total"] > 0, "the pool was meant to be too small for the batch"
    assert_pool_full(small)


def test_prefix_hit_on_the_heard_video(setup, film, expected):
    _, llm = setup
    prompt, kwargs, _ = cases(llm, film)["heard video"]
    llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)
    before = llm.get_metrics()
    out = llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
    hits = llm.get_metrics()["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert hits >= 16 * (len(out.prompt_token_ids) // 16 - 1)  # every whole block but the last
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected["heard video"]
    assert_pool_full(llm)


def test_full_omni_checkpoint_matches_transformers(tiny_ckpt, setup, film):
    path = tiny_ckpt("qwen2_5_omni_full")
    hf, llm = HFOmniReference(path, full=True), LLM(str(path), dtype="float32", num_kv_blocks=128,
                                                   limit_mm_per_prompt=LIMITS)
    prompt, kwargs, (text, media) = cases(llm, film)["heard video, clip, picture"]
    out = llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf.greedy(text, MAX_NEW, **media)


def test_a_window_off_the_audio_chunks_is_refused(tiny_ckpt, film, tmp_path):
    """n_window 25: the tower reads 50-frame chunks, a 2 s window is 200 frames: not a whole number of chunks."""
    path = tmp_path / "omni"
    shutil.copytree(tiny_ckpt("qwen2_5_omni"), path)
    config = json.loads((path / "config.json").read_text())
    config["audio_config"]["n_window"] = 25
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt=LIMITS)
    prompt = {"prompt": chat(f"{VID}?"), "multi_modal_data": {"video": film}}
    with pytest.raises(InvalidInputError, match="audio tower's chunks"):
        llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs=HEAR)
    assert len(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_NEW  # seen: fine
    assert_pool_full(llm)


def test_a_frame_split_over_windows_is_refused(setup):
    """10 s at its fewest frames (4): 5 s a temporal patch, so transformers splits frame 1 over windows."""
    _, llm = setup
    long = encode_video_with_audio(10.0, fps=2, wave=noise(10 * RATE, seed=13))
    prompt = {"prompt": chat(f"{VID}?"), "multi_modal_data": {"video": long}}
    with pytest.raises(InvalidInputError, match="several 2 s windows"):
        llm.generate(prompt, GREEDY, use_tqdm=False, mm_processor_kwargs={**HEAR, "fps": 0.1})
    assert_pool_full(llm)
