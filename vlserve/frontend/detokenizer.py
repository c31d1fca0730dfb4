"""Incremental detokenization with stop-string handling.

Decoding the whole output after every token is O(n^2); instead we decode a small
window of ids (prefix/read offsets): `prefix_offset..read_offset` is text that was
already emitted and only provides context (leading-space rules, merges), and
everything after `read_offset` is new. Text is emitted only once the window no
longer ends in U+FFFD, so a UTF-8 character split over several byte-level tokens
is never emitted half-done.
"""

from __future__ import annotations

from typing import Any

from vlserve.core.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5
# A UTF-8 character is at most 4 bytes; if this many new tokens still decode to
# an unfinished character the bytes are simply invalid, so emit them anyway
# (bounds the window and thus the per-token cost).
_MAX_PENDING_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Text a later token could turn into a stop string is cut then, so it must not be shown before. With
        # include_stop_str_in_output the cut falls after the match, inside text not shown yet: nothing to hold.
        self._hold_prefixes = not self._include_stop and bool(self._stops)
        self._longest_stop = max(map(len, self._stops), default=0)
        self._held_for, self._held = -1, 0  # _stop_prefix_len's answer, for the text length it was computed at

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context  # prompt context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []

        self._text = ""
        self.stop_string: str | None = None  # the stop string that ended the request
        self._finished = False

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def visible_text(self) -> str:
        """The text a stream may show now: all of it once finished; while running, all but a trailing piece
        that is the start of a stop string (it would be cut if the next tokens complete the stop string)."""
        if self.finished or not self._hold_prefixes:
            return self._text
        return self._text[: len(self._text) - self._stop_prefix_len()]

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that begins some stop string. Only the last (longest stop - 1)
        characters can matter, and each stop is tried from where its first character occurs there, longest
        candidate first, with C-level string operations: the cost is bounded by the stop limits, not the text."""
        if self._held_for == len(self._text):
            return self._held
        tail, best = self._text[max(0, len(self._text) - self._longest_stop + 1):], 0
        for stop in self._stops:
            i = tail.find(stop[0], max(0, len(tail) - len(stop) + 1))
            while i != -1 and len(tail) - i > best:
                if stop.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(stop[0], i + 1)
        self._held_for, self._held = len(self._text), best
        return best

    @property
    def finished(self) -> bool:
        return self._finished or self.stop_string is not None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add generated tokens; return the stop string if one matched now."""
        if self.finished:
            return None  # nothing after a stop (or finish) is ever emitted
        old_len = len(self._text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._ids.append(token_id)
            self._text += self._decode_step()
        if not self._stops or len(self.output_token_ids) <= self._min_tokens:
            return None  # like vLLM, stop strings only count once min_tokens are out
        return self._check_stop(old_len)

    def _decode_step(self) -> str:
        prefix, read = self._prefix_offset, self._read_offset
        prefix_text = self._decode(self._ids[prefix:read])
        full_text = self._decode(self._ids[prefix:])
        waited_enough = len(self._ids) - read >= _MAX_PENDING_TOKENS
        if len(full_text) <= len(prefix_text):
            # Nothing visible yet (e.g. skipped special tokens); still slide the
            # window now and then so it cannot grow without bound.
            if waited_enough:
                self._prefix_offset, self._read_offset = read, len(self._ids)
            return ""
        if full_text.endswith(_REPLACEMENT) and not waited_enough:
            return ""  # unfinished multi-byte character: wait for more bytes
        self._prefix_offset, self._read_offset = read, len(self._ids)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it would act on window edges
        # differently than on the full text.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _check_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # A new match must end inside the new text, so it starts no earlier than this: only new text is read.
            idx = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)  # earliest match wins; ties go to list order
        if best is None:
            return None
        idx, stop = best
        self._text = self._text[: idx + len(stop) if self._include_stop else idx]
        self.stop_string = stop
        return stop

    def finish(self) -> None:
        """The request ended (EOS, max_tokens, abort): held-back text becomes visible, and the bytes of a character
        the last tokens left unfinished are shown as U+FFFD, as decoding the whole output shows them (a stream's
        deltas still add up to the final text). A stop string's cut stays where it is."""
        if not self.finished and len(self._ids) > self._read_offset:
            prefix = self._prefix_offset
            shown = self._decode(self._ids[prefix:self._read_offset])
            self._text += self._decode(self._ids[prefix:])[len(shown):]
            self._read_offset = len(self._ids)
        self._finished = True
