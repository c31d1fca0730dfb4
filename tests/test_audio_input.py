"""Audio input: log-mel features equal to transformers' WhisperFeatureExtractor, PyAV decoding of every supported
container, downmix and resampling, the limits (each a clear 4xx before the work it bounds), content hashes, the
chat parts (`input_audio`, `audio_url`) and that decoding and features run off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import threading
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from tests.audio_samples import b64, data_url, encode_audio, encode_video_with_audio, noise, sine
from vlserve.core.config import DEFAULT_MM_LIMITS, EngineArgs, ServerArgs, parse_limits
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.frontend.chat import parse_chat_messages
from vlserve.media.audio import (
    AudioLimits,
    AudioProcessorConfig,
    audio_items,
    load_audio,
    load_video_audio,
)
from vlserve.media.audio_features import log_mel, valid_frames
from vlserve.media.audio_formats import check_audio_format, sniff_audio_format
from vlserve.media.hashing import hash_audio

QWEN2_AUDIO = AudioProcessorConfig()  # 128 mel bins, 16 kHz, 30 s window
LIMITS = AudioLimits()


def hf_features(x: np.ndarray, cfg: AudioProcessorConfig = QWEN2_AUDIO) -> tuple[torch.Tensor, int]:
    fe = WhisperFeatureExtractor(feature_size=cfg.feature_size, sampling_rate=cfg.sampling_rate,
                                 hop_length=cfg.hop_length, n_fft=cfg.n_fft, chunk_length=cfg.chunk_length,
                                 padding_value=cfg.padding_value)
    out = fe(x, sampling_rate=cfg.sampling_rate, padding="max_length", return_attention_mask=True,
             return_tensors="pt")
    return out["input_features"][0], int(out["attention_mask"].sum())


def assert_features_match(x: np.ndarray, cfg: AudioProcessorConfig = QWEN2_AUDIO, context: int = 2) -> None:
    ref, ref_len = hf_features(x, cfg)
    feats, length = log_mel(x, cfg, context)
    assert length == ref_len == valid_frames(len(x), cfg)
    assert feats.dtype == torch.float32 and feats.shape == (cfg.feature_size, min(ref_len + context, ref.shape[1]))
    assert (feats - ref[:, :feats.shape[1]]).abs().max().item() < 1e-5


# ---- features -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("samples", [1, 150, 399, 8000, 16001, 16000 * 7 + 13, 479_841, 479_999, 480_000])
def test_features_equal_whisper_extractor(samples):
    """< 1 s, odd counts, the last frames of the window and exactly 30 s: the valid frames, the two frames after
    them (their values come from the zero padding and the clip's maximum) and the valid length."""
    x = noise(samples, seed=samples) + np.resize(sine(1.0), samples)
    assert_features_match(x, context=0)
    assert_features_match(x, context=2)


@pytest.mark.parametrize("x", [np.zeros(5000, np.float32), noise(3000, amp=1e-6), noise(3000, amp=50.0)],
                         ids=["silence", "quiet", "loud"])
def test_features_at_the_floor_and_the_clamp(x):
    assert_features_match(x)


def test_features_of_other_settings():
    """Whisper's 80 bins, a padding value that is not silence, Qwen2.5-Omni's 300 s window."""
    assert_features_match(noise(12345, seed=1), AudioProcessorConfig(feature_size=80))
    assert_features_match(noise(7777, seed=2), AudioProcessorConfig(feature_size=80, padding_value=0.3))
    omni = AudioProcessorConfig(chunk_length=300)
    assert_features_match(noise(16000 * 40 + 7, seed=3), omni)
    assert omni.max_seconds == 300 and omni.nb_max_frames == 30000


def test_features_of_every_context_at_the_window_end():
    x = noise(2998 * 160, seed=4)
    for context in (0, 1, 2, 5):
        feats, length = log_mel(x, QWEN2_AUDIO, context)
        assert length == 2998 and feats.shape[1] == min(2998 + context, 3000)


def test_features_refuse_what_the_window_cannot_hold():
    with pytest.raises(MediaTooLargeError, match="30 s"):
        log_mel(np.zeros(480_001, np.float32), QWEN2_AUDIO)
    with pytest.raises(InvalidInputError, match="no samples"):
        log_mel(np.zeros(0, np.float32), QWEN2_AUDIO)


# ---- decoding ---------------------------------------------------------------------------------------------------
def test_a_waveform_at_the_model_rate_is_taken_as_is():
    x = noise(16000 * 3 + 1, seed=5)
    for src in ((x, 16000), (torch.from_numpy(x), 16000), (x, 16000.0), x):
        audio = load_audio(src, LIMITS)
        assert audio.waveform.dtype == np.float32 and np.array_equal(audio.waveform, x)
        assert audio.sample_rate == audio.source_rate == 16000 and audio.source_channels == 1


def test_channels_are_averaged():
    left, right = noise(8000, seed=6), noise(8000, seed=7)
    mean = np.stack([left, right]).mean(axis=0, dtype=np.float32)
    for src in (np.stack([left, right]), np.stack([left, right]).T):  # [channels, samples] and [samples, channels]
        audio = load_audio((src, 16000), LIMITS)
        assert np.array_equal(audio.waveform, mean) and audio.source_channels == 2


def test_integer_samples_are_scaled():
    pcm = (noise(4000, seed=8) * 32767).astype(np.int16)
    assert np.array_equal(load_audio((pcm, 16000), LIMITS).waveform, pcm.astype(np.float32) / 32768)
    u8 = np.array([0, 128, 255], np.uint8)
    assert np.allclose(load_audio((u8, 16000), LIMITS).waveform, [-1.0, 0.0, 127 / 128])


def test_int16_stereo_wav_decodes_to_the_mean_of_its_channels_and_its_features():
    """A 16 kHz int16 stereo WAV: no resampling, (L + R) / 2 of the int16 values / 32768, features equal HF's
    on that waveform."""
    pcm = (np.stack([sine(1.3), noise(20800, seed=9)]) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.T.tobytes())
    audio = load_audio(buf.getvalue(), LIMITS)
    expected = (pcm.astype(np.float32) / 32768).mean(axis=0, dtype=np.float32)
    assert audio.source_format == "wav" and audio.source_channels == 2
    assert np.array_equal(audio.waveform, expected)
    assert_features_match(audio.waveform)


@pytest.mark.parametrize("kind,rate", [("wav", 44100), ("wav_f32", 16000), ("mp3", 44100), ("flac", 48000),
                                       ("ogg", 48000), ("webm", 48000), ("m4a", 44100), ("aiff", 22050)])
def test_every_container_decodes(kind, rate, tmp_path):
    """Made with PyAV here; decoded from bytes, a data URL, a path and a file:// URL: about the clip's length
    and the sound itself (lossy codecs: correlated, not equal)."""
    clip = np.stack([sine(1.5, rate), sine(1.5, rate, phase=0.5)])
    data = encode_audio(clip, rate, kind)
    path = tmp_path / f"clip.{kind}"
    path.write_bytes(data)
    for src in (data, data_url(data), path, str(path), f"file://{path}"):
        audio = load_audio(src, LIMITS)
        assert audio.source_rate == rate and audio.source_channels == 2 and audio.sample_rate == 16000
        assert abs(audio.seconds - 1.5) < 0.1, audio.seconds
        ref = clip.mean(axis=0)[::1][: int(1.5 * rate)]
        ref16 = np.interp(np.arange(len(audio.waveform)) / 16000, np.arange(len(ref)) / rate, ref)
        n = min(len(ref16), 16000)
        if kind not in ("m4a",):  # aac shifts the clip by its encoder delay
            assert np.corrcoef(audio.waveform[800:n], ref16[800:n])[0, 1] > 0.95


def test_lossless_16khz_files_decode_exactly():
    x = noise(16000, seed=10, amp=0.3)
    pcm16 = np.round(x * 32768).clip(-32768, 32767) / 32768
    for kind in ("flac", "wav"):
        audio = load_audio(encode_audio(x, 16000, kind), LIMITS)
        assert np.allclose(audio.waveform, pcm16, atol=1 / 32768), kind
    f32 = load_audio(encode_audio(x, 16000, "wav_f32"), LIMITS)
    assert np.array_equal(f32.waveform, x)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_gives_the_length_and_the_sound(rate):
    """Into 16 kHz: the length a rate change gives (within a sample) and the same sines (the analytic signal at
    16 kHz, away from the edges where the source starts from silence), from an array and from a WAV."""
    seconds = 2.0 + 37 / rate
    x = sine(seconds, rate, freqs=(300.0, 2500.0))
    for src in ((x, rate), encode_audio(x, rate, "wav_f32")):
        audio = load_audio(src, LIMITS)
        assert abs(len(audio.waveform) - len(x) * 16000 / rate) <= 1
        ref = sine(len(audio.waveform) / 16000, 16000, freqs=(300.0, 2500.0))[:len(audio.waveform)]
        middle = slice(400, len(ref) - 400)
        assert np.abs(audio.waveform[middle] - ref[middle]).max() < 1e-3


def test_a_rate_change_inside_the_stream_is_followed():
    """Decoding state restarts at a new rate (chained streams): both parts arrive, each converted."""
    from vlserve.media.audio_samples import MonoStream

    out = MonoStream(16000)
    out.add(sine(0.5, 8000), 8000)
    out.add(sine(0.5, 32000), 32000)
    assert abs(len(out.result()) - 16000) <= 2


# ---- limits and bad input -----------------------------------------------------------------------------------
def wav_bytes(samples: int, rate: int = 16000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(samples * channels, np.int16).tobytes())
    return buf.getvalue()


def test_too_long_is_refused_with_the_bound_that_set_it():
    with pytest.raises(MediaTooLargeError, match=r"30.50 s long, more than the 30 s allowed \(--max-audio-seconds"):
        load_audio((np.zeros(16000 * 30 + 8000, np.float32), 16000), LIMITS)
    with pytest.raises(MediaTooLargeError, match="more than the 30 s"):
        load_audio(wav_bytes(44100 * 31, 44100), LIMITS)  # from the header, before decoding
    assert len(load_audio((np.zeros(16000 * 30, np.float32), 16000), LIMITS).waveform) == 480_000
    # the model's window caps the server's bound, and the error says so
    limits = AudioLimits.for_model(QWEN2_AUDIO, max_audio_seconds=600)
    assert limits.max_seconds == 30
    with pytest.raises(MediaTooLargeError, match="chunk_length"):
        load_audio((np.zeros(16000 * 31, np.float32), 16000), limits)
    omni = AudioLimits.for_model(AudioProcessorConfig(chunk_length=300), max_audio_seconds=120)
    assert omni.max_seconds == 120 and omni.max_seconds_reason == "--max-audio-seconds"


def test_codec_padding_at_the_limit_is_not_a_longer_clip():
    """30 s of AAC decodes to 30 s plus the encoder's priming (no edit list here): taken, cut at the window."""
    audio = load_audio(encode_audio(sine(30.0, 44100), 44100, "m4a"), LIMITS)
    assert len(audio.waveform) == 480_000


def test_too_long_is_caught_while_decoding_when_no_header_says():
    """A WebM holds no duration per stream: the decoded duration stops it as soon as it passes the bound."""
    data = encode_audio(sine(3.0, 48000), 48000, "webm")
    with pytest.raises(MediaTooLargeError, match="at least"):
        load_audio(data, dataclasses.replace(LIMITS, max_seconds=2.0))


def test_bytes_over_the_bound():
    data = wav_bytes(16000)
    small = dataclasses.replace(LIMITS, max_bytes=len(data) - 1)
    for src in (data, data_url(data)):
        with pytest.raises(MediaTooLargeError, match="over the limit"):
            load_audio(src, small)


def test_file_over_the_bound_and_missing_file(tmp_path):
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(16000))
    with pytest.raises(MediaTooLargeError):
        load_audio(path, dataclasses.replace(LIMITS, max_bytes=100))
    with pytest.raises(InvalidInputError, match="not found"):
        load_audio(tmp_path / "missing.wav", LIMITS)


@pytest.mark.parametrize("rate", [4000, 400_000])
def test_sample_rate_out_of_range(rate):
    with pytest.raises(InvalidInputError, match="sample rate"):
        load_audio((np.zeros(1000, np.float32), rate), LIMITS)
    with pytest.raises(InvalidInputError, match="sample rate"):
        load_audio(wav_bytes(1000, rate), LIMITS)


@pytest.mark.parametrize("rate", [16000.5, True, "16000", float("nan")])
def test_sample_rate_not_a_whole_number(rate):
    with pytest.raises(InvalidInputError):
        load_audio((np.zeros(1000, np.float32), rate), LIMITS)


def test_too_many_channels():
    with pytest.raises(InvalidInputError, match="12 channels"):
        load_audio(wav_bytes(1000, channels=12), LIMITS)
    with pytest.raises(InvalidInputError, match="9 channels"):
        load_audio((np.zeros((9, 1000), np.float32), 16000), LIMITS)
    assert load_audio(wav_bytes(1000, channels=8), LIMITS).source_channels == 8


def test_zero_length():
    for src in (wav_bytes(0), (np.zeros(0, np.float32), 16000), (np.zeros((2, 0), np.float32), 16000), b""):
        with pytest.raises(InvalidInputError, match="no audio samples|no samples|is empty"):
            load_audio(src, LIMITS)


@pytest.mark.parametrize("kind", ["wav", "mp3", "flac", "ogg", "m4a"])
def test_truncated_files_are_refused(kind):
    rate = 48000 if kind == "ogg" else 44100
    data = encode_audio(sine(2.0, rate), rate, kind)
    with pytest.raises(InvalidInputError, match="truncated|could not be"):
        load_audio(data[: len(data) * 6 // 10], LIMITS)


@pytest.mark.parametrize("data", [b"hello, not a sound at all", b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunkjunk",
                                  b"OggS" + bytes(200), b"#EXTM3U\n#EXT-X-VERSION:3\nfile:///etc/passwd\n",
                                  b"ffconcat version 1.0\nfile /etc/passwd\n"])
def test_undecodable_bytes(data):
    """Nothing but the recognised containers is ever opened: playlists and concat lists never reach ffmpeg's
    probing (which would open what they name)."""
    with pytest.raises(InvalidInputError) as e:
        load_audio(data, LIMITS)
    assert not isinstance(e.value, MediaTooLargeError)


def test_non_finite_samples():
    x = noise(1000)
    x[10] = np.nan
    with pytest.raises(InvalidInputError, match="NaN"):
        load_audio((x, 16000), LIMITS)
    with pytest.raises(InvalidInputError, match="NaN"):
        load_audio(encode_audio(x, 16000, "wav_f32"), LIMITS)


def test_declared_format_must_match_the_bytes():
    wav = wav_bytes(1600)
    assert check_audio_format("wav", wav[:12]) == "wav"
    assert check_audio_format("WAV", wav[:12]) == "wav"
    with pytest.raises(InvalidInputError, match="'mp3' but the data is wav"):
        check_audio_format("mp3", wav[:12])
    with pytest.raises(InvalidInputError, match="not supported"):
        check_audio_format("pcm16", wav[:12])
    with pytest.raises(InvalidInputError, match="but the data is wav"):
        load_audio(wav, LIMITS, fmt="flac")
    # a data URL's subtype is not judged (clients label mp3 bytes audio/wav): the container is sniffed
    assert load_audio(data_url(wav, "mpeg"), LIMITS).source_format == "wav"


def test_sniffing():
    made = {kind: encode_audio(sine(0.2, 48000), 48000, kind)[:12] for kind in ("wav", "mp3", "flac", "ogg", "webm",
                                                                              "m4a", "aiff")}
    assert {k: sniff_audio_format(v) for k, v in made.items()} == {
        "wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "webm": "matroska", "m4a": "mp4", "aiff": "aiff"}
    assert sniff_audio_format(b"\xff\xfb\x90\x00") == "mp3" and sniff_audio_format(b"\xff\xf1\x50\x80") == "aac"
    assert sniff_audio_format(b"\x89PNG\r\n\x1a\n") is None and sniff_audio_format(b"") is None


@pytest.mark.parametrize("src", ["https://example.com/a.wav", 42, [0.1, 0.2], (np.zeros(10),),
                                 "data:audio/wav;base64,@@"])
def test_bad_sources(src):
    with pytest.raises(InvalidInputError):
        load_audio(src, LIMITS)


# ---- settings, limits of a prompt, hashes -----------------------------------------------------------------------
def test_processor_config_from_a_checkpoint(tmp_path):
    qwen2_audio = {"chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
                   "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
                   "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
                   "sampling_rate": 16000}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(qwen2_audio))
    assert AudioProcessorConfig.from_pretrained(tmp_path) == QWEN2_AUDIO
    # no preprocessor_config.json: the family's defaults (Whisper's when it gives none; the Qwen family's own are
    # tested in test_audio_model.py)
    omni = tmp_path / "omni"
    omni.mkdir()
    assert AudioProcessorConfig.from_pretrained(omni) == QWEN2_AUDIO
    defaults = AudioProcessorConfig(feature_size=80, chunk_length=300)
    cfg = AudioProcessorConfig.from_pretrained(omni, defaults)
    assert (cfg.chunk_length, cfg.feature_size, cfg.n_samples) == (300, 80, 4_800_000)
    # a file that names some fields: the defaults fill the others
    (omni / "preprocessor_config.json").write_text(json.dumps({"padding_value": 0.5}))
    assert AudioProcessorConfig.from_pretrained(omni, defaults) == dataclasses.replace(defaults, padding_value=0.5)
    (omni / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        AudioProcessorConfig.from_pretrained(omni, defaults)
    (omni / "preprocessor_config.json").write_text(json.dumps({"hop_length": 0}))
    with pytest.raises(ModelLoadError):
        AudioProcessorConfig.from_pretrained(omni, defaults)


def test_prompt_limits_count_audio():
    assert DEFAULT_MM_LIMITS["audio"] == 4 and EngineArgs().mm_limits()["audio"] == 4
    assert parse_limits("image=2,audio=3") == {"image": 2, "audio": 3}
    with pytest.raises(ValueError, match="unknown media kind 'audoi'"):
        parse_limits("audoi=3")
    with pytest.raises(InvalidInputError, match="limit_mm_per_prompt"):
        EngineArgs(model="m", limit_mm_per_prompt={"sound": 1}).check()
    assert ServerArgs().max_audio_seconds == 30.0


def test_hash_audio_is_the_decoded_content():
    pcm = (noise(8000, seed=11) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    params = QWEN2_AUDIO.hash_params()
    from_file = load_audio(buf.getvalue(), LIMITS).waveform
    from_array = load_audio((pcm, 16000), LIMITS).waveform
    assert hash_audio(from_file, 16000, params) == hash_audio(from_array, 16000, params)
    assert hash_audio(from_file, 16000, params) != hash_audio(from_file[:-1], 16000, params)
    assert hash_audio(from_file, 16000, params) != hash_audio(from_file, 16000, {**params, "mel": 80})
    assert hash_audio(from_file, 16000, params) != hash_audio(from_file, 8000, params)
    assert hash_audio(from_file, 16000, params) != hash_audio(from_file, 16000, QWEN2_AUDIO.hash_params(2))


# ---- chat parts -------------------------------------------------------------------------------------------------
def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_input_audio_and_audio_url_parts():
    wav = wav_bytes(1600)
    chat = parse_chat_messages(user({"type": "text", "text": "What is it?"},
                                    {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}},
                                    {"type": "audio_url", "audio_url": {"url": "https://example.com/a.mp3"},
                                     "uuid": "clip-2"}),
                               allow_python_objects=False, modalities=("audio",))
    assert chat.messages[0]["content"] == [{"type": "text", "text": "What is it?"}, {"type": "audio"},
                                           {"type": "audio"}]
    assert chat.media["audio"] == [data_url(wav), "https://example.com/a.mp3"]
    prompt = chat.prompt("rendered")
    assert prompt["multi_modal_data"] == {"audio": chat.media["audio"]}
    assert prompt["multi_modal_uuids"] == {"audio": [None, "clip-2"]}
    assert load_audio(chat.media["audio"][0], LIMITS).seconds == pytest.approx(0.1)
    # a data URL in input_audio.data is taken as it is (and still checked against the format)
    url = data_url(wav, "wav")
    assert parse_chat_messages(user({"type": "input_audio", "input_audio": {"data": url, "format": "wav"}})
                               ).media["audio"] == [url]


@pytest.mark.parametrize("part,match", [
    ({"type": "input_audio"}, "needs 'input_audio'"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "needs 'input_audio'"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg=="}}, "format"),
    ({"type": "input_audio", "input_audio": {"data": "@@@@not base64@@@@", "format": "wav"}}, "base64"),
    ({"type": "input_audio", "input_audio": {"data": b64(b"ID3\x04" + bytes(40)), "format": "wav"}},
     "'wav' but the data is mp3"),
    ({"type": "input_audio", "input_audio": {"data": b64(b"plain text, not audio"), "format": "mp3"}},
     "not audio"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "pcm16"}}, "not supported"),
    ({"type": "audio_url", "audio_url": {}}, "audio_url"),
    ({"type": "audio", "audio": (np.zeros(10), 16000)}, "unsupported content part"),  # no Python objects
])
def test_bad_audio_parts(part, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_chat_messages(user(part), allow_python_objects=False)


def test_offline_audio_part_holds_a_python_object():
    clip = (np.zeros(160, np.float32), 16000)
    chat = parse_chat_messages(user({"type": "audio", "audio": clip}))
    assert chat.media["audio"] == [clip] and chat.messages[0]["content"] == [{"type": "audio"}]


def test_a_model_refuses_the_kinds_it_cannot_take():
    audio = {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}
    picture = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(InvalidInputError, match="this model takes image and video, not audio"):
        parse_chat_messages(user(audio), modalities=("image", "video"))
    with pytest.raises(InvalidInputError, match="this model takes audio, not image"):
        parse_chat_messages(user(picture), modalities=("audio",))
    assert parse_chat_messages(user(audio, picture), modalities=("image", "video", "audio")).media["audio"]


def _serving(limits: dict, modalities: tuple[str, ...]):
    from vlserve.server.serving_chat import OpenAIServingChat

    cfg = SimpleNamespace(limit_mm_per_prompt={**DEFAULT_MM_LIMITS, **limits}, max_model_len=4096,
                          model=SimpleNamespace(modalities=modalities))
    engine = SimpleNamespace(cfg=cfg, input_processor=SimpleNamespace(max_prompt_chars=10**6),
                             executor=None)  # messages are parsed on a worker thread (None: asyncio's default)
    return OpenAIServingChat(engine, ServerArgs(), "m")


def test_the_server_counts_audio_and_names_the_modalities_before_any_download():
    from vlserve.server.protocol import ChatCompletionRequest, parse_body

    clip = {"type": "input_audio", "input_audio": {"data": b64(wav_bytes(160)), "format": "wav"}}
    body = parse_body(json.dumps({"messages": user(clip, clip, clip)}).encode(), ChatCompletionRequest)
    with pytest.raises(InvalidInputError, match=r"3 audios in one request; at most 2 allowed \(--limit-mm-per-prompt"):
        asyncio.run(_serving({"audio": 2}, ("image", "video", "audio"))._prepare(body, 0.0, "r", None))
    with pytest.raises(InvalidInputError, match="takes image and video, not audio"):
        asyncio.run(_serving({}, ("image", "video"))._prepare(body, 0.0, "r", None))


# ---- off the event loop -----------------------------------------------------------------------------------------
def test_decoding_and_features_run_off_the_event_loop():
    """The aggregated path: the fetcher decodes the data URL on a thread, the input processor (here a stand-in
    doing what it does for audio: load_audio, log_mel, hash_audio) runs on the media pool; the loop keeps
    ticking meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from vlserve.media.fetch import MediaFetcher, MediaPolicy
    from vlserve.frontend.prompt_encoder import LocalPromptEncoder

    seen: list[tuple[str, bool]] = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    class AudioProcessor:
        def process(self, prompt, kwargs):
            for src in prompt["multi_modal_data"]["audio"]:
                assert isinstance(src, bytes)  # fetched (and decoded from base64) already
                audio = load_audio(src, LIMITS)
                feats, length = log_mel(audio.waveform, QWEN2_AUDIO, 2)
                hash_audio(audio.waveform, 16000, QWEN2_AUDIO.hash_params())
                seen.append((threading.current_thread().name, on_loop()))
            return SimpleNamespace(length=length)

    clip = data_url(encode_audio(sine(20.0, 44100), 44100, "flac"), "flac")

    async def main():
        pool = ThreadPoolExecutor(2, thread_name_prefix="vlserve-media")
        encoder = LocalPromptEncoder(AudioProcessor(), {"audio": MediaFetcher(MediaPolicy())}, pool)
        ticks, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                ticks.append(asyncio.get_running_loop().time())
                await asyncio.sleep(0.002)

        task = asyncio.create_task(ticker())
        out = await encoder.encode({"prompt": "x", "multi_modal_data": {"audio": [clip, clip]}}, None, "r")
        stop.set()
        await task
        await encoder.stop()
        pool.shutdown()
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out.prompt.length == 2000
    assert len(seen) == 2 and all(name.startswith("vlserve-media") and not loop for name, loop in seen)
    assert len(ticks) > 3  # the loop ran while the clips were decoded


# ---- a video's sound track, items ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,rate", [("mp4", 44100), ("webm", 48000)])
def test_a_video_sound_track(fmt, rate, tmp_path):
    data = encode_video_with_audio(2.0, wave=sine(2.0, rate), rate=rate, fmt=fmt)
    path = tmp_path / f"v.{fmt}"
    path.write_bytes(data)
    for src in (data, path, "data:video/mp4;base64," + b64(data)):
        audio = load_video_audio(src, LIMITS)
        assert audio is not None and abs(audio.seconds - 2.0) < 0.1 and audio.source_rate == rate
    assert load_video_audio(encode_video_with_audio(1.0, fmt=fmt), LIMITS) is None  # a silent video
    with pytest.raises(MediaTooLargeError):
        load_video_audio(data, dataclasses.replace(LIMITS, max_bytes=100))


def test_audio_items():
    clip = (np.zeros(10, np.float32), 16000)
    assert audio_items(None) == [] and audio_items(clip) == [clip] and audio_items([clip, clip]) == [clip, clip]
    assert audio_items(b"x") == [b"x"] and audio_items("data:audio/wav;base64,") == ["data:audio/wav;base64,"]
    assert len(audio_items((np.zeros(3), np.zeros(4)))) == 2  # two bare arrays, not a clip and its rate
