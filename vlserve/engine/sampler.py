"""Batched token sampling: grammar masks, penalties, temperature, min-p / top-k / top-p, logprobs.

Everything is vectorised over the batch; the only per-row Python work is the
random draw for rows that carry their own seeded generator, which keeps a
request's tokens identical whatever else shares its batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from vlserve.core.sampling_params import GREEDY_EPS, SamplingParams
from vlserve.model.accelerator import to_device

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 = greedy row
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: dict[int, torch.Generator]  # random rows with a seed only
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: list[list[int]] | None  # only set when repetition_penalty is
    output_token_ids: list[list[int]]
    min_tokens_blocked: dict[int, list[int]]  # row -> ids masked this step
    token_bitmask: "TokenBitmask | None"  # rows constrained by a grammar, and what each may sample
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        eos_token_ids: Sequence[Iterable[int]],
        generators: dict[int, torch.Generator],
        device: torch.device | str,
        token_bitmask: "TokenBitmask | None" = None,
    ) -> "SamplingMetadata":
        greedy = [p.temperature < GREEDY_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def row_tensor(values: list, dtype: torch.dtype, off) -> torch.Tensor | None:
            # None when every row has the feature off, so the sampler skips it.
            if all(v == off for v in values):
                return None
            return to_device(torch.tensor(values, dtype=dtype), device)

        temperature = to_device(torch.tensor([0.0 if g else p.temperature for p, g in zip(params, greedy)],
                                             dtype=torch.float32), device)
        # Truncation settings only matter for random rows.
        top_k = top_p = min_p = None
        if not all_greedy:
            top_k = row_tensor([0 if g else max(p.top_k, 0) for p, g in zip(params, greedy)], torch.int64, 0)
            top_p = row_tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32, 1.0)
            min_p = row_tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32, 0.0)

        presence = row_tensor([p.presence_penalty for p in params], torch.float32, 0.0)
        frequency = row_tensor([p.frequency_penalty for p in params], torch.float32, 0.0)
        repetition = row_tensor([p.repetition_penalty for p in params], torch.float32, 1.0)

        blocked: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                ids = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    ids.update(eos_token_ids[i])
                if ids:
                    blocked[i] = sorted(ids)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            # Greedy rows never draw, so their generators must not advance.
            generators={i: g for i, g in generators.items() if not greedy[i]},
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=prompt_token_ids if repetition is not None else None,
            output_token_ids=output_token_ids,
            min_tokens_blocked=blocked,
            token_bitmask=token_bitmask,
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=all_greedy,
            all_random=all_random,
        )


@dataclass
class TokenBitmask:
    """Grammar constraints of some rows: bit t of `bits[i]` (int32 words, little-endian) set = row `rows[i]` may
    sample token t."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B, 1 + k] float32; column 0 = sampled token
    logprob_token_ids: torch.Tensor | None  # [B, 1 + k] int64
    sampled_ranks: torch.Tensor | None  # [B] int64; 1 = most likely token


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Own float32 copy: everything below edits it in place.
        logits = logits.to(torch.float32, copy=True)

        # Logprobs describe the model's raw distribution (vLLM v1 "raw_logprobs").
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if meta.min_tokens_blocked:
            _mask_min_tokens(logits, meta.min_tokens_blocked)
        if meta.token_bitmask is not None:
            _apply_token_bitmask(logits, meta.token_bitmask)
        _apply_penalties(logits, meta)

        greedy_mask = meta.temperature < GREEDY_EPS
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            random = _sample_random(logits, meta)
            sampled = random if greedy is None else torch.where(greedy_mask, greedy, random)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)


def _mask_min_tokens(logits: torch.Tensor, blocked: dict[int, list[int]]) -> None:
    vocab = logits.shape[-1]
    rows = [r for r, ids in blocked.items() for t in ids if t < vocab]
    cols = [t for ids in blocked.values() for t in ids if t < vocab]
    if rows:
        logits[
            torch.tensor(rows, device=logits.device),
            torch.tensor(cols, device=logits.device),
        ] = _NEG_INF


# Byte value -> what its 8 bits add to the logits of 8 tokens: 0 where the bit is set, -inf where not. One
# embedding lookup per mask byte then expands a packed mask several times faster than shifting bits.
_BYTE_BIAS = torch.tensor([[0.0 if (b >> j) & 1 else _NEG_INF for j in range(8)] for b in range(256)])


@functools.lru_cache(maxsize=8)
def _byte_bias(device: torch.device) -> torch.Tensor:
    return _BYTE_BIAS.to(device)  # once per device, not per step


def _apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    vocab = logits.shape[-1]
    packed = to_device(mask.bits, logits.device).contiguous().view(torch.uint8)  # byte k: tokens 8k..8k+7
    bias = F.embedding(packed.long(), _byte_bias(logits.device)).view(len(mask.rows), -1)[:, :vocab]
    if len(mask.rows) == logits.shape[0]:
        logits += bias
    else:
        logits.index_add_(0, torch.tensor(mask.rows, device=logits.device), bias)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts, built with one scatter_add from a padded tensor."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.int32, device=device)
    if width:
        # Pad with an extra bucket `vocab` that is dropped afterwards.
        padded = torch.tensor(
            [t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.int64, device=device
        ).clamp_(0, vocab)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    rep, freq, pres = meta.repetition_penalty, meta.frequency_penalty, meta.presence_penalty
    if rep is None and freq is None and pres is None:
        return
    vocab, device = logits.shape[-1], logits.device
    output_counts = _token_counts(meta.output_token_ids, vocab, device)
    output_seen = output_counts > 0

    if rep is not None:
        assert meta.prompt_token_ids is not None, "repetition penalty needs prompt_token_ids"
        seen = output_seen | (_token_counts(meta.prompt_token_ids, vocab, device) > 0)
        rep = rep.unsqueeze(1)
        # Push seen tokens towards "less likely" whatever the sign of their logit.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    if freq is not None:
        logits -= freq.unsqueeze(1) * output_counts
    if pres is not None:
        logits -= pres.unsqueeze(1) * output_seen


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    # Greedy rows get temperature 1 here; their draw is discarded by the caller.
    temp = meta.temperature
    logits /= torch.where(temp < GREEDY_EPS, torch.ones_like(temp), temp).unsqueeze(1)

    if meta.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, _NEG_INF)

    if meta.top_k is not None or meta.top_p is not None:
        logits = _top_k_top_p(logits, meta.top_k, meta.top_p)

    probs = torch.softmax(logits, dim=-1)
    return _draw(probs, meta.generators)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """One descending sort serves both filters; masked logits become -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)

    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        sorted_logits.masked_fill_(positions >= k.unsqueeze(1), _NEG_INF)

    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Probability mass strictly before each token; the top token has 0 and
        # so is always kept. Rows with p == 1 are left alone (float error in the
        # cumsum could otherwise clip their tail).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = top_p.unsqueeze(1)
        sorted_logits.masked_fill_((mass_before >= p) & (p < 1.0), _NEG_INF)

    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row: argmax(p / E) with E ~ Exp(1) picks i with prob p_i."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()  # unseeded rows share the global RNG
    for row, gen in generators.items():
        # Each seeded row draws exactly V numbers from its own generator, so its
        # stream does not depend on batch size or position.
        noise[row].exponential_(generator=gen)
    # A zero draw would turn 0/0 into NaN for masked tokens; argmax treats NaN as max.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    k = min(k, raw_logprobs.shape[-1])
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = raw_logprobs.gather(1, sampled_col)
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
        logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        token_ids = torch.cat([sampled_col, top_ids], dim=1)
    else:
        logprobs, token_ids = sampled_lp, sampled_col
    return SamplerOutput(sampled, logprobs, token_ids, ranks)
