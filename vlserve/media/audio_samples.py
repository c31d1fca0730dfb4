"""Decoded samples to what the audio towers take: float32, channels averaged to mono, one sample rate (audio.py
decodes; this converts)."""

from __future__ import annotations

import numpy as np

from vlserve.core.errors import InvalidInputError

RESAMPLE_CHUNK = 1 << 16  # samples handed to libswresample at once (a call per small frame costs 3x)

INT_SCALE = {np.dtype(np.int16): 1 / 32768, np.dtype(np.int32): 1 / 2**31, np.dtype(np.int64): 1 / 2**63,
              np.dtype(np.int8): 1 / 128}


def to_float(arr: np.ndarray) -> np.ndarray:
    """Samples as float32 in [-1, 1): integers scaled by their range (unsigned ones centred first)."""
    if arr.dtype.kind == "f":
        with np.errstate(over="ignore"):  # float64 past float32's range becomes inf, refused by audio.py's `_finish`
            return arr.astype(np.float32, copy=False)
    if arr.dtype.kind == "u":
        half = 2 ** (8 * arr.dtype.itemsize - 1)
        return ((arr.astype(np.float64) - half) / half).astype(np.float32)
    if arr.dtype.kind == "i":
        return (arr.astype(np.float64 if arr.dtype.itemsize > 2 else np.float32) * INT_SCALE[arr.dtype]).astype(
            np.float32, copy=False)
    raise InvalidInputError(f"audio samples must be numbers, got {arr.dtype}")


def frame_mono(frame) -> np.ndarray:
    """A decoded frame's samples as float32, channels averaged."""
    arr = frame.to_ndarray()
    channels = frame.layout.nb_channels
    if not frame.format.is_planar:  # interleaved: [1, samples x channels]
        arr = arr.reshape(-1, channels).T
    return downmix(to_float(arr))


def downmix(channels: np.ndarray) -> np.ndarray:
    """float32 [channels, samples] -> [samples]: the channels' mean, summed in order then divided (numpy's
    `mean(axis=0)` in float32, without its slow strided path)."""
    if channels.shape[0] == 1:
        return channels[0]
    total = channels[0].copy()
    for row in channels[1:]:
        total += row
    total /= np.float32(channels.shape[0])
    return total


class MonoStream:
    """Mono chunks at any rate in, one waveform at `rate` out; libswresample converts, in blocks of about
    `RESAMPLE_CHUNK` samples (a new converter where the source changes its rate)."""

    def __init__(self, rate: int):
        self.rate = rate
        self.first_rate: int | None = None
        self.parts: list[np.ndarray] = []
        self._pending: list[np.ndarray] = []  # source samples not yet converted
        self._pending_samples = 0
        self._resampler = None
        self._source_rate: int | None = None

    def add(self, mono: np.ndarray, rate: int) -> None:
        if self.first_rate is None:
            self.first_rate = rate
        if rate != self._source_rate:
            self._flush()
            self._source_rate = rate
        if rate == self.rate:
            self.parts.append(np.ascontiguousarray(mono, dtype=np.float32))
            return
        self._pending.append(mono)
        self._pending_samples += len(mono)
        if self._pending_samples >= RESAMPLE_CHUNK:
            self._convert()

    def _convert(self) -> None:
        if not self._pending:
            return
        import av

        block = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending, self._pending_samples = [], 0
        if self._resampler is None:
            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(block, dtype=np.float32)[None], format="flt",
                                           layout="mono")
        frame.sample_rate = self._source_rate
        self._take(self._resampler.resample(frame))

    def _take(self, frames) -> None:
        self.parts += [f.to_ndarray()[0] for f in frames]

    def _flush(self) -> None:
        self._convert()
        if self._resampler is not None:
            self._take(self._resampler.resample(None))
            self._resampler = None

    def result(self) -> np.ndarray:
        self._flush()
        if not self.parts:
            return np.zeros(0, np.float32)
        return np.ascontiguousarray(np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0])
