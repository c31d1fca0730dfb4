"""The audio families' part of `make-tiny-model` (qwen/tiny.py): Qwen2-Audio's and Qwen2.5-Omni's configs, and
their Whisper feature extractor's preprocessor_config.json (Omni's also holds its image processor's fields).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5OmniThinkerConfig

from vlserve.model.families.qwen.tiny_parts import (
    OMNI,
    QwenShape,
    image_processor_config,
    lm_token_ids,
    text_config,
    vision_config,
)

# Whisper's log-mel front end, as Qwen2-Audio and Omni ship it: 128 bins of 10 ms at 16 kHz; Qwen2-Audio reads
# 30 s windows, Omni's extractor pads to 300 s (its tower reads valid frames only).
MEL_BINS, SAMPLING_RATE, HOP_LENGTH, N_FFT = 128, 16000, 160, 400
AUDIO_POSITIONS = 1500  # rows of the tower's position table: 30 s after the stride-2 conv


def _audio_tower_config(shape: QwenShape, init_range: float) -> dict[str, Any]:
    d_model, layers, heads, ffn = shape.audio
    return {"num_mel_bins": MEL_BINS, "d_model": d_model, "encoder_layers": layers, "encoder_attention_heads": heads,
            "encoder_ffn_dim": ffn, "max_source_positions": AUDIO_POSITIONS, "activation_function": "gelu",
            "initializer_range": init_range}


def model_config(arch: str, spec, shape: QwenShape, vocab_size: int, ids: dict[str, int], init_range: float,
                 config_cls) -> Any:
    """Qwen2-Audio (a Qwen2 LM with 1-D RoPE) or Qwen2.5-Omni's thinker (Qwen2.5-VL's vision tower and M-RoPE
    LM), or the full Omni model around that thinker with a minimal talker and token2wav."""
    token_ids = lm_token_ids(ids)
    text = text_config(spec, vocab_size, token_ids, init_range)
    if arch == "qwen2_audio":
        text |= {"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                 "tie_word_embeddings": False}  # transformers never ties Qwen2-Audio's head
        return config_cls(text_config=text, audio_config={"model_type": "qwen2_audio_encoder",
                                                          **_audio_tower_config(shape, init_range)},
                          audio_token_index=ids["<|AUDIO|>"])
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": list(shape.mrope_section),
                               "rope_theta": 1000000.0}
    vision = vision_config("qwen2_5_vl", spec, shape, init_range)
    del vision["tokens_per_second"]  # Omni spaces video by the thinker's position_id_per_seconds
    audio = _audio_tower_config(shape, init_range) | {"n_window": shape.audio_n_window, "output_dim": spec.hidden}
    media_ids = {"image_token_index": ids["<|IMAGE|>"], "video_token_index": ids["<|VIDEO|>"],
                 "audio_token_index": ids["<|AUDIO|>"], "vision_start_token_id": ids["<|vision_bos|>"],
                 "vision_end_token_id": ids["<|vision_eos|>"], "audio_start_token_id": ids["<|audio_bos|>"],
                 "audio_end_token_id": ids["<|audio_eos|>"]}
    thinker = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, position_id_per_seconds=25, seconds_per_chunk=2,
        tie_word_embeddings=spec.tie_embeddings, initializer_range=init_range, **media_ids, **token_ids)
    if arch == "qwen2_5_omni":
        return thinker
    # The talker turns the thinker's states into codec tokens, token2wav those into sound: random and minimal,
    # present so the checkpoint has what a released one has (vlserve skips their weights).
    talker = {"hidden_size": 32, "embedding_size": spec.hidden, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "initializer_range": init_range,
              "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
              **media_ids, **{k: v for k, v in token_ids.items() if k != "eos_token_id"}}
    dit = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16, "emb_dim": 16,
           "enc_emb_dim": 16, "enc_dim": 16, "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8,
           "enc_se_channels": 8, "num_embeds": 32, "mel_dim": 8, "look_ahead_layers": [0],
           "look_backward_layers": [0]}
    bigvgan = {"mel_dim": 8, "upsample_initial_channel": 16, "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
               "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]]}
    return config_cls(thinker_config=thinker.to_dict(), talker_config=talker,
                      token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan})


def preprocessor_config(arch: str, max_pixels: int) -> dict[str, Any]:
    """WhisperFeatureExtractor's fields (Omni: with its picture processor's in the same file)."""
    seconds = 300 if arch in OMNI else 30
    audio = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": MEL_BINS,
        "sampling_rate": SAMPLING_RATE,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "chunk_length": seconds,
        "n_samples": seconds * SAMPLING_RATE,
        "nb_max_frames": seconds * SAMPLING_RATE // HOP_LENGTH,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
        "processor_class": "Qwen2_5OmniProcessor" if arch in OMNI else "Qwen2AudioProcessor",
    }
    return image_processor_config(arch, max_pixels) | audio if arch in OMNI else audio
