"""Audio decoding (PyAV) for Whisper-style audio towers (Qwen2-Audio, Qwen2.5-Omni): settings, limits, decoding.
Features are in `audio_features.py`, container recognition in `audio_formats.py`, samples to mono float32 at one
rate in `audio_samples.py`.

Decoding: bytes, data URLs, files and `(waveform, sample_rate)` arrays become one mono float32 waveform at the
model's rate. The container is recognised from its first bytes (`sniff_audio_format`) and opened with that
demuxer only, so ffmpeg never probes its way into a playlist or concat format that would open other files or
URLs. Channels are averaged to mono with equal weights (what librosa's `to_mono` does, and so what transformers'
`load_audio` and vLLM users get); the rate is converted with libswresample's default filter (what
`ffmpeg -ar 16000` does). A waveform already at the model's rate is kept as it is, sample for sample. Every limit
(`AudioLimits`) is checked before the work it bounds: the header's duration before decoding, then the decoded
duration frame by frame, so a small file that claims or holds hours of sound costs at most the limit.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlserve.core.config import DEFAULT_MAX_AUDIO_SECONDS
from vlserve.core.errors import InvalidInputError, MediaTooLargeError, ModelLoadError
from vlserve.media.audio_formats import (
    DEMUXERS,
    SNIFF_BYTES,
    check_audio_format,
    check_wav_header,
    ogg_cut_short,
    sniff_audio_format,
    wav_cut_short,
    wav_format_name,
)
from vlserve.media.audio_samples import RESAMPLE_CHUNK, MonoStream, downmix, frame_mono, to_float
from vlserve.media.data_url import decode_data_url, is_data_url
from vlserve.media.pixels import read_json_object

# Whisper's feature extractor settings (transformers' WhisperFeatureExtractor defaults, with Whisper-large-v3's 128
# mel bins, which the audio towers served here use), for a checkpoint without a preprocessor_config.json; a family
# overrides them with its own (`AudioProcessorConfig.from_pretrained`'s `defaults`).
WHISPER_SAMPLING_RATE = 16000
WHISPER_HOP_LENGTH = 160
WHISPER_N_FFT = 400
WHISPER_MAX_FREQUENCY = 8000.0  # the mel filters' top, whatever the rate (as transformers builds them)
WHISPER_MEL_BINS = 128
WHISPER_CHUNK_SECONDS = 30

# Server-side bounds (see `AudioLimits`; --max-audio-seconds is DEFAULT_MAX_AUDIO_SECONDS by default).
MIN_SAMPLE_RATE = 8000  # telephone speech, the lowest rate common speech recordings use
MAX_SAMPLE_RATE = 384000  # the highest rate audio interfaces record at
MAX_CHANNELS = 8  # 7.1 surround, the widest common layout; decoding cost grows with every channel
# The largest sample magnitude taken. Full scale is 1 (integers are scaled to it); a float clip may go past it, and
# a float clip of unscaled integer samples reaches 2**31, but nothing real comes near this, and much larger values
# (from 1e18 on) overflow the features to NaN. A clip with a larger sample is refused, never silently rescaled.
MAX_SAMPLE_MAGNITUDE = 1e10
_TRUNCATION_SLACK_S = 0.1  # decoded this much (plus 2 %) shorter than the header says: the file was cut
# A file may decode to this much more than the sound it holds: a codec's priming and padding (AAC adds 1024 to
# 2048 samples, MP3 up to 1152 + 529) where the container does not say to drop them. A file at the limit plus at
# most this is taken, and that tail (padding, not sound) dropped at the limit.
_CODEC_PADDING_S = 0.1
_PROBE_BYTES = 1 << 16
_NO_DURATION_HEADER = frozenset({"aac"})  # ADTS: ffmpeg guesses the duration from the bit rate


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioProcessorConfig:
    """A checkpoint's feature extractor settings (its preprocessor_config.json).

    The padded window is `chunk_length` seconds, as transformers computes it (`n_samples = chunk_length x
    sampling_rate`, whatever the file says of n_samples); a longer clip is refused, never cut (transformers would
    cut it). `max_seconds` is that window: a model whose tower takes more raises it by replacing `chunk_length`
    (`dataclasses.replace`), which pads to the longer window exactly as transformers would with that setting.
    """

    feature_size: int = WHISPER_MEL_BINS
    sampling_rate: int = WHISPER_SAMPLING_RATE
    hop_length: int = WHISPER_HOP_LENGTH
    n_fft: int = WHISPER_N_FFT
    chunk_length: float = WHISPER_CHUNK_SECONDS
    padding_value: float = 0.0
    dither: float = 0.0  # read, not applied: features stay a function of the content (the caches key on it)

    @property
    def n_samples(self) -> int:
        """The padded window in samples."""
        return int(self.chunk_length * self.sampling_rate)

    @property
    def nb_max_frames(self) -> int:
        """Frames of the padded window (the feature extractor drops the STFT's last one)."""
        return self.n_samples // self.hop_length

    @property
    def max_seconds(self) -> float:
        return self.n_samples / self.sampling_rate

    def hash_params(self, context_frames: int = 0) -> dict:
        """The settings that change the features a tower reads (for `hash_audio`): these, and how many frames
        after the valid ones it reads."""
        return {"mel": self.feature_size, "rate": self.sampling_rate, "hop": self.hop_length, "n_fft": self.n_fft,
                "window": self.n_samples, "pad": self.padding_value, "context": context_frames}

    @classmethod
    def from_dict(cls, d: dict[str, Any], defaults: "AudioProcessorConfig | None" = None) -> "AudioProcessorConfig":
        base = defaults or cls()
        try:
            cfg = cls(feature_size=int(d.get("feature_size", base.feature_size)),
                      sampling_rate=int(d.get("sampling_rate", base.sampling_rate)),
                      hop_length=int(d.get("hop_length", base.hop_length)),
                      n_fft=int(d.get("n_fft", base.n_fft)),
                      chunk_length=float(d.get("chunk_length", base.chunk_length)),
                      padding_value=float(d.get("padding_value", base.padding_value)),
                      dither=float(d.get("dither", base.dither) or 0.0))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"unreadable audio feature settings ({type(e).__name__}: {e})") from None
        if min(cfg.feature_size, cfg.sampling_rate, cfg.hop_length, cfg.n_fft) <= 0 or cfg.nb_max_frames <= 0:
            raise ModelLoadError(f"invalid audio feature settings: {cfg}")
        if cfg.n_fft // 2 >= cfg.n_samples:
            raise ModelLoadError(f"audio window of {cfg.n_samples} samples is shorter than half of n_fft")
        return cfg

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, defaults: "AudioProcessorConfig | None" = None
                        ) -> "AudioProcessorConfig":
        """preprocessor_config.json's feature extractor fields; what it leaves out (or the whole file, if there is
        none) takes `defaults`: the model family's (its mel bins and window), Whisper's when None."""
        defaults = defaults or cls()
        raw = read_json_object(Path(folder) / "preprocessor_config.json")
        return defaults if raw is None else cls.from_dict(raw, defaults)


@dataclass(frozen=True)
class AudioLimits:
    """What one audio item may be, and the rate it is decoded to. `max_bytes` bounds raw bytes given directly
    (URLs, data URLs and files are bounded by the fetch policy, `--max-media-bytes`)."""

    sample_rate: int = WHISPER_SAMPLING_RATE  # the model's: every clip is converted to it
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_seconds_reason: str = "--max-audio-seconds"  # the bound that set max_seconds, named in errors
    max_bytes: int = 20 * 2**20
    max_bytes_reason: str = "--max-media-bytes"  # the option that sets max_bytes, named in errors
    min_sample_rate: int = MIN_SAMPLE_RATE
    max_sample_rate: int = MAX_SAMPLE_RATE
    max_channels: int = MAX_CHANNELS

    @classmethod
    def for_model(cls, cfg: AudioProcessorConfig, max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
                  max_bytes: int = 20 * 2**20) -> "AudioLimits":
        """The server's bound (`--max-audio-seconds`) within the model's window (`cfg.max_seconds`)."""
        if not max_audio_seconds > 0:
            raise InvalidInputError(f"max_audio_seconds must be positive, got {max_audio_seconds}")
        if cfg.max_seconds < max_audio_seconds:
            return cls(cfg.sampling_rate, cfg.max_seconds, "the longest this model takes: its feature extractor's "
                       "chunk_length", max_bytes)
        return cls(cfg.sampling_rate, float(max_audio_seconds), "--max-audio-seconds", max_bytes)

    @property
    def max_samples(self) -> int:
        """Samples at the model's rate of the longest clip allowed."""
        return int(self.max_seconds * self.sample_rate)


@dataclass(frozen=True)
class Audio:
    """A decoded clip: mono float32 at `sample_rate` (the model's), and what the source was."""

    waveform: np.ndarray  # float32 [samples], C-contiguous
    sample_rate: int
    source_rate: int
    source_channels: int
    source_format: str | None = None  # the container ("wav", "mp3", ...); None for arrays

    @property
    def seconds(self) -> float:
        return len(self.waveform) / self.sample_rate


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def load_audio(source: Any, limits: AudioLimits, fmt: str | None = None) -> Audio:
    """Decode `source` into a mono float32 clip at `limits.sample_rate`.

    `source`: raw bytes; a `data:audio/...;base64,` URL; a local path (str, PathLike or file://: the caller
    decides whether local files are allowed; the server's fetcher turns allowed file:// URLs into paths); a
    `(waveform, sample_rate)` tuple (numpy or torch, [samples] or [channels, samples]; a layout with the
    channels last is recognised by its short axis); or a bare array, taken to be at the model's rate. Integer
    samples are scaled to [-1, 1). `fmt` (an `input_audio.format`) must match the bytes when given.
    """
    if isinstance(source, tuple):
        if len(source) != 2:
            raise InvalidInputError("an audio tuple must be (waveform, sample_rate)")
        return _from_array(source[0], _rate(source[1]), limits)
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return _from_array(source, limits.sample_rate, limits)
    if isinstance(source, (bytes, bytearray, memoryview)):  # read where it is: a clip can be tens of megabytes
        data = source if isinstance(source, bytes) else memoryview(source).cast("B")
        if len(data) > limits.max_bytes:
            raise _too_big("the audio", len(data), limits)
        return _decode_bytes(data, limits, fmt, "the audio")
    if isinstance(source, os.PathLike):
        return _decode_path(Path(source), limits, fmt)
    if isinstance(source, str):
        if is_data_url(source):  # its subtype is not judged (audio/wav for mp3 bytes is common): the bytes are
            data = decode_data_url(source, limits.max_bytes, "audio", limits.max_bytes_reason)
            return _decode_bytes(data, limits, fmt, "the audio data URL")
        if source.startswith(("http://", "https://")):
            raise InvalidInputError("remote audio URLs must be fetched before load_audio")
        return _decode_path(Path(source.removeprefix("file://")), limits, fmt)
    raise InvalidInputError(f"unsupported audio source type {type(source).__name__}")


def load_video_audio(source: Any, limits: AudioLimits) -> Audio | None:
    """A video's sound track (for `use_audio_in_video`), decoded like any clip: bytes, a path or a
    `data:video/...` URL (`limits.max_bytes` should be the video bound, --max-video-bytes). None when the video
    has no audio stream, as transformers then gives the video no audio."""
    limits = replace(limits, max_bytes_reason="--max-video-bytes")
    if isinstance(source, str) and is_data_url(source):
        return _decode_bytes(decode_data_url(source, limits.max_bytes, "video", limits.max_bytes_reason), limits,
                             None, "the video", optional=True)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > limits.max_bytes:
            raise _too_big("the video", len(data), limits)
        return _decode_bytes(data, limits, None, "the video", optional=True)
    if isinstance(source, (str, os.PathLike)):
        return _decode_path(Path(str(source).removeprefix("file://")), limits, None, optional=True)
    raise InvalidInputError(f"unsupported video source type {type(source).__name__} for its audio")


def _too_big(what: str, size: int, limits: AudioLimits) -> MediaTooLargeError:
    return MediaTooLargeError(f"{what} is {size} bytes, over the limit of {limits.max_bytes} bytes "
                              f"({limits.max_bytes_reason})")


def audio_items(value: Any) -> list:
    """`multi_modal_data["audio"]` as a list of clips: one clip (a `(waveform, sample_rate)` tuple, an array,
    bytes, a URL or path) or a list (or tuple) of them."""
    if value is None:
        return []
    if _is_clip_tuple(value) or not isinstance(value, (list, tuple)):
        return [value]
    return list(value)


def _is_clip_tuple(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (np.ndarray, torch.Tensor))
            and isinstance(value[1], (int, float, np.integer, np.floating)) and not isinstance(value[1], bool))


def _rate(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidInputError(f"an audio tuple's sample rate must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value != int(value):
        raise InvalidInputError(f"an audio sample rate must be a whole number of hertz, got {value!r}")
    return int(value)


def _decode_path(path: Path, limits: AudioLimits, fmt: str | None, optional: bool = False) -> Audio | None:
    try:
        found, size = path.is_file(), path.stat().st_size if path.is_file() else 0
    except (OSError, ValueError):
        found, size = False, 0
    if not found:
        raise InvalidInputError(f"audio file not found: {str(path)[:256]}")
    if size > limits.max_bytes:
        raise _too_big("the audio file", size, limits)
    try:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise InvalidInputError(f"cannot read audio file {path.name!r}: {e.strerror or e}") from None
    return _decode_bytes(data, limits, fmt, f"audio file {path.name!r}", optional)


def _decode_bytes(data: bytes | memoryview, limits: AudioLimits, fmt: str | None, what: str, optional: bool = False
                  ) -> Audio | None:
    if not data:
        raise InvalidInputError(f"{what} is empty")
    if len(data) > limits.max_bytes:
        raise _too_big(what, len(data), limits)
    if fmt is not None:
        container = check_audio_format(fmt, data[:SNIFF_BYTES], "the audio")
    else:
        container = sniff_audio_format(data[:SNIFF_BYTES])
        if container is None:
            raise InvalidInputError(f"{what} is not audio in a supported container ({', '.join(sorted(DEMUXERS))})")
    encoding = None
    if container == "wav":
        tag = check_wav_header(data, what)  # a malformed header: a 400 before ffmpeg reads it
        encoding = wav_format_name(tag) if tag is not None else None
        if wav_cut_short(data[:1 << 16], len(data)):
            raise InvalidInputError(f"{what} is truncated: its WAV header promises more samples than the file holds")
    if container == "ogg" and ogg_cut_short(data):
        raise InvalidInputError(f"{what} is truncated: its last Ogg page runs past the end of the file")
    return _decode(io.BytesIO(data) if isinstance(data, bytes) else _ViewFile(data), container, limits, what,
                   optional, encoding)


class _ViewFile(io.RawIOBase):
    """A read-only file over bytes held elsewhere (a memoryview): io.BytesIO shares only a `bytes` object's
    buffer and would copy these."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _open(fp: Any, container: str, what: str):
    import av

    try:
        # probesize: what ffmpeg reads ahead to learn the stream's settings (its 5 MB default made opening a 5 MB
        # WAV cost 15x its decoding); every container here states them in its first packets.
        return av.open(fp, mode="r", format=DEMUXERS[container], metadata_errors="ignore",
                       options={"probesize": str(_PROBE_BYTES)})
    except (av.FFmpegError, ValueError, OSError, EOFError, ArithmeticError) as e:
        raise InvalidInputError(f"{what} could not be opened as {container} (truncated or corrupt: "
                                f"{type(e).__name__})") from None


def _decode(fp: Any, container_name: str, limits: AudioLimits, what: str, optional: bool = False,
            encoding: str | None = None) -> Audio | None:
    """The first audio stream (`optional`: None when there is none, else a 400). `encoding`: how an error names
    the stream's encoding, when the container's header said (a WAV format tag)."""
    import av

    with _open(fp, container_name, what) as container:
        if not container.streams.audio:
            if optional:
                return None
            raise InvalidInputError(f"{what} has no audio stream")
        stream = container.streams.audio[0]
        ctx = stream.codec_context
        if ctx is None or ctx.codec is None:  # ffmpeg has no decoder for what the header names
            raise InvalidInputError(f"{what} is in an encoding this server cannot decode ({encoding or container_name}"
                                    "): send PCM, IEEE float, FLAC, MP3, AAC, Vorbis or Opus audio")
        _check_rate(ctx.sample_rate, limits, what)
        _check_channels(ctx.channels, limits, what)
        declared = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                    and container_name not in _NO_DURATION_HEADER else None)
        if declared is not None and declared > limits.max_seconds + _CODEC_PADDING_S:
            raise _too_long(declared, limits, what)
        out = MonoStream(limits.sample_rate)
        seconds, channels = 0.0, ctx.channels
        try:
            for frame in container.decode(stream):
                if not frame.samples:
                    continue
                _check_rate(frame.sample_rate, limits, what)
                _check_channels(frame.layout.nb_channels, limits, what)
                seconds += frame.samples / frame.sample_rate
                if seconds > limits.max_seconds + _CODEC_PADDING_S:
                    raise _too_long(seconds, limits, what, "at least ")
                out.add(frame_mono(frame), frame.sample_rate)
        except InvalidInputError:
            raise
        except (av.FFmpegError, EOFError, ValueError) as e:
            raise InvalidInputError(f"{what} could not be decoded after {seconds:.2f} s (truncated or corrupt: "
                                    f"{type(e).__name__})") from None
    if seconds == 0:
        raise InvalidInputError(f"{what} holds no audio samples")
    if declared is not None and seconds < declared * 0.98 - _TRUNCATION_SLACK_S:
        raise InvalidInputError(f"{what} is truncated: {seconds:.2f} s decoded of the {declared:.2f} s its header "
                                "promises")
    waveform = _finish(out.result(), limits, what)
    return Audio(waveform, limits.sample_rate, out.first_rate or limits.sample_rate, channels, container_name)


def _too_long(seconds: float, limits: AudioLimits, what: str, prefix: str = "") -> MediaTooLargeError:
    return MediaTooLargeError(f"{what} is {prefix}{seconds:.2f} s long, more than the {limits.max_seconds:g} s "
                              f"allowed ({limits.max_seconds_reason}); send a shorter clip")


def _check_rate(rate: int, limits: AudioLimits, what: str) -> None:
    if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
        raise InvalidInputError(f"{what} has a sample rate of {rate} Hz, outside the {limits.min_sample_rate}-"
                                f"{limits.max_sample_rate} Hz accepted")


def _check_channels(channels: int, limits: AudioLimits, what: str) -> None:
    if not 1 <= channels <= limits.max_channels:
        raise InvalidInputError(f"{what} has {channels} channels; 1 to {limits.max_channels} are accepted")


def _from_array(wave: Any, rate: int, limits: AudioLimits) -> Audio:
    what = "the audio waveform"
    if isinstance(wave, torch.Tensor):
        wave = wave.detach().cpu()
        wave = (wave.float() if wave.is_floating_point() and wave.dtype != torch.float64 else wave).numpy()
    if not isinstance(wave, np.ndarray):
        raise InvalidInputError(f"an audio waveform must be a numpy array or a torch tensor, not "
                                f"{type(wave).__name__}")
    if wave.ndim == 1:
        wave = wave[None]
    elif wave.ndim == 2:
        if wave.shape[0] > limits.max_channels >= wave.shape[1]:
            wave = wave.T  # [samples, channels], as soundfile reads it
    else:
        raise InvalidInputError(f"an audio waveform must be [samples] or [channels, samples], got shape "
                                f"{tuple(wave.shape)}")
    _check_rate(rate, limits, what)
    _check_channels(wave.shape[0], limits, what)
    samples = wave.shape[1]
    if samples == 0:
        raise InvalidInputError(f"{what} holds no samples")
    if samples / rate > limits.max_seconds:
        raise _too_long(samples / rate, limits, what)
    if wave.dtype.kind not in "fiu":
        raise InvalidInputError(f"audio samples must be numbers, got {wave.dtype}")
    floats = to_float(wave)
    mono = downmix(floats)
    if rate == limits.sample_rate:
        waveform = np.array(mono, dtype=np.float32, order="C")  # the caller's samples, exactly (a copy)
    else:
        stream = MonoStream(limits.sample_rate)
        for start in range(0, samples, RESAMPLE_CHUNK):
            stream.add(mono[start:start + RESAMPLE_CHUNK], rate)
        waveform = stream.result()
    return Audio(_finish(waveform, limits, what), limits.sample_rate, rate, wave.shape[0])


def _finish(waveform: np.ndarray, limits: AudioLimits, what: str) -> np.ndarray:
    if len(waveform) > limits.max_samples:  # rounding or codec padding only: longer sources were refused
        waveform = waveform[:limits.max_samples]
    if not len(waveform):
        raise InvalidInputError(f"{what} holds no audio samples")
    if not np.isfinite(waveform).all():
        raise InvalidInputError(f"{what} holds NaN or infinite samples (or samples past float32's range); samples "
                                f"must be finite, within +-{MAX_SAMPLE_MAGNITUDE:g}")
    peak = float(np.abs(waveform).max())
    if peak > MAX_SAMPLE_MAGNITUDE:
        raise InvalidInputError(f"{what} holds a sample of magnitude {peak:.3g}; samples must lie within "
                                f"+-{MAX_SAMPLE_MAGNITUDE:g} (full scale is 1)")
    return waveform
