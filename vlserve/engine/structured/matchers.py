"""One grammar matcher per constrained request, built off the engine's step path; batch token masks.

A request's matcher is built on a worker thread when it arrives (the grammar compiled once per spec, then
copied); the scheduler admits the request once it is ready. Each step, the masks of the rows that sample are
filled by llguidance's own threads, started before the forward pass so they overlap it. Every token a
request keeps advances its matcher. Tokens are never taken back in this engine (a preempted request keeps
its output and recomputes only its KV), so the matcher never needs to roll back; a matcher built for a
request that already has output (resumed elsewhere) replays that output first.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from vlserve.engine.structured.grammar import grammar_for

MAX_CACHED_GRAMMARS = 256


class RequestGrammar:
    """A request's matcher: a future until built, then the matcher its tokens advance."""

    def __init__(self, future: Future):
        self._future = future

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the matcher could not be built (only once ready)."""
        exc = self._future.exception() if self.ready else None
        return None if exc is None else str(exc)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._future.result()

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (or the matcher failed)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow: the request is done."""
        return self.matcher.is_stopped()


class GrammarMatchers:
    """Builds matchers on a worker thread and fills the token bitmasks of a step's constrained rows."""

    def __init__(self, tokenizer_path: Path, eos_token_ids: tuple[int, ...], vocab_size: int, overlap: bool = False):
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-grammar")
        # Masks never queue behind a grammar being built (a cold compile or the first tokenizer load takes ~1 s).
        self._mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-masks") if overlap else None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()  # spec key -> fresh matcher

    def build(self, spec: StructuredOutputsParams, replay: list[int]) -> RequestGrammar:
        return RequestGrammar(self._worker.submit(self._build, spec, list(replay)))

    def _build(self, spec: StructuredOutputsParams, replay: list[int]) -> llguidance.LLMatcher:
        fresh = self._compiled.get(spec.key)
        if fresh is None:
            fresh = llguidance.LLMatcher(self._llg_tokenizer(), grammar_for(spec), log_level=0)
            if fresh.is_error():
                raise StructuredOutputsError(spec.kind, f"cannot be compiled: {fresh.get_error()}")
            self._compiled[spec.key] = fresh
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        matcher = fresh.deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise InvalidInputError(f"the request's output so far does not match its grammar: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # only on the worker thread; the first constrained request pays ~1 s
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(self.tokenizer_path))
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    def start_masks(self, grammars: list[RequestGrammar]) -> Callable[[], torch.Tensor]:
        """Begins the bitmask rows of these grammars ([len, ceil(vocab/32)] int32, bit set = allowed); call the
        result for them. With `overlap` (an accelerator runs the forward pass, the CPU waits) they are filled on
        the worker thread meanwhile. On CPU the forward pass has every core: a thread beside it only slows it
        (measured: +10 % per step at batch 16), so they are filled when asked, here, in microseconds."""
        matchers = [g.matcher for g in grammars]
        if self._mask_worker is not None:
            return self._mask_worker.submit(self._fill_masks, matchers).result
        return functools.partial(self._fill_masks, matchers)

    def _fill_masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row_bytes = bitmask.shape[1] * 4
        for i, matcher in enumerate(matchers):  # llguidance releases the GIL while it computes
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
        return bitmask

    def check(self, spec: StructuredOutputsParams) -> None:
        """Builds `spec`'s grammar now, with this model's tokenizer (it can refuse what a check without one
        passes, e.g. a special token the vocabulary lacks); raises InvalidInputError. For in-process callers."""
        self._worker.submit(self._build, spec, []).result()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=False, cancel_futures=True)
