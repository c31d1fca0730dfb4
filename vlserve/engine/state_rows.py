"""A hybrid model's linear-attention state (engine: its running slot) as rows of a KV handoff.

A prefill instance hands a decode instance, besides one KV row per prompt token, the state its linear layers
reached after the prompt: every linear layer's conv state then recurrent state, their bytes back to back, cut into
`state_row_count` rows of the KV rows' width and dtype. They follow the prompt's token rows in the same receive
blocks (rows n .. n + count for a prompt of n tokens), so they travel over the same transports, written in place
like KV rows.

The rows carry the states' bytes, not their values: the recurrent state stays float32 even when the rows are
bfloat16, so the decode instance resumes from exactly the state the prefill reached. (The bytes of a float32
read as bfloat16 are any bit pattern, so the receiver checks the state for NaN once it is unpacked, not the rows.)
"""

from __future__ import annotations

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.model.config_types import ModelConfig
from vlserve.model.layers.linear_state import LinearLayerState, state_bytes_per_slot


def state_row_count(model: ModelConfig, dtype: torch.dtype) -> int:
    """Rows one request's linear states take after its KV rows (0 for a model without linear layers)."""
    nbytes = state_bytes_per_slot(model.text, dtype)
    if not nbytes:
        return 0
    row_bytes = model.kv_row_width * torch.empty((), dtype=dtype).element_size()
    return -(-nbytes // row_bytes)


def state_parts(states: list[LinearLayerState | None], slot: int) -> list[torch.Tensor]:
    """The tensors one slot's state is made of: every linear layer's conv state then recurrent state."""
    return [t[slot] for st in states if st is not None for t in (st.conv, st.recurrent)]


def pack_state(states: list[LinearLayerState | None], slot: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The state in `slot` of every linear layer as [count, width] rows of `dtype`, on the CPU."""
    return pack_parts(state_parts(states, slot), width, dtype)


def pack_parts(parts: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    """`parts` (state_parts, or whole-model ones gathered from tensor-parallel ranks) as rows, their bytes back to
    back."""
    data = torch.cat([p.detach().cpu().contiguous().view(-1).view(torch.uint8) for p in parts])
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    padded = torch.zeros(-(-data.numel() // row_bytes) * row_bytes, dtype=torch.uint8)
    padded[: data.numel()] = data
    return padded.view(dtype).view(-1, width)


def unpack_state(rows: torch.Tensor, states: list[LinearLayerState | None], slot: int) -> None:
    """Writes rows made by `pack_state` into `slot` of every linear layer. Refuses (InvalidInputError) rows too
    short for this model's states or a state that is not finite (a peer's NaN would decode garbage)."""
    parts = state_parts(states, slot)
    for p, v in zip(parts, unpack_parts(rows, [(p.shape, p.dtype) for p in parts])):
        p.copy_(v.to(p.device))


def unpack_parts(rows: torch.Tensor, layout: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The tensors of shapes and dtypes `layout` that rows made by `pack_parts` hold (checked as unpack_state
    says), on the rows' device."""
    data = rows.contiguous().view(-1).view(torch.uint8)
    need = sum(shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout)
    if data.numel() < need:
        raise InvalidInputError(f"the handed-over linear-attention state has {data.numel()} bytes; this model's "
                                f"takes {need}")
    values, offset = [], 0
    for shape, dtype in layout:
        n = shape.numel() * torch.empty((), dtype=dtype).element_size()
        values.append(data[offset : offset + n].view(dtype).view(shape))
        offset += n
    if not all(bool(torch.isfinite(v).all()) for v in values):
        raise InvalidInputError("the handed-over linear-attention state holds NaN or infinite values")
    return values
