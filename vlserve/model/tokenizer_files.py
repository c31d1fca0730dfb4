"""A checkpoint's tokenizer, loaded with transformers' `AutoTokenizer` (the front end's and the grammar engine's:
one loader, one error).

`AutoTokenizer` indexes every model transformers knows before it picks a class (~1 CPU-second a process). Loading
the class tokenizer_config.json names directly would skip that, but is not the same tokenizer: transformers
overrides the named class by the config's model type (a tiny Qwen3.5 declaring `TokenizersBackend` gets
`Qwen3_5Tokenizer`, which splits whitespace differently; tests/test_qwen3_5_parity.py caught it)."""

from __future__ import annotations

from pathlib import Path

from vlserve.core.errors import ModelLoadError


def load_tokenizer(folder: Path):
    folder = Path(folder)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{folder}: no tokenizer files (tokenizer.json / vocab.json + merges.txt)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types here; the user needs to know which folder failed
        raise ModelLoadError(f"{folder}: could not load the tokenizer ({type(e).__name__}: {e})") from e
