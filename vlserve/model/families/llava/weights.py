"""LLaVA checkpoint tensor names onto ours: a prefix rename (transformers 5 may save `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.image_newline`, `model.language_model.*`, `lm_head.*`; hub checkpoints
and transformers 5.x's save_pretrained `vision_tower.*`, `multi_modal_projector.*`, `image_newline`,
`language_model.model.*`, `language_model.lm_head.*`), then the vision encoder's own layout
(`[vision_model.]embeddings.*`, `[vision_model.]encoder.layers.*`) flattened, then the fused parameters of
vlserve.model.weight_names (q/k/v into `qkv_proj`, the LM's gate/up into `gate_up_proj`). What LLaVA never reads
is skipped: the encoder's `post_layernorm` and SigLIP's pooling `head`, CLIP's stored `position_ids`.
"""

from __future__ import annotations

from vlserve.model.weight_names import fused_name

# (checkpoint prefix, our prefix), first match wins
PREFIX_RENAMES = [
    ("model.vision_tower.", "visual.vision_tower."),
    ("vision_tower.", "visual.vision_tower."),
    ("model.multi_modal_projector.", "visual.multi_modal_projector."),
    ("multi_modal_projector.", "visual.multi_modal_projector."),
    ("model.image_newline", "visual.image_newline"),
    ("image_newline", "visual.image_newline"),
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
]
# inside the vision tower: (their name, ours); None: not read
VISION_RENAMES = [
    ("embeddings.patch_embedding.", "patch_embed.proj."),
    ("embeddings.class_embedding", "class_embedding"),
    ("embeddings.position_embedding.", "position_embedding."),
    ("embeddings.position_ids", None),
    ("pre_layrnorm.", "pre_layrnorm."),
    ("encoder.layers.", "layers."),
    ("post_layernorm.", None),
    ("head.", None),
]
TOWER = "visual.vision_tower."


def our_name(ckpt_name: str) -> tuple[str, str | None] | None:
    """(our parameter name, the fused shard it fills or None); None for a tensor no served model reads."""
    for old, new in PREFIX_RENAMES:
        if ckpt_name.startswith(old):
            ckpt_name = new + ckpt_name[len(old) :]
            break
    if ckpt_name.startswith(TOWER):
        inner = ckpt_name[len(TOWER) :].removeprefix("vision_model.")
        for old, new in VISION_RENAMES:
            if inner.startswith(old):
                if new is None:
                    return None
                ckpt_name = TOWER + new + inner[len(old) :]
                break
    return fused_name(ckpt_name)
