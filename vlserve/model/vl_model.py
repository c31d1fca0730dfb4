"""A multimodal model for generation: media towers (vision, audio: either or both), a decoder and the LM
head (the Qwen family builds every model this way; vlserve.model.families).

The runner drives the parts separately: `encode_images` / `encode_audio` for scheduled multimodal items,
`embed_tokens` + scattering of media embeddings, `forward` over the flat token batch, `compute_logits` for
the rows that sample. Either half may be left out (`with_vision`: the towers / `with_language`) for
disaggregated roles.

Side rows: a tower may return, per media token, its embedding followed by rows the decoder reads on its own
(`ModelConfig.side_rows`; `ModelConfig.embedding_width` columns in all); the runner splits them off and hands them
to `forward` (Qwen3-VL's DeepStack: one feature row per level, added after the first decoder layers).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn as nn

from vlserve.model.audio_encoder import AudioEncoder
from vlserve.model.decoder import SideRows
from vlserve.model.config_types import ModelConfig
from vlserve.model.layers.attention import AttentionMetadata
from vlserve.model.layers.moe import Experts
from vlserve.model.layers.parallel import SINGLE, TPGroup, building_for, current_tp, vocab_head


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vision_cls: type[nn.Module] | None, text_cls: type[nn.Module],
                 with_vision=True, with_language=True, vision_tp: TPGroup | None = None,
                 towers: Collection[str] | None = None, item_tokens: Callable[[tuple], int] | None = None,
                 item_pixel_rows: Callable[[tuple], int] | None = None):
        """Both halves are built for `current_tp()`; `vision_tp` (a single rank: the data-parallel encoder)
        overrides it for the vision tower. `with_vision` builds the media towers the config has (`visual` and
        `audio_tower`, None where it has none), or only those named in `towers` ("vision", "audio": an encoder
        serving some kinds); the audio tower is whole on every rank."""
        super().__init__()
        self.cfg = cfg
        self.tp = current_tp()
        self.item_tokens, self.item_pixel_rows = item_tokens, item_pixel_rows
        towers = ("vision", "audio") if towers is None else tuple(towers)
        with building_for(vision_tp or self.tp):
            self.visual = (vision_cls(cfg.vision) if with_vision and "vision" in towers and cfg.vision is not None
                           else None)
        with building_for(SINGLE):
            self.audio_tower = (AudioEncoder(cfg.audio) if with_vision and "audio" in towers and cfg.audio is not None
                                else None)
        self.language_model = text_cls(cfg.text) if with_language else None
        self.lm_head = None
        if with_language and not cfg.text.tie_word_embeddings:
            self.lm_head = vocab_head(cfg.text.hidden_size, cfg.text.vocab_size, self.tp)

    def encode_images(self, pixel_values: torch.Tensor, layouts: list[tuple[int, int, int]],
                      tower: Callable | None = None) -> list[torch.Tensor]:
        """One ViT call for several items; returns each item's rows [tokens_i, embedding_width]. `tower`: what
        runs the vision tower in its place (its captured graphs), called as the tower is."""
        merged = (tower or self.visual)(pixel_values, layouts)
        return list(merged.split([self.item_tokens(layout) for layout in layouts]))

    def encode_audio(self, features: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        """One audio-tower call for several clips (features [n_mels, frames_i], `lengths[i]` valid frames);
        returns each clip's rows [audio_output_tokens(lengths[i]), embedding_width]."""
        return self.audio_tower(features, lengths)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(token_ids)

    def forward(self, inputs_embeds, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                side: SideRows | None = None):
        return self.language_model(inputs_embeds, positions, kv_caches, meta, side)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = hidden @ self.language_model.embed_tokens.weight.t()  # tied embeddings
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.cfg.text.vocab_size]  # every rank's vocabulary slice

    def pack_for_cpu(self) -> int:
        """Prepacked oneDNN weights for every linear and MoE expert, the tied LM head included (a packed copy of
        the embedding table: the vocab projection is the biggest matrix of a decode step)."""
        from vlserve.model.layers.packed_linear import PackedLinear, pack_linears

        swapped = pack_linears(self)
        for module in self.modules():
            if isinstance(module, Experts):
                swapped += module.pack()
        if self.language_model is not None and self.lm_head is None:
            self.lm_head = PackedLinear(self.language_model.embed_tokens.weight, None)
            swapped += 1
        return swapped
