"""The decode role's connector: a request arrives prefilled by another instance, its KV as one row per token in
this engine's receive blocks (`prompt.block_rows`) and its first token (with the random state) in a `Handoff`.
It waits in the queue like any request; when the scheduler admits it, its KV is written into its blocks (a prefix
already cached here is shared) and the receive blocks are released at once. Its pictures are not here to
recompute it from, so a preemption swaps its KV out to host memory and back in at readmission. A hybrid model's
linear states arrive as rows after the prompt's KV rows and go into the request's state slot with its KV; a
preemption swaps them out and back in with it."""

from __future__ import annotations

import logging

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.kv_connector.base import KVConnector, KVTransfer, MovedKV, PendingKV
from vlserve.engine.kv_handoff import check_handed_first, rows_to_kv
from vlserve.engine.state_rows import state_row_count

logger = logging.getLogger(__name__)


class DecodeConnector(KVConnector):
    def __init__(self, cfg):
        self.cfg = cfg
        self.state_rows = state_row_count(cfg.model, cfg.dtype)  # after each prompt's KV rows (hybrid models)
        self._pending: dict[str, PendingKV] = {}  # KV to write when the request is (re)admitted
        self._not_recomputable: set[str] = set()  # handed-over requests: preempting one swaps its KV out

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams, kv_transfer: KVTransfer | None) -> None:
        if kv_transfer is None:
            return  # computed here like on any engine
        if params.n != 1:
            raise InvalidInputError("a handed-over request samples once (n = 1)")
        if self.transfer is None or prompt.block_rows is None:
            raise InvalidInputError("a handed-over request needs its KV rows in this engine's receive blocks")
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

        def read(start: int) -> torch.Tensor:
            return rows_to_kv(transfer.read_rows(blocks, start, n - start), t.num_kv_layers, t.num_kv_heads,
                              t.head_dim)

        def read_state() -> torch.Tensor:  # a hybrid model's linear states follow the prompt's KV rows
            return transfer.read_rows(blocks, n, state_rows)

        self._pending[req.request_id] = PendingKV(n, read, from_peer=True,
                                                  state_rows=read_state if state_rows else None)
        self._not_recomputable.add(req.request_id)
        return EngineCoreOutput(req.request_id, list(first.new_token_ids), first.new_logprobs,
                                num_cached_tokens=first.num_cached_tokens)

    def owns(self, request_id: str) -> bool:
        return request_id in self._pending or request_id in self._not_recomputable

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._not_recomputable.discard(rid)

    def pending_kv(self, req: Request) -> PendingKV | None:
        return self._pending.get(req.request_id)

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
                runner.write_kv(runner.token_slots(req, pending.num_tokens)[start:], pending.read(start))
                if pending.state_rows is not None:
                    runner.write_state_rows(self.scheduler.state.slot(req), pending.state_rows())
            except InvalidInputError as e:  # e.g. a peer's state holding NaN: that request fails, the engine goes on
                logger.error("request %s: its handed-over state was refused: %s", req.request_id, e)
                moved.failed.append((req.request_id, str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - that request fails (500), the engine goes on
                logger.exception("request %s: its KV could not be written", req.request_id)
                moved.failed.append((req.request_id, f"its KV could not be written: {type(e).__name__}"))
                continue
            self.scheduler.kv.cache_full_blocks(req)
            if pending.from_peer:
                moved.loaded.append(req.request_id)
        return moved
