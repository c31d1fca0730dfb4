"""Small synthetic sounds and the files PyAV makes of them, for audio tests (no downloads, no ffmpeg binary)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np

# (container, codec, sample format) of each kind of file the tests make
CODECS = {
    "wav": ("wav", "pcm_s16le", "s16"),
    "wav_f32": ("wav", "pcm_f32le", "flt"),
    "mp3": ("mp3", "libmp3lame", "fltp"),
    "flac": ("flac", "flac", "s16"),
    "ogg": ("ogg", "libopus", "flt"),  # opus takes 8, 12, 16, 24 or 48 kHz
    "webm": ("webm", "libopus", "flt"),
    "m4a": ("mp4", "aac", "fltp"),
    "aiff": ("aiff", "pcm_s16be", "s16"),
}


def sine(seconds: float, rate: int = 16000, freqs=(440.0, 1250.0), amp: float = 0.3, phase: float = 0.0
         ) -> np.ndarray:
    """float32 [samples]: a sum of sines (frequencies below every Nyquist the tests use)."""
    t = np.arange(int(round(seconds * rate))) / rate
    return (amp * sum(np.sin(2 * np.pi * f * t + phase * (i + 1)) for i, f in enumerate(freqs)) / len(freqs)
            ).astype(np.float32)


def noise(samples: int, seed: int = 0, amp: float = 0.1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * amp).astype(np.float32)


def encode_audio(wave: np.ndarray, rate: int, kind: str = "wav") -> bytes:
    """A file of `kind` (see CODECS) holding `wave`, float [samples] (mono) or [channels, samples]."""
    fmt, codec, sample_fmt = CODECS[kind]
    planes = wave[None] if wave.ndim == 1 else wave
    layout = {1: "mono", 2: "stereo"}.get(planes.shape[0], f"{planes.shape[0]}c")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        stream.format = sample_fmt
        _write_sound(container, stream, planes, rate, layout, sample_fmt)
    return buf.getvalue()


def _write_sound(container, stream, planes: np.ndarray, rate: int, layout: str, sample_fmt: str) -> None:
    """Encode float planes [channels, samples] into `stream` a codec frame at a time, then flush it."""
    size = stream.codec_context.frame_size or 1024
    convert = av.AudioResampler(format=sample_fmt, layout=layout, rate=rate)
    for start in range(0, planes.shape[1], size):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, start:start + size], np.float32),
                                           format="fltp", layout=layout)
        frame.sample_rate, frame.pts = rate, start
        for converted in convert.resample(frame):
            for packet in stream.encode(converted):
                container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)


def data_url(data: bytes, subtype: str = "wav") -> str:
    return f"data:audio/{subtype};base64," + base64.b64encode(data).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encode_video_with_audio(seconds: float = 1.0, fps: int = 4, wave: np.ndarray | None = None, rate: int = 16000,
                            fmt: str = "mp4") -> bytes:
    """A small h264 video (gradient frames) with, when `wave` is given, an AAC (mp4) or Opus (webm) sound track."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        video = container.add_stream("libx264" if fmt == "mp4" else "libvpx-vp9", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = None
        if wave is not None:
            audio = container.add_stream("aac" if fmt == "mp4" else "libopus", rate=rate, layout="mono")
        for i in range(int(seconds * fps)):
            pixels = np.full((48, 64, 3), (i * 30) % 256, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            _write_sound(container, audio, wave[None], rate, "mono", audio.codec_context.codec.audio_formats[0].name)
    return buf.getvalue()
