"""Continuous batching with chunked prefill and recompute-preemption.

There are no separate prefill and decode phases: every request has `num_computed_tokens` catching up with
its `num_tokens`. Each step packs, under a token budget, first the running requests (one token for those
decoding, a chunk for those still prefilling), then new ones from the waiting queue. When KV blocks run out,
the most recently admitted running request is preempted: its blocks are freed and it is recomputed later
(or, when the engine's KV connector says it cannot be recomputed here, its KV is read out first and written back
at readmission). The connector (engine/kv_connector/, none on an aggregated engine) also says which waiting
requests have KV to load instead of computing, and keeps the blocks of requests whose KV it exports.

A hybrid model (linear-attention layers) also needs a state slot per running request and, for a prefix hit, a
state snapshot where the hit ends (engine/state_cache.py): its hits are cut back to the longest cached prefix that
has one.
"""

from __future__ import annotations

import logging
from collections import deque

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput, TokenLogprobs
from vlserve.core.request import Request, RequestStatus
from vlserve.engine.config import VlserveConfig
from vlserve.engine.encoder_cache import EncoderCacheManager
from vlserve.engine.kv_cache_manager import KVCacheManager
from vlserve.engine.kv_connector.base import KVConnector
from vlserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from vlserve.engine.state_cache import StateCache, StateStep

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: VlserveConfig, connector: KVConnector | None = None):
        self.cfg = cfg
        self.connector = connector
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.encoder_cache = EncoderCacheManager.for_model(cfg.encoder_cache_size, cfg.model)
        self.state: StateCache | None = None
        if cfg.model.is_hybrid:
            self.state = StateCache(cfg.max_num_seqs, cfg.num_state_snapshots, cfg.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._freed_encoder_keys: list[str] = []
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Refuse up front what could never be scheduled, instead of letting it wait forever."""
        cfg, max_tokens = self.cfg, req.params.max_tokens or 0
        if req.num_prompt_tokens + max_tokens > cfg.max_model_len:
            raise InvalidInputError(
                f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"maximum context length ({cfg.max_model_len} tokens)")
        # Without max_tokens a request may grow to max_model_len: that must fit too, or it would preempt itself
        # forever once the pool is full.
        unbounded = req.params.max_tokens is None
        total = max(cfg.max_model_len, req.num_prompt_tokens) if unbounded else req.num_prompt_tokens + max_tokens
        if self.kv.blocks_needed(total) > self.kv.pool.num_blocks:
            raise InvalidInputError(
                f"request needs more KV cache ({total} tokens) than the whole pool holds "
                f"({self.kv.pool.num_blocks * self.kv.block_size} tokens)"
                + ("; max_tokens is unset, so it may grow to max_model_len: set max_tokens" if unbounded else ""))
        for item in req.mm_items:
            if cfg.disable_chunked_mm_input and item.num_tokens > cfg.max_num_batched_tokens:
                raise InvalidInputError(
                    f"a multimodal item of {item.num_tokens} tokens cannot be scheduled whole with "
                    f"max_num_batched_tokens={cfg.max_num_batched_tokens} and chunked mm input disabled")
            if not item.needs_encoder:
                continue  # its embeddings came with the request: no encoder budget or cache involved
            if not self.encoder_cache.fits_ever(item.num_tokens):
                raise InvalidInputError(
                    f"a multimodal item needs {item.num_tokens * self.encoder_cache.rows_per_token} encoder-cache "
                    f"rows, more than the whole encoder cache (encoder_cache_size={cfg.encoder_cache_size}); "
                    f"send a smaller image")
            if item.num_tokens > cfg.max_num_encoder_input_tokens:
                raise InvalidInputError(
                    f"a multimodal item needs {item.num_tokens} embedding tokens, more than the per-step encoder "
                    f"budget (max_num_encoder_input_tokens={cfg.max_num_encoder_input_tokens}); send a smaller image")

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(free_encoder_keys=self._freed_encoder_keys)
        if self.state is not None:
            out.state = StateStep()
        self._freed_encoder_keys = []
        token_budget = self.cfg.max_num_batched_tokens
        encoder_budget = self.cfg.max_num_encoder_input_tokens

        i = 0
        while i < len(self.running) and token_budget > 0:
            req = self.running[i]
            if req.num_pending and self._last_token_pending(req):
                i += 1
                continue
            n, encode = self._plan_chunk(req, req.num_computed_tokens, token_budget, encoder_budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()  # lowest priority: admitted last
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._commit(req, req.num_computed_tokens, n, encode, out)
                token_budget -= n
                encoder_budget -= sum(req.mm_items[k].num_tokens for k in encode)
                i += 1
                continue
            break  # the request itself was preempted: nothing smaller left to try this step

        # Admit waiting requests only when nothing was preempted: if blocks were short just now, they still are.
        # A request whose grammar is still being built is passed over (it keeps its place in the queue); one whose
        # grammar failed waits for the engine core to refuse it.
        if self.connector is not None and self.connector.holds_blocks_for_waiting and not out.preempted:
            self._admit_holding_blocks(out)
        not_ready: list[Request] = []
        while self.waiting and token_budget > 0 and not out.preempted and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and (not req.grammar.ready or req.grammar.error is not None):
                not_ready.append(self.waiting.popleft())
                continue
            if req.lora is not None and not self._adapter_fits(req):  # every adapter slot is taken: it waits
                not_ready.append(self.waiting.popleft())
                continue
            pending = None if self.connector is None else self.connector.pending_kv(req)
            if pending is not None and pending.take_blocks is not None:  # admitted above, once there is a seat
                not_ready.append(self.waiting.popleft())
                continue
            if pending is not None:  # its KV is written, not computed
                cached = self.kv.find_cached_prefix(req) if pending.from_peer else []
                if not self._admit_computed(req, pending.num_tokens, cached):
                    break
                hit = len(cached) * self.kv.block_size
                if pending.from_peer:
                    self.kv.record_lookup(req, hit)
                self.waiting.popleft()
                out.kv_in.append((req, hit))
                continue
            cached = self.kv.find_cached_prefix(req)
            snapshot = None
            if self.state is not None and self.kv.enable_prefix_caching:
                keep, snapshot = self.state.resumable_blocks(req, cached)
                cached = cached[:keep]
            start = len(cached) * self.kv.block_size
            n, encode = self._plan_chunk(req, start, token_budget, encoder_budget)
            if n == 0 or not self.kv.allocate_slots(req, n, cached):
                break
            if self.state is not None and self.kv.enable_prefix_caching:
                self.state.record_lookup(snapshot is not None)
            if snapshot is not None:
                self.state.resume(req, snapshot, out.state)
            self.kv.record_lookup(req, start)
            req.num_cached_tokens = start
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._commit(req, start, n, encode, out)
            token_budget -= n
            encoder_budget -= sum(req.mm_items[k].num_tokens for k in encode)
        self.waiting.extendleft(reversed(not_ready))
        return out

    def _admit_holding_blocks(self, out: SchedulerOutput) -> None:
        """Waiting requests whose KV a peer wrote into blocks they already hold (`PendingKV.take_blocks`) take
        no new block: they go first, so a request ahead of them that waits for blocks cannot hold theirs back
        (those would never come free). A prefix already cached here is shared and the request's copy freed."""
        for req in list(self.waiting):
            if len(self.running) >= self.cfg.max_num_seqs:
                return
            pending = self.connector.pending_kv(req)
            if pending is None or pending.take_blocks is None:
                continue
            if req.grammar is not None and (not req.grammar.ready or req.grammar.error is not None):
                continue
            if req.lora is not None and not self._adapter_fits(req):
                continue
            self.waiting.remove(req)
            req.block_ids = pending.take_blocks()
            hit = self.kv.share_cached_prefix(req)
            self._admit_computed(req, pending.num_tokens)  # its blocks are there: it fits
            self.kv.record_lookup(req, hit)
            out.kv_in.append((req, hit))

    def _adapter_fits(self, req: Request) -> bool:
        """Running requests use at most max_loras different adapters (the device's slots)."""
        running = {r.lora.key for r in self.running if r.lora is not None}
        return req.lora.key in running or len(running) < self.cfg.lora.max_loras

    def _plan_chunk(self, req: Request, start: int, token_budget: int, encoder_budget: int) -> tuple[int, list[int]]:
        """How many tokens of `req` to compute from `start`, and which of its items must be encoded for them.

        Pure: nothing is reserved here; `_commit` does that once the KV blocks are secured.
        """
        cache = self.encoder_cache
        # a token still being sampled (async scheduling) counts: the step that reads it is scheduled now
        end = start + min(req.num_tokens + req.num_pending - start, token_budget)
        if start >= req.media_end:  # past its media (every decode row): nothing to encode
            return end - start, []
        encode: list[int] = []
        new_hashes: set[str] = set()
        available = {req.mm_items[i].mm_hash for i in req.items_overlapping(start, end)
                     if req.mm_items[i].needs_encoder and req.mm_items[i].mm_hash in cache}
        new_tokens = 0
        for idx in req.items_overlapping(start, end):
            item = req.mm_items[idx]
            needs_encoding = item.needs_encoder and item.mm_hash not in available and item.mm_hash not in new_hashes
            too_big = needs_encoding and (
                item.num_tokens > encoder_budget or not cache.can_allocate(new_tokens + item.num_tokens, available))
            if too_big or (item.end > end and self.cfg.disable_chunked_mm_input):
                end = max(start, item.offset)  # stop right before this item; it goes whole in a later step
                break
            if needs_encoding:
                encoder_budget -= item.num_tokens
                new_tokens += item.num_tokens
                new_hashes.add(item.mm_hash)
                encode.append(idx)
        return end - start, encode

    def _last_token_pending(self, req: Request) -> bool:
        """Under async scheduling: the token being sampled for `req` is its last (max_tokens, the context
        length), so nothing more is scheduled; reading it finishes the request."""
        p = req.params
        if p.max_tokens is not None and req.num_output_tokens + req.num_pending >= p.max_tokens:
            return True
        return req.num_tokens + req.num_pending >= self.cfg.max_model_len

    def _commit(self, req: Request, start: int, n: int, encode: list[int], out: SchedulerOutput) -> None:
        samples = start + n == req.num_tokens + req.num_pending
        out.chunks.append(ScheduledChunk(req, start, n, samples))
        req.num_computed_tokens = start + n  # the next step's chunk starts here, whether or not this one is done
        if samples:
            req.num_pending += 1
        if out.state is not None:
            out.state.slots[req.request_id] = self.state.slot(req)
            if self.kv.enable_prefix_caching:
                self.state.checkpoints(req, start, start + n, out.state)
        if start >= req.media_end:  # past its media (every decode row): no encoder-cache entry to hold
            return
        cache, rid, items = self.encoder_cache, req.request_id, req.mm_items
        pending = [i for i in req.items_overlapping(start, start + n)
                   if items[i].needs_encoder and not cache.holds((rid, i), items[i]) and i not in encode]
        # Hold cached entries first so making room for new ones can never evict them.
        for idx in [i for i in pending if items[i].mm_hash in cache]:
            cache.lookup((rid, idx), items[idx])
        for idx in encode:
            out.free_encoder_keys.extend(cache.allocate((rid, idx), items[idx]))
            out.encode.append((req, idx))
        for idx in [i for i in pending if not cache.holds((rid, i), items[i])]:  # same picture again in this request
            cache.lookup((rid, idx), items[idx])

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if req.num_computed_tokens and self.connector is not None and self.connector.keeps_kv_on_preempt(req):
            # A hybrid model's state goes with its KV: its slot is read before this step's forward pass (no slot
            # is handed out again before then: nothing is admitted in a step that preempts).
            slot = None if self.state is None else self.state.slot_of.get(req.request_id)
            out.kv_out.append((req, list(req.block_ids), req.num_computed_tokens, slot))
        self.kv.free(req)
        if self.state is not None:
            self.state.free(req)  # else recomputed at readmission, from token 0 or from a snapshot
        out.free_encoder_keys.extend(self.encoder_cache.release_all(req.request_id, req.mm_items))
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    # ---- after the forward pass ------------------------------------------------------------------------
    def update_from_output(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, TokenLogprobs] | None = None,
    ) -> list[EngineCoreOutput]:
        outputs = []
        if sched.state is not None:
            self.state.step_done(sched.state)
        for chunk in sched.chunks:
            req = chunk.req
            if req.status.finished:  # aborted while the step ran (or, async: finished by the step before)
                continue
            running = req.status == RequestStatus.RUNNING  # else preempted since (async scheduling)
            if running:
                for idx in req.items_overlapping(chunk.start, chunk.end):
                    if req.mm_items[idx].end <= chunk.end:
                        self._freed_encoder_keys.extend(self.encoder_cache.release((req.request_id, idx),
                                                                                   req.mm_items[idx]))
            if not chunk.samples:
                if running:
                    self.kv.cache_full_blocks(req)
                continue
            req.num_pending -= 1
            token = sampled[req.request_id]
            req.token_ids.append(token)  # a preempted request keeps it: it was computed from its whole context
            if running:
                self.kv.cache_full_blocks(req)
            if req.grammar is not None:
                status = self._advance_grammar(req, token)
                if status is None:
                    status = self._check_stop(req, token)
            else:
                status = self._check_stop(req, token)
            new_lp = [logprobs[req.request_id]] if logprobs and req.request_id in logprobs else None
            out = EngineCoreOutput(req.request_id, [token], new_lp, num_cached_tokens=req.num_cached_tokens)
            if status is not None:
                self._finish(req, status)
                out.finish_reason, out.stop_reason = status.value, req.stop_reason
            outputs.append(out)
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.cfg.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> RequestStatus | None:
        """Before the usual stop checks: a token the grammar refuses must not end the request as a normal stop."""
        if token in req.eos_token_ids and not req.params.ignore_eos and req.grammar.matcher.is_accepting():
            return None  # the grammar is complete and EOS ends it: the stop checks below say so
        if not req.grammar.accept(token):  # the mask allowed it, so only a matcher limit can refuse it here
            logger.error("request %s: its grammar refused token %d (%s); request aborted", req.request_id, token,
                         req.grammar.matcher.get_error())
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if req.grammar.finished else None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if self.connector is None or not self.connector.request_finished(req, status):
            self.kv.free(req)  # else the connector frees them once it has exported the KV
        if self.state is not None:
            self.state.free(req)
        self._freed_encoder_keys.extend(self.encoder_cache.release_all(req.request_id, req.mm_items))
        del self.requests[req.request_id]

    def _admit_computed(self, req: Request, num_computed: int, cached: list[int] | None = None) -> bool:
        """Into the running set with blocks for `num_computed` tokens (after the `cached` prefix blocks) whose
        KV the engine writes (`SchedulerOutput.kv_in`)."""
        cached_tokens = len(cached or []) * self.kv.block_size
        if len(self.running) >= self.cfg.max_num_seqs or \
                not self.kv.allocate_slots(req, num_computed - cached_tokens, cached):
            return False
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix block and state snapshot; False while requests hold blocks."""
        if not self.kv.reset_prefix_cache():
            return False
        return self.state is None or self.state.reset()

    def finish_status(self, req: Request, token: int) -> RequestStatus | None:
        """How `req` ends at `token`, just appended (its grammar built and advanced by the caller), or None."""
        if req.grammar is not None and req.grammar.finished:
            return RequestStatus.FINISHED_STOPPED
        return self._check_stop(req, token)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or stop, e.g. on a stop string found by the front end) requests that are still here."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status)
