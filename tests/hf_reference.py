"""Greedy generation with transformers itself: the reference every parity test compares against."""

from __future__ import annotations

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


class HFReference:
    def __init__(self, arch: str, path):
        self.model = HF_CLASSES[arch].from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.image_token_id = self.model.config.image_token_id

    def inputs(self, prompt: str, images: list) -> dict:
        """transformers' pixels and grids; ids expanded by hand from transformers' grid (no vlserve code)."""
        ids = self.tokenizer.encode(prompt)
        out = {}
        if images:
            proc = self.image_processor(images=images, return_tensors="pt")
            counts = iter((proc["image_grid_thw"].prod(-1) // 4).tolist())
            ids = [t for tok in ids for t in ([tok] * next(counts) if tok == self.image_token_id else [tok])]
            out = {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
        input_ids = torch.tensor([ids])
        out["input_ids"] = input_ids
        out["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        out["attention_mask"] = torch.ones_like(input_ids)
        return out

    @torch.no_grad()
    def greedy(self, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """Returns (expanded prompt ids, generated ids); EOS is ignored so every run has the same length."""
        inputs = self.inputs(prompt, images)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        prompt_ids = inputs["input_ids"][0].tolist()
        return prompt_ids, out[0, len(prompt_ids):].tolist()


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
            counts = iter((((lengths - 1) // 2 + 1 - 2) // 2 + 1).tolist())
            ids = [t for tok in ids for t in ([tok] * next(counts) if tok == self.audio_token_id else [tok])]
            out = {"input_features": feats["input_features"], "feature_attention_mask": feats["attention_mask"]}
        input_ids = torch.tensor([ids])
        out["input_ids"] = input_ids
        out["attention_mask"] = torch.ones_like(input_ids)
        return out

    @torch.no_grad()
    def greedy(self, prompt: str, clips: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
        inputs = self.inputs(prompt, clips)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        prompt_ids = inputs["input_ids"][0].tolist()
        return prompt_ids, out[0, len(prompt_ids):].tolist()
