"""A vlserve encoder as a Dynamo encode worker (`vlserve dynamo-worker --disaggregation-mode encode`): Dynamo's
E->PD pattern with vlserve's roles.

Dynamo's frontend sends a request with media to an encode worker first (the language worker registered with
`--route-to-encoder`); this one fetches and encodes its items into the encoder cache of the vlserve encode service
it runs (`disagg.encode_service`), and answers with an `encoder_result` naming itself. The frontend hands that to
the language worker, whose prompt encoder asks this same encoder for the rows (its cache hits) over vlserve's
transports, as in any vlserve E->PD deployment; the encoder is found through vlserve's registry (`--registry`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import Any

from dynamo.common.backend import EngineConfig, LLMEngine, WorkerConfig
from dynamo.common.backend.multimodal import encoder_terminal_chunk
from dynamo.common.utils.token_ids import normalize_request_token_ids

from vlserve.core.config import Options
from vlserve.core.errors import ConfigurationError, InvalidInputError, VlserveError
from vlserve.core.processes import finish
from vlserve.dynamo.flags import FromFlags, worker_setup
from vlserve.dynamo.request import ENCODER_RESULT_KEY, dynamo_prompt
from vlserve.dynamo.worker import dynamo_error

logger = logging.getLogger("vlserve.dynamo")



class VlserveEncodeEngine(FromFlags, LLMEngine):
    def __init__(self, opts: Options, worker: WorkerConfig):
        self.opts, self.worker = opts, worker
        self.service = None
        self.registry = None
        self._serving: asyncio.Task | None = None
        self.instance_id = ""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, log_level: str = "INFO"):
        from dynamo.common.constants import DisaggregationMode

        from vlserve.model.checkpoint_path import resolve_model_path

        opts, worker, _ = worker_setup(ns)
        if ns.disaggregation_mode != "encode":
            raise ConfigurationError("the encode worker is for --disaggregation-mode encode")
        if opts.engine.encoder_cache_size == 0:
            raise ConfigurationError("--disaggregation-mode encode keeps what it encodes in its encoder cache for the "
                                     "language worker: --encoder-cache-size 0 would encode every item twice")
        worker.disaggregation_mode, worker.enable_kv_routing = DisaggregationMode.ENCODE, False
        worker.model_name = str(resolve_model_path(opts.engine.model))  # the folder, as the language worker's
        worker.served_model_name = opts.server.served_model_name or opts.engine.model
        return cls(opts, worker), worker

    async def start(self, worker_id: int) -> EngineConfig:
        from vlserve.disagg.encode_service import EncodeService
        from vlserve.disagg.registries import open_registry
        from vlserve.disagg.registry import InstanceInfo, advertised_host, new_instance_id

        opts = self.opts
        # (no HTTP server of ours: the data socket takes a free port, read back once bound)
        opts.disagg = dataclasses.replace(opts.disagg, data_port=0)
        self.service = EncodeService(opts)
        self.service.bind()
        host = advertised_host(opts.disagg, opts.server.host)
        self.instance_id = new_instance_id()
        info = InstanceInfo(self.instance_id, "encode", f"{host}:{self.service.data_port}", f"{host}:0")
        self.registry = open_registry(opts.disagg, info, opts.engine.model, load_fn=lambda: self.service.in_flight,
                                      auth=self.service.auth)
        await self.registry.start()
        self._serving = asyncio.get_running_loop().create_task(self.service.serve())
        logger.info("vlserve encode worker %s ready for Dynamo: vlserve encoder %s, data tcp://%s", worker_id,
                    self.instance_id, info.address)
        return EngineConfig(model=self.worker.model_name, served_model_name=self.worker.served_model_name)

    async def cleanup(self) -> None:
        """Null-safe and idempotent: out of the registry, the data socket and its transfers stopped, the tower
        shut down; each step runs whatever the one before it raised."""
        try:
            if self.registry is not None:
                registry, self.registry = self.registry, None
                await finish(registry.stop())
        finally:
            service, self.service = self.service, None
            serving, self._serving = self._serving, None
            tasks = [serving] if serving is not None else []
            if service is not None:
                tasks += list(service.tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if service is not None:
                await finish(service.aclose())

    async def register_prometheus(self, metrics: Any) -> None:
        """The encoder's metrics (encoder-cache hits, tower latency, transfers) on the worker's /metrics."""
        from dynamo.common.backend.metrics import register_engine_registry

        if self.service is not None:
            register_engine_registry(metrics, self.service.registry)

    async def generate(self, request: dict, context) -> AsyncGenerator[dict, None]:
        try:
            asked = dynamo_prompt(normalize_request_token_ids(request), set())
            media = asked.prompt.get("multi_modal_data") or {}
            if media:
                if asked.text is None:
                    raise InvalidInputError("extra_args.formatted_prompt is missing: the encoder needs the prompt's "
                                            "text")
                prompt = {"prompt": asked.text, "multi_modal_data": media}
                await self.service.warm(prompt, asked.mm_processor_kwargs, context.id() or "dynamo")
        except VlserveError as e:
            raise dynamo_error(e) from None
        n = sum(len(v) for v in media.values())
        yield encoder_terminal_chunk({ENCODER_RESULT_KEY: self.instance_id, "items": n})
