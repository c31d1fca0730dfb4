"""Qwen checkpoint tensor names onto ours, in two steps: a prefix rename (both the transformers-5 layout
`model.language_model.*` / `model.visual.*` and the original `model.*` / `visual.*` are accepted; a full
Qwen2.5-Omni checkpoint's `thinker.` is dropped, its talker and token2wav are not built, so skipped), then fused
parameters (vlserve.model.weight_names): q/k/v projections land in one `qkv_proj` (Omni's vision q/k/v in one
`qkv`), gate/up in one `gate_up_proj`. The audio towers keep their own names (Whisper's separate q/k/v), but for
Qwen2-Audio's final norm and projector, which take Omni's (`ln_post`, `proj`). Qwen3.5's multi-token-prediction
layers (`mtp.*`) are not served.
"""

from __future__ import annotations

from vlserve.model.weight_names import fused_name

OMNI_THINKER = "thinker."  # a full Qwen2.5-Omni checkpoint: the thinker's tensors (talker.*, token2wav.* skipped)
# (checkpoint prefix, our prefix), first match wins
PREFIX_RENAMES = [
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.linear.", "audio_tower.proj."),  # Qwen2-Audio's projector
    ("multi_modal_projector.linear.", "audio_tower.proj."),
    ("model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
]
# then (our prefix, renamed): Qwen2-Audio's final norm by Omni's name
AUDIO_RENAMES = [("audio_tower.layer_norm.", "audio_tower.ln_post.")]
# checkpoint tensors no served model reads: Omni's audio bos/eos embeddings (used by the talker path only)
UNUSED = ("audio_tower.audio_bos_eos_token.",)
MTP = "mtp."  # Qwen3.5's multi-token-prediction layers (speculative decoding; not served)


def our_name(ckpt_name: str) -> tuple[str, str | None] | None:
    """(our parameter name, the fused shard it fills or None); None for a tensor no served model reads."""
    ckpt_name = ckpt_name.removeprefix(OMNI_THINKER)
    if ckpt_name.startswith(MTP):
        return None
    for old, new in PREFIX_RENAMES:
        if ckpt_name.startswith(old):
            ckpt_name = new + ckpt_name[len(old) :]
            break
    if ckpt_name.startswith("audio_tower."):
        for old, new in AUDIO_RENAMES:
            if ckpt_name.startswith(old):
                ckpt_name = new + ckpt_name[len(old) :]
        return None if ckpt_name.startswith(UNUSED) else (ckpt_name, None)
    return fused_name(ckpt_name)
