"""The random demo checkpoint that `vlserve serve` and `vlserve demo` use without --model. It lives here, below the
server, so that both commands (and the tensor-parallel ranks they start) reach it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path

from vlserve.tools.tiny_arches import DEFAULT_ARCH

DEMO_NAME = "vlserve-demo"  # the name the demo checkpoint is served as, and that `LLM(model=...)` accepts for it


def demo_checkpoint() -> Path:
    """A small random checkpoint of make-tiny-model's default arch, made once and kept in the user's cache dir."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vlserve" / f"demo-{DEFAULT_ARCH}-small"
    if not (root / "config.json").is_file():
        # The builder imports transformers' model classes (seconds): only when there is something to build.
        from vlserve.tools.tiny_model import make_tiny_model

        make_tiny_model(root, arch=DEFAULT_ARCH, size="small", seed=0)
    return root


def resolve_demo_name(model: str) -> str:
    """`LLM(model="vlserve-demo")`, as the server's clients name it, loads the demo checkpoint (made on first use);
    a local folder of that name wins."""
    if model == DEMO_NAME and not Path(model).exists():
        return str(demo_checkpoint())
    return model
