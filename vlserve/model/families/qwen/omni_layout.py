"""Qwen2.5-Omni prompt layout: position ids over text, pictures, videos and audio, and a video's sound track
interleaved with its frames (`use_audio_in_video`).

Positions (transformers 5.24 `Qwen2_5OmniThinker...get_rope_index`): text runs on; each media item starts at the
previous maximum + 1 (the older M-RoPE rule: a video's last frames push the text after it on); pictures and
videos take M-RoPE t/h/w ids with frame k at `floor(k * seconds_per_grid * position_id_per_seconds)`; audio
takes one id per token on all three axes.

A video heard with its sound becomes, between its `<|vision_bos|>` and `<|vision_eos|>`:

    <|audio_bos|>  V0 A0 V1 A1 ...  <|audio_eos|>

where Vj are the frames whose time id falls in the j-th window of `position_id_per_seconds * seconds_per_chunk`
ids (2 s) and Aj the audio tokens of that window (50 tokens of 40 ms). Both tracks start at the same id, one past
the `<|vision_bos|>`, which shares its id with `<|audio_bos|>`; the two closing tokens share the id after the
last window's maximum. The token layout follows the processor (frame times as floats) and the ids follow the model
(times truncated), exactly as the two do in transformers. Windows are cut token by token there: a temporal patch
more than one window past the last edge (over 2 s a patch) is split over windows, which is refused here.

Each Vj and Aj is its own media item here: the Qwen2.5-VL vision tower attends within a frame and the Omni audio
tower within chunks of 2 * n_window frames, so a window encodes alone to the rows it has inside the whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlserve.core.errors import InvalidInputError


def window_spans(times: Sequence[float], per_window: float) -> list[tuple[int, int]]:
    """Split increasing `times` into runs: a new run starts at the first value at or past the next window edge
    (one edge per run, even when a value jumps past several: what both sides of transformers do)."""
    spans, start, edge = [], 0, 1
    for i, value in enumerate(times):
        if value >= edge * per_window:
            spans.append((start, i))
            start, edge = i, edge + 1
    spans.append((start, len(times)))
    return spans


def frame_times(grid_t: int, seconds_per_grid: float, ids_per_second: float) -> list[float]:
    """Each temporal patch's time id before truncation (the processor's layout uses these)."""
    return [k * seconds_per_grid * ids_per_second for k in range(grid_t)]


def frame_ids(grid_t: int, seconds_per_grid: float, ids_per_second: float) -> torch.Tensor:
    """Each temporal patch's time id as the model makes it: a float32 product, truncated."""
    return (torch.arange(grid_t) * torch.tensor(seconds_per_grid, dtype=torch.float32) * ids_per_second).long()


@dataclass(frozen=True)
class AudioVideoWindows:
    """The windows of one video heard with its sound: frames [a, b) and audio tokens [c, d) per window (either may
    be absent from the last windows), in prompt order V0 A0 V1 A1 ..."""

    frames: list[tuple[int, int]]
    audio: list[tuple[int, int]]

    @classmethod
    def plan(cls, grid_t: int, seconds_per_grid: float, audio_tokens: int, ids_per_second: float,
             seconds_per_chunk: float, tokens_per_frame: int = 1) -> "AudioVideoWindows":
        """Windows are cut token by token, as transformers does: a temporal patch more than one window after the
        last edge is split over several windows, which no item here can hold (each frame encodes whole), so such a
        video is refused."""
        per_window = int(ids_per_second * seconds_per_chunk)
        if per_window <= 0:
            raise InvalidInputError("this model's position_id_per_seconds x seconds_per_chunk is not positive")
        times = [t for t in frame_times(grid_t, seconds_per_grid, ids_per_second) for _ in range(tokens_per_frame)]
        spans = window_spans(times, per_window)
        if any(a % tokens_per_frame or b % tokens_per_frame for a, b in spans):
            raise InvalidInputError(
                f"use_audio_in_video: one temporal patch of this video covers {seconds_per_grid:g} s, so its frames "
                f"fall across several {seconds_per_chunk:g} s windows; send a shorter video or ask for a higher "
                f"fps or max_frames")
        return cls([(a // tokens_per_frame, b // tokens_per_frame) for a, b in spans],
                   window_spans(range(audio_tokens), per_window))

    def order(self) -> list[tuple[str, int, int]]:
        """("video", first frame, end frame) and ("audio", first token, end token), as laid out."""
        out = []
        for j in range(max(len(self.frames), len(self.audio))):
            if j < len(self.frames):
                out.append(("video", *self.frames[j]))
            if j < len(self.audio):
                out.append(("audio", *self.audio[j]))
        return out


@dataclass(frozen=True)
class OmniItem:
    """A media item at `offset` in the expanded prompt: pictures and videos by their patch grid, audio by
    `audio_tokens` (grid unused)."""

    offset: int
    num_tokens: int
    layout: tuple[int, int, int] = (1, 1, 1)
    seconds_per_grid: float = 1.0  # videos; pictures 1 (one frame at id 0)
    audio: bool = False


@dataclass(frozen=True)
class OmniGroup:
    """A video heard with its sound: its interleaved tokens start at `offset` (just after `<|audio_bos|>`)."""

    offset: int
    layout: tuple[int, int, int]
    seconds_per_grid: float
    audio_tokens: int

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.layout
        return t * (h // merge) * (w // merge) + self.audio_tokens


def _vision_ids(start: int, grid_thw: tuple[int, int, int], seconds_per_grid: float, ids_per_second: float,
                merge: int) -> torch.Tensor:
    t, h, w = grid_thw
    gh, gw = h // merge, w // merge
    tt = frame_ids(t, seconds_per_grid, ids_per_second)
    ids = torch.stack(torch.meshgrid(tt, torch.arange(gh), torch.arange(gw), indexing="ij")).view(3, -1)
    return ids + start


def omni_positions(seq_len: int, entries: Sequence[OmniItem | OmniGroup], merge: int, ids_per_second: float,
                   seconds_per_chunk: float) -> tuple[torch.Tensor, int]:
    """Position ids [3, seq_len] and the rope delta for one prompt; `entries` sorted by offset."""
    positions = torch.empty((3, seq_len), dtype=torch.long)
    cursor, next_id = 0, 0  # next token to fill, next free id

    def text(end: int) -> None:
        nonlocal cursor, next_id
        if end > cursor:
            positions[:, cursor:end] = torch.arange(next_id, next_id + end - cursor)
            next_id += end - cursor
            cursor = end

    for entry in entries:
        if isinstance(entry, OmniGroup):
            # the two opening tokens share an id; both tracks start one past it
            if entry.offset - 2 < cursor or entry.offset + entry.num_tokens(merge) + 2 > seq_len:
                raise InvalidInputError("a video heard with its sound must sit between <|vision_bos|> and "
                                        "<|vision_eos|> in the prompt")
            text(entry.offset - 1)
            positions[:, entry.offset - 1] = next_id - 1
            start = next_id
            video = _vision_ids(start, entry.layout, entry.seconds_per_grid, ids_per_second, merge)
            audio = torch.arange(entry.audio_tokens).expand(3, -1) + start
            per_window = int(ids_per_second * seconds_per_chunk)
            v_spans = window_spans((video[0] - start).tolist(), per_window)  # the model's (truncated) windows
            a_spans = window_spans(range(entry.audio_tokens), per_window)
            parts = []
            for j in range(max(len(v_spans), len(a_spans))):
                if j < len(v_spans):
                    parts.append(video[:, v_spans[j][0]:v_spans[j][1]])
                if j < len(a_spans):
                    parts.append(audio[:, a_spans[j][0]:a_spans[j][1]])
            ids = torch.cat(parts, dim=1)
            end = entry.offset + ids.shape[1]
            positions[:, entry.offset:end] = ids
            closing = int(parts[-1].max()) + 1  # after the last window's maximum, not the group's (as transformers)
            positions[:, end:end + 2] = closing
            cursor, next_id = end + 2, closing + 1
            continue
        if entry.offset < cursor or entry.offset + entry.num_tokens > seq_len:
            raise InvalidInputError("media items overlap or run past the end of the prompt")
        text(entry.offset)
        if entry.audio:
            ids = torch.arange(entry.num_tokens).expand(3, -1) + next_id
        else:
            ids = _vision_ids(next_id, entry.layout, entry.seconds_per_grid, ids_per_second, merge)
            if ids.shape[1] != entry.num_tokens:
                raise InvalidInputError(f"a media item of grid {entry.layout} takes {ids.shape[1]} tokens, "
                                        f"not {entry.num_tokens}")
        positions[:, cursor:cursor + entry.num_tokens] = ids
        cursor += entry.num_tokens
        next_id = int(ids.max()) + 1
    text(seq_len)
    delta = (int(positions.max()) + 1 - seq_len) if seq_len else 0
    return positions, delta
