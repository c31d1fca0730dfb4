"""A prompt after input processing, and the one owner of what it holds outside the engine (a disaggregated
server's receive blocks, where its rows landed).

Whoever holds a `PreparedPrompt` either sends it or drops it, and nobody frees it by hand:
- `AsyncLLM.generate` / `prefill` take it over (`hand_over`); from then on the engine's report frees it (the
  request released, refused, or the engine dead), or they free it at once if it never reached the engine;
- anything else drops it with `close()`, or `with prepared:`, which closes it on every way out of the block: an
  exception, a cancellation, or the engine having taken it (then closing does nothing).
A prompt is sent at most once: its rows may be freed as soon as the first engine request is done with them.
"""

from __future__ import annotations

from collections.abc import Callable

from vlserve.core.messages import Handoff
from vlserve.core.prompt import ProcessedPrompt
from vlserve.frontend.prompt_encoder import EncodedPrompt


class PromptSpentError(RuntimeError):
    """A prepared prompt sent twice, or sent after it was closed: a bug in the caller, never a client's doing."""


class PreparedPrompt:
    def __init__(self, prompt: ProcessedPrompt, arrival: float, handoff: Handoff | None = None,
                 release: Callable[[], None] | None = None):
        """`arrival` starts the TTFT and e2e clocks; `handoff`: the first token and random state of a prompt
        prefilled on another instance; `release` frees what the prompt holds outside the engine, if anything."""
        self.prompt, self.arrival, self.handoff = prompt, arrival, handoff
        self._release = release
        self._open = True  # neither closed nor handed over

    @classmethod
    def from_encoded(cls, encoded: EncodedPrompt, arrival: float) -> "PreparedPrompt":
        return cls(encoded.prompt, arrival, encoded.handoff, encoded.release)

    @property
    def num_tokens(self) -> int:
        return self.prompt.num_tokens

    @property
    def is_open(self) -> bool:
        """Neither sent nor closed: closing it now frees what it holds."""
        return self._open

    def hand_over(self) -> Callable[[], None] | None:
        """For the engine client only: ownership moves to the caller, who must call what this returns (if not
        None) exactly once, when the engine is done with the prompt or it never got there. `close()` does
        nothing from now on."""
        if not self._open:
            raise PromptSpentError("this prepared prompt was already sent or closed; prepare the prompt again")
        self._open = False
        release, self._release = self._release, None
        return release

    def close(self) -> None:
        """Frees what the prompt holds, unless it was sent or closed already (then nothing happens)."""
        if self._open:
            release = self.hand_over()
            if release is not None:
                release()

    def __enter__(self) -> "PreparedPrompt":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
