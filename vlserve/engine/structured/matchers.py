"""One grammar matcher per constrained request, built off the engine's step path; batch token masks.

A request's matcher is built on a worker thread when it arrives (the grammar compiled once per spec, then
copied); the scheduler admits the request once it is ready. Each step, the masks of the rows that sample are
filled by llguidance's own threads, started before the forward pass so they overlap it. Every token a
request keeps advances its matcher. Tokens are never taken back in this engine (a preempted request keeps
its output and recomputes only its KV), so the matcher never needs to roll back; a matcher built for a
request that already has output (resumed elsewhere) replays that output first.

Builds run on `GrammarLimits.threads` threads; one for a request that is aborted before it starts is dropped.
Fresh matchers are cached by spec in an LRU bounded by bytes (an estimate, see `cache`); so are the specs that
failed, so the same bad spec is refused at once. A matcher that fails in the middle of an answer (a limit of
the grammar engine) is reported (`take_failures`): its request fails with the reason rather than ending as if
it were complete.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.structured_outputs import GrammarLimits, StructuredOutputsError, StructuredOutputsParams
from vlserve.engine.structured.cache import MATCHER_BASE_BYTES, MATCHER_BYTES_PER_CHAR, ByteLRU, spec_digest
from vlserve.engine.structured.grammar import DEFAULT_LIMITS, cacheable, check_time, grammar_for, parser_limits
from vlserve.engine.structured.pool import CompilePool


def first_line(error: str) -> str:
    """The gist of a grammar engine error (its first line, bounded)."""
    lines = error.strip().splitlines()
    return lines[0][:500] if lines else "unknown error"


class RequestGrammar:
    """A request's matcher: a future until built, then the matcher its tokens advance."""

    def __init__(self, future: Future, field: str, on_failure: Callable[[str], None] | None = None):
        self._future = future
        self.field = field  # named in a failure: "structured_outputs.regex", ...
        self._on_failure = on_failure
        self.num_accepted = 0

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the matcher could not be built (only once ready)."""
        if not self.ready:
            return None
        if self._future.cancelled():
            return "cancelled"
        exc = self._future.exception()
        return None if exc is None else str(exc)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._future.result()

    def cancel(self) -> None:
        """The request left: a build that has not started is dropped."""
        self._future.cancel()

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it or the matcher failed (the
        failure is reported with the grammar engine's reason)."""
        matcher = self.matcher
        if matcher.consume_token(token) and not matcher.is_error():
            self.num_accepted += 1
            return True
        if self._on_failure is not None:
            why = first_line(matcher.get_error() or f"token {token} is not allowed")
            self._on_failure(f"{self.field} failed after {self.num_accepted} token(s) of output, in the grammar "
                             f"engine: {why}")
        return False

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow: the request is done."""
        return self.matcher.is_stopped()


class GrammarMatchers:
    """Builds matchers on a worker thread and fills the token bitmasks of a step's constrained rows."""

    def __init__(self, tokenizer_path: Path, eos_token_ids: tuple[int, ...], vocab_size: int, overlap: bool = False,
                 limits: GrammarLimits = DEFAULT_LIMITS):
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.limits = limits
        self._worker = CompilePool(limits.threads, "vlserve-grammar")
        # Masks never queue behind a grammar being built (a cold compile or the first tokenizer load takes ~1 s).
        self._mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlserve-masks") if overlap else None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        # spec digest -> a fresh matcher, or the StructuredOutputsError it failed with
        self._compiled = ByteLRU(limits.cache_mb << 20)
        self._failures: list[tuple[str, str]] = []  # (request id, why) of matchers that failed mid-answer

    def build(self, spec: StructuredOutputsParams, replay: list[int], request_id: str = "") -> RequestGrammar:
        def failed(why: str) -> None:
            self._failures.append((request_id, why))

        grammar = RequestGrammar(self._worker.submit(self._build, spec, list(replay)),
                                 f"structured_outputs.{spec.kind}", failed)
        grammar.num_accepted = len(replay)
        return grammar

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the matchers that failed while advancing since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _build(self, spec: StructuredOutputsParams, replay: list[int]) -> llguidance.LLMatcher:
        digest = spec_digest(spec.key)
        fresh = self._compiled.get(digest)
        if fresh is None:
            try:
                fresh, grammar_chars = self._compile(spec)
            except StructuredOutputsError as e:
                kept = cacheable(e)
                if kept is not None:
                    self._compiled.put(digest, kept, len(str(e)))
                raise
            self._compiled.put(digest, fresh, MATCHER_BASE_BYTES + MATCHER_BYTES_PER_CHAR * grammar_chars)
        if isinstance(fresh, StructuredOutputsError):
            raise fresh.for_field(fresh.field)  # a new exception each time: several threads may raise it
        matcher = fresh.deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise InvalidInputError(f"the request's output so far does not match its grammar: {matcher.get_error()}")
        return matcher

    def _compile(self, spec: StructuredOutputsParams) -> tuple[llguidance.LLMatcher, int]:
        """A fresh matcher for `spec`, within the limits and the time budget; tried on its first mask and one
        token down its forced start, so a grammar that fails as soon as it starts is refused here (400), not in
        the middle of an answer."""
        started = time.monotonic()
        grammar = grammar_for(spec, self.limits)
        fresh = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=parser_limits())
        if fresh.is_error():
            raise StructuredOutputsError(spec.kind, f"cannot be compiled: {fresh.get_error()}")
        probe = fresh.deep_copy()  # its first step: the grammar engine's limits (items in a row...) show there
        mask = probe.compute_bitmask()
        first = None if probe.is_error() else (probe.compute_ff_tokens()[:1] or self._first_allowed(mask))
        if probe.is_error() or (first and not probe.consume_tokens(first)) or probe.is_error():
            raise StructuredOutputsError(spec.kind, "fails as soon as it starts, in the grammar engine: "
                                                    + first_line(probe.get_error() or "its first token is refused"))
        check_time(spec.kind, started, self.limits)
        return fresh, len(grammar)

    def _first_allowed(self, mask: bytes) -> list[int]:
        """The lowest token a mask allows, EOS aside ([] if none): bit t % 8 of byte t // 8."""
        for i, byte in enumerate(mask):
            for bit in range(8) if byte else ():
                if byte >> bit & 1 and i * 8 + bit not in self.eos_token_ids:
                    return [i * 8 + bit]
        return []

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # built once by the first build thread; the first request pays ~1 s
            if self._tokenizer is None:
                import llguidance.hf

                from vlserve.model.tokenizer_files import load_tokenizer

                hf = load_tokenizer(self.tokenizer_path)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids)
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
        self._worker.shutdown()
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=False, cancel_futures=True)
