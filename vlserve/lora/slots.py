"""The adapters a model shard holds: on the device, up to `max_loras` slots; in host memory, up to
`max_cpu_loras` adapters and `max_cpu_bytes` bytes of them read from disk (least recently used ones go first,
never one a request in the engine uses).

Reading (`read`) touches nothing of the slots, so a loader thread does it while the engine steps; the thread
that owns the slots (the engine's, an encoder's vision thread) then hands the weights in (`insert`)."""

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
                 max_bytes: int, dtype: torch.dtype, device: torch.device, elsewhere: tuple[str, ...] = (),
                 max_cpu_bytes: int | None = None):
        """`elsewhere`: prefixes of the modules this shard does not hold (an encoder's LM, a language server's
        towers): an adapter's pieces there are another process's to apply."""
        self.targets = lora_targets(model)
        self.layers: dict[str, LoRALinear | ExpertWeightLoRA] = wrap_targets(model, self.targets, max_loras)
        self.our_name, self.max_rank, self.max_bytes, self.elsewhere = our_name, max_rank, max_bytes, elsewhere
        self.dtype, self.device = dtype, device
        self.max_cpu_loras, self.max_cpu_bytes = max_cpu_loras, max_cpu_bytes
        self.host: OrderedDict[str, Weights] = OrderedDict()  # adapter key -> its whole pairs on the CPU
        self.slot_keys: list[str | None] = [None] * max_loras
        self.slot_refs: list[AdapterRef | None] = [None] * max_loras  # what each slot holds (other ranks fill alike)
        self.last_used = [0] * max_loras
        self._tick = 0
        self.loads = 0  # adapters put into a slot (each a copy of its weights to the device)
        # the keys of every request's adapter in the engine: host memory keeps those (the engine core sets it)
        self.in_use: Callable[[], set[str]] = set

    def prepare(self, ref: AdapterRef) -> None:
        """Reads a new request's adapter into host memory now, unless it is there: a file that no longer fits
        refuses the request here, never a step later. (The engine process reads on its loader thread first.)"""
        self._host_weights(ref)

    def holds(self, ref: AdapterRef) -> bool:
        return ref.key in self.host

    def read(self, ref: AdapterRef) -> Weights:
        """The adapter's whole pairs on the CPU, from its files read once (any thread: nothing shared changes).
        Refused when the files are not those the front end checked (`ref.key`), or take more host memory than
        max_cpu_bytes (from the header: the tensors are not read then). A runtime-loaded adapter (`ref.root`) is
        read only inside its --lora-dir folder, and any failure before its key is checked is one message (the
        client chose the path: what is there now is not its to learn); the log says why."""
        try:
            spec = read_adapter(ref.name, ref.path, self.targets, self.our_name, self.max_rank, self.max_bytes,
                                self.elsewhere, keep=True, roots=None if ref.root is None else (ref.root,),
                                max_host_bytes=self.max_cpu_bytes, itemsize=self.dtype.itemsize)
            if spec.key != ref.key:
                raise InvalidInputError(f"LoRA adapter {ref.name!r}: {ref.path} changed since it was loaded; load "
                                        "it again")
        except (InvalidInputError, OSError) as e:
            if ref.root is None:  # the operator's own folder (--lora-modules, the offline API): the details help
                raise
            logger.warning("LoRA adapter %r could not be read again from %s: %s", ref.name, ref.path, e)
            raise InvalidInputError(f"LoRA adapter {ref.name!r} changed since it was loaded; load it again") \
                from None
        weights = adapter_weights(spec, self.targets, self.dtype, torch.device("cpu"))
        logger.info("LoRA adapter %s read from %s (rank %d, %d linears)", ref.name, ref.path, spec.rank,
                    len(weights))
        return weights

    def insert(self, ref: AdapterRef, weights: Weights) -> None:
        """Keeps what `read` gave (on the thread that owns the slots), dropping the least recently used adapters
        no request in the engine uses while there are more than max_cpu_loras or max_cpu_bytes of them."""
        if ref.key in self.host:
            self.host.move_to_end(ref.key)
            return
        size = _nbytes(weights)
        if self.max_cpu_bytes is not None and size > self.max_cpu_bytes:
            raise InvalidInputError(f"LoRA adapter {ref.name!r}: its weights take {size} bytes of host memory, "
                                    f"more than max_cpu_lora_memory_gb allows ({self.max_cpu_bytes})")
        self.host[ref.key] = weights
        in_use, total = self.in_use(), self.host_bytes
        for key in [k for k in self.host if k not in in_use and k != ref.key]:  # least recently used first
            if len(self.host) <= self.max_cpu_loras and (self.max_cpu_bytes is None or total <= self.max_cpu_bytes):
                break
            total -= _nbytes(self.host.pop(key))

    @property
    def host_bytes(self) -> int:
        return sum(_nbytes(w) for w in self.host.values())

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
        if ref.key not in self.host:
            self.insert(ref, self.read(ref))
        self.host.move_to_end(ref.key)
        return self.host[ref.key]


def _nbytes(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for pair in weights.values() for t in pair)
