"""The engine core: scheduler + model runner, advanced one step at a time.

`step()` is the whole loop body: schedule() -> execute() -> update_from_output(). This object is what runs
in the engine process once the server splits front end and engine.
"""

from __future__ import annotations

import logging
import time

import torch

from vlserve.engine.config import VlserveConfig
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.request import Request, RequestStatus
from vlserve.model.loader import load_model
from vlserve.model.layers.packed_linear import packed_linear_supported
from vlserve.engine.model_runner import ModelRunner
from vlserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, cfg: VlserveConfig, model: torch.nn.Module | None = None):
        self.cfg = cfg
        t0 = time.perf_counter()
        model = model or load_model(cfg.model_path, cfg.model, cfg.dtype, cfg.device, with_vision=cfg.load_vision)
        if packed_linear_supported(cfg.device, cfg.dtype) and hasattr(model, "pack_for_cpu"):
            logger.info("packed %d linears into oneDNN's layout", model.pack_for_cpu())
        self.runner = ModelRunner(cfg, model)
        self.scheduler = Scheduler(cfg)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("engine ready in %.1fs: %s on %s, %s, %d KV blocks x %d tokens", time.perf_counter() - t0,
                    cfg.model.architecture, cfg.device, str(cfg.dtype).removeprefix("torch."), cfg.num_kv_blocks,
                    cfg.block_size)

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self.prompt_tokens_total += req.num_prompt_tokens

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched): same clean-up as an abort, reported as stop."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        sampled, logprobs = self.runner.execute(sched)
        outputs = self.scheduler.update_from_output(sched, sampled, logprobs)
        self.generation_tokens_total += len(outputs)
        return outputs

    def get_metrics(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "kv_cache_usage_perc": s.kv.usage,
            "num_preemptions_total": s.num_preemptions,
            "prefix_cache_queries_total": s.kv.prefix_queries,
            "prefix_cache_hits_total": s.kv.prefix_hits,
            "encoder_cache_queries_total": s.encoder_cache.queries,
            "encoder_cache_hits_total": s.encoder_cache.hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }
