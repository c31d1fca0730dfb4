"""The Qwen family's request path: pictures and videos resized by `smart_resize` and cut into patches (grid_thw in
patches), Qwen3-VL's per-patch video timestamps, audio as log-mel features, Qwen2.5-Omni's videos heard with their
sound; placeholders expanded; positions by `ModelConfig.position_kind` (M-RoPE, plain RoPE or Omni's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.core.prompt import ProcessedPrompt
from vlserve.media.audio import (
    WHISPER_CHUNK_SECONDS,
    AudioLimits,
    AudioProcessorConfig,
    load_audio,
    load_video_audio,
)
from vlserve.media.audio_features import log_mel, valid_frames
from vlserve.media.hashing import (
    hash_audio,
    hash_embeddings,
    hash_image,
    hash_user_id,
    hash_video,
    hash_video_patch,
    hash_window,
)
from vlserve.media.image import load_image
from vlserve.media.video import load_video
from vlserve.model.audio_encoder import audio_output_tokens
from vlserve.model.config_types import ModelConfig
from vlserve.model.families.processor import (
    EMBED_DTYPES,
    MediaItem,
    MediaItemCache,
    MultiModalProcessor,
    ProcessorContext,
    PromptMedia,
    decode_embeds,
    expand_all_placeholders,
    rope_positions,
)
from vlserve.model.families.qwen.config import OMNI_FAMILY
from vlserve.model.families.qwen.mrope import MRopeItem, mrope_positions
from vlserve.model.families.qwen.omni_layout import AudioVideoWindows, OmniGroup, OmniItem, omni_positions
from vlserve.model.families.qwen.pixels import (
    MAX_ASPECT_RATIO,
    ImageProcessorConfig,
    preprocess_image,
    resolve_pixel_limits,
    smart_resize,
)
from vlserve.model.families.qwen.video_layout import VideoLayout
from vlserve.model.families.qwen.video_rules import QwenVideoOptions, preprocess_video, video_grid, video_timestamps

OMNI_AUDIO_WINDOW_SECONDS = 300  # Qwen2.5-Omni's feature extractor window (Qwen2-Audio keeps Whisper's 30 s)


def audio_defaults(m: ModelConfig) -> AudioProcessorConfig:
    """The feature settings a checkpoint's preprocessor_config.json leaves out (or all, without one): Whisper's,
    with config.json's mel bins and Omni's longer window."""
    window = OMNI_AUDIO_WINDOW_SECONDS if m.architecture in OMNI_FAMILY else WHISPER_CHUNK_SECONDS
    return AudioProcessorConfig(feature_size=int(m.audio.num_mel_bins), chunk_length=window)


@dataclass
class _Item(MediaItem):
    """A media item with what Qwen's M-RoPE positions read of a video."""

    time_interval: float = 1.0  # M-RoPE temporal spacing (videos)
    seconds_per_grid: float = 1.0  # seconds one temporal patch covers (videos; Omni positions)


@dataclass
class _Heard:
    """An Omni video heard with its sound: its 2-second windows' items (frames, then audio) in prompt order."""

    items: list[_Item]
    layout: tuple[int, int, int]
    seconds_per_grid: float
    audio_tokens: int

    def token_ids(self, m) -> list[int]:
        """What replaces the video's pad: <|audio_bos|>, each window's pads, <|audio_eos|>."""
        pads = {"video": m.video_token_id, "audio": m.audio_token_id}
        return [m.audio_start_token_id, *(t for it in self.items for t in [pads[it.modality]] * it.num_tokens),
                m.audio_end_token_id]

    def placed(self, offset: int) -> list[tuple[int, _Item]]:
        out = []
        for it in self.items:
            out.append((offset, it))
            offset += it.num_tokens
        return out



class QwenProcessor(MultiModalProcessor):
    """`max_image_pixels` bounds every picture and video frame twice: as decoded (checked from the header,
    before decoding: a larger one is refused) and as resized for the encoder (the resize target shrinks to fit
    under it; checked again before resizing). `image_cfg` is None for a model without a vision tower,
    `audio_cfg` for one without an audio tower (both read from the checkpoint when not given)."""

    mm_kwargs = frozenset({"min_pixels", "max_pixels", "fps", "max_frames", "total_pixels", "use_audio_in_video"})
    max_image_aspect_ratio = MAX_ASPECT_RATIO  # smart_resize's bound (transformers')

    def __init__(self, ctx: ProcessorContext, image_cfg: ImageProcessorConfig | None = None,
                 audio_cfg: AudioProcessorConfig | None = None):
        super().__init__(ctx)
        m = ctx.model
        if image_cfg is None and m.vision is not None:
            image_cfg = ImageProcessorConfig.from_pretrained(ctx.model_path)
        if audio_cfg is None and m.audio is not None:
            audio_cfg = AudioProcessorConfig.from_pretrained(ctx.model_path, audio_defaults(m))
        self.image_cfg, self.audio_cfg = image_cfg, audio_cfg
        if audio_cfg is not None:
            self.audio_limits = AudioLimits.for_model(audio_cfg, ctx.max_audio_seconds, max_bytes=ctx.max_media_bytes)
            self.video_audio_limits = AudioLimits.for_model(audio_cfg, ctx.max_audio_seconds,
                                                            max_bytes=ctx.max_video_bytes)
        self.video_opts = QwenVideoOptions.for_model(ctx.model_path, m.video_rules, ctx.max_video_frames) \
            if m.vision is not None else None
        # Qwen3-VL: each temporal patch of a video is its own item, after a timestamp written into the prompt
        self.video_layout = (VideoLayout(ctx.tokenizer, m.vision_start_token_id, m.video_token_id,
                                         m.vision_end_token_id) if m.video_rules == "qwen3" else None)

    def process(self, prompt: PromptMedia) -> ProcessedPrompt:
        return self._run(prompt, pixels=True)

    def layout(self, prompt: PromptMedia) -> ProcessedPrompt:
        """No resize or patchify: token counts follow from the decoded size (decoding stays: the content hash is
        of the decoded pixels, as the engine's); items seen before come from `self.layouts`."""
        return self._run(prompt, pixels=False)

    def _run(self, prompt: PromptMedia, pixels: bool) -> ProcessedPrompt:
        kwargs, token_ids, media = prompt.mm_kwargs, prompt.token_ids, prompt.media
        hear_videos = self._use_audio_in_video(kwargs)
        mcfg = self.ctx.model
        audio_items_ = [self._audio(src, uid) for src, uid in media.get("audio", [])]
        image_items, per_video = [], []
        if mcfg.vision is not None:
            images = media.get("image", [])
            videos = media.get("video", [])
            min_px, max_px = resolve_pixel_limits(self.image_cfg, kwargs.get("min_pixels"), kwargs.get("max_pixels"),
                                                  cap=self.ctx.max_image_pixels)
            if min_px > max(self.image_cfg.max_pixels, self.image_cfg.min_pixels):
                raise InvalidInputError(f"min_pixels {min_px} is above this model's max_pixels "
                                        f"({self.image_cfg.max_pixels})")
            pixel_params = {"min_pixels": min_px, "max_pixels": max_px}  # what changes the encoder's output
            image_items = [self._image(src, uid, pixel_params, pixels) for src, uid in images]
            per_video = [self._video(src, uid, kwargs, pixel_params, hear_videos, pixels) for src, uid in videos]
        if self.video_layout is not None and per_video:
            stamps = [timestamps for _, timestamps in per_video]
            if prompt.from_token_ids:
                token_ids = self.video_layout.token_ids(token_ids, stamps)
            else:  # rewritten as text and tokenized again, as the reference processor does
                token_ids = prompt.tokenize(self.video_layout.text(prompt.text, stamps))
        if hear_videos:  # one replacement per video: plain, or its frames and sound interleaved
            video_pads = [items.token_ids(mcfg) if isinstance(items, _Heard) else items[0].num_tokens
                          for items, _ in per_video]
        else:
            video_items = [item for items, _ in per_video for item in items]
            video_pads = [it.num_tokens for it in video_items]
        token_ids, offsets = expand_all_placeholders(token_ids, {
            mcfg.image_token_id: [it.num_tokens for it in image_items],
            mcfg.video_token_id: video_pads,
            mcfg.audio_token_id: [it.num_tokens for it in audio_items_]})
        placed = list(zip(offsets[mcfg.image_token_id], image_items)) + \
            list(zip(offsets[mcfg.audio_token_id], audio_items_))
        groups = []
        if hear_videos:
            for start, (items, _) in zip(offsets[mcfg.video_token_id], per_video):
                if isinstance(items, _Heard):  # after its <|audio_bos|>
                    groups.append((items, OmniGroup(start + 1, items.layout, items.seconds_per_grid,
                                                    items.audio_tokens)))
                    placed += items.placed(start + 1)
                else:
                    placed.append((start, items[0]))
        else:
            placed += list(zip(offsets[mcfg.video_token_id], video_items))
        placed.sort(key=lambda x: x[0])
        positions, delta = POSITIONS[mcfg.position_kind](self, len(token_ids), placed, groups)
        mm_items = [it.placed_at(off) for off, it in placed]
        return ProcessedPrompt(token_ids, mm_items, positions, delta, prompt.text)


    def _mrope(self, length: int, placed: list, groups: list) -> tuple[torch.Tensor, int]:
        return mrope_positions(range(length), [MRopeItem(off, it.layout, it.time_interval) for off, it in placed],
                               self.ctx.model.vision.spatial_merge_size)

    def _rope(self, length: int, placed: list, groups: list) -> tuple[torch.Tensor, int]:
        """Qwen2-Audio: one running position, one row."""
        return rope_positions(length)

    def _omni(self, length: int, placed: list, groups: list) -> tuple[torch.Tensor, int]:
        m = self.ctx.model
        in_groups = {id(it) for heard, _ in groups for it in heard.items}
        entries = [OmniItem(off, it.num_tokens, it.layout, it.seconds_per_grid, it.modality == "audio")
                   for off, it in placed if id(it) not in in_groups] + [group for _, group in groups]
        entries.sort(key=lambda e: e.offset)
        return omni_positions(length, entries, m.vision.spatial_merge_size, m.audio.position_id_per_seconds,
                              m.audio.seconds_per_chunk)

    def _use_audio_in_video(self, kwargs: dict) -> bool:
        hear = kwargs.get("use_audio_in_video", False)
        if not isinstance(hear, bool):
            raise InvalidInputError("use_audio_in_video must be true or false")
        if hear and self.ctx.model.position_kind != "omni":
            raise InvalidInputError("use_audio_in_video: this model cannot hear a video's sound (Qwen2.5-Omni can)")
        return hear

    def _image(self, src: Any, uid: str | None, params: dict, pixels: bool = True) -> _Item:
        if isinstance(src, dict) and "image_embeds" in src:
            return self._embeds(src)
        key = MediaItemCache.key("image", src, [uid, params])
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(key, lambda: self._load_image(src, uid, params, pixels))

    def _load_image(self, src: Any, uid: str | None, params: dict, pixels: bool) -> _Item:
        img = load_image(src, self.image_bounds, lambda w, h: self._resized(h, w, params))  # checked undecoded
        h, w = self._resized(img.height, img.width, params)
        patch, merge = self.image_cfg.patch_size, self.image_cfg.merge_size
        mm_hash = hash_user_id(str(uid), params) if uid else hash_image(img, params)
        if not pixels:  # what preprocess_image's grid and token count would be
            return _Item((h // patch) * (w // patch) // merge**2, (1, h // patch, w // patch), mm_hash)
        p = preprocess_image(img, self.image_cfg, params["min_pixels"], params["max_pixels"])
        return _Item(p.num_embed_tokens, p.layout, mm_hash, pixel_values=p.pixel_values)

    def _video(self, src: Any, uid: str | None, kwargs: dict, pixel_params: dict,
               hear: bool = False, pixels: bool = True) -> tuple[list[_Item] | _Heard, list[float]]:
        """The video's items: one, or with Qwen3-VL's layout one per temporal patch plus each patch's time in
        seconds (for the prompt), or (`hear`: Omni with its sound) its windows' items."""
        opts = self.video_opts.with_overrides(kwargs, self.ctx.max_video_frames, self.ctx.max_image_pixels)
        if hear:  # a heard video's windows need its sound's features: always whole
            return self._load_video(src, uid, opts, pixel_params, hear, True)
        key = MediaItemCache.key("video", src, [uid, pixel_params, repr(opts)])
        cache = self.processed if pixels else self.layouts
        return cache.get_or_make(key, lambda: self._load_video(src, uid, opts, pixel_params, False, pixels))

    def _load_video(self, src: Any, uid: str | None, opts, pixel_params: dict, hear: bool,
                    pixels: bool) -> tuple[list[_Item] | _Heard, list[float]]:
        video = load_video(list(src) if isinstance(src, np.ndarray) else src, opts, self.image_bounds)
        lo, hi = pixel_params["min_pixels"], pixel_params["max_pixels"]
        t, h, w = video_grid(video, self.image_cfg, opts, lo, hi)
        # one item per temporal patch with Qwen3-VL's layout: each must fit the encoder on its own
        self._check_size((1, h, w) if self.video_layout is not None else (t, h, w), "video")
        params = {**pixel_params, "fps": opts.fps, "max_frames": opts.max_frames, "total_pixels": opts.total_pixels}
        mm_hash = hash_user_id(str(uid), params) if uid else hash_video(video.frames, params)
        if not pixels:
            return self._video_layout(video, (t, h, w), mm_hash)
        p = preprocess_video(video, self.image_cfg, opts, lo, hi)
        if self.video_layout is not None:
            t, h, w = p.layout
            rows = p.pixel_values.view(t, h * w, -1)
            items = [_Item(h * w // self.image_cfg.merge_size**2, (1, h, w), hash_video_patch(mm_hash, k),
                           pixel_values=rows[k], modality="video") for k in range(t)]
            return items, video_timestamps(video, self.image_cfg.temporal_patch_size)
        vision = self.ctx.model.vision
        interval = p.second_per_grid * vision.tokens_per_second if vision.time_scaled_video else 1.0
        sound = load_video_audio(src, self.video_audio_limits) if hear and not isinstance(src, np.ndarray) else None
        if sound is not None:  # a silent video stays a plain one
            return self._heard_video(p, mm_hash, sound.waveform, uid), []
        return [_Item(p.num_embed_tokens, p.layout, mm_hash, pixel_values=p.pixel_values,
                      time_interval=interval, modality="video", seconds_per_grid=p.second_per_grid)], []

    def _video_layout(self, video, grid_thw: tuple[int, int, int],
                      mm_hash: str) -> tuple[list[_Item], list[float]]:
        """`_load_video`'s items as preprocess_video's grid would make them, without the pixels."""
        t, h, w = grid_thw
        tp, tokens = self.image_cfg.temporal_patch_size, h * w // self.image_cfg.merge_size**2
        if self.video_layout is not None:
            return ([_Item(tokens, (1, h, w), hash_video_patch(mm_hash, k), modality="video") for k in range(t)],
                    video_timestamps(video, tp))
        vision, second_per_grid = self.ctx.model.vision, tp / video.sample_fps
        interval = second_per_grid * vision.tokens_per_second if vision.time_scaled_video else 1.0
        return [_Item(t * tokens, grid_thw, mm_hash, time_interval=interval, modality="video",
                      seconds_per_grid=second_per_grid)], []

    def _heard_video(self, p, video_hash: str, waveform: np.ndarray, uid: str | None) -> _Heard:
        """Frames and sound cut into the windows they are laid out in; each window of either encodes alone."""
        m = self.ctx.model
        merge = m.vision.spatial_merge_size
        sound = self._audio_item(waveform, f"{uid}/audio" if uid else None, "the video's sound track")
        t, h, w = p.layout
        windows = AudioVideoWindows.plan(t, p.second_per_grid, sound.num_tokens, m.audio.position_id_per_seconds,
                                         m.audio.seconds_per_chunk, h * w // merge**2)
        per_window = int(m.audio.position_id_per_seconds * m.audio.seconds_per_chunk)
        tokens_per_encoder_chunk = m.audio.n_window // 2  # 2 * n_window frames -> n_window rows -> pooled by 2
        if m.audio.n_window % 2 or per_window % tokens_per_encoder_chunk:
            raise InvalidInputError("use_audio_in_video: this model's audio windows do not fall on its audio "
                                    "tower's chunks, so its sound cannot be encoded window by window")
        rows = p.pixel_values.view(t, h * w, -1)
        items = []
        for kind, a, b in windows.order():
            if kind == "video":
                items.append(_Item((b - a) * h * w // merge**2, (b - a, h, w), hash_window(video_hash, a, b),
                                   pixel_values=rows[a:b].reshape((b - a) * h * w, -1), modality="video",
                                   seconds_per_grid=p.second_per_grid))
                continue
            # A token pools 2 rows of the stride-2 stem: 4 frames. The last window keeps every frame left: the
            # tower's last chunk reads the frames past its last whole token too (conv taps and attention).
            last = b == sound.num_tokens
            frames = (sound.audio_len if last else 4 * b) - 4 * a
            if audio_output_tokens(frames) != b - a:
                raise InvalidInputError("use_audio_in_video: the sound track's windows do not split evenly")
            feats = sound.audio_features[:, 4 * a:None if last else 4 * b].contiguous()
            items.append(_Item(b - a, (1, 1, b - a), hash_window(sound.mm_hash, a, b), modality="audio",
                               audio_features=feats, audio_len=frames))
        return _Heard(items, p.layout, p.second_per_grid, sound.num_tokens)

    def _audio(self, src: Any, uid: str | None) -> _Item:
        clip = load_audio(src, self.audio_limits)
        return self._audio_item(clip.waveform, uid, "audio clip")

    def _audio_item(self, waveform: np.ndarray, uid: str | None, what: str) -> _Item:
        """Features the checkpoint's extractor would give (the frames the tower reads), token count checked first."""
        cfg, ctx = self.audio_cfg, self.ctx.model.audio.context_frames
        tokens = audio_output_tokens(valid_frames(len(waveform), cfg))
        if tokens <= 0:
            raise InvalidInputError(f"the {what} is too short ({len(waveform) / cfg.sampling_rate * 1000:.0f} ms): "
                                    f"it gives the model no audio token")
        name, limit = self.ctx.item_token_limit
        if tokens > limit:
            raise InvalidInputError(f"the {what} would take {tokens} embedding tokens, more than the {limit} one item "
                                    f"may take here ({name}); send a shorter one")
        feats, frames = log_mel(waveform, cfg, ctx)
        params = cfg.hash_params(ctx)
        mm_hash = hash_user_id(str(uid), params) if uid else hash_audio(waveform, cfg.sampling_rate, params)
        return _Item(tokens, (1, 1, tokens), mm_hash, modality="audio", audio_features=feats, audio_len=frames)

    def _resized(self, height: int, width: int, params: dict) -> tuple[int, int]:
        """A picture's size for the encoder (smart_resize: its aspect-ratio bound), its grid's size checked."""
        h, w = smart_resize(height, width, self.image_cfg.factor, params["min_pixels"], params["max_pixels"])
        self._check_size((1, h // self.image_cfg.patch_size, w // self.image_cfg.patch_size), "picture")
        return h, w

    def _check_size(self, grid_thw: tuple[int, int, int], what: str) -> None:
        """Refuse a resized item that is too large before doing the resize."""
        t, h, w = grid_thw
        patch, merge = self.image_cfg.patch_size, self.image_cfg.merge_size
        if h * w * patch * patch > self.ctx.max_image_pixels:
            raise MediaTooLargeError(f"the {what} would be resized to {h * w * patch * patch} pixels per frame, more "
                                     f"than the {self.ctx.max_image_pixels} allowed (--max-image-pixels)")
        tokens = t * h * w // merge**2
        name, limit = self.ctx.item_token_limit
        if tokens > limit:
            raise InvalidInputError(f"the {what} would take {tokens} embedding tokens, more than the {limit} one item "
                                    f"may take here ({name}); lower max_pixels or send a smaller one")

    def _embeds(self, entry: dict) -> _Item:
        """Precomputed image embeddings: a tensor (or base64 safetensors) plus its image_grid_thw."""
        if not self.ctx.enable_mm_embeds:
            raise InvalidInputError("image embeddings input is disabled; start with --enable-mm-embeds")
        embeds, grid = decode_embeds(entry.get("image_embeds")), entry.get("image_grid_thw")
        if isinstance(grid, torch.Tensor):
            grid = grid.flatten().tolist()
        merge = self.ctx.model.vision.spatial_merge_size
        if (not isinstance(grid, (list, tuple)) or len(grid) != 3 or not all(isinstance(g, int) and g > 0 for g in grid)
                or grid[1] % merge or grid[2] % merge):
            raise InvalidInputError(f"image_grid_thw must be 3 positive integers with h, w divisible by {merge}, "
                                    f"got {grid!r}")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        tokens = grid[0] * grid[1] * grid[2] // merge**2
        expected = (tokens, self.ctx.model.embedding_width)
        if tuple(embeds.shape) != expected:
            levels = self.ctx.model.side_rows
            layout = f" (the embedding, then {levels} DeepStack feature rows, side by side)" if levels else ""
            raise InvalidInputError(f"image_embeds has shape {tuple(embeds.shape)}; image_grid_thw {tuple(grid)} on "
                                    f"this model needs {expected}{layout}")
        if embeds.dtype not in EMBED_DTYPES:
            raise InvalidInputError(f"image_embeds dtype {embeds.dtype} is not float32, bfloat16 or float16")
        if not torch.isfinite(embeds).all():
            raise InvalidInputError("image_embeds holds NaN or infinite values")
        embeds = embeds.to(self.ctx.dtype).contiguous()
        grid = (grid[0], grid[1], grid[2])
        return _Item(tokens, grid, hash_embeddings(embeds, grid), embeddings=embeds)



# How each model family numbers a prompt's positions (`ModelConfig.position_kind`).
POSITIONS = {"mrope": QwenProcessor._mrope, "rope": QwenProcessor._rope, "omni": QwenProcessor._omni}
