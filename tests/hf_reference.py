"""Greedy generation with transformers itself: the reference every parity test compares against."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

HF_CLASSES = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
              "qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration}


def expand_by_hand(ids: list[int], token: int, counts) -> list[int]:
    """The k-th `token` becomes counts[k] copies of it (no vlserve code)."""
    counts = iter(counts)
    return [t for tok in ids for t in ([tok] * next(counts) if tok == token else [tok])]


@torch.no_grad()
def greedy_new_tokens(model, tokenizer, inputs: dict, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(expanded prompt ids, generated ids) of transformers' `generate`; EOS is ignored so every run has the same
    length."""
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


@torch.no_grad()
def greedy_with_logprobs(model, tokenizer, inputs: dict, max_new_tokens: int) -> tuple[list[int], list[int], list]:
    """(expanded prompt ids, generated ids, each generated token's log-probability under the model's raw logits)
    of transformers' `generate` on a processor's inputs; EOS is ignored."""
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
    prompt_ids = inputs["input_ids"][0].tolist()
    new = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)]
    return prompt_ids, new, logprobs


def hf_class(arch: str):
    """transformers' class for `arch`; Qwen3.5's (transformers >= 5.23) are imported when first asked for."""
    if arch not in HF_CLASSES and arch in ("qwen3_5", "qwen3_5_moe"):
        from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

        HF_CLASSES.update(qwen3_5=Qwen3_5ForConditionalGeneration, qwen3_5_moe=Qwen3_5MoeForConditionalGeneration)
    return HF_CLASSES[arch]


def prompt_references(tiny_ckpt, prompts: list, max_new_tokens: int):
    """A module fixture's body: arch -> (tiny checkpoint folder, transformers reference, its greedy (prompt ids,
    new ids) for each of `prompts`). The reference is `shared_reference`'s; each answer is computed when a test
    first reads it (a test run alone computes only what it compares against)."""

    def get(arch: str):
        path = tiny_ckpt(arch)
        hf = shared_reference(arch, path)
        return str(path), hf, PromptReferences(hf, prompts, max_new_tokens)

    return get


class PromptReferences(Sequence):
    """transformers' greedy (prompt ids, new ids) for each of `prompts`, computed on first read (memoized by the
    reference, see `HFReference.greedy`)."""

    def __init__(self, hf: HFReference, prompts: list, max_new_tokens: int):
        self.hf, self.prompts, self.max_new_tokens = hf, prompts, max_new_tokens

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        prompt, images = self.prompts[i]
        return self.hf.greedy(prompt, images, self.max_new_tokens)


_SHARED: dict[tuple[str, str], HFReference] = {}


def shared_reference(arch: str, path) -> HFReference:
    """One `HFReference` per checkpoint for the whole test process, so its memo of answers serves every module
    that asks the same checkpoint the same prompt (the tiny checkpoints are made once per session)."""
    key = (arch, str(path))
    if key not in _SHARED:
        _SHARED[key] = HFReference(arch, path)
    return _SHARED[key]


def image_key(image) -> tuple:
    """What tells two pictures apart for transformers' image processor: mode, size, pixels, palette."""
    digest = hashlib.sha1(image.tobytes())
    palette = image.getpalette() if image.mode == "P" else None
    if palette:
        digest.update(bytes(palette))
    return image.mode, image.size, digest.hexdigest(), repr(sorted(image.info.items()))


class HFReference:
    def __init__(self, arch: str, path):
        self.model = hf_class(arch).from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.image_token_id = self.model.config.image_token_id
        self._answers: dict[tuple, dict[int, tuple[list[int], list[int]]]] = {}

    def inputs(self, prompt: str, images: list) -> dict:
        """transformers' pixels and grids; ids expanded by hand from transformers' grid (no vlserve code)."""
        ids = self.tokenizer.encode(prompt)
        out = {}
        if images:
            proc = self.image_processor(images=images, return_tensors="pt")
            ids = expand_by_hand(ids, self.image_token_id, (proc["image_grid_thw"].prod(-1) // 4).tolist())
            out = {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
        input_ids = torch.tensor([ids])
        out["input_ids"] = input_ids
        out["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        out["attention_mask"] = torch.ones_like(input_ids)
        return out

    def greedy(self, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """Memoized (greedy decoding is deterministic): the same prompt and pictures are generated once. EOS is
        masked up to the last token (`greedy_new_tokens`), so the first n tokens of a longer answer are the n-token
        answer: a shorter request is answered from a longer run."""
        runs = self._answers.setdefault((prompt, tuple(image_key(im) for im in images)), {})
        longest = max((n for n in runs if n >= max_new_tokens), default=None)
        if longest is None:
            longest = max_new_tokens
            runs[longest] = greedy_new_tokens(self.model, self.tokenizer, self.inputs(prompt, images), longest)
        prompt_ids, new = runs[longest]
        return list(prompt_ids), list(new[:max_new_tokens])


class HFAudioReference:
    """transformers' Qwen2-Audio: its own feature extractor (30 s, padded) and `generate`; the audio placeholder
    expanded by hand from the extractor's mask (no vlserve code)."""

    def __init__(self, path):
        from transformers import Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

        self.model = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        self.audio_token_id = self.model.config.audio_token_id

    def inputs(self, prompt: str, clips: list) -> dict:
        ids = self.tokenizer.encode(prompt)
        out = {}
        if clips:
            feats = self.extractor(clips, sampling_rate=self.extractor.sampling_rate, padding="max_length",
                                   return_attention_mask=True, return_tensors="pt")
            lengths = feats["attention_mask"].sum(-1)
            ids = expand_by_hand(ids, self.audio_token_id, (((lengths - 1) // 2 + 1 - 2) // 2 + 1).tolist())
            out = {"input_features": feats["input_features"], "feature_attention_mask": feats["attention_mask"]}
        input_ids = torch.tensor([ids])
        out["input_ids"] = input_ids
        out["attention_mask"] = torch.ones_like(input_ids)
        return out

    def greedy(self, prompt: str, clips: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
        return greedy_new_tokens(self.model, self.tokenizer, self.inputs(prompt, clips), max_new_tokens)


class HFOmniReference:
    """transformers' Qwen2.5-Omni thinker (alone, or inside the full model): WhisperFeatureExtractor for sound,
    Qwen2VLImageProcessorPil for pictures, video pixels given (ours, equal to transformers' image path: see
    test_video.py). Placeholders expanded by hand; a video heard with its sound laid out by transformers' own
    `Qwen2_5OmniProcessor.replace_video_with_audio_token`, called unbound (the processor needs torchvision)."""

    def __init__(self, path, full: bool = False):
        from transformers import (
            Qwen2_5OmniForConditionalGeneration,
            Qwen2_5OmniThinkerForConditionalGeneration,
            WhisperFeatureExtractor,
        )

        if full:
            self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).thinker
        else:
            self.model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.cfg = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)

    def _sound(self, wave) -> tuple[torch.Tensor, torch.Tensor, int]:
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

        feats = self.extractor([wave], sampling_rate=self.extractor.sampling_rate, padding="max_length",
                               return_attention_mask=True, return_tensors="pt")
        mask = feats["attention_mask"]
        return feats["input_features"], mask, int(_get_feat_extract_output_lengths(mask.sum(-1))[0])

    def _heard_layout(self, grid: tuple[int, int, int], seconds_per_grid: float, audio_tokens: int) -> list[int]:
        import types

        import numpy as np
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

        c = self.cfg
        processor = types.SimpleNamespace(  # what the method reads of its processor; one character a token
            video_processor=types.SimpleNamespace(merge_size=c.vision_config.spatial_merge_size),
            audio_bos_token="B", audio_eos_token="E", video_token="V", audio_token="A",
            get_chunked_index=lambda idx, n: Qwen2_5OmniProcessor.get_chunked_index(None, np.asarray(idx), n))
        text = Qwen2_5OmniProcessor.replace_video_with_audio_token(
            processor, {"video_grid_thw": [list(grid)], "video_second_per_grid": [seconds_per_grid]}, 0,
            {"num_audio_tokens": [audio_tokens]}, 0, position_id_per_seconds=c.position_id_per_seconds,
            seconds_per_chunk=c.seconds_per_chunk)
        ids = {"B": c.audio_start_token_id, "E": c.audio_end_token_id, "V": c.video_token_id, "A": c.audio_token_id}
        return [ids[ch] for ch in text]

    def inputs(self, prompt: str, audio=(), images=(), videos=(), heard: bool = False) -> dict:
        """`audio`: waveforms at 16 kHz; `videos`: (pixel_values, grid_thw, seconds_per_grid, waveform | None),
        heard with their sound when `heard` (every video of the prompt then needs one)."""
        c = self.cfg
        merge = c.vision_config.spatial_merge_size
        clips, sounds, out = iter(audio), [], {}
        pictures = iter([])
        if images:
            im = self.image_processor(images=list(images), return_tensors="pt")
            out.update(pixel_values=im["pixel_values"], image_grid_thw=im["image_grid_thw"])
            pictures = iter((im["image_grid_thw"].prod(-1) // merge**2).tolist())
        films = iter(videos)
        ids = []
        for tok in self.tokenizer.encode(prompt):
            if tok == c.audio_token_id:
                sounds.append(self._sound(next(clips)))
                ids += [tok] * sounds[-1][2]
            elif tok == c.image_token_id:
                ids += [tok] * next(pictures)
            elif tok == c.video_token_id:
                _, grid, seconds, wave = next(films)
                if heard:
                    sounds.append(self._sound(wave))
                    ids += self._heard_layout(grid, seconds, sounds[-1][2])
                else:
                    ids += [tok] * (grid[0] * grid[1] * grid[2] // merge**2)
            else:
                ids.append(tok)
        if sounds:  # in the order the prompt hears them, the video's own among the clips
            out.update(input_features=torch.cat([s[0] for s in sounds]),
                       feature_attention_mask=torch.cat([s[1] for s in sounds]))
        if videos:
            out.update(pixel_values_videos=torch.cat([v[0] for v in videos]),
                       video_grid_thw=torch.tensor([list(v[1]) for v in videos]),
                       video_second_per_grid=torch.tensor([v[2] for v in videos]))
        out["use_audio_in_video"] = heard
        input_ids = torch.tensor([ids])
        out.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return out

    def greedy(self, prompt: str, max_new_tokens: int, **media) -> tuple[list[int], list[int]]:
        return greedy_new_tokens(self.model, self.tokenizer, self.inputs(prompt, **media), max_new_tokens)


LLAVA_ARCHES = ("LlavaOnevisionForConditionalGeneration", "LlavaNextVideoForConditionalGeneration")


def llava_processor(folder, tokenizer=None):
    """transformers' own processor (LlavaOnevisionProcessor / LlavaNextVideoProcessor) over a LLaVA checkpoint's
    files, with the PIL image processor and the tokenizer's chat template. Their video processors need torchvision,
    which is not installed: none is given (the class check that would load one is skipped while it is made)."""
    import json
    from pathlib import Path
    from unittest import mock

    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_next_video.processing_llava_next_video import LlavaNextVideoProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    folder = Path(folder)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    processor_cls, image_cls = dict(zip(LLAVA_ARCHES, [(LlavaOnevisionProcessor, LlavaOnevisionImageProcessorPil),
                                                       (LlavaNextVideoProcessor, LlavaNextImageProcessorPil)]))[arch]
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    own = json.loads((folder / "processor_config.json").read_text())
    own.pop("processor_class", None)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return processor_cls(image_processor=image_cls.from_pretrained(folder), tokenizer=tokenizer,
                             chat_template=tokenizer.chat_template, **own)


class _LlavaFrames:
    """Stands in for transformers' LLaVA video processors (torchvision): each video's frames as vlserve's
    `pixels.video_pixels` makes them, [frames, 3, side, side] (equal to transformers' torchvision pipeline:
    tests/test_llava_processor.py). The processor's own `replace_video_token` then counts the tokens."""

    def __init__(self, folder, arch: str):
        from vlserve.model.families.llava.pixels import load_settings

        self.settings = load_settings(folder, arch, "video")

    def __call__(self, videos, **kwargs):
        import numpy as np
        from transformers.feature_extraction_utils import BatchFeature

        from vlserve.model.families.llava.pixels import video_pixels

        videos = [videos] if isinstance(videos, np.ndarray) and videos.ndim == 4 else list(videos)
        side = self.settings.out_side
        pixels = [video_pixels(v, self.settings).view(len(v), 3, side, side) for v in videos]
        return BatchFeature({"pixel_values_videos": torch.stack(pixels)})


class HFLlavaReference:
    """transformers' LLaVA-OneVision / LLaVA-NeXT-Video: its processor expands the placeholders and makes the
    pictures' pixels (`llava_processor`), video frames from `_LlavaFrames`; its model's `generate`."""

    def __init__(self, path):
        import json
        from pathlib import Path

        from transformers import LlavaNextVideoForConditionalGeneration, LlavaOnevisionForConditionalGeneration

        self.arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
        model_cls = dict(zip(LLAVA_ARCHES, [LlavaOnevisionForConditionalGeneration,
                                            LlavaNextVideoForConditionalGeneration]))[self.arch]
        self.model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = llava_processor(path, self.tokenizer)
        self.processor.video_processor = _LlavaFrames(path, self.arch)

    def inputs(self, text: str, images=(), videos=()) -> dict:
        media = {"images": list(images) or None, "videos": list(videos) or None}
        return dict(self.processor(text=[text], **media, return_tensors="pt"))

    @torch.no_grad()
    def greedy(self, text: str, max_new_tokens: int, images=(), videos=()) -> tuple[list[int], list[int], list]:
        """(expanded prompt ids, generated ids, each generated token's log-probability under the model's raw
        logits); EOS is ignored."""
        return greedy_with_logprobs(self.model, self.tokenizer, self.inputs(text, images, videos), max_new_tokens)


class _InternVLFrames:
    """Stands in for transformers' InternVLVideoProcessor (torchvision): each video's frames as vlserve makes
    them, [frames, 3, S, S] (torch's resize: the one torchvision runs); the processor's own `replace_video_token`
    then lays the video out."""

    def __init__(self, folder):
        from vlserve.model.families.internvl.pixels import load_settings

        self.settings = load_settings(folder, "video")

    def __call__(self, videos, **kwargs):
        import numpy as np
        from transformers.feature_extraction_utils import BatchFeature

        from vlserve.model.families.internvl.pixels import frame_pixels

        videos = [videos] if isinstance(videos, np.ndarray) and videos.ndim == 4 else list(videos)
        side = self.settings.tile
        pixels = [frame_pixels(list(v), self.settings).view(len(v), 3, side, side) for v in videos]
        return BatchFeature({"pixel_values_videos": torch.stack(pixels)})


def internvl_processor(folder, tokenizer=None):
    """transformers' InternVLProcessor over an InternVL checkpoint's files with the PIL image processor
    (GotOcr2ImageProcessorPil); its video processor is `_InternVLFrames` (the class check that would load the
    torchvision one is skipped while it is made)."""
    import json
    from pathlib import Path
    from unittest import mock

    from transformers import InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    own = json.loads((Path(folder) / "processor_config.json").read_text())
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        proc = InternVLProcessor(image_processor=GotOcr2ImageProcessorPil.from_pretrained(folder),
                                 tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template,
                                 image_seq_length=own["image_seq_length"])
    proc.video_processor = _InternVLFrames(folder)
    return proc


class HFInternVLReference:
    """transformers' InternVL3: its processor (`internvl_processor`) and its model's `generate`; the same calls as
    HFLlavaReference."""

    def __init__(self, path, model=None):
        from transformers import InternVLForConditionalGeneration

        self.path = path
        self.model = model or InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = internvl_processor(path, self.tokenizer)

    def inputs(self, text: str, images=(), videos=()) -> dict:
        media = {"images": list(images) or None, "videos": list(videos) or None}
        return dict(self.processor(text=[text], **media, return_tensors="pt"))

    @torch.no_grad()
    def greedy(self, text: str, max_new_tokens: int, images=(), videos=()) -> tuple[list[int], list[int], list]:
        """(expanded prompt ids, generated ids, each generated token's log-probability); EOS is ignored."""
        return greedy_with_logprobs(self.model, self.tokenizer, self.inputs(text, images, videos), max_new_tokens)
