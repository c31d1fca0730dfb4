"""A small byte-level BPE tokenizer, trained offline, with a family's special tokens, chat template and eos / pad
tokens (its tiny-checkpoint builder gives them: see tiny_model.py).

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


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    # Sorted so the corpus order (and hence the learned merges) never depends on dict order.
    return [topics[key] for key in sorted(topics)]


def train_bpe(vocab_size: int, special_tokens: tuple[str, ...]) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE with `vocab_size` learned tokens, then append the special tokens (their
    ids follow the trained vocabulary, in their order)."""
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


def build_tokenizer(vocab_size: int, *, special_tokens: tuple[str, ...], chat_template: str, eos_token: str,
                    pad_token: str, token_names: dict[str, str] | None = None,
                    model_max_length: int = 32768) -> PreTrainedTokenizerFast:
    """The transformers-wrapped tokenizer with a family's special tokens, chat template, eos and pad tokens;
    `token_names` become attributes (`tokenizer.audio_token`, ...)."""
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


def special_token_ids(tokenizer: PreTrainedTokenizerFast, special_tokens: tuple[str, ...]) -> dict[str, int]:
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
