"""Log-mel features of Whisper-style audio towers (Qwen2-Audio, Qwen2.5-Omni).

`log_mel` equals transformers' `WhisperFeatureExtractor(..., padding="max_length",
return_attention_mask=True)` on the frames a tower reads (the valid frames and `context_frames` after them),
padded frames included: their value comes from the clip's global maximum, and frames of pure padding never raise
that maximum (they sit at the floor), so only the frames that touch the signal are transformed.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.media.audio import WHISPER_MAX_FREQUENCY, AudioProcessorConfig


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4)."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3 / 200
    log = 15 + np.log(np.maximum(hz, 1e-10) / 1000) * 27 / np.log(6.4)
    return np.where(hz >= 1000, log, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15, 1000 * np.exp((mel - 15) * np.log(6.4) / 27), mel * 200 / 3)


@lru_cache(maxsize=8)
def mel_filters(n_fft: int, n_mels: int, sampling_rate: int, max_frequency: float = WHISPER_MAX_FREQUENCY
                ) -> torch.Tensor:
    """float32 [n_mels, n_fft // 2 + 1]: triangles evenly spaced in Slaney mels from 0 Hz to `max_frequency`,
    each scaled to unit area in Hz (Slaney's normalisation), over the FFT bins' frequencies."""
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(max_frequency), n_mels + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None] - lo) / (mid - lo)
    falling = (hi - bins[None]) / (hi - mid)
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (hi - lo))
    return torch.from_numpy(weights.astype(np.float32))


@lru_cache(maxsize=8)
def _sparse_mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """The same, as a sparse (CSR) matrix: each FFT bin feeds at most two filters, so the product with the power
    spectrum costs a few hundred multiply-adds a frame instead of n_mels x bins."""
    with warnings.catch_warnings():  # "sparse CSR support is in beta": a product is all that is used here
        warnings.simplefilter("ignore", UserWarning)
        return mel_filters(n_fft, n_mels, sampling_rate).to_sparse_csr()


@lru_cache(maxsize=8)
def _window(n_fft: int) -> torch.Tensor:
    return torch.hann_window(n_fft)


def valid_frames(num_samples: int, cfg: AudioProcessorConfig) -> int:
    """Feature frames of a clip of `num_samples` (transformers' `feature_attention_mask.sum()`)."""
    return min(-(-num_samples // cfg.hop_length), cfg.nb_max_frames)


def log_mel(waveform: Any, cfg: AudioProcessorConfig, context_frames: int = 0) -> tuple[torch.Tensor, int]:
    """(features float32 [n_mels, L + context_frames, at most the window's frames], L): transformers'
    WhisperFeatureExtractor output (max_length padding) for those frames, L the valid ones.

    Frame t is the Hann-windowed n_fft samples centred on sample t x hop of the padded window (reflected at its
    ends); power spectrum, Slaney mel filters, log10 floored at 1e-10, then everything raised to (the window's
    maximum - 8) and mapped by (x + 4) / 4. Frames that only see padding are at the floor and never hold the
    maximum, so only frames up to the last one touching the clip (or the last one returned) are transformed.
    """
    x = torch.as_tensor(np.asarray(waveform, dtype=np.float32) if not isinstance(waveform, torch.Tensor)
                        else waveform.detach().cpu().float()).flatten()
    n, total, hop, n_fft = x.numel(), cfg.n_samples, cfg.hop_length, cfg.n_fft
    if n == 0:
        raise InvalidInputError("the audio holds no samples")
    if n > total:
        raise MediaTooLargeError(f"the audio is {n / cfg.sampling_rate:.2f} s long, more than the "
                                 f"{cfg.max_seconds:g} s this model takes")
    if context_frames < 0:
        raise ValueError("context_frames must be >= 0")
    frames, half = cfg.nb_max_frames, n_fft // 2
    length = valid_frames(n, cfg)
    out = min(length + context_frames, frames)
    touching = min(-(-(n + half) // hop), frames)  # frames whose window reaches a sample of the clip
    needed = max(out, touching) if cfg.padding_value == 0 else frames
    span = (needed - 1) * hop + half  # samples of the window the needed frames read, after the left padding
    if span <= total:  # the right end's reflection is never read: pad with the padding value only
        body = torch.full((max(span, half + 1),), cfg.padding_value, dtype=torch.float32)
        body[:min(n, body.numel())] = x[:body.numel()]
        padded = torch.cat([body[1:half + 1].flip(0), body[:span]])
    else:
        body = torch.full((total,), cfg.padding_value, dtype=torch.float32)
        body[:n] = x
        padded = torch.cat([body[1:half + 1].flip(0), body, body[-half - 1:-1].flip(0)])
        padded = padded[:(needed - 1) * hop + n_fft]
    # Frames as rows: one real FFT per row, the power from the real and imaginary parts (no square root), then
    # the sparse mel filters times the power as [bins, frames] (a third of the time of torch.stft, abs() ** 2 and
    # a dense product).
    spec = torch.view_as_real(torch.fft.rfft(padded.unfold(0, n_fft, hop) * _window(n_fft), dim=-1))
    power = (spec[..., 0].square() + spec[..., 1].square()).T.contiguous()  # [bins, needed]
    mel = _sparse_mel_filters(n_fft, cfg.feature_size, cfg.sampling_rate) @ power  # [n_mels, needed]
    logs = mel.clamp_(min=1e-10).log10_()
    floor = logs.max() - 8.0
    feats = torch.maximum(logs[:, :out], floor).add_(4.0).div_(4.0)
    return feats.contiguous(), length
