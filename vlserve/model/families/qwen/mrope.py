"""M-RoPE (multimodal rotary position) ids for Qwen2-VL / Qwen2.5-VL.

Each token has three position ids (temporal, height, width). Text tokens use the same running
position on all three axes. A vision item (image or video) laid out on a merged grid of
(t, h/merge, w/merge) tokens starting at running position `s` gets

    t_pos = s + floor(frame * time_interval),  h_pos = s + row,  w_pos = s + col

and the text after it resumes at `s + max(h/merge, w/merge)`.

That resume rule is the one of transformers 5.23 `Qwen2VLModel.get_rope_index` /
`Qwen2_5_VLModel.get_rope_index`. Older releases (4.x) resumed at `max(all t/h/w positions of the
item) + 1`. For images (one frame, t_pos == s) both rules agree. For videos they differ whenever
`floor((t - 1) * time_interval) >= max(h, w) / merge`: 5.23 ignores the temporal extent, so the
following text may reuse temporal positions already taken by late frames. We follow 5.23 because
the checkpoints are served next to it, and the returned delta still uses the true maximum.

Decoding: the rope delta is `max(position) + 1 - len(prompt)`. The generated token at sequence
index `n` (0-based, counting the prompt) has position `n + delta` on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MRopeItem:
    """One image or video occupying a run of placeholder tokens in the expanded prompt."""

    offset: int  # index of the item's first placeholder token in token_ids
    layout: tuple[int, int, int]  # (t, h, w) in patches, before spatial merging
    # Temporal spacing between consecutive merged frames. Images: 1.0. Qwen2.5-VL videos:
    # second_per_grid_t * tokens_per_second. Qwen2-VL videos: 1.0 (it has no time scaling).
    time_interval: float = 1.0

    def num_tokens(self, spatial_merge_size: int) -> int:
        t, h, w = self.layout
        return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def mrope_positions(
    token_ids: Sequence[int], items: Sequence[MRopeItem], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """3D position ids `[3, len(token_ids)]` (int64) and the rope delta for one prompt.

    `items` must be sorted by offset and must not overlap. Only the length of `token_ids` is
    used: the items say where the vision tokens are.
    """
    seq_len = len(token_ids)
    positions = torch.empty((3, seq_len), dtype=torch.long)
    cursor = 0  # next token index to fill
    pos = 0  # running position for the next text token
    max_pos = -1
    for item in items:
        n = _check_item(item, spatial_merge_size, cursor, seq_len)
        if item.offset > cursor:  # text before the item
            text_len = item.offset - cursor
            positions[:, cursor : item.offset] = torch.arange(pos, pos + text_len)
            pos += text_len
            max_pos = max(max_pos, pos - 1)
        t, h, w = item.layout
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        # Same float32 product + truncation as transformers, so fractional intervals round alike.
        t_pos = (torch.arange(t) * item.time_interval).long() + pos
        tt, hh, ww = torch.meshgrid(t_pos, torch.arange(pos, pos + gh), torch.arange(pos, pos + gw), indexing="ij")
        positions[:, item.offset : item.offset + n] = torch.stack((tt, hh, ww)).view(3, n)
        max_pos = max(max_pos, int(t_pos[-1]), pos + max(gh, gw) - 1)
        pos += max(gh, gw)  # transformers 5.23 rule, see module docstring
        cursor = item.offset + n
    if cursor < seq_len:  # trailing text
        positions[:, cursor:] = torch.arange(pos, pos + seq_len - cursor)
        max_pos = max(max_pos, pos + seq_len - cursor - 1)
    delta = max_pos + 1 - seq_len if seq_len else 0
    return positions, delta


def _check_item(item: MRopeItem, merge: int, cursor: int, seq_len: int) -> int:
    t, h, w = item.layout
    if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
        raise ValueError(f"grid_thw {item.layout} must be positive with h, w divisible by {merge}")
    if item.time_interval < 0:
        raise ValueError(f"time_interval must be >= 0, got {item.time_interval}")
    n = item.num_tokens(merge)
    if item.offset < cursor or item.offset + n > seq_len:
        raise ValueError(
            f"item at offset {item.offset} with {n} tokens overlaps the previous item "
            f"or runs past the prompt end ({seq_len} tokens)"
        )
    return n
