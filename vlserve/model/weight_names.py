"""Our fused parameters, filled from a checkpoint's separate pieces: q/k/v projections in one `qkv_proj` (a vision
tower's q/k/v in one `qkv`), gate/up in one `gate_up_proj`; MoE experts stored one by one
(`experts.<e>.gate_proj` ..., as transformers 5 saves Qwen3.5-MoE) in the 3-D `experts.gate_up_proj` /
`experts.down_proj`. Every family's weight names end here."""

from __future__ import annotations

import re

# (checkpoint piece, our fused piece, which shard)
FUSED_PIECES = [
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.shared_expert.gate_proj.", ".mlp.shared_expert.gate_up_proj.", "gate"),  # Qwen3.5-MoE
    (".mlp.shared_expert.up_proj.", ".mlp.shared_expert.gate_up_proj.", "up"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", "gate"),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", "up"),
    (".attn.q.", ".attn.qkv.", "q"),  # Qwen2.5-Omni's vision tower
    (".attn.k.", ".attn.qkv.", "k"),
    (".attn.v.", ".attn.qkv.", "v"),
]
FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "qkv": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


# One expert's matrix: its shard is "e<expert>.<gate|up|down>"
EXPERT_PIECE = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
EXPERT_SHARD = re.compile(r"e(\d+)\.(gate|up|down)$")


def fused_name(name: str) -> tuple[str, str | None]:
    """(our parameter name, the shard of it this checkpoint piece fills, or None when stored whole)."""
    m = EXPERT_PIECE.search(name)
    if m:
        fused = ".experts.down_proj" if m[2] == "down" else ".experts.gate_up_proj"
        return name[: m.start()] + fused, f"e{m[1]}.{m[2]}"
    for piece, fused, shard in FUSED_PIECES:
        if piece in name:
            return name.replace(piece, fused), shard
    return name, None
