"""The engine core: scheduler + model runner, advanced one step at a time.

`step()` is the whole loop body: schedule() -> execute() -> update_from_output(). This object is what runs
in the engine process once the server splits front end and engine. A role that moves KV between instances
(prefill, decode) plugs in a KV connector (engine/kv_connector/); this file knows none of them.
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
from vlserve.core.structured_outputs import GrammarLimits
from vlserve.core.wire import KVSend
from vlserve.engine.config import VlserveConfig
from vlserve.engine.kv_connector import KVConnector, KVTransfer
from vlserve.engine.kv_events import KVEventPublisher
from vlserve.engine.model_runner import LaunchedStep, ModelRunner
from vlserve.engine.executor import start_executor
from vlserve.engine.model_shard import ModelShard
from vlserve.engine.prompt_check import check_prompt
from vlserve.engine.scheduler import Scheduler
from vlserve.engine.scheduler_output import SchedulerOutput
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.engine.transfer_buffers import TransferBuffers

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, cfg: VlserveConfig, model: torch.nn.Module | None = None, report_released: bool = False,
                 transfer: TransferBuffers | None = None, connector: KVConnector | None = None):
        """`report_released`: collect the requests whose samples have all left (a front-end in another process
        frees their prompts' buffers then). `transfer`: receive blocks peers write prompts into. `connector`:
        the role's KV connector, if its KV is not all computed here."""
        self.cfg = cfg
        self.report_released = report_released
        self.transfer = transfer
        t0 = time.perf_counter()
        if model is not None:
            if cfg.tensor_parallel_size > 1:
                raise InvalidInputError("a model object runs on one device: tensor_parallel_size must be 1")
            executor = ModelShard(model, cfg)
        else:
            executor = start_executor(cfg)  # with tensor parallelism: rank 0 here, the others in their processes
        self.grammars = GrammarMatchers(cfg.model_path, cfg.model.eos_token_ids, cfg.model.text.vocab_size,
                                        overlap=cfg.device.type != "cpu", limits=GrammarLimits.from_args(cfg.args))
        self.runner = ModelRunner(cfg, executor, transfer, self.grammars)
        self.scheduler = Scheduler(cfg, connector)
        self.lora = getattr(executor, "lora", None)  # LoRA adapter slots, when serving adapters
        if self.lora is not None:
            self.lora.in_use = lambda: {r.lora.key for r in self.scheduler.requests.values() if r.lora is not None}
        self.connector = connector
        self.kv_events: KVEventPublisher | None = None
        endpoint = cfg.args.kv_events_endpoint if cfg.args is not None else None
        if endpoint is not None:
            self.kv_events = KVEventPublisher(endpoint, cfg.block_size)
            self.scheduler.kv.pool.events = self.kv_events.recorder
        if connector is not None:
            connector.bind(self.scheduler, self.runner, transfer)
        self._building: list[Request] = []  # requests whose grammar is being built
        self._failed: list[tuple[str, str, int]] = []  # (API request, why, status) refused after admission
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._parent_of: dict[str, str] = {}  # engine request id -> the API request it samples for
        self._open: dict[str, set[str]] = {}  # API request -> its samples still in the engine
        self._released: list[str] = []
        # Outputs a request arrived with (sampled elsewhere): waiting for its grammar, then reported at the next step.
        self._arrived_with: dict[str, EngineCoreOutput] = {}
        self._ready_arrived: list[EngineCoreOutput] = []
        self._inputs_released: list[str] = []  # prompts whose buffers the engine stopped reading before they left
        # Async scheduling (not with a KV connector: its moves need each step's results first): the step launched
        # and not finished yet, as (schedule, launch).
        self.async_scheduling = cfg.async_scheduling and connector is None
        self._inflight: tuple[SchedulerOutput, LaunchedStep | None] | None = None
        self.overlapped_steps = 0  # steps launched before the one before them was finished
        kv_gib = cfg.num_kv_blocks * cfg.block_size * cfg.kv_bytes_per_token / 2**30
        logger.info("engine ready in %.1fs: %s on %s, %s, KV cache %.3f GiB (%d blocks x %d tokens)%s",
                    time.perf_counter() - t0, cfg.model.architecture, cfg.device, str(cfg.dtype).removeprefix("torch."),
                    kv_gib, cfg.num_kv_blocks, cfg.block_size, _state_pool_text(cfg))

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, kv_transfer: KVTransfer | None = None,
                    kv_send: KVSend | None = None) -> list[str]:
        """Admits the n samples of one request together, or none of them; returns their engine request ids.

        `kv_transfer`: the request's KV was computed elsewhere (the connector loads it; see kv_connector/).
        `kv_send`: its KV goes to another instance as it is computed (the connector writes it)."""
        if kv_transfer is not None and self.connector is None:
            raise InvalidInputError("this engine computes its own KV: it takes none from other instances")
        if kv_send is not None and self.connector is None:
            raise InvalidInputError("this engine sends no KV rows to other instances")
        if self.connector is not None:
            self.connector.check_request(prompt, params, kv_transfer)
        # where its rows are: receive blocks, or (KV written in place) the KV cache
        rows_in = self.transfer or (self.runner.kv_buffers if prompt.kv_in_blocks else None)
        capacity = None if rows_in is None else (rows_in.num_blocks, rows_in.block_tokens)
        check_prompt(prompt, self.cfg, capacity)
        if prompt.lora is not None:
            if self.lora is None:
                raise InvalidInputError(f"LoRA adapter {prompt.lora.name!r}: this engine serves no adapters (start "
                                        "it with enable_lora / --enable-lora)")
            self.lora.prepare(prompt.lora)  # read now unless in host memory (the engine process reads it first,
            # off its loop: engine.lora_loader): an adapter that does not fit refuses this request only
        children = [Request(cid, prompt, p, self.cfg.model.eos_token_ids, arrival_time)
                    for cid, p in fan_out(params, request_id)]
        self._check_id_free([c.request_id for c in children], request_id)
        arrived: dict[str, EngineCoreOutput] = {}
        try:  # every check before anything is queued
            for child in children:
                if self.connector is not None and (out := self.connector.admit(child, kv_transfer)) is not None:
                    arrived[child.request_id] = out
                self.scheduler.check_fits(child)
                if kv_send is not None:
                    self.connector.will_send(child, kv_send)
        except BaseException:
            if self.connector is not None:
                self.connector.forget([c.request_id for c in children])
            raise
        for child in children:
            if child.params.structured_outputs is not None:  # replays the tokens it arrived with, if any
                child.grammar = self.grammars.build(child.params.structured_outputs, child.output_token_ids,
                                                    child.request_id)
                self._building.append(child)
            self.scheduler.add_request(child)
            self._parent_of[child.request_id] = request_id
            if child.request_id in arrived:  # its prompt was computed elsewhere: only what it generates counts
                self._arrived_with[child.request_id] = arrived[child.request_id]
            else:
                self.prompt_tokens_total += child.num_prompt_tokens
        self._open[request_id] = {c.request_id for c in children}
        for child in children:
            if child.request_id in arrived and child.grammar is None:
                self._report_arrived(child)
        return [c.request_id for c in children]

    def _report_arrived(self, req: Request) -> None:
        """The output a request arrived with goes out at the next step; if it ends the request, so does it."""
        out = self._arrived_with.pop(req.request_id)
        self._ready_arrived.append(out)
        self.generation_tokens_total += len(out.new_token_ids)
        status = self.scheduler.finish_status(req, req.token_ids[-1])
        if status is not None:  # nothing to decode
            out.finish_reason, out.stop_reason = status.value, req.stop_reason
            self.scheduler.finish_requests([req.request_id], status)
            self._left([req.request_id])

    def _move_kv(self, sched) -> None:
        """Before this step's forward pass: the connector moves KV out of reused blocks and into admitted ones."""
        moved = self.connector.move_kv(sched)
        for rid, why, status in moved.failed:
            self.abort_requests([rid])
            self._failed.append((self._parent_of.get(rid, rid), why, status))
        if self.report_released:  # the prompt's inputs (receive blocks) are not read any more
            self._inputs_released += [self._parent_of.get(rid, rid) for rid in moved.loaded]

    @property
    def has_released(self) -> bool:
        return bool(self._released or self._inputs_released)

    def take_released(self) -> list[str]:
        """Requests all of whose samples have left the engine since the last call."""
        released, self._released = self._released, []
        return released

    def take_inputs_released(self) -> list[str]:
        """Requests whose prompt buffers the engine stopped reading since the last call while they still run (a
        connector loaded their KV): the front end may free those now; each is in `take_released` later too."""
        released, self._inputs_released = self._inputs_released, []
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
        for rid in request_ids:  # a grammar not being built yet never will be
            req = self.scheduler.requests.get(rid)
            if req is not None and req.grammar is not None:
                req.grammar.cancel()
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._left(request_ids)
        self._drop_arrived(request_ids)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finished by the front end (a stop string matched): same clean-up as an abort, reported as stop."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._left(request_ids)
        self._drop_arrived(request_ids)

    def _drop_arrived(self, request_ids: list[str]) -> None:
        """An output a request arrived with, not yet reported, leaves with it; so does the connector's state."""
        gone = set(request_ids)
        if self._ready_arrived:
            self._ready_arrived = [o for o in self._ready_arrived if o.request_id not in gone]
        for rid in gone & self._arrived_with.keys():
            del self._arrived_with[rid]
        if self.connector is not None:
            self.connector.forget(request_ids)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._ready_arrived) or self._inflight is not None

    def _check_id_free(self, engine_ids: list[str], request_id: str) -> None:
        if any(i in self.scheduler.requests or (self.connector is not None and self.connector.owns(i))
               for i in engine_ids):
            raise InvalidInputError(f"request id {request_id!r} is already in use")

    def take_failed(self) -> list[tuple[str, str, int]]:
        """(request id, reason, status) of API requests refused after admission: their grammar failed to build,
        or their KV could not be moved (500: written in, or exported; 503: a peer sent KV holding NaN)."""
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
            elif req.request_id in self._arrived_with and self.scheduler.requests.get(req.request_id) is req:
                self._report_arrived(req)

    def _fail_broken_grammars(self) -> None:
        """A matcher that failed mid-answer (a limit of the grammar engine) fails its API request with the reason
        (500, as vLLM's FINISHED_ERROR): an answer cut there is not one its grammar accepts."""
        for child_id, why in self.grammars.take_failures():
            parent = self._parent_of.get(child_id)
            if parent is not None:
                self.abort_requests(sorted(self._open.get(parent, ())))
                self._failed.append((parent, why, 500))

    def step(self) -> list[EngineCoreOutput]:
        """schedule() -> launch on the device -> update_from_output(). Under async scheduling the step launched
        last time is finished after this one is launched, so scheduling and preparing a step overlap the device's
        work on the one before (its outputs come back one call later); a step that needs every token read first
        (see `_may_overlap`) finishes the one in flight before it schedules."""
        if self._building:
            self._check_grammars()
        if self.connector is not None:
            self.connector.start_step()
        arrived, self._ready_arrived = self._ready_arrived, []
        outputs: list[EngineCoreOutput] = []
        overlap = self.async_scheduling and self._may_overlap()
        if self._inflight is not None and not overlap:
            outputs += self._finish_step(*self._inflight)
            self._inflight = None
        sched = self.scheduler.schedule()
        if self.connector is not None:
            self._move_kv(sched)
        if sched.empty and self._building:  # only grammars being built: let the worker have the CPU
            time.sleep(0.001)
        launched = self.runner.launch(sched)
        if overlap:
            if self._inflight is not None:
                self.overlapped_steps += 1
                outputs += self._finish_step(*self._inflight)
            self._inflight = (sched, launched) if not sched.empty else None
        else:
            outputs += self._finish_step(sched, launched)
        self.publish_kv_events()
        return arrived + outputs

    def _finish_step(self, sched: SchedulerOutput, launched: LaunchedStep | None) -> list[EngineCoreOutput]:
        """Reads a launched step's tokens and applies them: finished requests leave, the connector exports."""
        sampled, logprobs = self.runner.collect(launched)
        outputs = self.scheduler.update_from_output(sched, sampled, logprobs)
        self._fail_broken_grammars()
        self.generation_tokens_total += len(outputs)
        if self.connector is not None:  # before `_left`, which forgets whose samples these are
            self.connector.after_step(outputs)
            for rid, why in self.connector.take_failed():  # that request fails, the engine goes on
                self._failed.append((self._parent_of.get(rid, rid), why, 500))
        self._left(o.request_id for o in outputs if o.finish_reason is not None)
        return outputs

    def _may_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are read: not when any request
        needs them on the host to build its next step's sampling (a grammar's mask, penalties over its output,
        min_tokens still to reach)."""
        for req in self.scheduler.requests.values():
            p = req.params
            if req.grammar is not None or p.presence_penalty or p.frequency_penalty or \
                    p.repetition_penalty != 1.0 or req.num_output_tokens + req.num_pending < p.min_tokens:
                return False
        return True

    def publish_kv_events(self) -> None:
        """This step's prefix-cache changes as one batch; between steps, a keepalive batch when one is due, so
        routers know an idle engine is still there."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix block (published as AllBlocksCleared) and state snapshot; False while requests
        hold blocks."""
        if self._inflight is not None:  # async scheduling: a step of requests that all ended may be in flight
            if self.scheduler.requests:
                return False
            self._finish_step(*self._inflight)  # nothing of it is reported: its requests are gone
            self._inflight = None
        done = self.scheduler.reset_prefix_cache()
        if done and self.kv_events is not None:
            self.kv_events.flush()
        return done

    def take_encoder_seconds(self) -> list[tuple[str, float]]:
        """Vision-tower call durations since the last call (histogram samples for the metrics)."""
        return self.runner.take_encoder_seconds()

    def check_alive(self) -> None:
        """Raises TensorParallelError once a tensor-parallel rank is lost (the engine cannot go on)."""
        self.runner.executor.check_alive()

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks, if any, the grammar threads, and closes the KV events socket;
        each even if one before it fails."""
        try:
            self.runner.executor.shutdown()
        finally:
            try:
                self.grammars.shutdown()
            finally:
                if self.kv_events is not None:
                    self.kv_events.close()

    def get_metrics(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "kv_cache_usage_perc": s.kv.usage,
            "kv_cache_blocks": s.kv.pool.num_blocks,
            "num_preemptions_total": s.num_preemptions,
            "prefix_cache_queries_total": s.kv.prefix_queries,
            "prefix_cache_hits_total": s.kv.prefix_hits,
            "state_snapshot_queries_total": s.state.queries if s.state is not None else 0,
            "state_snapshot_hits_total": s.state.hits if s.state is not None else 0,
            "state_cache_usage_perc": s.state.usage if s.state is not None else 0.0,
            "encoder_cache_queries_total": s.encoder_cache.queries,
            "encoder_cache_hits_total": s.encoder_cache.hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }


def _state_pool_text(cfg: VlserveConfig) -> str:
    """A hybrid model's state pool, for the start-up line beside the KV cache ('' for other models)."""
    if not cfg.model.is_hybrid:
        return ""
    return (f", linear-attention state pool {cfg.state_bytes / 2**30:.3f} GiB ({cfg.max_num_seqs} running + "
            f"{cfg.num_state_snapshots} snapshot slots)")
