"""The adapters a front end serves, by name: each checked once against the model (from the adapter's header and
a model built on the meta device, so no weights are read here), and how a prompt takes one on."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import torch
from blake3 import blake3

from vlserve.core.errors import InvalidInputError
from vlserve.core.lora import AdapterRef, LoRARequest, PeerAdapter
from vlserve.core.prompt import ProcessedPrompt
from vlserve.lora.adapter import LinearTarget, lora_targets, read_adapter
from vlserve.lora.files import FolderRefused
from vlserve.model.config_types import ModelConfig
from vlserve.model.families import family_of
from vlserve.model.layers.parallel import SINGLE, building_for

logger = logging.getLogger("vlserve.lora")
MAX_NAME_CHARS = 256


class LoRACatalog:
    def __init__(self, model: ModelConfig, model_path: Path, max_rank: int, max_host_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32):
        """`max_host_bytes`: the host memory an adapter's weights may take in the engine (max_cpu_lora_memory_gb,
        numbers of the model's `dtype`): a larger one is refused at load, not on every request."""
        self.model, self.model_path, self.max_rank = model, Path(model_path), max_rank
        self.max_host_bytes, self._itemsize = max_host_bytes, dtype.itemsize
        family = family_of(model.architecture)
        self._our_name = family.load(family.weight_names)
        self._build = family.load(family.model)
        self._targets: dict[str, LinearTarget] | None = None
        self._max_bytes = sum(f.stat().st_size for f in checkpoint_files(self.model_path))
        self._lock = threading.Lock()  # the server loads adapters on worker threads
        self.adapters: dict[str, AdapterRef] = {}

    def targets(self) -> dict[str, LinearTarget]:
        if self._targets is None:
            with torch.device("meta"), building_for(SINGLE):
                meta = self._build(self.model, with_vision=True, with_language=True, vision_tp=None, towers=None)
            self._targets = lora_targets(meta)
        return self._targets

    def load(self, name: str, path: str | Path, roots: tuple[str, ...] | None = None) -> AdapterRef:
        """Checks the adapter and serves it as `name` (a name already served is replaced). `roots`: a runtime
        load's --lora-dir folders: the path must lie in one, and every refusal of the path itself is
        one message (the log says which)."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or name != name.strip():
            raise InvalidInputError(f"LoRA adapter names are 1-{MAX_NAME_CHARS} characters without surrounding "
                                    f"spaces, got {name!r}")
        with self._lock:
            try:
                spec = read_adapter(name, path, self.targets(), self._our_name, self.max_rank, self._max_bytes,
                                    roots=roots, max_host_bytes=self.max_host_bytes, itemsize=self._itemsize)
            except FolderRefused as e:
                if roots is None:
                    raise
                logger.warning("runtime load of LoRA adapter %r refused: %s", name, e)
                raise InvalidInputError(runtime_refusal(name, path)) from None
            ref = AdapterRef(name, spec.path, spec.key, spec.towers, spec.root)
            self.adapters[name] = ref
            return ref

    def resolve(self, named: PeerAdapter) -> AdapterRef | None:
        """The adapter a peer names (a request it accepted), if this instance serves one of that name with the
        same files (key) and reach (towers); None otherwise. Nothing is read: a peer never names a path."""
        ref = self.adapters.get(named.name)
        return ref if ref is not None and (ref.key, ref.towers) == (named.key, named.towers) else None

    def unload(self, name: str) -> None:
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise KeyError(name)

    def for_request(self, request: LoRARequest) -> AdapterRef:
        """The offline API's `lora_request`: served already under that name and folder, or checked now."""
        ref = self.adapters.get(request.lora_name)
        if ref is not None and Path(ref.path) == Path(request.lora_path):
            return ref
        return self.load(request.lora_name, request.lora_path)


def runtime_refusal(name: str, path) -> str:
    """The one answer to every runtime load whose path cannot be loaded: missing, not a folder, unreadable,
    outside --lora-dir, a symlink out of it, files missing. A client learns nothing about the server's files."""
    return (f"LoRA adapter {name!r}: {str(path)[:4096]!r} is not an adapter folder this server may load (a folder "
            "under its --lora-dir holding adapter_config.json and adapter_model.safetensors)")


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files (the loader's own listing is not imported into front ends)."""
    return sorted(folder.glob("*.safetensors"))


def parse_lora_modules(entries) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH ...` as (name, path) pairs."""
    pairs = []
    for entry in entries or ():
        name, sep, path = str(entry).partition("=")
        if not sep or not name or not path:
            raise InvalidInputError(f"lora_modules takes NAME=PATH entries, got {entry!r}")
        pairs.append((name, path))
    return pairs


def with_adapter(prompt: ProcessedPrompt, ref: AdapterRef | None) -> ProcessedPrompt:
    """The prompt run with adapter `ref`. An adapter of the towers changes what they make of each item: its items
    get hashes of their own (new item objects: processed media may be shared with other prompts)."""
    if ref is None or prompt.lora == ref:  # already run with it (an encoder service salted its items' hashes)
        return prompt
    items = prompt.mm_items
    if ref.towers:
        items = [dataclasses.replace(it, mm_hash=_salted(it.mm_hash, ref.key)) for it in items]
    return dataclasses.replace(prompt, lora=ref, mm_items=items)


def _salted(mm_hash: str, key: str) -> str:
    return blake3(f"{mm_hash}|lora:{key}".encode()).hexdigest()[: max(len(mm_hash), 32)]
