"""Where a checkpoint's files are: a local folder as given, or a hub id fetched into the local hub cache.

Apart from the loader so that a front end can find the config files without importing the weight loader."""

from __future__ import annotations

import os
from pathlib import Path

from vlserve.core.errors import ModelLoadError

HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*", "*.tiktoken"]


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, fetched (or found in the local hub cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"{model}: not a folder; expected a Hugging Face model folder or hub id")
    if str(model).count("/") != 1 or str(model).startswith(("/", ".", "~")):
        raise ModelLoadError(f"model '{model}': no such folder, and it does not look like a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=str(model), allow_patterns=HUB_FILE_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, network: all end the same way for the user
        raise ModelLoadError(
            f"model '{model}' is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Download it first (e.g. `hf download {model}`) or pass a folder."
        ) from e
