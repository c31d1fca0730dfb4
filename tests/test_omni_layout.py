"""Qwen2.5-Omni's prompt layout (vlserve/model/families/qwen/omni_layout.py) against transformers 5.24 itself: the window
split against both `get_chunked_index` (the model's and the processor's), and position ids plus rope delta
against the tiny thinker's `get_rope_index` on hand-built expanded prompts. A video heard with its sound is laid
out by transformers' own `Qwen2_5OmniProcessor.replace_video_with_audio_token`, called unbound (the processor
itself needs torchvision)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
    Qwen2_5OmniProcessor,
    _get_feat_extract_output_lengths,
)

from vlserve.core.errors import InvalidInputError
from vlserve.model.families.qwen.omni_layout import (
    AudioVideoWindows,
    OmniGroup,
    OmniItem,
    omni_positions,
    window_spans,
)

IDS_PER_SECOND, SECONDS_PER_CHUNK, MERGE = 25, 2, 2
PER_WINDOW = IDS_PER_SECOND * SECONDS_PER_CHUNK


# ---- windows ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("times", [
    [0, 25, 50, 75, 100, 125],  # one frame per half window
    [0, 0, 0, 0, 50, 50, 50, 50, 100, 100],  # frames of several tokens
    [0, 75, 150, 151, 152, 300],  # jumps past several windows: one edge per run
    [0, 175, 176, 177, 178],  # one jump, then every value opens a run until the edges catch up
    [0.0, 12.5, 25.0, 37.5, 49.999, 50.0, 99.9, 100.0],  # the processor's float times
    list(range(137)),  # audio tokens
    [7],
])
def test_window_spans_equal_transformers(times):
    model_spans = Qwen2_5OmniThinkerForConditionalGeneration.get_chunked_index(
        None, torch.tensor(times) + 1000, PER_WINDOW, 1000)  # (the model subtracts the start id)
    processor_spans = Qwen2_5OmniProcessor.get_chunked_index(None, np.array(times), PER_WINDOW)
    assert window_spans(times, PER_WINDOW) == model_spans == processor_spans


# ---- positions -------------------------------------------------------------------------------------------------
def processor_self() -> types.SimpleNamespace:
    """What `replace_video_with_audio_token` reads of its processor; tokens as one character each."""
    return types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=MERGE), audio_bos_token="B", audio_eos_token="E",
        video_token="V", audio_token="A",
        get_chunked_index=lambda idx, n: Qwen2_5OmniProcessor.get_chunked_index(None, idx, n))


class Prompt:
    """An expanded prompt built piece by piece: its ids, our entries, and transformers' get_rope_index inputs."""

    def __init__(self, cfg):
        self.cfg, self.ids, self.entries = cfg, [], []
        self.images, self.videos, self.seconds, self.audio_frames = [], [], [], []
        self.windows = []  # (ours, transformers') token layout of each heard video
        self.refused = False  # our plan refused a heard video's layout

    def text(self, n: int) -> "Prompt":
        self.ids += [5 + i % 50 for i in range(n)]
        return self

    def audio(self, frames: int) -> "Prompt":
        c = self.cfg
        n = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
        self.ids.append(c.audio_start_token_id)
        self.entries.append(OmniItem(len(self.ids), n, (1, 1, n), audio=True))
        self.ids += [c.audio_token_id] * n + [c.audio_end_token_id]
        self.audio_frames.append(frames)
        return self

    def picture(self, grid: tuple[int, int, int]) -> "Prompt":
        return self._vision(grid, 1.0, self.cfg.image_token_id, self.images)

    def video(self, grid: tuple[int, int, int], seconds_per_grid: float) -> "Prompt":
        self.seconds.append(seconds_per_grid)
        return self._vision(grid, seconds_per_grid, self.cfg.video_token_id, self.videos)

    def _vision(self, grid, seconds, token, grids) -> "Prompt":
        c = self.cfg
        n = grid[0] * grid[1] * grid[2] // MERGE**2
        self.ids.append(c.vision_start_token_id)
        self.entries.append(OmniItem(len(self.ids), n, grid, seconds))
        self.ids += [token] * n + [c.vision_end_token_id]
        grids.append(grid)
        return self

    def heard_video(self, grid: tuple[int, int, int], seconds_per_grid: float, frames: int) -> "Prompt":
        """Layout from transformers' processor; our own plan of it checked against that."""
        c = self.cfg
        n = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
        layout = Qwen2_5OmniProcessor.replace_video_with_audio_token(
            processor_self(), {"video_grid_thw": [torch.tensor(grid)], "video_second_per_grid": [seconds_per_grid]},
            0, {"num_audio_tokens": [torch.tensor(n)]}, 0, position_id_per_seconds=IDS_PER_SECOND,
            seconds_per_chunk=SECONDS_PER_CHUNK)
        per_frame = grid[1] * grid[2] // MERGE**2
        try:
            plan = AudioVideoWindows.plan(grid[0], seconds_per_grid, n, IDS_PER_SECOND, SECONDS_PER_CHUNK, per_frame)
        except InvalidInputError:
            self.refused = True  # a frame split over windows: positions still checked, on transformers' layout
        else:
            ours = "".join(("V" * (b - a) * per_frame) if kind == "video" else "A" * (b - a)
                           for kind, a, b in plan.order())
            self.windows.append((f"B{ours}E", layout))
        tokens = {"B": c.audio_start_token_id, "E": c.audio_end_token_id, "V": c.video_token_id, "A": c.audio_token_id}
        self.ids.append(c.vision_start_token_id)
        self.entries.append(OmniGroup(len(self.ids) + 1, grid, seconds_per_grid, n))
        self.ids += [tokens[ch] for ch in layout] + [c.vision_end_token_id]
        self.videos.append(grid)
        self.seconds.append(seconds_per_grid)
        self.audio_frames.append(frames)
        return self

    def check(self, model, heard: bool = False) -> torch.Tensor:
        for ours, theirs in self.windows:
            assert ours == theirs
        ids = torch.tensor([self.ids])
        grids = {k: torch.tensor(v).view(-1, 3) if v else None for k, v in (("i", self.images), ("v", self.videos))}
        if grids["i"] is None and grids["v"] is None:  # (else transformers numbers the prompt as plain text)
            grids["i"] = torch.zeros((0, 3), dtype=torch.long)
        expected, delta = model.get_rope_index(ids, grids["i"], grids["v"], torch.ones_like(ids), heard,
                                               torch.tensor(self.audio_frames), torch.tensor(self.seconds))
        positions, our_delta = omni_positions(len(self.ids), self.entries, MERGE, IDS_PER_SECOND, SECONDS_PER_CHUNK)
        assert torch.equal(positions, expected[:, 0])
        assert our_delta == int(delta)
        return positions


@pytest.fixture(scope="module")
def thinker(tiny_ckpt):
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_ckpt("qwen2_5_omni"))
    cfg = model.config
    assert (cfg.position_id_per_seconds, cfg.seconds_per_chunk, model.spatial_merge_size) == \
        (IDS_PER_SECOND, SECONDS_PER_CHUNK, MERGE)
    return model.model


def test_text_and_audio(thinker):
    p = Prompt(thinker.config).text(4).audio(317).text(3).audio(40).text(2)
    positions = p.check(thinker)
    assert torch.equal(positions, torch.arange(len(p.ids)).expand(3, -1))  # audio takes plain positions


def test_audio_and_picture(thinker):
    Prompt(thinker.config).text(3).audio(250).picture((1, 6, 8)).text(5).check(thinker)
    Prompt(thinker.config).picture((1, 10, 4)).audio(99).check(thinker)  # media first, nothing after


def test_two_pictures_and_a_video(thinker):
    p = Prompt(thinker.config).text(2).picture((1, 4, 6)).text(1).picture((1, 8, 4)).text(3)
    positions = p.video((3, 4, 4), 2.0).text(4).check(thinker)
    assert positions.max() >= 100  # frame 2 at 2 x 2 s x 25 ids: the text after jumps on
    Prompt(thinker.config).video((4, 6, 4), 0.6666666666666666).picture((1, 4, 4)).text(2).check(thinker)


@pytest.mark.parametrize("grid,seconds,frames,quirk,split", [
    ((6, 4, 4), 1.0, 300, False, False),  # 6 s of frames, 3 s of sound: the video's last window after the sound
    ((2, 4, 4), 1.0, 530, False, False),  # 2 s of frames, 5.3 s of sound: the sound outlasts the video
    ((4, 4, 4), 2 / 3, 400, False, False),  # 16.67 ids a frame: windows by float (layout), truncated (ids)
    ((4, 4, 4), 2.0, 400, False, False),  # a frame a window
    ((2, 2, 2), 5.0, 440, True, False),  # frame 1 at id 125 jumps past two windows but opens window 1 only
    ((1, 2, 124), 1.0, 240, True, False),  # one frame 62 tokens wide: its w ids pass the sound's last one
    ((2, 4, 4), 5.0, 440, True, True),  # frame 1's 4 tokens at id 125 open windows 1, 2 (1 token) and 3: refused
    ((4, 4, 4), 3.0, 400, False, True),  # frame 3 at 225 is split too (frames 1, 2 each opened one window)
])
def test_video_heard_with_its_sound(thinker, grid, seconds, frames, quirk, split):
    p = Prompt(thinker.config).text(3).heard_video(grid, seconds, frames).text(4)
    positions = p.check(thinker, heard=True)
    assert p.refused == split
    group = p.entries[0]
    end = group.offset + group.num_tokens(MERGE)
    bos = positions[:, group.offset - 2:group.offset]
    assert (bos == 3).all() and positions[:, group.offset].eq(4).all()  # the bos pair share an id; both tracks next
    assert (positions[:, end:end + 2] == positions[0, end]).all()  # so do the two closing tokens
    # the closing tokens take the id after the LAST window's max, which can be below the group's own max
    assert (positions[0, end] <= positions[:, group.offset:end].max()) == quirk


def test_video_heard_with_pictures_and_audio_around(thinker):
    p = Prompt(thinker.config).text(2).picture((1, 4, 6)).audio(123).text(1)
    p.heard_video((5, 4, 6), 1.0, 470).text(2).audio(60).text(3).heard_video((2, 6, 4), 2.0, 200).text(1)
    p.check(thinker, heard=True)


def test_overlapping_or_misplaced_entries_are_refused():
    with pytest.raises(InvalidInputError, match="overlap"):
        omni_positions(10, [OmniItem(2, 4, audio=True), OmniItem(4, 2, audio=True)], MERGE, 25, 2)
    with pytest.raises(InvalidInputError, match="past the end"):
        omni_positions(10, [OmniItem(8, 4, audio=True)], MERGE, 25, 2)
    with pytest.raises(InvalidInputError, match="vision_bos"):  # no room for the two opening tokens
        omni_positions(20, [OmniGroup(1, (1, 2, 2), 1.0, 3)], MERGE, 25, 2)
    with pytest.raises(InvalidInputError, match="takes 4 tokens"):
        omni_positions(20, [OmniItem(2, 5, (1, 4, 4))], MERGE, 25, 2)
