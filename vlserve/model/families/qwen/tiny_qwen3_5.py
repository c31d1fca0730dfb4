"""The Qwen3.5 part of `make-tiny-model` (qwen/tiny.py): the hybrid decoder's text config. The vision tower,
tokenizer, chat template and processor files are Qwen3-VL's (Qwen3.5 has no DeepStack).

Layers alternate Gated DeltaNet and full attention (full_attention_interval 2), so a 4-layer model has two of each;
head sizes are multiples of 16 (the CPU attention kernels' fast path); rotary covers a quarter of each head.
"""

from __future__ import annotations

from typing import Any

QWEN3_5_ARCHES = ("qwen3_5", "qwen3_5_moe")
# size -> (layers, head_dim, mrope_section of the rotated quarter, linear (key heads, value heads, key dim, value dim))
SHAPES = {
    "tiny": (4, 32, (2, 1, 1), (2, 4, 16, 16)),
    "small": (4, 32, (2, 1, 1), (2, 4, 32, 32)),
    "medium": (12, 256, (11, 11, 10), (8, 16, 128, 128)),
}
PROBES = ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.1.self_attn.q_proj.weight",
          "visual.blocks.0.attn.qkv.weight")


def text_config(arch: str, size: str, base: dict[str, Any], experts: tuple[int, int, int]) -> dict[str, Any]:
    """`base`: the keys every tiny LM shares (sizes, token ids, init range); `size`: make-tiny-model's size name."""
    layers, head_dim, section, (kh, vh, kd, vd) = SHAPES[size]
    text = dict(base, num_hidden_layers=layers, head_dim=head_dim, full_attention_interval=2,
                linear_num_key_heads=kh, linear_num_value_heads=vh, linear_key_head_dim=kd, linear_value_head_dim=vd,
                linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "mrope_section": list(section), "mrope_interleaved": True,
                                 "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
    if arch == "qwen3_5_moe":
        del text["intermediate_size"]
        num, top_k, width = experts
        text |= {"num_experts": num, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
                 "shared_expert_intermediate_size": width}
    return text
