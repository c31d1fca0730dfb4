"""InternVL checkpoint tensor names onto ours: a prefix rename (transformers 5 saves `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`; checkpoints saved by transformers 4.x
`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`), then
InternViT's patch embedding (`patch_embed.proj`: the loader turns its Conv2d kernel into a Linear) and blocks
(`encoder.layer.<i>.attention.{q,k,v}_proj` into one `qkv`), then the fused parameters of
vlserve.model.weight_names (the LM's q/k/v and gate/up)."""

from __future__ import annotations

from vlserve.model.weight_names import fused_name

# (checkpoint prefix, our prefix), first match wins
PREFIX_RENAMES = [
    ("model.vision_tower.", "visual.vision_tower."),
    ("vision_tower.", "visual.vision_tower."),
    ("model.multi_modal_projector.", "visual.multi_modal_projector."),
    ("multi_modal_projector.", "visual.multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
]
# inside a tower block: (their piece, ours, the shard of our fused qkv it fills)
BLOCK_PIECES = [
    (".attention.q_proj.", ".attn.qkv.", "q"),
    (".attention.k_proj.", ".attn.qkv.", "k"),
    (".attention.v_proj.", ".attn.qkv.", "v"),
    (".attention.", ".attn.", None),  # projection_layer, q_norm, k_norm
]
TOWER = "visual.vision_tower."


def our_name(ckpt_name: str) -> tuple[str, str | None] | None:
    """(our parameter name, the fused shard it fills or None); None for a tensor no served model reads."""
    for old, new in PREFIX_RENAMES:
        if ckpt_name.startswith(old):
            ckpt_name = new + ckpt_name[len(old) :]
            break
    if ckpt_name.startswith(TOWER + "encoder.layer."):
        ckpt_name = TOWER + "layers." + ckpt_name[len(TOWER + "encoder.layer.") :]
        for old, new, shard in BLOCK_PIECES:
            if old in ckpt_name:
                return ckpt_name.replace(old, new), shard
    if ckpt_name.startswith(TOWER + "embeddings.patch_embeddings.projection."):
        return TOWER + "embeddings.patch_embed.proj." + ckpt_name.rsplit(".", 1)[1], None  # the loader's Linear
    if ckpt_name.startswith(TOWER + "embeddings.mask_token"):
        return None  # masked image modelling only
    return fused_name(ckpt_name)
