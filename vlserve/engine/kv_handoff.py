"""What a prefill instance hands a decode instance for one request: the KV of its prompt as one row per token, the
token it sampled, and the state of its random stream, so decoding goes on exactly as one engine would have."""

from __future__ import annotations

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.sampling_params import SamplingParams


def kv_to_rows(kv: torch.Tensor) -> torch.Tensor:
    """[layers, 2, n, kv_heads, head_dim] -> [n, width]: one row per token, so KV travels in the same receive
    blocks and transports as embedding rows (a token's row lands in that token's slot)."""
    return kv.permute(2, 0, 1, 3, 4).reshape(kv.shape[2], -1)


def rows_to_kv(rows: torch.Tensor, layers: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of `kv_to_rows`."""
    if rows.dim() != 2 or rows.shape[1] != layers * 2 * kv_heads * head_dim:
        raise InvalidInputError(f"KV rows of shape {tuple(rows.shape)} do not fit this model ({layers} layers, "
                                f"{kv_heads} KV heads of {head_dim})")
    return rows.view(rows.shape[0], layers, 2, kv_heads, head_dim).permute(1, 2, 0, 3, 4)


def check_handed_first(first: EngineCoreOutput, params: SamplingParams, vocab_size: int, has_state: bool) -> None:
    """Refuses a prefill's first output that this request could not have produced (a decode instance trusts no
    peer blindly: a bad id or logprobs entry would crash the engine or the front end later)."""
    if len(first.new_token_ids) != 1:
        raise InvalidInputError("a handed-over request carries exactly the one token its prefill sampled")
    token = first.new_token_ids[0]
    if not 0 <= token < vocab_size:
        raise InvalidInputError(f"the handed-over token {token} is outside the vocabulary")
    entries = first.new_logprobs or []
    want = 0 if params.logprobs is None else 1
    ok = len(entries) == want and all(
        len(e.token_ids) == len(e.logprobs) == 1 + params.logprobs and e.token_ids[0] == token
        and all(0 <= t < vocab_size for t in e.token_ids) for e in entries)
    if not ok:
        raise InvalidInputError("the handed-over logprobs do not match the request's logprobs setting")
    if params.seed is not None and not params.greedy and not has_state:
        raise InvalidInputError("a seeded sampled request needs the prefill's random state to go on exactly")
