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
    reads it from `path` when a request first needs it (refusing other files than `key` says), inside `root` if
    it was loaded at runtime. Within one instance only: peers are told a `PeerAdapter`. `key` (name and a digest of
    its weights) is what caches tell adapters apart by: an adapter reloaded under the same name with other weights
    never meets old entries."""

    name: str
    path: str
    key: str
    towers: bool  # it adapts a media tower or projector: the towers' outputs depend on it
    root: str | None = None  # the --lora-dir folder a runtime load found it in: the engine reads only inside it

    def for_peer(self) -> PeerAdapter:
        return PeerAdapter(self.name, self.key, self.towers)


class PeerAdapter(msgspec.Struct, frozen=True, array_like=True):
    """An adapter as one instance names it to another (disaggregated serving): by name and content, never by
    path. The peer applies it only if it serves an adapter of that name with that key (its --lora-modules)."""

    name: str
    key: str
    towers: bool
