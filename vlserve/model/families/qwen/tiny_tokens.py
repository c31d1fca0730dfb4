"""The Qwen tokenizers of `make-tiny-model` (qwen/tiny.py gives them to vlserve.tools.tiny_model, which trains
the BPE): each family's special tokens, chat template and the tokenizer attributes naming them (Qwen2-VL's, which
the Qwen-VL families share, and the audio families': Qwen2-Audio, Qwen2.5-Omni).
"""

from __future__ import annotations

from vlserve.model.families.qwen.tiny_parts import OMNI

# Same tokens, same order as Qwen2-VL; they get the ids right after the trained vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2-Audio: Qwen2's three, then the audio placeholder and the tokens around it.
QWEN2_AUDIO_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
)
# Qwen2.5-Omni: Qwen2-VL's slots, some renamed (the audio tokens take the object/box ones; vision_bos/eos,
# IMAGE and VIDEO are Qwen2-VL's vision_start/end, image_pad and video_pad).
OMNI_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>",
    "<|VIDEO|>",
)
# What Omni's processor reads off its tokenizer (`tokenizer.image_token`, ...).
OMNI_TOKEN_NAMES = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


# Renders the Qwen chat format. Every piece of output is an explicit string expression with whitespace trimmed
# around all tags, so the template's own layout never leaks into the prompt. `media` is the Jinja branch for one
# content part of kind `kind` (the family's placeholders); counters number the parts over the conversation.
def _chat_template(media: str) -> str:
    return """
{%- set counts = namespace(image=0, video=0, audio=0) -%}
{%- macro render_content(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- set kind = part['type'] if part is mapping else none -%}
      {%- if kind == 'text' -%}
        {{- part['text'] -}}
""" + media + """
      {%- else -%}
        {{- raise_exception('unsupported content part type: ' ~ kind) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if not messages or messages[0]['role'] != 'system' -%}
  {{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM_PROMPT + """<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {{- '<|im_start|>' ~ message['role'] ~ '\\n' -}}
  {{- render_content(message['content']) -}}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
""".strip()


CHAT_TEMPLATE = _chat_template("""
      {%- elif kind in ['image', 'image_url'] -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif kind in ['video', 'video_url'] -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}""")
# Qwen2-Audio-7B-Instruct's own layout: "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" and a newline.
QWEN2_AUDIO_CHAT_TEMPLATE = _chat_template("""
      {%- elif kind in ['audio', 'audio_url', 'input_audio'] -%}
        {%- set counts.audio = counts.audio + 1 -%}
        {{- 'Audio ' ~ counts.audio ~ ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' -}}""")
# Qwen2.5-Omni's: bare placeholders, numbered with add_vision_id / add_audio_id.
OMNI_CHAT_TEMPLATE = _chat_template("""
      {%- elif kind in ['image', 'image_url'] -%}
        {%- set counts.image = counts.image + 1 -%}
        {{- ('Picture ' ~ counts.image ~ ': ' if add_vision_id else '') ~ '<|vision_bos|><|IMAGE|><|vision_eos|>' -}}
      {%- elif kind in ['audio', 'audio_url', 'input_audio'] -%}
        {%- set counts.audio = counts.audio + 1 -%}
        {{- ('Audio ' ~ counts.audio ~ ': ' if add_audio_id else '') ~ '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}
      {%- elif kind in ['video', 'video_url'] -%}
        {%- set counts.video = counts.video + 1 -%}
        {{- ('Video ' ~ counts.video ~ ': ' if add_vision_id else '') ~ '<|vision_bos|><|VIDEO|><|vision_eos|>' -}}""")

# arch -> (special tokens, chat template, tokenizer attributes naming them); the others take Qwen2-VL's
TOKENIZERS = {"qwen2_audio": (QWEN2_AUDIO_SPECIAL_TOKENS, QWEN2_AUDIO_CHAT_TEMPLATE, None)} | {
    arch: (OMNI_SPECIAL_TOKENS, OMNI_CHAT_TEMPLATE, OMNI_TOKEN_NAMES) for arch in OMNI}
