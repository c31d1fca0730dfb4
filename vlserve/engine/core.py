"""The engine core: scheduler + model runner, advanced one step at a time.

`step()` is the whole loop body: schedule() -> execute() -> update_from_output(). This object is what runs
in the engine process once the server splits front end and engine.
"""

from __future__ import annotations

import logging
import time

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams, fan_out
from vlserve.engine.config import VlserveConfig
from vlserve.engine.kv_handoff import PrefilledKV
from vlserve.engine.model_runner import ModelRunner
from vlserve.engine.prompt_check import check_prompt
from vlserve.engine.scheduler import Scheduler
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.model.layers.packed_linear import packed_linear_supported
from vlserve.model.loader import load_model

logger = logging.getLogger(__name__)
HELD_KV_TTL_S = 120.0  # a prefill's KV kept this long for its decode instance at most


class EngineCore:
    def __init__(self, cfg: VlserveConfig, model: torch.nn.Module | None = None, report_released: bool = False,
                 transfer: TransferBuffers | None = None):
        """`report_released`: collect the requests whose samples have all left (a front-end in another process
        frees their prompts' buffers then). `transfer`: receive blocks an encoder service writes into."""
        self.cfg = cfg
        self.report_released = report_released
        self.transfer = transfer
        t0 = time.perf_counter()
        model = model or load_model(cfg.model_path, cfg.model, cfg.dtype, cfg.device, with_vision=cfg.load_vision,
                                    quantization=cfg.quantization)
        if packed_linear_supported(cfg.device, cfg.dtype) and hasattr(model, "pack_for_cpu"):
            logger.info("packed %d linears into oneDNN's layout", model.pack_for_cpu())
        self.grammars = GrammarMatchers(cfg.model_path, cfg.model.eos_token_ids, cfg.model.text.vocab_size,
                                        overlap=cfg.device.type != "cpu")
        self.runner = ModelRunner(cfg, model, transfer, self.grammars)
        self.scheduler = Scheduler(cfg)
        self._building: list[Request] = []  # requests whose grammar is being built
        self._failed: list[tuple[str, str]] = []  # (API request, why) refused after admission
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._parent_of: dict[str, str] = {}  # engine request id -> the API request it samples for
        self._open: dict[str, set[str]] = {}  # API request -> its samples still in the engine
        self._released: list[str] = []
        logger.info("engine ready in %.1fs: %s on %s, %s, %d KV blocks x %d tokens", time.perf_counter() - t0,
                    cfg.model.architecture, cfg.device, str(cfg.dtype).removeprefix("torch."), cfg.num_kv_blocks,
                    cfg.block_size)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, hold_kv: bool = False) -> list[str]:
        """Admits the n samples of one request together, or none of them; returns their engine request ids.

        `hold_kv` (a prefill instance): the finished request keeps its KV blocks for `export_held`."""
        if hold_kv and params.n != 1:
            raise InvalidInputError("a request whose KV is handed over samples once (n = 1)")
        capacity = None if self.transfer is None else (self.transfer.num_blocks, self.transfer.block_tokens)
        check_prompt(prompt, self.cfg, capacity)
        children = [Request(cid, prompt, p, self.cfg.model.eos_token_ids, arrival_time)
                    for cid, p in fan_out(params, request_id)]
        self._check_id_free([c.request_id for c in children], request_id)
        for child in children:
            self.scheduler.check_fits(child)  # raises before anything is queued
        for child in children:
            child.hold_kv = hold_kv
            if child.params.structured_outputs is not None:
                child.grammar = self.grammars.build(child.params.structured_outputs, child.output_token_ids)
                self._building.append(child)
            self.scheduler.add_request(child)
            self.prompt_tokens_total += child.num_prompt_tokens
            self._parent_of[child.request_id] = request_id
        self._open[request_id] = {c.request_id for c in children}
        return [c.request_id for c in children]

    # ---- KV handed between instances (prefill -> decode) -------------------------------------------------------
    @property
    def held(self) -> dict:
        return self.scheduler.held

    def export_held(self, request_id: str) -> PrefilledKV:
        """A finished prefill's KV, sampled tokens and random state; its blocks are freed."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise InvalidInputError(f"nothing held for request {request_id!r}")
        try:
            kv = self.runner.read_kv(self.runner.token_slots(req, req.num_prompt_tokens))
            state = req.generator.get_state() if req.generator is not None else None
            return PrefilledKV(kv, list(req.output_token_ids), state)
        finally:
            self.scheduler.release_held(request_id)

    def release_held(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def add_prefilled(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      handed: PrefilledKV, arrival_time: float | None = None) -> bool:
        """A request another instance prefilled: its KV into our blocks, then decoding goes on here. False (and
        nothing kept) while there is no room: try again later."""
        t = self.cfg.model.text
        check_prompt(prompt, self.cfg, None)
        handed.check(t.num_layers, t.num_kv_heads, t.head_dim, len(prompt.prompt_token_ids))
        if params.n != 1:
            raise InvalidInputError("a handed-over request samples once (n = 1)")
        self._check_id_free([request_id], request_id)
        req = Request(request_id, prompt, params, self.cfg.model.eos_token_ids, arrival_time)
        req.token_ids += handed.output_token_ids
        self.scheduler.check_fits(req)
        # Everything that can fail comes before admission, so a refusal leaves nothing behind.
        if handed.generator_state is not None:
            req.generator = torch.Generator(device=self.cfg.device)
            try:
                req.generator.set_state(handed.generator_state)
            except RuntimeError as e:  # e.g. a CPU generator's state for a CUDA one
                raise InvalidInputError(f"the handed-over random state does not fit this device: {e}") from None
        if params.structured_outputs is not None:
            req.grammar = self.grammars.build(params.structured_outputs, req.output_token_ids)
            req.grammar.matcher  # noqa: B018 - raises here if the grammar fails; usually cached, so quick
        if self.scheduler.ends_at(req, req.token_ids[-1]):
            raise InvalidInputError(f"request {request_id!r} ended at its handed-over token: nothing to decode")
        if not self.scheduler.add_prefilled(req, handed.num_tokens):
            return False
        try:
            self.runner.write_kv(self.runner.token_slots(req, handed.num_tokens), handed.kv)
        except BaseException:
            self.scheduler.finish_requests([request_id])
            raise
        self.scheduler.kv.cache_full_blocks(req)
        self._parent_of[request_id] = request_id
        self._open[request_id] = {request_id}
        return True

    @property
    def has_released(self) -> bool:
        return bool(self._released)

    def take_released(self) -> list[str]:
        """Requests all of whose samples have left the engine since the last call."""
        released, self._released = self._released, []
        return released

    def _left(self, child_ids) -> None:
        for child_id in child_ids:
            parent = self._parent_of.pop(child_id, None)
            if parent is None:
                continue
            children = self._open[parent]
            children.discard(child_id)
            if not children:
                del self._open[parent]
                if self.report_released:
                    self._released.append(parent)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._left(request_ids)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched): same clean-up as an abort, reported as stop."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._left(request_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def _check_id_free(self, engine_ids: list[str], request_id: str) -> None:
        if any(i in self.scheduler.requests or i in self.scheduler.held for i in engine_ids):
            raise InvalidInputError(f"request id {request_id!r} is already in use")

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, reason) of API requests refused after admission: their grammar failed to build."""
        failed, self._failed = self._failed, []
        return failed

    def _check_grammars(self) -> None:
        """Requests whose grammar failed leave the engine (all their samples); the rest wait until built."""
        building, self._building = self._building, []
        for req in building:
            if not req.grammar.ready:
                self._building.append(req)
            elif req.grammar.error is not None and self.scheduler.requests.get(req.request_id) is req:
                parent = self._parent_of[req.request_id]
                self.abort_requests(sorted(self._open.get(parent, ())))
                self._failed.append((parent, req.grammar.error))

    def step(self) -> list[EngineCoreOutput]:
        if self._building:
            self._check_grammars()
        if self.scheduler.held:
            for rid in self.scheduler.release_stale_held(HELD_KV_TTL_S):
                logger.warning("request %s: its prefilled KV was not taken within %.0f s; released", rid,
                               HELD_KV_TTL_S)
        sched = self.scheduler.schedule()
        if sched.empty and self._building:  # only grammars being built: let the worker have the CPU
            time.sleep(0.001)
        sampled, logprobs = self.runner.execute(sched)
        outputs = self.scheduler.update_from_output(sched, sampled, logprobs)
        self.generation_tokens_total += len(outputs)
        self._left(o.request_id for o in outputs if o.finish_reason is not None)
        return outputs

    def take_encoder_seconds(self) -> list[float]:
        """Vision-tower call durations since the last call (histogram samples for the metrics)."""
        return self.runner.take_encoder_seconds()

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
