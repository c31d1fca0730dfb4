"""Front end + engine core in one process: the offline `LLM` drives this step by step."""

from __future__ import annotations

import itertools

from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.lora import AdapterRef, LoRARequest
from vlserve.core.outputs import RequestOutput
from vlserve.core.sampling_params import SamplingParams, fan_out
from vlserve.engine.config import VlserveConfig, resolve_config
from vlserve.engine.core import EngineCore
from vlserve.engine.cpu_threads import apply_cpu_threads
from vlserve.frontend.config import FrontendConfig
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.output_processor import OutputProcessor
from vlserve.lora.catalog import LoRACatalog, parse_lora_modules, with_adapter


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.cfg: VlserveConfig = resolve_config(args)
        self.input_processor = InputProcessor.for_model(FrontendConfig.of(self.cfg.facts, args))
        self.tokenizer = self.input_processor.tokenizer
        # torch's threads from the CPU budget while this engine lives (the caller's count comes back at shutdown)
        self._restore_threads = apply_cpu_threads(args.cpu_threads, self.cfg.tensor_parallel_size)
        try:
            self.core = EngineCore(self.cfg)
        except BaseException:
            self._restore_threads()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.loras: LoRACatalog | None = None
        if self.cfg.lora is not None:
            self.loras = LoRACatalog(self.cfg.model, self.cfg.model_path, self.cfg.lora.max_rank,
                                     self.cfg.lora.max_cpu_bytes, self.cfg.dtype)
            for name, path in parse_lora_modules(args.lora_modules):
                self.loras.load(name, path)
        self._ids = itertools.count()
        self._failed: list[tuple[str, str]] = []  # (request id, why), raised by the next step()

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    mm_processor_kwargs: dict | None = None, lora_request: LoRARequest | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id or str(next(self._ids))
        if params.structured_outputs is not None:
            self.core.grammars.check(params.structured_outputs)  # a bad schema or grammar is refused here
        adapter = self._adapter(lora_request)
        processed = with_adapter(self.input_processor.process(prompt, mm_processor_kwargs), adapter)
        self.core.add_request(request_id, processed, params)
        self.output_processor.add(request_id, processed.text, processed.prompt_token_ids, fan_out(params, request_id))
        return request_id

    def _adapter(self, lora_request: LoRARequest | None) -> AdapterRef | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidInputError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.loras is None:
            raise InvalidInputError("this engine serves no LoRA adapters: create it with enable_lora=True")
        return self.loras.for_request(lora_request)

    def shutdown(self) -> None:
        try:
            self.core.shutdown()
        finally:
            self._restore_threads()

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0 or bool(self._failed)

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs. A request the engine refused after admission (its grammar failed to
        build; `add_request` checks first, so this is rare) raises here, at the step after the one that found
        it, so that step's outputs are never lost."""
        if self._failed:
            request_id, why = self._failed.pop(0)
            raise InvalidInputError(f"request {request_id}: {why}")
        outputs, stop_now = self.output_processor.process(self.core.step())
        if stop_now:
            self.core.stop_requests(stop_now)
        for request_id, why, _ in self.core.take_failed():
            self.output_processor.abort(request_id)
            self._failed.append((request_id, why))
        return outputs

