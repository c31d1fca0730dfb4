"""A small byte-level BPE tokenizer with a Qwen family's special tokens and chat format, trained offline
(Qwen2-VL's, and the audio families': Qwen2-Audio, Qwen2.5-Omni).

The training text is `pydoc_data.topics`, which ships with CPython, so no download is needed.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

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


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    # Sorted so the corpus order (and hence the learned merges) never depends on dict order.
    return [topics[key] for key in sorted(topics)]


def train_bpe(vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE with `vocab_size` learned tokens, then append the special tokens."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256-byte alphabet, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False and no normalizer: decode(encode(s)) == s for any string.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # All 256 byte symbols must be present or unseen bytes (emoji, CJK) could not be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in special_tokens])
    return tokenizer


def build_tokenizer(vocab_size: int, model_max_length: int = 32768, special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
                    chat_template: str = CHAT_TEMPLATE, token_names: dict[str, str] | None = None,
                    eos_token: str = EOS_TOKEN, pad_token: str = PAD_TOKEN) -> PreTrainedTokenizerFast:
    """The transformers-wrapped tokenizer, with Qwen's eos/pad tokens, a family's special tokens and chat
    template (Qwen2-VL's by default); `token_names` become attributes (`tokenizer.audio_token`, ...); the eos and
    pad tokens are Qwen's unless named (LLaVA-NeXT-Video's Llama: "</s>")."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, special_tokens),
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        extra_special_tokens=token_names or {},
        # Any cleanup would break the exact decode round trip (e.g. "a ." -> "a.").
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def special_token_ids(tokenizer: PreTrainedTokenizerFast, special_tokens: tuple[str, ...] = SPECIAL_TOKENS
                      ) -> dict[str, int]:
    """Map each special token to its id, failing loudly if one is missing."""
    ids: dict[str, int] = {}
    for token in special_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise RuntimeError(f"special token {token} did not get its own id")
        ids[token] = token_id
    return ids


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers 5 layout)."""
    tokenizer.save_pretrained(str(out_dir))
