"""A small byte-level BPE tokenizer with the Qwen2-VL special tokens and chat format, trained offline.

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
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Renders the Qwen2-VL chat format. Every piece of output is an explicit string expression with
# whitespace trimmed around all tags, so the template's own layout never leaks into the prompt.
CHAT_TEMPLATE = """
{%- macro render_content(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- set kind = part['type'] if part is mapping else none -%}
      {%- if kind == 'text' -%}
        {{- part['text'] -}}
      {%- elif kind in ['image', 'image_url'] -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif kind in ['video', 'video_url'] -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
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


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    # Sorted so the corpus order (and hence the learned merges) never depends on dict order.
    return [topics[key] for key in sorted(topics)]


def train_bpe(vocab_size: int) -> Tokenizer:
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
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    return tokenizer


def build_tokenizer(vocab_size: int, model_max_length: int = 32768) -> PreTrainedTokenizerFast:
    """The transformers-wrapped tokenizer, with Qwen2-VL's eos/pad tokens and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        # Any cleanup would break the exact decode round trip (e.g. "a ." -> "a.").
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Map each special token to its id, failing loudly if one is missing."""
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise RuntimeError(f"special token {token} did not get its own id")
        ids[token] = token_id
    return ids


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers 5 layout)."""
    tokenizer.save_pretrained(str(out_dir))
