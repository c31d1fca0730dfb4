"""The offline API: `LLM(model=...).generate(...)` / `.chat(...)`, shaped like vLLM's."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vlserve.core.config import EngineArgs
from vlserve.core.cpu_budget import WAIT_POLICY_ENV
from vlserve.core.errors import InvalidInputError
from vlserve.core.lora import LoRARequest
from vlserve.core.outputs import RequestOutput
from vlserve.core.sampling_params import SamplingParams
from vlserve.frontend.chat import parse_chat_messages
from vlserve.frontend.input_processor import as_list
from vlserve.frontend.llm_engine import LLMEngine
from vlserve.frontend.tokenizer import render_chat
from vlserve.frontend.tool_calls import check_tools
from vlserve.tools.demo_checkpoint import resolve_demo_name

logger = logging.getLogger("vlserve")


class LLM:
    """Load a checkpoint of a family vlserve serves (vlserve.model.families) and generate with continuous batching.

    >>> llm = LLM(model="path/or/org/name", dtype="bfloat16", max_num_seqs=32)   # "vlserve-demo": the demo checkpoint
    >>> llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is this?",
    ...               "multi_modal_data": {"image": [pil_image]}}, SamplingParams(max_tokens=32))
    """

    def __init__(self, model: str, dtype: str = "auto", **engine_args: Any):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        if not any(name in os.environ for name in WAIT_POLICY_ENV):  # torch came before `from vlserve import LLM`
            logger.info("OpenMP threads wait as torch loaded them (a long spin, costly on busy cores): import LLM from "
                        "vlserve before torch, or set GOMP_SPINCOUNT=10000 (KMP_BLOCKTIME=1), as the CLI does")
        self.engine = LLMEngine(EngineArgs(model=resolve_demo_name(model), dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer

    @property
    def config(self):
        return self.engine.cfg

    def shutdown(self) -> None:
        """Stops the engine's other processes (the tensor-parallel ranks) now rather than at exit."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        mm_processor_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter of every prompt, or a list with one per prompt (None: the base
        model); needs `LLM(..., enable_lora=True)`."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        adapters = self._adapters_list(lora_request, len(prompts))
        ids = []
        try:
            for prompt, p, adapter in zip(prompts, params, adapters):
                ids.append(self.engine.add_request(prompt, p, mm_processor_kwargs=mm_processor_kwargs,
                                                   lora_request=adapter))
        except Exception:
            for rid in ids:  # nothing half-submitted stays in the engine
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        mm_processor_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`tools`: function tools offered to the model (OpenAI's layout); parse its answer with
        `vlserve.frontend.tool_calls.extract_tool_calls`. `lora_request`: as for `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tools = check_tools(tools)
        prompts = []
        for conv in conversations:
            chat = parse_chat_messages(conv, modalities=self.engine.cfg.model.modalities)
            text = render_chat(self.tokenizer, chat.messages, add_generation_prompt, chat_template, tools=tools)
            prompts.append(chat.prompt(text))
        return self.generate(prompts, sampling_params, use_tqdm, mm_processor_kwargs, lora_request)

    def get_metrics(self) -> dict[str, float]:
        return self.engine.core.get_metrics()

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = as_list(sampling_params)
        if len(params) != n:
            raise InvalidInputError(f"{len(params)} sampling params for {n} prompts")
        return params

    @staticmethod
    def _adapters_list(lora_request, n: int) -> list:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        adapters = as_list(lora_request)
        if len(adapters) != n:
            raise InvalidInputError(f"{len(adapters)} LoRA requests for {n} prompts")
        return adapters

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except Exception:
            for rid in ids:  # one request failed: the rest of this call leaves the engine too
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]
