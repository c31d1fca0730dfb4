"""Engine-core outputs -> user-facing RequestOutputs: detokenize, apply stop strings, gather the n samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlserve.core.messages import EngineCoreOutput
from vlserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from vlserve.core.sampling_params import SamplingParams
from vlserve.frontend.detokenizer import IncrementalDetokenizer


@dataclass
class _Child:
    output: CompletionOutput
    detok: IncrementalDetokenizer
    params: SamplingParams


@dataclass
class _Parent:
    out: RequestOutput
    children: dict[str, _Child] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A logprob entry shows each alternative token's text: one decode per distinct id, bounded by the vocabulary
        # (a request with top_logprobs=20 would otherwise decode 21 ids per token on the event loop).
        self._token_text: dict[int, str] = {}
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[tuple[str, SamplingParams]]) -> None:
        parent = _Parent(RequestOutput(request_id, prompt, prompt_token_ids))
        for index, (child_id, params) in enumerate(children):
            out = CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.children[child_id] = _Child(out, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                                               params)
            parent.out.outputs.append(out)
            self._parent_of[child_id] = request_id
        self._parents[request_id] = parent

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    @property
    def num_unfinished_children(self) -> int:
        """Engine requests still running (n > 1 fans one request out to n of them)."""
        return len(self._parent_of)

    def parent_of(self, child_id: str) -> str | None:
        return self._parent_of.get(child_id)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the request outputs that changed, and child ids the engine must stop (stop string hit)."""
        changed: dict[str, RequestOutput] = {}
        stop_now: list[str] = []
        for co in core_outputs:
            parent_id = self._parent_of.get(co.request_id)
            if parent_id is None:
                continue  # already finished here (e.g. a stop string) while the engine produced one more token
            parent = self._parents[parent_id]
            child = parent.children[co.request_id]
            out = child.output
            parent.out.num_cached_tokens = max(parent.out.num_cached_tokens, co.num_cached_tokens)
            out.token_ids.extend(co.new_token_ids)
            if co.new_logprobs and out.logprobs is not None:
                self._add_logprobs(out, co)
            stop_string = child.detok.update(co.new_token_ids)
            if stop_string is not None:  # the detokenizer has already cut the text at the stop string
                out.finish_reason, out.stop_reason = "stop", stop_string
                if co.finish_reason is None:
                    stop_now.append(co.request_id)
            elif co.finish_reason is not None:
                out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
            if out.finish_reason is not None:
                child.detok.finish()
            out.text = child.detok.visible_text
            changed[parent_id] = parent.out
            if out.finish_reason is not None:
                del self._parent_of[co.request_id]
        for parent_id, ro in changed.items():
            if all(c.finish_reason is not None for c in ro.outputs):
                ro.finished = True
                del self._parents[parent_id]
        return list(changed.values()), stop_now

    def _add_logprobs(self, out: CompletionOutput, co: EngineCoreOutput) -> None:
        for lp in co.new_logprobs:
            entry = {}
            for rank_i, (tid, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
                rank = lp.sampled_rank if rank_i == 0 else rank_i
                if tid not in entry:
                    entry[tid] = Logprob(val, rank, self._text_of(tid))
            out.logprobs.append(entry)
            out.cumulative_logprob += lp.logprobs[0]

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent request; returns its child ids so the engine can free them."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.children:
            self._parent_of.pop(child_id, None)
        return list(parent.children)
