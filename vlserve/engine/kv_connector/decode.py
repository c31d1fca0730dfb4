"""The decode role's connector: a request arrives prefilled by another instance, its KV as one row per token and
its first token (with the random state) in a `Handoff`. Where the KV is:
- in place (a KV cache in a shared file, `VlserveConfig.kv_cache_file`): the front end reserved KV blocks for the
  transfer (`reserve`, under a holder name: one transfer) and the peer wrote the rows straight into them
  (`prompt.block_rows`). The request waits in the queue like any request and takes those blocks when the scheduler
  admits it: nothing is copied (a prefix already cached here is shared and its copy freed). Blocks no request took
  go back with `release`;
- else in this engine's receive blocks (tensor parallelism, a GPU), which it reserves for each transfer too (so
  its row socket takes peers' writes only there): when the scheduler admits it, its KV is written into its blocks
  (a prefix already cached here is shared) and the front end releases the receive blocks.
Its pictures are not here to recompute it from, so a preemption swaps its KV out to host memory and back in at
readmission. A hybrid model's linear states arrive as rows after the prompt's KV rows (in place: in the slots
after its prompt's, read out before its first step writes there) and go into the request's state slot; a
preemption swaps them out and back in with its KV. Either way a prompt's KV rows are checked finite on a thread
of their own from its arrival, the answer taken when it is admitted (a streaming client has its first token by
then: it gets the error after it), unless the transport refused any that were not as it wrote them
(`rows_checked`)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import CancelReserveKV, KVReserved, ReleaseKV, ReserveKV
from vlserve.engine.kv_connector.base import KVConnector, KVTransfer, MovedKV, PendingKV
from vlserve.engine.block_pool import BlockPool
from vlserve.engine.kv_connector.reserved_blocks import ReservedBlocks
from vlserve.engine.kv_handoff import check_handed_first, rows_to_kv
from vlserve.engine.state_rows import state_row_count
from vlserve.engine.write_grants import WriteGrants

logger = logging.getLogger(__name__)
NOT_FINITE = "the prefill instance sent KV rows holding NaN or infinite values; retry"


class DecodeConnector(KVConnector):
    def __init__(self, cfg, rows_checked: bool = False):
        """`rows_checked`: the transport that lands peers' rows here refused any that are not finite (zmq's row
        socket, for a model without state rows), so `admit` need not read them again."""
        self.cfg, self.rows_checked = cfg, rows_checked
        self.state_rows = state_row_count(cfg.model, cfg.dtype)  # after each prompt's KV rows (hybrid models)
        self._pending: dict[str, PendingKV] = {}  # KV to write when the request is (re)admitted
        self._not_recomputable: set[str] = set()  # handed-over requests: preempting one swaps its KV out
        self._reserved: ReservedBlocks | None = None  # in place: blocks reserved for peers' writes (bind)
        self._receive: ReservedBlocks | None = None  # else: receive blocks reserved for them
        self._asked: dict[int, ReserveKV] = {}  # reservations waiting for blocks, in the order they came
        self._checks: dict[str, Future] = {}  # handed-over prompts' KV rows being checked finite (`_check_finite`)
        self._checker: ThreadPoolExecutor | None = None

    def bind(self, scheduler, runner, transfer) -> None:
        super().bind(scheduler, runner, transfer)
        if runner.kv_buffers is not None:
            self._reserved = ReservedBlocks(scheduler.kv.pool, self.cfg.block_size, runner.kv_buffers.grants)
        elif transfer is not None:  # this process gives them out, so the grants its row socket checks are here
            if transfer.grants is None:
                transfer.grants = WriteGrants()
            pool = transfer.pool if transfer.pool is not None else BlockPool(transfer.num_blocks)
            self._receive = ReservedBlocks(pool, transfer.block_tokens, transfer.grants)

    @property
    def in_place(self) -> bool:
        return self._reserved is not None

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams, kv_transfer: KVTransfer | None) -> None:
        if kv_transfer is None:
            return  # computed here like on any engine
        if params.n != 1:
            raise InvalidInputError("a handed-over request samples once (n = 1)")
        if prompt.block_rows is None or (self.transfer is None and not self.in_place):
            raise InvalidInputError("a handed-over request needs its KV rows in this engine's blocks")
        # (in place, `admit` checks its blocks as it claims them)
        check_handed_first(kv_transfer.first, params, self.cfg.model.text.vocab_size,
                           kv_transfer.generator_state is not None)

    def admit(self, req: Request, kv_transfer: KVTransfer | None) -> EngineCoreOutput | None:
        if kv_transfer is None:
            return None
        first = kv_transfer.first
        req.token_ids += first.new_token_ids
        if kv_transfer.generator_state is not None:
            state = torch.frombuffer(bytearray(kv_transfer.generator_state), dtype=torch.uint8)
            req.generator = torch.Generator(device=self.cfg.device)
            try:
                req.generator.set_state(state)
            except RuntimeError as e:  # e.g. a CPU generator's state for a CUDA one, or a truncated state
                raise InvalidInputError(f"the handed-over random state does not fit this device: {e}") from None
        req.num_cached_tokens = first.num_cached_tokens  # what the prefill saved: reported in usage
        t, blocks, n = self.cfg.model.text, req.prompt.block_rows, req.num_prompt_tokens
        transfer, state_rows = self.transfer, self.state_rows
        if self.in_place:
            kv, reserved = self.runner.kv_buffers, self._reserved
            reserved.claim(req.request_id, blocks, n + state_rows)
            self._check_finite(req.request_id, kv, blocks, n)

            def read_state_in_place() -> torch.Tensor:  # from the request's own blocks, after its prompt's rows
                return kv.read_rows(req.block_ids, n, state_rows)

            self._pending[req.request_id] = PendingKV(
                n, None, from_peer=True, state_rows=read_state_in_place if state_rows else None,
                take_blocks=lambda: reserved.take(req.request_id))
            self._not_recomputable.add(req.request_id)
            return self._first_output(req, first)
        if self._receive is not None:  # its transfer is over: its receive blocks take no more writes (as `claim`)
            self._receive.grants.close(blocks)
        self._check_finite(req.request_id, transfer, blocks, n)

        def read(start: int) -> torch.Tensor:
            return rows_to_kv(transfer.read_rows(blocks, start, n - start), t.num_kv_layers, t.num_kv_heads,
                              t.head_dim)

        def read_state() -> torch.Tensor:  # a hybrid model's linear states follow the prompt's KV rows
            return transfer.read_rows(blocks, n, state_rows)

        self._pending[req.request_id] = PendingKV(n, read, from_peer=True,
                                                  state_rows=read_state if state_rows else None)
        self._not_recomputable.add(req.request_id)
        return self._first_output(req, first)

    def _check_finite(self, request_id: str, buffers, blocks: list[int], n: int) -> None:
        """The prompt's KV rows, as a peer wrote them (one-sided: shm, Mooncake, NIXL; or a hybrid model's over
        zmq), are checked to hold no NaN or inf on a thread of their own (its blocks take no more writes by now),
        not on the engine's: `move_kv` takes the answer when the request is admitted, and a NaN fails that request
        alone, as the server's fault (503). Its state rows are float32 bytes: checked as states when they are
        written into its slot."""
        if self.rows_checked:
            return
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="vlserve-kv-check")
        self._checks[request_id] = self._checker.submit(buffers.rows_finite, blocks, torch.arange(n))

    @staticmethod
    def _first_output(req: Request, first: EngineCoreOutput) -> EngineCoreOutput:
        return EngineCoreOutput(req.request_id, list(first.new_token_ids), first.new_logprobs,
                                num_cached_tokens=first.num_cached_tokens)

    # ---- blocks reserved for peers' writes (in place) ------------------------------------------------------------
    def reserve(self, msg: ReserveKV) -> KVReserved:
        if not self.in_place:
            return self._reserve_receive_blocks(msg)
        kv = self.scheduler.kv
        need = kv.blocks_needed(max(msg.num_rows, 1))
        if need > kv.pool.num_blocks:
            return KVReserved(msg.reserve_id, error=f"{msg.num_rows} rows need {need} KV blocks; the KV cache has "
                                                    f"{kv.pool.num_blocks}")
        # Reserving must not starve what runs or waits here: a block stays free for each running request's next
        # token, and room for the first waiting request that needs blocks (preempted, or computed here).
        if need + len(self.scheduler.running) + self._wanted_by_waiting() > kv.pool.num_free:
            return KVReserved(msg.reserve_id)
        return KVReserved(msg.reserve_id, self._reserved.reserve(msg.holder, need))

    def _reserve_receive_blocks(self, msg: ReserveKV) -> KVReserved:
        if self._receive is None:
            return KVReserved(msg.reserve_id, error="this engine has no receive blocks for peers' writes")
        need, pool = self.transfer.blocks_for(msg.num_rows), self._receive.pool
        if need > pool.num_blocks:
            return KVReserved(msg.reserve_id, error=f"{msg.num_rows} rows need {need} receive blocks; there are "
                                                    f"{pool.num_blocks} (--kv-buffer-blocks)")
        if need > pool.num_free:
            return KVReserved(msg.reserve_id)  # asked again once requests gave some back
        return KVReserved(msg.reserve_id, self._receive.reserve(msg.holder, need))

    def ask(self, msg: ReserveKV) -> KVReserved | None:
        if not self._asked:  # none waits before it
            answer = self.reserve(msg)
            if answer.block_ids is not None or answer.error is not None:
                return answer
        self._asked[msg.reserve_id] = msg
        return None

    def answer_waiting(self) -> list[KVReserved]:
        """First come, first served: none goes ahead of an earlier (bigger) one, which would wait for ever."""
        answers = []
        while self._asked:
            msg = next(iter(self._asked.values()))
            answer = self.reserve(msg)
            if answer.block_ids is None and answer.error is None:
                break
            del self._asked[msg.reserve_id]
            answers.append(answer)
        return answers

    def cancel(self, msg: CancelReserveKV) -> KVReserved | None:
        return None if self._asked.pop(msg.reserve_id, None) is None else KVReserved(msg.reserve_id)

    def _wanted_by_waiting(self) -> int:
        for req in self.scheduler.waiting:
            pending = self._pending.get(req.request_id)
            if pending is None or pending.take_blocks is None:
                return self.scheduler.kv.blocks_needed(req.num_tokens + 1)
        return 0

    def release(self, msg: ReleaseKV) -> None:
        held = self._reserved or self._receive
        if held is not None:
            held.release(msg.holder, msg.block_ids)

    @property
    def num_reserved_blocks(self) -> int:
        held = self._reserved or self._receive
        return 0 if held is None else held.num_blocks

    def owns(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._not_recomputable

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.in_place:
                self._reserved.unclaim(rid)  # its blocks stay their holder's, whose release frees them
            self._pending.pop(rid, None)
            check = self._checks.pop(rid, None)
            if check is not None:
                check.cancel()  # not started: it never will (one under way only reads, its answer unused)
            self._not_recomputable.discard(rid)

    def pending_kv(self, req: Request) -> PendingKV | None:
        return self._pending.get(req.request_id)

    @property
    def holds_blocks_for_waiting(self) -> bool:
        return self.in_place and self._reserved.has_claims

    def keeps_kv_on_preempt(self, req: Request) -> bool:
        return req.request_id in self._not_recomputable

    def request_finished(self, req: Request, status: RequestStatus) -> bool:
        self.forget([req.request_id])
        return False

    def move_kv(self, sched) -> MovedKV:
        runner = self.runner
        for req, block_ids, n, slot in sched.kv_out:  # read before this step's forward pass reuses the blocks
            kv = runner.read_kv(runner.block_slots(block_ids, n))
            state = None if slot is None else runner.read_state_rows(slot)
            self._pending[req.request_id] = PendingKV(n, lambda start, kv=kv: kv[:, :, start:],
                                                      state_rows=None if state is None else lambda s=state: s)
        moved = MovedKV([], [])
        for req, start in sched.kv_in:
            pending = self._pending.pop(req.request_id)
            try:
                check = self._checks.pop(req.request_id, None)
                if check is not None and not check.result():  # (done long since, unless it arrived this step)
                    logger.error("request %s: its prefill instance sent KV rows holding NaN or infinite values",
                                 req.request_id)
                    moved.failed.append((req.request_id, NOT_FINITE, 503))
                    continue
                if pending.take_blocks is None:  # in place, the KV is in the request's blocks already
                    runner.write_kv(runner.token_slots(req, pending.num_tokens)[start:], pending.read(start))
                if pending.state_rows is not None:
                    runner.write_state_rows(self.scheduler.state.slot(req), pending.state_rows())
            except InvalidInputError as e:  # e.g. a peer's state holding NaN: that request fails, the engine goes on
                logger.error("request %s: its handed-over state was refused: %s", req.request_id, e)
                moved.failed.append((req.request_id, str(e), 500))
                continue
            except Exception as e:  # noqa: BLE001 - that request fails (500), the engine goes on
                logger.exception("request %s: its KV could not be written", req.request_id)
                moved.failed.append((req.request_id, f"its KV could not be written: {type(e).__name__}", 500))
                continue
            self.scheduler.kv.cache_full_blocks(req)
            if pending.from_peer and pending.take_blocks is None:  # its receive blocks may go
                moved.loaded.append(req.request_id)
        return moved

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True, cancel_futures=True)
            self._checker = None
