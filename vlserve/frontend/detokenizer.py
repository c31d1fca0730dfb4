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
        # Streaming must not show a prefix of a stop string that may later be cut.
        self._holdback = (
            max(len(s) for s in self._stops) - 1 if self._stops and not self._include_stop else 0
        )

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context  # prompt context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []

        self._text = ""
        self._sent = 0  # chars of _text already returned by get_next_delta
        self.stop_string: str | None = None  # the stop string that ended the request
        self._finished = False

    @property
    def output_text(self) -> str:
        return self._text

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
        # A new match must end inside the new text, so it starts no earlier than this.
        start = max(0, old_len - max(len(s) for s in self._stops) + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = self._text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)  # earliest match wins; ties go to list order
        if best is None:
            return None
        idx, stop = best
        self._text = self._text[: idx + len(stop) if self._include_stop else idx]
        self._sent = min(self._sent, len(self._text))
        self.stop_string = stop
        return stop

    def get_next_delta(self) -> str:
        """Text not handed out yet, minus a possible stop-string prefix at the end."""
        end = len(self._text)
        if not self.finished:
            end = max(self._sent, end - self._holdback)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def finish(self) -> str:
        """Mark the request done (e.g. max_tokens/EOS) and release held-back text."""
        self._finished = True
        return self.get_next_delta()
