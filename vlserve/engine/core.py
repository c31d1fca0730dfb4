"""The engine core: scheduler + model runner, advanced one step at a time.

`step()` is the whole loop body: schedule() -> execute() -> update_from_output(). This object is what runs
in the engine process once the server splits front end and engine.
"""

from __future__ import annotations

import logging
import time

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput, Handoff
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams, fan_out
from vlserve.core.structured_outputs import GrammarLimits
from vlserve.engine.config import VlserveConfig
from vlserve.engine.kv_handoff import PendingKV, PrefilledKV, check_handed_first, kv_to_rows, rows_to_kv
from vlserve.engine.model_runner import ModelRunner
from vlserve.engine.model_shard import ModelShard, load_shard
from vlserve.engine.prompt_check import check_prompt
from vlserve.engine.scheduler import Scheduler
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.engine.tp.leader import TPLeader
from vlserve.engine.transfer_buffers import TransferBuffers

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
        if model is not None:
            if cfg.tensor_parallel_size > 1:
                raise InvalidInputError("a model object runs on one device: tensor_parallel_size must be 1")
            executor = ModelShard(model, cfg)
        elif cfg.tensor_parallel_size > 1:
            executor = TPLeader.start(cfg)  # rank 0 here, the other ranks in their own processes
        else:
            executor = load_shard(cfg)
        self.grammars = GrammarMatchers(cfg.model_path, cfg.model.eos_token_ids, cfg.model.text.vocab_size,
                                        overlap=cfg.device.type != "cpu", limits=GrammarLimits.from_args(cfg.args))
        self.runner = ModelRunner(cfg, executor, transfer, self.grammars)
        self.scheduler = Scheduler(cfg)
        self._building: list[Request] = []  # requests whose grammar is being built
        self._failed: list[tuple[str, str, int]] = []  # (API request, why, status) refused after admission
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._parent_of: dict[str, str] = {}  # engine request id -> the API request it samples for
        self._open: dict[str, set[str]] = {}  # API request -> its samples still in the engine
        self._released: list[str] = []
        self._unreported: dict[str, EngineCoreOutput] = {}  # handed-over first tokens waiting for their grammar
        self._first_outputs: list[EngineCoreOutput] = []  # handed-over first tokens, reported at the next step
        self._released_early: set[str] = set()  # handed over, their receive blocks released once the KV was in
        logger.info("engine ready in %.1fs: %s on %s, %s, %d KV blocks x %d tokens", time.perf_counter() - t0,
                    cfg.model.architecture, cfg.device, str(cfg.dtype).removeprefix("torch."), cfg.num_kv_blocks,
                    cfg.block_size)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, hold_kv: bool = False) -> list[str]:
        """Admits the n samples of one request together, or none of them; returns their engine request ids.

        `hold_kv` (a prefill instance): the finished request keeps its KV blocks for `export_held`."""
        if hold_kv and params.n != 1:
            raise InvalidInputError("a request whose KV is handed over samples once (n = 1)")
        if hold_kv:
            self._check_kv_movable()
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
                child.grammar = self.grammars.build(child.params.structured_outputs, child.output_token_ids,
                                                    child.request_id)
                self._building.append(child)
            self.scheduler.add_request(child)
            self.prompt_tokens_total += child.num_prompt_tokens
            self._parent_of[child.request_id] = request_id
        self._open[request_id] = {c.request_id for c in children}
        return [c.request_id for c in children]

    # ---- KV handed between instances (prefill -> decode) -------------------------------------------------------
    def _check_kv_movable(self) -> None:
        if self.cfg.tensor_parallel_size > 1:
            raise InvalidInputError("KV handed between instances is not supported with tensor parallelism")

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
                      handed: PrefilledKV, arrival_time: float | None = None) -> None:
        """A request another instance prefilled (its first token already known to the caller): it waits in the
        queue like any request, and its KV is written into our blocks when the scheduler admits it."""
        self._check_kv_movable()
        t = self.cfg.model.text
        check_prompt(prompt, self.cfg, None)
        handed.check(t.num_layers, t.num_kv_heads, t.head_dim, len(prompt.prompt_token_ids))
        req = self._handed_request(request_id, prompt, params, handed.output_token_ids, handed.generator_state,
                                   arrival_time)
        if self.scheduler.finish_status(req, req.token_ids[-1]) is not None:
            raise InvalidInputError(f"request {request_id!r} ended at its handed-over token: nothing to decode")
        # Without its pictures here a preempted request could not be recomputed: then its KV is swapped out.
        req.swap_on_preempt = any(it.pixel_values is None and it.embeddings is None for it in prompt.mm_items)
        kv = handed.kv
        self._queue_handed(req, PendingKV(handed.num_tokens, lambda start: kv[:, :, start:], handed_over=True))

    def add_handoff(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, handoff: Handoff,
                    arrival_time: float | None = None) -> None:
        """Decode instance: a request prefilled by another instance, whose KV rows (`kv_handoff.kv_to_rows`) are
        in this engine's receive blocks `prompt.block_rows`. It waits in the queue like any request; its first
        token is reported at the next step (once its grammar is built), and when the scheduler admits it the KV
        is copied in (a cached prefix shared) and the receive blocks are released at once."""
        self._check_kv_movable()
        if self.transfer is None or prompt.block_rows is None:
            raise InvalidInputError("a handed-over request needs its KV rows in this engine's receive blocks")
        check_prompt(prompt, self.cfg, (self.transfer.num_blocks, self.transfer.block_tokens))
        first = handoff.first
        check_handed_first(first, params, self.cfg.model.text.vocab_size, handoff.generator_state is not None)
        state = None if handoff.generator_state is None else torch.frombuffer(bytearray(handoff.generator_state),
                                                                               dtype=torch.uint8)
        req = self._handed_request(request_id, prompt, params, first.new_token_ids, state, arrival_time,
                                   wait_for_grammar=True)
        req.num_cached_tokens = first.num_cached_tokens  # what the prefill saved: reported in usage
        req.swap_on_preempt = True  # the receive blocks are reused once its KV is in: it cannot be recomputed here
        t, blocks, n = self.cfg.model.text, prompt.block_rows, req.num_prompt_tokens
        self._queue_handed(req, PendingKV(n, lambda start: rows_to_kv(self.transfer.read_rows(blocks, start, n - start),
                                                                      t.num_layers, t.num_kv_heads, t.head_dim),
                                          handed_over=True))
        self._unreported[request_id] = EngineCoreOutput(request_id, list(first.new_token_ids), first.new_logprobs,
                                                        num_cached_tokens=first.num_cached_tokens)
        if req.grammar is not None and (not req.grammar.ready or req.grammar.error is not None):
            # Reported once built (whether the token ends it depends on the grammar); a failed one is refused
            # there, with its receive blocks released.
            self._building.append(req)
        else:
            self._report_first(req)

    def _queue_handed(self, req: Request, pending: PendingKV) -> None:
        req.pending_kv = pending
        self.scheduler.add_request(req)
        self._parent_of[req.request_id] = req.request_id
        self._open[req.request_id] = {req.request_id}

    def _report_first(self, req: Request) -> None:
        """A handed-over request's first token goes out at the next step; if it ends the request, so does it."""
        first = self._unreported.pop(req.request_id)
        self._first_outputs.append(first)
        self.generation_tokens_total += 1
        status = self.scheduler.finish_status(req, req.token_ids[-1])
        if status is not None:  # nothing to decode
            first.finish_reason, first.stop_reason = status.value, req.stop_reason
            self.scheduler.finish_requests([req.request_id], status)
            self._left([req.request_id])

    def _handed_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                        output_token_ids: list[int], generator_state: torch.Tensor | None,
                        arrival_time: float | None, wait_for_grammar: bool = False) -> Request:
        """The request as the prefill left it, every check done (nothing is admitted yet)."""
        if params.n != 1:
            raise InvalidInputError("a handed-over request samples once (n = 1)")
        if not output_token_ids:
            raise InvalidInputError("a handed-over request needs the token its prefill sampled")
        self._check_id_free([request_id], request_id)
        req = Request(request_id, prompt, params, self.cfg.model.eos_token_ids, arrival_time)
        req.token_ids += output_token_ids
        self.scheduler.check_fits(req)
        if generator_state is not None:
            req.generator = torch.Generator(device=self.cfg.device)
            try:
                req.generator.set_state(generator_state)
            except RuntimeError as e:  # e.g. a CPU generator's state for a CUDA one
                raise InvalidInputError(f"the handed-over random state does not fit this device: {e}") from None
        if params.structured_outputs is not None:
            req.grammar = self.grammars.build(params.structured_outputs, req.output_token_ids, request_id)
            if not wait_for_grammar:
                req.grammar.matcher  # noqa: B018 - raises here if the grammar fails; usually cached, so quick
        return req

    def _move_kv(self, sched) -> None:
        """Before this step's forward pass: KV of preempted requests that cannot be recomputed out to host memory
        (their blocks are reused from now on), and the pending KV of requests admitted now into their blocks."""
        for req, block_ids, n in sched.swap_out:
            kv = self.runner.read_kv(self.runner.block_slots(block_ids, n))
            req.pending_kv = PendingKV(n, lambda start, kv=kv: kv[:, :, start:])
        for req, start in sched.kv_in:
            pending, req.pending_kv = req.pending_kv, None
            try:
                self.runner.write_kv(self.runner.token_slots(req, pending.num_tokens)[start:], pending.read(start))
            except Exception as e:  # noqa: BLE001 - that request fails (500), the engine goes on
                logger.exception("request %s: its KV could not be written", req.request_id)
                self.abort_requests([req.request_id])
                self._failed.append((req.request_id, f"its KV could not be written: {type(e).__name__}", 500))
                continue
            self.scheduler.kv.cache_full_blocks(req)
            if pending.handed_over:  # the receive blocks (if any) are free to reuse now
                self._released_early.add(req.request_id)
                if self.report_released:
                    self._released.append(req.request_id)

    def take_handed(self, outputs: list[EngineCoreOutput]) -> list[tuple[str, torch.Tensor, bytes | None]]:
        """Prefill instance: (request id, KV rows, random state) of every request of `outputs` that finished with
        its KV held; their blocks are freed."""
        handed = []
        for out in outputs:
            if out.finish_reason is not None and out.request_id in self.scheduler.held:
                kv = self.export_held(out.request_id)
                state = None if kv.generator_state is None else kv.generator_state.numpy().tobytes()
                handed.append((out.request_id, kv_to_rows(kv.kv), state))
        return handed

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
                if self.report_released and parent not in self._released_early:
                    self._released.append(parent)
                self._released_early.discard(parent)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # a grammar not being built yet never will be
            req = self.scheduler.requests.get(rid)
            if req is not None and req.grammar is not None:
                req.grammar.cancel()
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._left(request_ids)
        self._drop_handoffs(request_ids)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched): same clean-up as an abort, reported as stop."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._left(request_ids)
        self._drop_handoffs(request_ids)

    def _drop_handoffs(self, request_ids: list[str]) -> None:
        """A handed-over first token not yet reported leaves with its request."""
        gone = set(request_ids)
        if self._first_outputs:
            self._first_outputs = [o for o in self._first_outputs if o.request_id not in gone]
        for rid in gone & self._unreported.keys():
            del self._unreported[rid]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._first_outputs)

    def _check_id_free(self, engine_ids: list[str], request_id: str) -> None:
        if any(i in self.scheduler.requests or i in self.scheduler.held for i in engine_ids):
            raise InvalidInputError(f"request id {request_id!r} is already in use")

    def take_failed(self) -> list[tuple[str, str, int]]:
        """(request id, reason, status) of API requests refused after admission: their grammar failed to build,
        or (500) their handed-over KV could not be written."""
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
                self._failed.append((parent, req.grammar.error, 400))
            elif req.request_id in self._unreported and self.scheduler.requests.get(req.request_id) is req:
                self._report_first(req)

    def _fail_broken_grammars(self) -> None:
        """A matcher that failed mid-answer (a limit of the grammar engine) fails its API request with the reason
        (500, as vLLM's FINISHED_ERROR): an answer cut there is not one its grammar accepts."""
        for child_id, why in self.grammars.take_failures():
            parent = self._parent_of.get(child_id)
            if parent is not None:
                self.abort_requests(sorted(self._open.get(parent, ())))
                self._failed.append((parent, why, 500))

    def step(self) -> list[EngineCoreOutput]:
        if self._building:
            self._check_grammars()
        if self.scheduler.held:
            for rid in self.scheduler.release_stale_held(HELD_KV_TTL_S):
                logger.warning("request %s: its prefilled KV was not taken within %.0f s; released", rid,
                               HELD_KV_TTL_S)
        first, self._first_outputs = self._first_outputs, []
        sched = self.scheduler.schedule()
        self._move_kv(sched)
        if sched.empty and self._building:  # only grammars being built: let the worker have the CPU
            time.sleep(0.001)
        sampled, logprobs = self.runner.execute(sched)
        outputs = self.scheduler.update_from_output(sched, sampled, logprobs)
        self._fail_broken_grammars()
        self.generation_tokens_total += len(outputs)
        self._left(o.request_id for o in outputs if o.finish_reason is not None)
        return first + outputs

    def take_encoder_seconds(self) -> list[float]:
        """Vision-tower call durations since the last call (histogram samples for the metrics)."""
        return self.runner.take_encoder_seconds()

    def check_alive(self) -> None:
        """Raises TensorParallelError once a tensor-parallel rank is lost (the engine cannot go on)."""
        self.runner.executor.check_alive()

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks, if any (a single-device engine has nothing to stop)."""
        self.runner.executor.shutdown()

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
