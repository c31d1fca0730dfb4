"""A random multimodal chat workload for `vlserve bench serve`.

Each request is one user message in OpenAI chat format: some `image_url` parts holding
random-noise pictures as base64 data URLs, some `input_audio` parts holding synthetic sound (tones
and noise) as base64 WAV, then a text part of random words. Everything is drawn from one seeded
generator, so the same config always yields byte-identical requests (and a config without audio the
same requests as before audio existed).
"""

from __future__ import annotations

import base64
import io
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

# Plain lowercase words: each is one or two BPE tokens in most vocabularies, so word count
# is a fair stand-in for prompt length without needing the server's tokenizer.
WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education blue green red small "
    "large quick slow bright dark river mountain window garden street table chair paper light"
).split()


@dataclass
class RandomMMConfig:
    num_prompts: int = 100
    input_len: int = 64  # words of text per request
    output_len: int = 64  # max_tokens per request
    range_ratio: float = 0.0  # 0: fixed lengths; r: uniform in [len*(1-r), len*(1+r)]
    image_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(448, 448)])  # (width, height)
    images_per_request: int = 1
    max_images_per_request: int | None = None  # set: image count uniform in [images_per_request, this]
    repeat_image_ratio: float = 0.0  # share of images re-used from the pool below
    repeat_pool_size: int = 8  # how many distinct pictures re-used images are drawn from
    image_format: str = "jpeg"  # jpeg encodes ~15x faster than png and is a quarter of the size
    audios_per_request: int = 0
    max_audios_per_request: int | None = None  # set: clip count uniform in [audios_per_request, this]
    audio_seconds: list[float] = field(default_factory=lambda: [5.0])  # one picked at random per clip
    audio_sample_rate: int = 16000  # another rate makes the server resample
    repeat_audio_ratio: float = 0.0  # share of clips re-used from a pool of `repeat_pool_size` earlier ones
    seed: int = 0

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if not 0.0 <= self.repeat_image_ratio <= 1.0:
            raise ValueError("repeat_image_ratio must be in [0, 1]")
        if self.images_per_request < 0:
            raise ValueError("images_per_request must be >= 0")
        if self.max_images_per_request is not None and self.max_images_per_request < self.images_per_request:
            raise ValueError("max_images_per_request must be >= images_per_request")
        if not self.image_sizes or any(w < 1 or h < 1 for w, h in self.image_sizes):
            raise ValueError("image_sizes must be a non-empty list of positive (width, height)")
        if self.repeat_pool_size < 1:
            raise ValueError("repeat_pool_size must be >= 1")
        if self.image_format not in ("jpeg", "png"):
            raise ValueError("image_format must be 'jpeg' or 'png'")
        if self.audios_per_request < 0:
            raise ValueError("audios_per_request must be >= 0")
        if self.max_audios_per_request is not None and self.max_audios_per_request < self.audios_per_request:
            raise ValueError("max_audios_per_request must be >= audios_per_request")
        if not self.audio_seconds or any(not 0 < s <= 3600 for s in self.audio_seconds):
            raise ValueError("audio_seconds must be a non-empty list of lengths in (0, 3600] seconds")
        if not 8000 <= self.audio_sample_rate <= 192000:
            raise ValueError("audio_sample_rate must be in [8000, 192000]")
        if not 0.0 <= self.repeat_audio_ratio <= 1.0:
            raise ValueError("repeat_audio_ratio must be in [0, 1]")


@dataclass
class BenchRequest:
    messages: list[dict[str, Any]]
    max_tokens: int
    num_images: int
    num_words: int  # length of the text part, in words
    num_repeated_images: int = 0  # how many of the images came from the re-use pool
    num_audios: int = 0
    audio_seconds: float = 0.0  # all clips of the request together


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'224x224,448x336' -> [(224, 224), (448, 336)] (width x height)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            w, h = item.split("x")
            sizes.append((int(w), int(h)))
        except ValueError:
            raise ValueError(f"bad image size {item!r}; expected WIDTHxHEIGHT such as 448x448") from None
    if not sizes:
        raise ValueError("no image sizes given")
    return sizes


def parse_audio_seconds(text: str) -> list[float]:
    """'5' -> [5.0]; '2,10,30' -> [2.0, 10.0, 30.0] (one picked at random per clip)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad audio lengths {text!r}; expected seconds such as 5 or 2,10,30") from None
    if not values or any(not 0 < v <= 3600 for v in values):
        raise ValueError("audio lengths must be seconds in (0, 3600]")
    return values


def sample_len(rng: np.random.Generator, base: int, ratio: float, minimum: int) -> int:
    """Uniform integer in [base*(1-ratio), base*(1+ratio)], at least `minimum`."""
    if ratio == 0.0:
        return max(base, minimum)
    lo = max(int(np.floor(base * (1 - ratio))), minimum)
    hi = max(int(np.ceil(base * (1 + ratio))), lo)
    return int(rng.integers(lo, hi + 1))


def noise_data_url(rng: np.random.Generator, size: tuple[int, int], fmt: str) -> str:
    w, h = size
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    if fmt == "png":
        # Noise does not compress; level 1 keeps encoding fast at no loss in size.
        Image.fromarray(pixels, "RGB").save(buf, "PNG", compress_level=1)
    else:
        Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=85)
    return f"data:image/{fmt};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def tone_wav(rng: np.random.Generator, seconds: float, rate: int) -> bytes:
    """A mono 16-bit WAV of `seconds`: three random tones, each fading in and out at its own pace, over quiet
    noise (something like voiced sound to an audio encoder, unlike pure noise or silence)."""
    n = max(1, int(round(seconds * rate)))
    t = np.arange(n) / rate
    sound = np.zeros(n)
    for _ in range(3):
        freq, pace, phase = rng.uniform(120.0, 3000.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi)
        sound += np.sin(2 * np.pi * freq * t + phase) * (0.5 + 0.5 * np.sin(2 * np.pi * pace * t))
    sound = sound / 3 * 0.5 + rng.normal(0.0, 0.01, n)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(sound, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _audio_parts(rng: np.random.Generator, cfg: RandomMMConfig, pool: list[tuple[str, float]]
                 ) -> tuple[list[dict[str, Any]], float]:
    """This request's `input_audio` parts and their seconds in all. Draws nothing when the config asks for no
    audio, so image workloads stay what they were."""
    hi = cfg.max_audios_per_request if cfg.max_audios_per_request is not None else cfg.audios_per_request
    if hi == 0:
        return [], 0.0
    parts, seconds = [], 0.0
    for _ in range(int(rng.integers(cfg.audios_per_request, hi + 1))):
        reuse = rng.random() < cfg.repeat_audio_ratio  # drawn every time, like the pictures' coin
        if reuse and pool:
            data, length = pool[int(rng.integers(len(pool)))]
        else:
            length = cfg.audio_seconds[int(rng.integers(len(cfg.audio_seconds)))]
            data = base64.b64encode(tone_wav(rng, length, cfg.audio_sample_rate)).decode("ascii")
            if len(pool) < cfg.repeat_pool_size:
                pool.append((data, length))
        parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
        seconds += length
    return parts, seconds


def build_requests(cfg: RandomMMConfig) -> list[BenchRequest]:
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    pool: list[str] = []  # first pictures made; later ones re-use these to hit the server's caches
    audio_pool: list[tuple[str, float]] = []  # the same for sound clips (base64 WAV, seconds)
    out = []
    for _ in range(cfg.num_prompts):
        hi_images = cfg.max_images_per_request if cfg.max_images_per_request is not None else cfg.images_per_request
        n_images = int(rng.integers(cfg.images_per_request, hi_images + 1))
        content: list[dict[str, Any]] = []
        repeated = 0
        for _ in range(n_images):
            # Draw the coin every time (even with an empty pool) so the stream of random numbers,
            # hence the workload, does not depend on how the pool happened to fill.
            reuse = rng.random() < cfg.repeat_image_ratio
            if reuse and pool:
                url = pool[int(rng.integers(len(pool)))]
                repeated += 1
            else:
                size = cfg.image_sizes[int(rng.integers(len(cfg.image_sizes)))]
                url = noise_data_url(rng, size, cfg.image_format)
                if len(pool) < cfg.repeat_pool_size:
                    pool.append(url)
            content.append({"type": "image_url", "image_url": {"url": url}})
        audio, seconds = _audio_parts(rng, cfg, audio_pool)
        content += audio
        n_words = sample_len(rng, cfg.input_len, cfg.range_ratio, minimum=1)
        text = " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=n_words))
        content.append({"type": "text", "text": text})
        out.append(BenchRequest(
            messages=[{"role": "user", "content": content}],
            max_tokens=sample_len(rng, cfg.output_len, cfg.range_ratio, minimum=1),
            num_images=n_images,
            num_words=n_words,
            num_repeated_images=repeated,
            num_audios=len(audio),
            audio_seconds=seconds,
        ))
    return out
