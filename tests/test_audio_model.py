"""The audio models (#27) against transformers 5, fp32, on tiny random checkpoints: Qwen2-Audio and Qwen2.5-Omni's
thinker (also read from the full Omni checkpoint).

Configs parse (the hub's sparse Qwen2-Audio config too); the audio towers' rows equal transformers' for clips of
several lengths in one batched call (Qwen2-Audio's tower runs on the valid frames only, transformers on 30 s
of padded frames with the padded keys masked); Omni's vision tower equals transformers'; every checkpoint
tensor lands in our model class; greedy decoding through our model (a whole-sequence forward per token, no
engine) equals transformers' `generate` for text alone (Qwen2-Audio's 1-D RoPE as three equal M-RoPE rows),
for audio, and for Omni's audio + picture with transformers' own M-RoPE positions.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2AudioForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlserve.core.errors import ModelLoadError
from vlserve.model.audio_encoder import audio_output_tokens
from vlserve.media.audio import AudioProcessorConfig
from vlserve.model.families.qwen.config import QWEN2_5_OMNI, QWEN2_5_OMNI_THINKER, QWEN2_AUDIO
from vlserve.model.families.qwen.processor import audio_defaults
from vlserve.model.hf_config import ModelConfig, load_model_config, parse_model_config
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span
from vlserve.model.layers.parallel import TPGroup
from vlserve.model.loader import load_model

RATE = 16000
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def qwen2_audio(tiny_ckpt):
    path = tiny_ckpt("qwen2_audio")
    return path, Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def omni(tiny_ckpt):
    path = tiny_ckpt("qwen2_5_omni")
    return path, Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _ours(path: Path, **kw):
    return load_model(Path(path), dtype="float32", **kw)


def _clips(seconds: list[float], seed: int = 0) -> list[np.ndarray]:
    """Speech-like noise: a few tones under noise, so neighbouring frames differ."""
    rng = np.random.default_rng(seed)
    out = []
    for s in seconds:
        t = np.arange(int(s * RATE)) / RATE
        wave = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 3000, 3)) * 0.1
        out.append((wave + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
    return out


def _features(path: Path, clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' extractor, as its processors call it: padded, with the mask of valid frames."""
    fe = WhisperFeatureExtractor.from_pretrained(path)
    f = fe(clips, sampling_rate=RATE, padding="max_length", return_attention_mask=True, return_tensors="pt")
    return f["input_features"], f["attention_mask"]


# ---- configs -------------------------------------------------------------------------------------------------
def test_qwen2_audio_config(qwen2_audio):
    path, hf = qwen2_audio
    cfg = load_model_config(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.architecture == QWEN2_AUDIO
    assert cfg.vision is None and cfg.modalities == ("audio",) and cfg.position_kind == "rope"
    assert cfg.side_rows == 0 and cfg.rows_per_media_token == 1 and cfg.embedding_width == cfg.text.hidden_size
    t = cfg.text
    # 1-D RoPE: every frequency follows the first position row (the three rows are equal)
    assert t.rotary_sections == (t.head_dim // 2, 0, 0) and t.rope_theta == 10000.0 and not t.tie_word_embeddings
    a = cfg.audio
    hc = hf.config.audio_config
    assert (a.num_mel_bins, a.d_model, a.layers, a.heads, a.ffn_dim, a.max_source_positions) == (
        hc.num_mel_bins, hc.d_model, hc.encoder_layers, hc.encoder_attention_heads, hc.encoder_ffn_dim,
        hc.max_source_positions)
    assert a.output_dim == t.hidden_size and a.context_frames == 2 and a.learned_positions
    assert cfg.audio_token_id == hf.config.audio_token_id == tok.convert_tokens_to_ids("<|AUDIO|>")
    assert cfg.image_token_id == cfg.video_token_id == cfg.vision_start_token_id == -1  # no picture tokens
    assert cfg.audio_start_token_id == cfg.audio_end_token_id == -1  # plain text around <|AUDIO|> in this family


def test_released_qwen2_audio_config_takes_qwen2_defaults(tmp_path):
    """Qwen2-Audio-7B-Instruct's config.json lists only what differs from transformers' defaults."""
    raw = {"architectures": ["Qwen2AudioForConditionalGeneration"], "audio_token_index": 151646,
           "audio_config": {"model_type": "qwen2_audio_encoder"}, "model_type": "qwen2_audio",
           "torch_dtype": "bfloat16",
           "text_config": {"bos_token_id": 151643, "eos_token_id": 151645, "intermediate_size": 11008,
                           "max_position_embeddings": 8192, "model_type": "qwen2", "rms_norm_eps": 1e-05,
                           "torch_dtype": "bfloat16", "use_mrope": False, "vocab_size": 156032},
           "vocab_size": 156032, "transformers_version": "4.45.0.dev0"}
    cfg = parse_model_config(raw, tmp_path)
    t, a = cfg.text, cfg.audio
    assert (t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim) == (4096, 32, 32, 32, 128)
    assert (t.vocab_size, t.intermediate_size, t.rms_norm_eps, t.max_position_embeddings) == (156032, 11008, 1e-5, 8192)
    assert t.rope_theta == 10000.0 and t.rotary_sections == (64, 0, 0) and t.qkv_bias and not t.tie_word_embeddings
    assert (a.num_mel_bins, a.d_model, a.layers, a.heads, a.ffn_dim) == (128, 1280, 32, 20, 5120)
    assert a.output_dim == 4096 and cfg.audio_token_id == 151646 and cfg.eos_token_ids == (151645,)
    assert cfg.checkpoint_dtype == "bfloat16" and cfg.transformers_major == 4
    assert audio_defaults(cfg) == AudioProcessorConfig()  # no preprocessor_config.json: Whisper's, 128 bins, 30 s
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        parse_model_config({**raw, "text_config": {**raw["text_config"], "rope_scaling": {"rope_type": "yarn"}}},
                           tmp_path)


def test_omni_thinker_config(omni):
    path, hf = omni
    cfg = load_model_config(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.architecture == QWEN2_5_OMNI_THINKER
    assert cfg.modalities == ("image", "video", "audio") and cfg.position_kind == "omni" and cfg.side_rows == 0
    hc = hf.config
    v, a = cfg.vision, cfg.audio
    assert v.window_size == 112 and v.fullatt_block_indexes == tuple(hc.vision_config.fullatt_block_indexes)
    assert v.time_scaled_video and v.tokens_per_second == hc.position_id_per_seconds
    assert a.n_window == hc.audio_config.n_window and a.context_frames == 0 and not a.learned_positions
    assert (a.position_id_per_seconds, a.seconds_per_chunk) == (hc.position_id_per_seconds, hc.seconds_per_chunk)
    assert cfg.text.rotary_sections == tuple(hc.text_config.rope_parameters["mrope_section"])
    assert cfg.text.tie_word_embeddings == hc.tie_word_embeddings
    names = {"image_token_id": "<|IMAGE|>", "video_token_id": "<|VIDEO|>", "audio_token_id": "<|AUDIO|>",
             "vision_start_token_id": "<|vision_bos|>", "vision_end_token_id": "<|vision_eos|>",
             "audio_start_token_id": "<|audio_bos|>", "audio_end_token_id": "<|audio_eos|>"}
    for field, token in names.items():
        assert getattr(cfg, field) == tok.convert_tokens_to_ids(token) == getattr(hc, field), field


def test_full_omni_checkpoint_is_read_as_its_thinker(tiny_ckpt, omni, tmp_path):
    full = load_model_config(tiny_ckpt("qwen2_5_omni_full"))
    assert full.architecture == QWEN2_5_OMNI
    thinker = load_model_config(omni[0])
    # the same sizes as a thinker checkpoint made with the same settings
    assert full.text == thinker.text and full.vision == thinker.vision and full.audio == thinker.audio
    assert full.audio_token_id == thinker.audio_token_id
    # Qwen/Qwen2.5-Omni-* name the preview's class
    raw = json.loads((tiny_ckpt("qwen2_5_omni_full") / "config.json").read_text())
    raw["thinker_config"]["audio_config"]["num_mel_bins"] = 80
    preview = parse_model_config({**raw, "architectures": ["Qwen2_5OmniModel"]}, tmp_path)
    assert preview.architecture == QWEN2_5_OMNI
    # without a preprocessor_config.json the features take the thinker's mel bins and Omni's 300 s window
    defaults = audio_defaults(preview)
    assert (defaults.feature_size, defaults.chunk_length, defaults.n_samples) == (80, 300, 4_800_000)


def test_configs_cross_processes_unchanged(qwen2_audio, omni):
    for path in (qwen2_audio[0], omni[0]):
        cfg = load_model_config(path)
        assert msgspec.json.decode(msgspec.json.encode(cfg), type=ModelConfig) == cfg


def test_audio_output_tokens_is_transformers_formula(qwen2_audio):
    tower = qwen2_audio[1].model.audio_tower
    lengths = torch.arange(1, 3001)
    _, expected = tower._get_feat_extract_output_lengths(lengths)
    assert [audio_output_tokens(n) for n in lengths.tolist()] == expected.clamp(min=0).tolist()


# ---- towers --------------------------------------------------------------------------------------------------
def _hf_qwen2_audio_rows(hf, feats: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Qwen2AudioModel.forward's tower call: 3000 padded frames, padded keys masked, then the projector."""
    tower = hf.model.audio_tower
    conv_lens, tokens = tower._get_feat_extract_output_lengths(mask.sum(-1))
    rows = tower.config.max_source_positions
    keys = (torch.arange(rows)[None] < conv_lens[:, None]).long()
    attn = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(feats), rows, 1),
                                     attention_mask=keys)
    out = hf.model.multi_modal_projector(tower(feats, attention_mask=attn).last_hidden_state)
    return [out[i, :n] for i, n in enumerate(tokens.tolist())]


# 0.05 s (5 frames, 1 token), odd frame counts, chunk-sized, near and at 30 s
SECONDS = [0.05, 1.0, 3.0078, 7.33, 29.97, 30.0]


def test_qwen2_audio_tower_rows_equal_transformers(qwen2_audio):
    path, hf = qwen2_audio
    model = _ours(path)
    feats, mask = _features(path, _clips(SECONDS))
    lengths = mask.sum(-1).tolist()
    assert lengths[-2] < 3000 and lengths[-1] == 3000 and lengths[2] % 2 == 1
    with torch.no_grad():
        expected = _hf_qwen2_audio_rows(hf, feats, mask)
        # what the front end sends: valid frames and the 2 after them (clipped at 3000)
        ours = model.encode_audio([feats[i, :, : n + 2] for i, n in enumerate(lengths)], lengths)
        alone = model.encode_audio([feats[1, :, : lengths[1] + 2]], lengths[1:2])[0]
        # the padded frames after the context ones are never read
        padded = model.encode_audio([feats[1]], lengths[1:2])[0]
    for i, (e, o) in enumerate(zip(expected, ours)):
        assert o.shape == e.shape == (audio_output_tokens(lengths[i]), model.cfg.text.hidden_size)
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5, msg=f"clip {i} ({lengths[i]} frames)")
    torch.testing.assert_close(alone, ours[1], rtol=1e-6, atol=1e-6)  # batched: no attention across clips
    assert torch.equal(padded, alone)


def test_omni_audio_tower_rows_equal_transformers(omni):
    path, hf = omni
    model = _ours(path)
    chunk = 2 * model.cfg.audio.n_window
    feats, mask = _features(path, _clips([0.05, 1.0, 3.0078, chunk / 100, 29.97, 45.0], seed=1))
    lengths = mask.sum(-1).tolist()
    assert lengths[3] == chunk and lengths[-1] == 4500
    with torch.no_grad():
        expected = hf.get_audio_features(feats, mask).last_hidden_state
        ours = model.encode_audio([feats[i, :, :n] for i, n in enumerate(lengths)], lengths)
    assert sum(o.shape[0] for o in ours) == expected.shape[0]
    for i, (e, o) in enumerate(zip(expected.split([o.shape[0] for o in ours]), ours)):
        assert o.shape[0] == audio_output_tokens(lengths[i])
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5, msg=f"clip {i} ({lengths[i]} frames)")


@pytest.mark.parametrize("arch", ["qwen2_audio", "qwen2_5_omni"])
def test_audio_towers_in_bf16_and_on_either_attention_path(tiny_ckpt, monkeypatch, arch):
    """bf16 is what a CPU with native bf16 (AVX-512-BF16, AMX) serves a bf16 checkpoint in, and there the towers'
    attention runs vlserve's kernel (AVX-512, head_dim a multiple of 16). Both are checked on every machine: bf16
    rows stay close to fp32 ones (bf16 is emulated, and slow, on AVX2), and the rows from whichever attention
    path this CPU takes equal the portable fallback's (the kernel itself: tests/test_prefill_attention.py)."""
    from vlserve.model import vision_common

    path = tiny_ckpt(arch)
    full, half = _ours(path), load_model(Path(path), dtype="bfloat16")
    feats, mask = _features(path, _clips([0.7, 2.3], seed=4))
    lengths = mask.sum(-1).tolist()
    ctx = full.cfg.audio.context_frames
    clips = [feats[i, :, : n + ctx] for i, n in enumerate(lengths)]
    with torch.no_grad():
        reference = full.encode_audio(clips, lengths)
        rows_bf16 = half.encode_audio(clips, lengths)
        monkeypatch.setattr(vision_common, "_kernels", lambda q: None)
        fallback = full.encode_audio(clips, lengths)
        fallback_bf16 = half.encode_audio(clips, lengths)
    for r, b, f, fb in zip(reference, rows_bf16, fallback, fallback_bf16):
        assert b.dtype == torch.bfloat16 and b.shape == r.shape
        torch.testing.assert_close(f, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.float(), r, rtol=0.05, atol=0.05 * r.abs().max().item())
        torch.testing.assert_close(fb.float(), b.float(), rtol=0.02, atol=0.02 * r.abs().max().item())


def test_omni_vision_tower_equals_transformers(omni):
    path, hf = omni
    model = _ours(path)
    rng = np.random.default_rng(3)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((84, 112), (300, 200))]
    pixels = Qwen2VLImageProcessorPil.from_pretrained(path)(images=pictures, return_tensors="pt")
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        expected = hf.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output
        ours = model.encode_images(pixels["pixel_values"], grids)
    for e, o in zip(expected, ours):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=5e-5)


# ---- loading -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2_audio", "qwen2_5_omni", "qwen2_5_omni_full"])
def test_every_checkpoint_tensor_lands(tiny_ckpt, arch, caplog):
    """load_model raises on a parameter the checkpoint lacks; nothing of what we build is left unread either."""
    with caplog.at_level(logging.WARNING, logger="vlserve.model.loader"):
        model = _ours(tiny_ckpt(arch))
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]
    assert model.audio_tower is not None and (model.visual is None) == (arch == "qwen2_audio")
    towers = _ours(tiny_ckpt(arch), with_language=False)
    assert towers.language_model is None and towers.audio_tower is not None
    lm = _ours(tiny_ckpt(arch), with_vision=False)
    assert lm.audio_tower is None and lm.visual is None and lm.language_model is not None


@pytest.mark.parametrize("arch", ["qwen2_audio", "qwen2_5_omni"])
def test_audio_tower_is_whole_on_every_rank(tiny_ckpt, arch):
    """Under tensor parallelism the LM is split but every rank holds the whole audio tower, which runs with no
    collective (rank 1 of 2 here, no process group: a collective would fail)."""
    path = tiny_ckpt(arch)
    whole = _ours(path)
    rank1 = _ours(path, tp=TPGroup(rank=1, size=2))
    mlp_width = [m.language_model.layers[0].mlp.down_proj.weight.shape[1] for m in (whole, rank1)]
    assert mlp_width[0] == 2 * mlp_width[1]
    for (name, a), (_, b) in zip(whole.audio_tower.named_parameters(), rank1.audio_tower.named_parameters()):
        assert torch.equal(a, b), name
    feats = torch.randn(128, 300)
    with torch.no_grad():
        torch.testing.assert_close(rank1.encode_audio([feats], [298])[0], whole.encode_audio([feats], [298])[0])


def test_full_omni_checkpoint_serves_its_thinker(tiny_ckpt):
    path = tiny_ckpt("qwen2_5_omni_full")
    hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().thinker
    model = _ours(path)
    feats, mask = _features(path, _clips([2.5], seed=4))
    n = int(mask.sum())
    with torch.no_grad():
        expected = hf.get_audio_features(feats, mask).last_hidden_state
        ours = model.encode_audio([feats[0, :, :n]], [n])[0]
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        ids = torch.tensor([[5, 17, 99, 3, 250]])
        logits = model.compute_logits(_forward(model, model.embed_tokens(ids[0]), _rope_positions(5)))
        torch.testing.assert_close(logits, hf(input_ids=ids).logits[0], rtol=1e-4, atol=1e-4)


# ---- greedy decoding through our model ---------------------------------------------------------------------
def _rope_positions(n: int) -> torch.Tensor:
    return torch.arange(n).expand(3, n)


def _forward(model, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One causal prefill over the whole sequence (fresh KV cache): the final hidden states."""
    t = model.cfg.text
    n = embeds.shape[0]
    heads = model.language_model.layers[0].self_attn.num_kv_heads
    caches = [torch.zeros(2, n, heads, t.head_dim) for _ in range(t.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[build_prefill_span(0, n, n, None)])
    return model(embeds, positions, caches, meta)


@torch.no_grad()
def _our_greedy(model, ids: list[int], steps: int, media: dict[int, torch.Tensor] | None = None,
                positions: torch.Tensor | None = None) -> list[int]:
    """`media`: placeholder token id -> its rows, in order; `positions` [3, prompt] (default 1-D), generated
    tokens continue after the largest."""
    out: list[int] = []
    for _ in range(steps):
        seq = torch.tensor(ids + out)
        embeds = model.embed_tokens(seq)
        for token, rows in (media or {}).items():
            embeds[seq == token] = rows
        prompt = positions if positions is not None else _rope_positions(len(ids))
        after = prompt.max() + 1 + torch.arange(len(out))
        pos = torch.cat([prompt, after.expand(3, len(out))], dim=1)
        out.append(int(model.compute_logits(_forward(model, embeds, pos)[-1:]).argmax(-1)))
    return out


def _hf_greedy(hf, ids: list[int], steps: int, **inputs) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, pad_token_id=0, **inputs)
    return out[0, len(ids):].tolist()


def _expand(ids: list[int], token: int, counts: list[int]) -> list[int]:
    it = iter(counts)
    return [t for tok in ids for t in ([tok] * next(it) if tok == token else [tok])]


def test_qwen2_audio_text_greedy_equals_transformers(qwen2_audio):
    """Our M-RoPE decoder with three equal position rows is Qwen2's 1-D RoPE: long prompts, positions to ~700."""
    path, hf = qwen2_audio
    model = _ours(path)
    tok = AutoTokenizer.from_pretrained(path)
    for prompt in ("Hello, how are you?", "def fibonacci(n):\n    return n " * 60):
        ids = tok.encode(prompt)
        assert _our_greedy(model, ids, 10) == _hf_greedy(hf, ids, 10), prompt[:20]


def test_qwen2_audio_greedy_with_audio_equals_transformers(qwen2_audio):
    path, hf = qwen2_audio
    model = _ours(path)
    tok = AutoTokenizer.from_pretrained(path)
    clips = _clips([1.3, 4.0], seed=5)
    content = [{"type": "audio"}, {"type": "audio"}, {"type": "text", "text": "What do you hear?"}]
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    assert prompt == (SYSTEM + "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: "
                      "<|audio_bos|><|AUDIO|><|audio_eos|>\nWhat do you hear?<|im_end|>\n<|im_start|>assistant\n")
    feats, mask = _features(path, clips)
    lengths = mask.sum(-1).tolist()
    audio = model.cfg.audio_token_id
    ids = _expand(tok.encode(prompt), audio, [audio_output_tokens(n) for n in lengths])
    with torch.no_grad():
        rows = torch.cat(model.encode_audio([feats[i, :, : n + 2] for i, n in enumerate(lengths)], lengths))
    expected = _hf_greedy(hf, ids, 10, input_features=feats, feature_attention_mask=mask)
    assert _our_greedy(model, ids, 10, {audio: rows}) == expected
    # and the sound matters: other clips, other tokens
    other, other_mask = _features(path, _clips([1.3, 4.0], seed=6))
    assert _hf_greedy(hf, ids, 10, input_features=other, feature_attention_mask=other_mask) != expected


def test_omni_greedy_with_audio_and_picture_equals_transformers(omni):
    """Rows from our towers, positions from transformers' get_rope_index (the front end's is tested apart)."""
    path, hf = omni
    model = _ours(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.cfg
    content = [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Describe both."}]
    prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    assert prompt == (SYSTEM + "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|>"
                      "<|vision_eos|>Describe both.<|im_end|>\n<|im_start|>assistant\n")
    feats, mask = _features(path, _clips([2.2], seed=7))
    n = int(mask.sum())
    picture = Image.fromarray(np.random.default_rng(8).integers(0, 256, (100, 130, 3), dtype=np.uint8))
    pixels = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[picture], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    ids = _expand(tok.encode(prompt), cfg.audio_token_id, [audio_output_tokens(n)])
    ids = _expand(ids, cfg.image_token_id, [int(grid.prod()) // 4])
    input_ids = torch.tensor([ids])
    positions, _ = hf.model.get_rope_index(input_ids, grid, None, torch.ones_like(input_ids), False, mask.sum(-1))
    with torch.no_grad():
        sound = model.encode_audio([feats[0, :, :n]], [n])[0]
        sight = model.encode_images(pixels["pixel_values"], [tuple(grid[0].tolist())])[0]
    expected = _hf_greedy(hf, ids, 10, input_features=feats, feature_attention_mask=mask,
                          pixel_values=pixels["pixel_values"], image_grid_thw=grid)
    ours = _our_greedy(model, ids, 10, {cfg.audio_token_id: sound, cfg.image_token_id: sight}, positions[:, 0])
    assert ours == expected
    # the sound and the picture both move the next-token distribution (the tiny model is not very sensitive)
    def next_token(media: dict[int, torch.Tensor]) -> torch.Tensor:
        seq = torch.tensor(ids)
        embeds = model.embed_tokens(seq)
        for token, rows in media.items():
            embeds[seq == token] = rows
        with torch.no_grad():
            return model.compute_logits(_forward(model, embeds, positions[:, 0])[-1:])[0].softmax(-1)

    both = next_token({cfg.audio_token_id: sound, cfg.image_token_id: sight})
    turned = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[picture.transpose(Image.ROTATE_180)],
                                                             return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        other_sight = model.encode_images(turned, [tuple(grid[0].tolist())])[0]
    assert (next_token({cfg.audio_token_id: sound.flip(0), cfg.image_token_id: sight}) - both).abs().sum() > 0.05
    assert (next_token({cfg.audio_token_id: sound, cfg.image_token_id: other_sight}) - both).abs().sum() > 0.1


# ---- the tiny checkpoints ------------------------------------------------------------------------------------
def test_tiny_omni_folder(omni):
    """What Omni's processor reads (its video processor needs torchvision, which this venv has not)."""
    path = omni[0]
    _, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.audio_token, tok.image_token, tok.video_token) == ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")
    assert (tok.audio_bos_token, tok.vision_eos_token) == ("<|audio_bos|>", "<|vision_eos|>")
    fe = WhisperFeatureExtractor.from_pretrained(path)
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft) == (128, RATE, 160, 400)
    assert Qwen2VLImageProcessorPil.from_pretrained(path).patch_size == 14
    content = [{"type": "video"}, {"type": "audio"}, {"type": "image"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_vision_id=True,
                                       add_audio_id=True)
    assert rendered == (SYSTEM + "<|im_start|>user\nVideo 1: <|vision_bos|><|VIDEO|><|vision_eos|>Audio 1: "
                        "<|audio_bos|><|AUDIO|><|audio_eos|>Picture 1: <|vision_bos|><|IMAGE|><|vision_eos|>"
                        "<|im_end|>\n")


def test_tiny_qwen2_audio_folder(qwen2_audio):
    path = qwen2_audio[0]
    _, info = Qwen2AudioForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    fe = WhisperFeatureExtractor.from_pretrained(path)
    assert (fe.feature_size, fe.sampling_rate, fe.n_samples, fe.nb_max_frames) == (128, RATE, 30 * RATE, 3000)
    tok = AutoTokenizer.from_pretrained(path)
    with pytest.raises(Exception, match="unsupported content part type: image"):  # it cannot see
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
