"""Qwen3-VL's video layout in the prompt: every temporal patch of a video is its own vision block, after its time.

The prompt's `<|vision_start|><|video_pad|><|vision_end|>` for a video becomes, per temporal patch,
`<{t:.1f} seconds><|vision_start|><|video_pad|><|vision_end|>`; each pad is then expanded like any media item.
A lone `<|video_pad|>` (no vision block around it) is replaced the same way.

The reference is transformers 4.57's Qwen3VLProcessor, which replaces the whole vision block. transformers 5.23's
processor replaces only the pad, and so nests vision_start / vision_end; we keep the 4.57 rendering, the one the
model was trained with. Text prompts are rewritten before tokenizing (as the reference does); prompts given as
token ids are rewritten in ids, each timestamp tokenized on its own.
"""

from __future__ import annotations

from vlserve.core.errors import InvalidInputError


class VideoLayout:
    def __init__(self, tokenizer, vision_start_id: int, video_pad_id: int, vision_end_id: int):
        self.tokenizer = tokenizer
        self.ids = (vision_start_id, video_pad_id, vision_end_id)
        self.start, self.pad, self.end = tokenizer.convert_ids_to_tokens(list(self.ids))

    def text(self, text: str, timestamps: list[list[float]]) -> str:
        """`timestamps[k]`: the k-th video's temporal patches, in seconds."""
        out, pos = [], 0
        for stamps in timestamps:
            i = text.find(self.pad, pos)
            if i < 0:
                raise self._count_error("fewer", len(timestamps))
            block = self.start + self.pad + self.end
            lo = i - len(self.start)
            whole = lo >= pos and text.startswith(block, lo)
            start, stop = (lo, lo + len(block)) if whole else (i, i + len(self.pad))
            out += [text[pos:start], "".join(f"<{t:.1f} seconds>{block}" for t in stamps)]
            pos = stop
        out.append(text[pos:])
        return "".join(out)

    def token_ids(self, ids: list[int], timestamps: list[list[float]]) -> list[int]:
        start_id, pad_id, end_id = self.ids
        out: list[int] = []
        videos = iter(timestamps)
        i = 0
        while i < len(ids):
            if ids[i] != pad_id:
                out.append(ids[i])
                i += 1
                continue
            stamps = next(videos, None)
            if stamps is None:
                raise self._count_error("more", len(timestamps))
            whole = out[-1:] == [start_id] and ids[i + 1 : i + 2] == [end_id]
            if whole:
                out.pop()
            for t in stamps:
                out += self.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False)
                out += [start_id, pad_id, end_id]
            i += 2 if whole else 1
        if next(videos, None) is not None:
            raise self._count_error("fewer", len(timestamps))
        return out

    @staticmethod
    def _count_error(which: str, videos: int) -> InvalidInputError:
        return InvalidInputError(f"the prompt has {which} video placeholders than the {videos} videos given")
