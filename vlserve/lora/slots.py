"""The adapters a model shard holds: on the device, up to `max_loras` slots; in host memory, up to
`max_cpu_loras` adapters read from disk (least recently used ones go first, never one a step is using)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.lora import AdapterRef
from vlserve.lora.adapter import adapter_weights, lora_targets, read_adapter, this_ranks_part
from vlserve.lora.layers import ExpertWeightLoRA, LoRALinear, wrap_targets

logger = logging.getLogger("vlserve.lora")
Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRASlots:
    def __init__(self, model: torch.nn.Module, our_name, max_loras: int, max_cpu_loras: int, max_rank: int,
                 max_bytes: int, dtype: torch.dtype, device: torch.device, elsewhere: tuple[str, ...] = ()):
        """`elsewhere`: prefixes of the modules this shard does not hold (an encoder's LM, a language server's
        towers): an adapter's pieces there are another process's to apply."""
        self.targets = lora_targets(model)
        self.layers: dict[str, LoRALinear | ExpertWeightLoRA] = wrap_targets(model, self.targets, max_loras)
        self.our_name, self.max_rank, self.max_bytes, self.elsewhere = our_name, max_rank, max_bytes, elsewhere
        self.dtype, self.device = dtype, device
        self.max_cpu_loras = max_cpu_loras
        self.host: OrderedDict[str, Weights] = OrderedDict()  # adapter key -> its whole pairs on the CPU
        self.slot_keys: list[str | None] = [None] * max_loras
        self.slot_refs: list[AdapterRef | None] = [None] * max_loras  # what each slot holds (other ranks fill alike)
        self.last_used = [0] * max_loras
        self._tick = 0
        self.loads = 0  # adapters put into a slot (each a copy of its weights to the device)
        # the keys of every request's adapter in the engine: host memory keeps those (the engine core sets it)
        self.in_use: Callable[[], set[str]] = set

    def prepare(self, ref: AdapterRef) -> None:
        """Reads a new request's adapter into host memory now: a file that no longer fits refuses the request
        here, never a step later."""
        self._host_weights(ref)

    def assign(self, refs: list[AdapterRef]) -> dict[str, int]:
        """A slot for each adapter of a step (at most max_loras different ones: the scheduler sees to it),
        filling slots whose adapters this step does not use, least recently used first."""
        wanted = list(dict.fromkeys(r.key for r in refs))
        if len(wanted) > len(self.slot_keys):
            raise RuntimeError(f"{len(wanted)} adapters in one step, {len(self.slot_keys)} slots")
        self._tick += 1
        slots = {}
        for ref in {r.key: r for r in refs}.values():
            if ref.key in self.slot_keys:
                slot = self.slot_keys.index(ref.key)
            else:
                free = [s for s, k in enumerate(self.slot_keys) if k not in wanted]
                slot = min(free, key=lambda s: (self.slot_keys[s] is not None, self.last_used[s]))
                self._fill(slot, ref)
            self.last_used[slot] = self._tick
            slots[ref.key] = slot
        return slots

    def whole_weights(self, ref: AdapterRef) -> Weights:
        """An adapter's whole pairs (host memory), which rank 0 of a tensor-parallel engine hands the other
        ranks when it puts the adapter in a slot: they never read adapter files themselves."""
        return self._host_weights(ref)

    def hold(self, refs: list[AdapterRef | None], given: dict[int, Weights]) -> None:
        """Rank 0's slots on another rank (`slot_refs`, and the whole pairs of the adapters it put in a slot since
        it last said): each slot holds the same adapter, this rank's part of it."""
        for slot, ref in enumerate(refs):
            if ref is not None and self.slot_keys[slot] != ref.key:
                if slot not in given:
                    raise RuntimeError(f"rank 0 put LoRA adapter {ref.name!r} in slot {slot} without its weights")
                self._fill(slot, ref, given[slot])

    def _fill(self, slot: int, ref: AdapterRef, weights: Weights | None = None) -> None:
        weights = self._host_weights(ref) if weights is None else weights
        for name, layer in self.layers.items():
            pair = weights.get(name)
            if pair is not None:
                pair = tuple(t.to(self.device) for t in this_ranks_part(self.targets[name].cut, *pair))
            layer.adapters[slot] = pair
        self.slot_keys[slot], self.slot_refs[slot] = ref.key, ref
        self.loads += 1

    def _host_weights(self, ref: AdapterRef) -> Weights:
        if ref.key in self.host:
            self.host.move_to_end(ref.key)
            return self.host[ref.key]
        spec = read_adapter(ref.name, ref.path, self.targets, self.our_name, self.max_rank, self.max_bytes,
                            self.elsewhere)
        if spec.key != ref.key:
            raise InvalidInputError(f"LoRA adapter {ref.name!r}: {ref.path} changed since it was loaded; load it "
                                    "again")
        weights = adapter_weights(spec, self.targets, self.dtype, torch.device("cpu"))
        self.host[ref.key] = weights
        in_use, excess = self.in_use(), max(0, len(self.host) - self.max_cpu_loras)
        for key in [k for k in self.host if k not in in_use and k != ref.key][:excess]:
            del self.host[key]  # least recently used first; adapters of requests in the engine stay
        logger.info("LoRA adapter %s read from %s (rank %d, %d linears)", ref.name, ref.path, spec.rank,
                    len(weights))
        return weights
