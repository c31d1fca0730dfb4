"""The prefill role's connector: every request computes its prompt and samples its first token; when it finishes
its blocks are kept, read out as KV rows after the step (sent back to the front end, which hands them to a decode
instance) and freed. A hybrid model's linear states follow its KV rows as rows too (read as it finishes, before
its state slot is freed). A hold nobody takes (the step's outputs were lost) expires."""

from __future__ import annotations

import logging
import time

import torch

from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.engine.kv_connector.base import ExportedKV, KVConnector, KVTransfer
from vlserve.engine.kv_handoff import kv_to_rows

logger = logging.getLogger(__name__)
HELD_KV_TTL_S = 120.0  # a finished prefill's blocks are kept this long at most


class PrefillConnector(KVConnector):
    def __init__(self, cfg, ttl: float = HELD_KV_TTL_S):
        self.ttl = ttl
        # Finished, blocks kept until exported: (request, since, a hybrid model's state rows read at its finish).
        self.held: dict[str, tuple[Request, float, torch.Tensor | None]] = {}
        self._failed: list[tuple[str, str]] = []  # (request id, why) whose export failed, for take_failed

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams, kv_transfer: KVTransfer | None) -> None:
        if kv_transfer is not None:
            raise InvalidInputError("a prefill engine takes no handed-over KV")
        if params.n != 1:
            raise InvalidInputError("a request whose KV is handed over samples once (n = 1)")

    def owns(self, request_id: str) -> bool:
        return request_id in self.held

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._release(rid)

    def request_finished(self, req: Request, status: RequestStatus) -> bool:
        if status == RequestStatus.FINISHED_ABORTED or not req.block_ids:
            return False
        state = self.scheduler.state
        # Its state slot is freed with the request (the pool has one per running request): its rows are read now.
        rows = None if state is None else self.runner.read_state_rows(state.slot_of[req.request_id])
        self.held[req.request_id] = (req, time.monotonic(), rows)
        return True

    def start_step(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (_, since, _) in self.held.items() if now - since > self.ttl]:
            logger.warning("request %s: its prefilled KV was not taken within %.0f s; released", rid, self.ttl)
            self._release(rid)

    def after_step(self, outputs: list[EngineCoreOutput]) -> list[ExportedKV]:
        exported = []
        for out in outputs:
            if out.finish_reason is None or out.request_id not in self.held:
                continue
            try:
                exported.append(self.export(out.request_id))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory copying a long prompt's KV: that request
                # fails (export has freed its blocks), the engine and the step's other requests go on
                logger.exception("request %s: its KV could not be exported", out.request_id)
                self._failed.append((out.request_id, f"its KV could not be exported: {type(e).__name__}"))
        return exported

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self._failed = self._failed, []
        return failed

    def export(self, request_id: str) -> ExportedKV:
        """A held request's prompt KV as rows, with its random state; its blocks are freed."""
        if request_id not in self.held:
            raise InvalidInputError(f"nothing held for request {request_id!r}")
        req, _, state_rows = self.held[request_id]
        try:
            rows = kv_to_rows(self.runner.read_kv(self.runner.token_slots(req, req.num_prompt_tokens)))
            if state_rows is not None:
                rows = torch.cat([rows, state_rows])  # both in the KV cache's dtype (the states as bytes)
            state = None if req.generator is None else req.generator.get_state().numpy().tobytes()
            return ExportedKV(request_id, rows, state)
        finally:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.scheduler.kv.free(held[0])
