"""LoRA adapters as requests name them: light (no torch), so every process and the wire can carry them."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name and argument order: `LoRARequest("docs", 1, "/adapters/docs")`. `lora_int_id` is the caller's
    number for it (kept for compatibility; vlserve tells adapters apart by name and content)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class AdapterRef(msgspec.Struct, frozen=True, array_like=True):
    """What a prompt carries about its adapter, checked by the front end (vlserve.lora.adapter): the engine
    loads it from `path` when a step first needs it. `key` (name and a digest of its weights) is what caches
    tell adapters apart by: an adapter reloaded under the same name with other weights never meets old entries."""

    name: str
    path: str
    key: str
    towers: bool  # it adapts a media tower or projector: the towers' outputs depend on it
