"""Tokenizer and chat template loading (transformers' fast tokenizers; templates from the checkpoint)."""

from __future__ import annotations

import logging
from pathlib import Path

from vlserve.core.errors import InvalidInputError, ModelLoadError

logger = logging.getLogger(__name__)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{folder}: no tokenizer files (tokenizer.json / vocab.json + merges.txt)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types here; the user needs to know which folder failed
        raise ModelLoadError(f"{folder}: could not load the tokenizer ({type(e).__name__}: {e})") from e


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None) -> str:
    from jinja2 import TemplateError

    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidInputError("this model has no chat template; send a formatted prompt instead")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except TemplateError as e:  # a user-given template, or messages the model's template refuses
        raise InvalidInputError(f"the chat template failed on these messages: {e}") from None
