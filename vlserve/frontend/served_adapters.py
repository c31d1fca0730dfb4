"""The LoRA adapters a front end serves (--enable-lora): those it starts with (--lora-modules) and those loaded
or unloaded at runtime (/v1/load_lora_adapter, --lora-dir). Their files are read on the media pool, never on the
event loop; the engine process reads the weights when a request first needs them."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from vlserve.core.errors import InvalidInputError, NotFoundError
from vlserve.core.lora import AdapterRef
from vlserve.lora.catalog import LoRACatalog, parse_lora_modules, runtime_refusal

logger = logging.getLogger("vlserve.engine")


class ServedAdapters:
    """`catalog` (None: no adapters, --enable-lora is off) under names other than the served model's."""

    def __init__(self, catalog: LoRACatalog | None, model_name: str, executor: Executor):
        self.catalog, self.model_name, self.executor = catalog, model_name, executor
        self._loading: set[str] = set()  # adapter names a runtime load is checking now

    def start_with(self, lora_modules) -> None:
        """Loads --lora-modules; a bad one stops the start with its reason."""
        for name, path in parse_lora_modules(lora_modules):
            self._check_new_name(name)
            self.catalog.load(name, path)

    async def load(self, name: str, path: str, replace: bool = False, lora_dirs: tuple[str, ...] = ()
                   ) -> AdapterRef:
        """Checks the adapter at `path` (a folder on this machine, inside one of `lora_dirs`: --lora-dir) and
        serves it as `name`; on the thread pool, since it reads the adapter's files. A name already served is
        refused unless `replace` (requests running with the old adapter finish with it). The engine process reads
        the weights when a request first needs them. Peers (disaggregated) apply only their own --lora-modules."""
        if self.catalog is None:
            raise InvalidInputError("this server serves no LoRA adapters: start it with --enable-lora")
        if not lora_dirs:
            raise InvalidInputError("loading LoRA adapters at runtime needs --lora-dir: the folders they may be "
                                    "loaded from (none given)")
        if not replace and (name in self.catalog.adapters or name in self._loading):
            raise InvalidInputError(f"the LoRA adapter {name!r} has already been loaded")
        self._check_new_name(name)
        self._loading.add(name)  # on the event loop: two loads of one name cannot both pass the check above
        try:
            ref = await asyncio.get_running_loop().run_in_executor(self.executor, self.catalog.load, name, path,
                                                                   tuple(lora_dirs))
        except OSError as e:  # the caller's folder, not the server, is at fault; which failure is not said
            logger.warning("runtime load of LoRA adapter %r refused: %s", name, e)
            raise InvalidInputError(runtime_refusal(name, path)) from None
        finally:
            self._loading.discard(name)
        logger.info("LoRA adapter %r loaded from %r", name, ref.path)
        return ref

    async def unload(self, name: str) -> None:
        """New requests naming it are refused (404); those already running finish with it. On the thread pool:
        the catalog's lock may be held by a load reading its files."""
        if self.catalog is None:
            raise InvalidInputError("this server serves no LoRA adapters: start it with --enable-lora")
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.catalog.unload, name)
        except KeyError:
            raise NotFoundError(f"the LoRA adapter {name!r} is not loaded") from None
        logger.info("LoRA adapter %r unloaded", name)

    def _check_new_name(self, name: str) -> None:
        if name == self.model_name:  # the base model's name must keep meaning the base model
            raise InvalidInputError(f"a LoRA adapter cannot be named {name!r}: that is the served model's name")
