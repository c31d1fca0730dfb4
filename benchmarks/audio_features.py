"""Audio input cost: log-mel features against transformers' WhisperFeatureExtractor, and decoding by container.

Features (the same frames, max abs difference printed): transformers' `__call__` (padding="max_length", its torch
path), its numpy path (`_np_extract_fbank_features` on the padded window), and vlserve's `log_mel`, for clips of
several lengths in Qwen2-Audio's 30 s window and Qwen2.5-Omni's 300 s one. Decoding: `load_audio` of a 30 s
stereo clip in each container (resampled to 16 kHz where it is not already).

    .venv/bin/python benchmarks/audio_features.py [--seconds 1,5,30] [--omni-seconds 30,300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.audio_samples import encode_audio, noise, sine  # noqa: E402
from vlserve.media.audio import AudioLimits, AudioProcessorConfig, load_audio  # noqa: E402
from vlserve.media.audio_features import log_mel  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def features(seconds: list[float], cfg: AudioProcessorConfig, repeats: int) -> None:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=cfg.feature_size, chunk_length=cfg.chunk_length)
    print(f"\nfeatures, {cfg.feature_size} mel bins, {cfg.max_seconds:g} s window (ms, best of {repeats}):")
    print(f"{'clip':>8} {'HF __call__':>12} {'HF numpy':>10} {'vlserve':>9} {'speed-up':>9} {'max diff':>9}")
    for s in seconds:
        x = noise(int(s * cfg.sampling_rate), seed=int(s)) + np.resize(sine(1.0), int(s * cfg.sampling_rate))

        def hf():
            return fe(x, sampling_rate=cfg.sampling_rate, padding="max_length", return_attention_mask=True,
                      return_tensors="pt")

        padded = np.zeros((1, cfg.n_samples), np.float32)
        padded[0, :len(x)] = x
        t_hf = best_of(hf, repeats)
        t_np = best_of(lambda: fe._np_extract_fbank_features(padded, "cpu"), max(1, repeats // 2))
        t_ours = best_of(lambda: log_mel(x, cfg, 2), repeats)
        ours, _ = log_mel(x, cfg, 2)
        diff = (ours - hf()["input_features"][0, :, :ours.shape[1]]).abs().max().item()
        print(f"{s:>7g}s {t_hf:>12.1f} {t_np:>10.1f} {t_ours:>9.1f} {t_hf / t_ours:>8.1f}x {diff:>9.1e}")


def decoding(repeats: int) -> None:
    print(f"\ndecoding a 30 s stereo clip to 16 kHz mono (ms, best of {repeats}):")
    for kind, rate in (("wav", 16000), ("wav", 44100), ("flac", 48000), ("mp3", 44100), ("ogg", 48000),
                       ("m4a", 44100)):
        clip = np.stack([sine(30.0, rate), sine(30.0, rate, phase=0.5)])
        data = encode_audio(clip, rate, kind)
        t = best_of(lambda: load_audio(data, AudioLimits()), repeats)
        print(f"  {kind:>5} {rate:>6} Hz {len(data) / 2**20:>6.2f} MiB {t:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", default="1,5,30", help="clip lengths in Qwen2-Audio's 30 s window")
    p.add_argument("--omni-seconds", default="30,300", help="clip lengths in Qwen2.5-Omni's 300 s window")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    features([float(s) for s in args.seconds.split(",")], AudioProcessorConfig(), args.repeats)
    features([float(s) for s in args.omni_seconds.split(",")], AudioProcessorConfig(chunk_length=300),
             max(1, args.repeats // 2))
    decoding(args.repeats)


if __name__ == "__main__":
    main()
