"""The audio towers of Qwen2-Audio and Qwen2.5-Omni: Whisper's encoder, pooled and projected to the LM width.

    log-mel [n_mels, frames] -> conv1 (k3) -> GELU -> conv2 (k3, stride 2) -> GELU -> + positions
      -> pre-LN transformer layers (full attention inside a segment) -> average pool by 2 -> LayerNorm -> proj

The two families differ in what a *segment* is:
- Qwen2-Audio: the whole clip (at most 30 s, 1500 rows after the stride-2 conv), with a learned position table
  from the checkpoint. transformers runs it on the extractor's 3000 padded frames and masks the padded keys; we
  run it on the clip's valid frames plus the 2 the convolution reads past them (`AudioConfig.context_frames`,
  sent by the front end), which gives the same rows for the valid tokens.
- Qwen2.5-Omni: chunks of 2 * n_window frames (the last one shorter), each convolved with its own zero
  padding, positioned from 0 with Whisper's sinusoids, and attended on its own.
Pooling runs over a clip's rows (all its chunks), in pairs; an odd last row is dropped.

Many clips go through in one call as a flat `[rows, d_model]` list (no attention across segments; see
`vision_common.varlen_attention`). Qwen2-Audio's multi_modal_projector is this tower's `proj` (the loader
renames it), so both towers hand the LM its rows directly.

Tensor parallelism: the tower is small beside the LM and is built whole on every rank (`building_for` a single
rank, as the data-parallel vision encoder is); rank 0 runs it alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlserve.core.errors import InvalidInputError
from vlserve.model.config_types import AudioConfig
from vlserve.model.layers.mlp import get_activation, in_row_slices
from vlserve.model.vision_common import plan_varlen, varlen_attention


def audio_output_tokens(feature_len: int) -> int:
    """LM tokens of a clip of `feature_len` valid log-mel frames: the stride-2 conv, then pooling by 2."""
    after_conv = (feature_len - 1) // 2 + 1
    return max(0, (after_conv - 2) // 2 + 1)


def conv_output_rows(frames: int) -> int:
    """Rows the stride-2 conv stem makes of `frames` frames."""
    return (frames - 1) // 2 + 1


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] fp32: sines of the position at log-spaced timescales, then cosines (Whisper's)."""
    cpu = torch.device("cpu")  # explicit: construction may run under a meta-device context
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2, device=cpu).float())
    scaled_time = torch.arange(length, device=cpu)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class AudioAttention(nn.Module):
    """Whisper's attention: biased q/v/out projections, no bias on k."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor, plan) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(varlen_attention(q, k, v, plan).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.act = get_activation(cfg.activation)

    def forward(self, x: torch.Tensor, plan) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), plan)
        x = x + in_row_slices(lambda rows: self.fc2(self.act(self.fc1(self.final_layer_norm(rows)))), x)
        if x.dtype == torch.float16:  # as the reference: keep fp16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        if cfg.learned_positions:  # Qwen2-Audio: the checkpoint's table
            self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        else:  # Omni: computed; a plain fp32 attribute, so dtype casts and meta-device construction leave it alone
            self._sinusoids = {torch.device("cpu"): whisper_sinusoids(cfg.max_source_positions, cfg.d_model)}
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.output_dim)

    def positions(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        if self.cfg.learned_positions:
            return self.embed_positions.weight[:rows]
        if like.device not in self._sinusoids:
            self._sinusoids[like.device] = self._sinusoids[torch.device("cpu")].to(like.device)
        return self._sinusoids[like.device][:rows].to(like.dtype)

    def segments(self, features: list[torch.Tensor], lengths: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """What the stem convolves on its own, and the number of rows each keeps: Qwen2-Audio a clip (its valid
        frames and the context frames after them), Omni each chunk of a clip's valid frames."""
        cfg = self.cfg
        if cfg.learned_positions:  # at most the 30 s the reference reads (what its position table covers)
            end = 2 * cfg.max_source_positions
            segs = [f[:, : min(n + cfg.context_frames, end)] for f, n in zip(features, lengths)]
            return segs, [conv_output_rows(n) for n in lengths]
        chunk = 2 * cfg.n_window
        segs = [part for f, n in zip(features, lengths) for part in f[:, :n].split(chunk, dim=1)]
        return segs, [conv_output_rows(s.shape[1]) for s in segs]

    def stem(self, segments: list[torch.Tensor], keep: list[int]) -> torch.Tensor:
        """conv1 -> GELU -> conv2 -> GELU -> + positions for every segment at once (zero-padded to the longest,
        conv1's output past a segment's end zeroed, as its own padding would be); flat [sum(keep), d_model]."""
        frames = torch.tensor([s.shape[1] for s in segments], device=segments[0].device)
        batch = nn.utils.rnn.pad_sequence([s.T for s in segments], batch_first=True).transpose(1, 2)
        batch = batch.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(batch))
        x = x * (torch.arange(x.shape[2], device=x.device) < frames[:, None]).unsqueeze(1).to(x.dtype)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [segments, rows, d_model]
        x = x + self.positions(x.shape[1], x)
        return torch.cat([rows[:n] for rows, n in zip(x, keep)])

    def forward(self, features: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        """features[i]: [n_mels, frames_i] log-mel of clip i (its `lengths[i]` valid frames first); returns each
        clip's rows [audio_output_tokens(lengths[i]), output_dim]."""
        cfg = self.cfg
        if not features:
            return []
        for f, n in zip(features, lengths):
            if f.dim() != 2 or f.shape[0] != cfg.num_mel_bins or not 0 < n <= f.shape[1]:
                raise InvalidInputError(f"audio features of shape {tuple(f.shape)} for {n} valid frames; expected "
                                        f"({cfg.num_mel_bins}, frames >= {n})")
            if cfg.learned_positions and conv_output_rows(n) > cfg.max_source_positions:
                raise InvalidInputError(f"{n} audio frames are more than this audio tower reads "
                                        f"({2 * cfg.max_source_positions}, 30 s)")
        segments, keep = self.segments(features, lengths)
        x = self.stem(segments, keep)
        plan = plan_varlen(keep, x.device)
        for layer in self.layers:
            x = layer(x, plan)
        # Average pooling by 2 over each clip's rows: pairs (0, 1), (2, 3), ...; an odd last row is dropped.
        tokens = [audio_output_tokens(n) for n in lengths]
        clips = x.split([conv_output_rows(n) for n in lengths])
        pairs = torch.cat([rows[: 2 * t] for rows, t in zip(clips, tokens)]).view(-1, 2, cfg.d_model)
        pooled = (pairs[:, 0] + pairs[:, 1]) / 2
        return list(self.proj(self.ln_post(pooled)).split(tokens))
