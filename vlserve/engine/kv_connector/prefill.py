"""The prefill role's connector: every request computes its prompt and samples its first token; when it finishes
its blocks are kept. A hybrid model's linear states follow its KV rows as rows (read as it finishes, before its
state slot is freed). A hold nobody takes (the step's outputs were lost) expires.

Where the KV goes: with a row writer (made by the disaggregation layer for the instance's transport) it stays in
this process, which writes it into the decode instance's blocks itself. Those blocks, for every row, come with
the request (`will_send`): its rows go out as the prompt is computed, each layer's as soon as that layer ran, on a
thread of their own while the engine steps on (layer_sends), and the send ends in `take_written`. What no layer
write covered is written from the finished request's kept KV: on the CPU (one rank, or several whose KV files
rank 0 maps: engine.ranked_kv) its blocks themselves, kept until the send has ended (vLLM's delayed free) and
read on the writer thread, so the engine's own thread spends nothing on the export; elsewhere (a GPU; ranks
torchrun started, whose heads are gathered) rows read out after the step, the blocks freed then. What is kept
goes when the send has ended, when the front end drops the request (`forget`, blocks freed once no write reads
them), or after the same expiry. Without a writer (an engine driven directly) the rows go out with the first
token."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vlserve.core.cpu_budget import cpu_budget
from vlserve.core.errors import InvalidInputError
from vlserve.core.messages import EngineCoreOutput
from vlserve.core.prompt import ProcessedPrompt
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.wire import KVSend, KVWritten
from vlserve.engine.kv_connector.base import ExportedKV, KVConnector, KVTransfer, MovedKV, RowWriter
from vlserve.engine.kv_connector.layer_sends import LayerSend
from vlserve.engine.transfer_buffers import all_finite


logger = logging.getLogger(__name__)
HELD_KV_TTL_S = 120.0  # a finished prefill's blocks are kept this long at most


@dataclass
class KeptKV:
    """A finished prompt's KV kept for the writer: its rows read out already, or (on the CPU) its blocks."""

    num_tokens: int
    read_rows: Callable[[int, int], torch.Tensor]  # tokens start..end's rows (sliced, or read out of the blocks)
    state_rows: torch.Tensor | None  # a hybrid model's, written after the last token's row (when not in rows)
    req: Request | None  # whose blocks stay allocated until the transfer is over (None: rows read out)
    last_used: float

    @classmethod
    def of_rows(cls, rows: torch.Tensor, num_tokens: int) -> "KeptKV":
        """Rows read out at export: every token's, then any state rows (sliced with the last chunk, not copied)."""
        def read_rows(start: int, end: int) -> torch.Tensor:
            return rows[start:end] if end < num_tokens else rows[start:]
        return cls(num_tokens, read_rows, None, None, time.monotonic())

    def rows_of(self, start: int, end: int) -> torch.Tensor:
        """Tokens start..end as rows; the last chunk also carries the state rows. On the writer thread."""
        rows = self.read_rows(start, end)
        if end == self.num_tokens and self.state_rows is not None:
            rows = torch.cat([rows, self.state_rows])
        return rows


def spare_core(device: torch.device) -> bool:
    """Whether a writer thread may copy while the model computes without slowing it: on a CPU, only when torch's
    threads leave a core of this process's budget free (with every core computing, each layer's write stalled
    the step's threads: a 2,000-token prompt in 4 steps took 5 % longer, 50 ms, to save a 11-15 ms handoff;
    with one core spare it took the same time and the handoff went: benchmarks/layer_sends.py)."""
    return device.type != "cpu" or torch.get_num_threads() < cpu_budget().cpus


class PrefillConnector(KVConnector):
    def __init__(self, cfg, ttl: float = HELD_KV_TTL_S, writer: RowWriter | None = None):
        self.ttl, self.writer = ttl, writer
        self.keep_s = HELD_KV_TTL_S if writer is None else writer.keep_s
        # Finished, blocks kept until exported: (request, since, a hybrid model's state rows read at its finish).
        self.held: dict[str, tuple[Request, float, torch.Tensor | None]] = {}
        self._failed: list[tuple[str, str]] = []  # (request id, why) whose export failed, for take_failed
        self._exported: list[ExportedKV] = []  # since the last take_exported
        # With a writer: what it writes from, per request.
        self.kept: dict[str, KeptKV] = {}
        self._free_after_writes: list[tuple[str, Request]] = []  # blocks a write under way still reads
        # One thread: a send's writes land in order, and a write never competes with the next for memory.
        self._pool = None if writer is None else ThreadPoolExecutor(1, thread_name_prefix="vlserve-kv-write")
        self.sends: dict[str, LayerSend] = {}  # requests whose KV goes out as it is computed (layer_sends)
        self.by_layer = False  # (bind) each layer's KV is written as soon as it is computed
        self.kv_planes = 2 * cfg.model.text.num_kv_layers  # a row's planes: each KV layer's keys, then values

    def bind(self, scheduler, runner, transfer) -> None:
        super().bind(scheduler, runner, transfer)
        # A layer is read by the writer thread while the engine computes the next: only where the KV cache may be
        # read off the engine's thread, into a transport that writes some planes of some rows, and where that
        # thread does not take a core from the computation (layer_sends: measured).
        can = self.writer is not None and getattr(self.writer, "writes_layers", False) and runner.reads_kv_off_thread
        spare = spare_core(runner.device)
        self.by_layer = can and spare
        if self.writer is not None:
            why = "" if self.by_layer or not can else \
                " (the computation uses every core here: a writer thread beside it would slow it more than it saves)"
            logger.info("KV of a prompt: sent into the decode blocks %s%s", "layer by layer as it is computed"
                        if self.by_layer else "when the prompt is computed", why)

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams, kv_transfer: KVTransfer | None) -> None:
        if kv_transfer is not None:
            raise InvalidInputError("a prefill engine takes no handed-over KV")
        if params.n != 1:
            raise InvalidInputError("a request whose KV is handed over samples once (n = 1)")

    def owns(self, request_id: str) -> bool:
        return request_id in self.held or request_id in self.kept or request_id in self.sends

    def will_send(self, req: Request, send: KVSend) -> None:
        if self._pool is None:
            raise InvalidInputError("this engine writes no KV rows to other instances")
        if not 0 < send.end <= req.num_prompt_tokens:
            raise InvalidInputError(f"tokens 0..{send.end} of a {req.num_prompt_tokens}-token prompt cannot be sent")
        # Layer by layer only through a writer that writes some planes of some rows (not zmq's), into rows stored
        # by plane like this KV cache (a KV cache, not receive blocks).
        by_layer = self.by_layer and getattr(self.writer, "writes_layers", False) \
            and self.writer.planes_of(send.destination) == self.kv_planes
        self.sends[req.request_id] = LayerSend(send, req.request_id, by_layer=by_layer)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if (send := self.sends.get(rid)) is not None:
                send.release()  # answered once no write of it runs (take_written)
            self._release(rid)
            self._drop_kept(rid)

    # ---- sends as the prompt is computed ---------------------------------------------------------------------
    def move_kv(self, sched) -> MovedKV:
        """Queues, after each layer of this step's forward pass, the writes of that layer's keys and values of the
        tokens the step computes for sends (AttentionMetadata.after_kv_layer)."""
        for rid in sched.preempted:  # its blocks are freed: layer writes queued before may read others' KV
            if (send := self.sends.get(rid)) is not None:
                send.restart()  # what it recomputes is written again, the rest at the finish
        if self.by_layer and self.sends:
            jobs = []
            for chunk in sched.chunks:
                send = self.sends.get(chunk.req.request_id)
                if send is None or send.released or not send.by_layer:
                    continue
                span = send.computed(chunk.start, chunk.end)
                if span is not None:
                    slots = self.runner.token_slots(chunk.req, span[1])[span[0]:]
                    jobs.append((send, slots, span[0]))
            if jobs:
                sched.after_kv_layer = functools.partial(self._queue_layer, jobs)
        return MovedKV([], [])

    def _queue_layer(self, jobs, kv_layer: int) -> None:
        """On the engine thread, right after the layer ran: its writes go to the writer thread."""
        for send, slots, first_row in jobs:
            send.futures.append(self._pool.submit(self._send_layer, send, slots, first_row, kv_layer))

    def _send_layer(self, send: LayerSend, slots: torch.Tensor, first_row: int, kv_layer: int) -> int:
        def write() -> int:
            rows = self.runner.read_kv_layer(slots, kv_layer)  # [m, 2, heads x head size]
            if not all_finite(rows):
                raise ValueError(f"layer {kv_layer}'s KV of tokens {first_row}..{first_row + len(slots)} holds NaN "
                                 "or infinite values: not written")
            return self.writer.write(send.msg.destination, rows, first_row, 2 * kv_layer)
        return self._sending(send, write)

    def _send_rest(self, request_id: str, kept: KeptKV) -> None:
        """Its request finished: what no layer write covered, and the state rows, from its kept KV."""
        send = self.sends.get(request_id)
        if send is None:
            return
        send.finished = True
        if send.released:
            return
        ranges = send.rest()
        for start, end in ranges:
            send.futures.append(self._pool.submit(self._send_rows, send, kept, start, end))
        if kept.state_rows is not None and send.msg.end == kept.num_tokens \
                and not any(end == kept.num_tokens for _, end in ranges):  # (else they go with that range)
            send.futures.append(self._pool.submit(self._send_state, send, kept))

    def _send_rows(self, send: LayerSend, kept: KeptKV, start: int, end: int) -> int:
        """Tokens [start, end) (with the state rows when `end` is the prompt's last token)."""
        def write() -> int:
            rows = kept.rows_of(start, end)
            if not all_finite(rows[: end - start]):  # (state rows are float32 bytes: checked as states)
                raise ValueError(f"the KV rows of tokens {start}..{end} hold NaN or infinite values: not written")
            return self.writer.write(send.msg.destination, rows, start)
        return self._sending(send, write)

    def _send_state(self, send: LayerSend, kept: KeptKV) -> int:
        """A hybrid model's state rows, after the last token's row."""
        return self._sending(send, lambda: self.writer.write(send.msg.destination, kept.state_rows, kept.num_tokens))

    @staticmethod
    def _sending(send: LayerSend, write: Callable[[], int]) -> int:
        """One write of a send, on the writer thread: none after the send failed, was released or is past its
        deadline; a failure fails the send."""
        send.check_live()
        try:
            return write()
        except Exception as e:
            send.error = send.error or f"{type(e).__name__}: {e}"
            raise

    def _writing(self, request_id: str) -> bool:
        """A write under way may still read this request's blocks."""
        send = self.sends.get(request_id)
        return send is not None and send.writing

    def request_finished(self, req: Request, status: RequestStatus) -> bool:
        if status == RequestStatus.FINISHED_ABORTED or not req.block_ids:
            if (send := self.sends.get(req.request_id)) is not None:
                send.release()
                if send.writing and req.block_ids:  # a layer write under way reads them: freed once it ended
                    self._free_after_writes.append((req.request_id, req))
                    return True
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
            if (send := self.sends.get(rid)) is not None:
                send.release()
            self._release(rid)
        for rid in [rid for rid, kept in self.kept.items() if now - kept.last_used > self.keep_s]:
            logger.warning("request %s: nobody asked for its KV rows for %.0f s; dropped", rid, self.keep_s)
            self._drop_kept(rid)

    def _drop_kept(self, request_id: str) -> None:
        """The writer is done with this request: its rows go, its blocks are freed (once no write reads them)."""
        kept = self.kept.pop(request_id, None)
        if kept is None or kept.req is None:
            return  # a write under way keeps its own reference to the rows it writes
        if self._writing(request_id):
            self._free_after_writes.append((request_id, kept.req))
        else:
            self.scheduler.kv.free(kept.req)

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        exported = self._exported
        for out in outputs:
            if out.finish_reason is None or out.request_id not in self.held:
                continue
            try:
                if self.writer is not None and self.runner.reads_kv_off_thread:
                    exported.append(self._keep_blocks(out.request_id))
                    self._send_rest(out.request_id, self.kept[out.request_id])
                    continue
                num_tokens = self.held[out.request_id][0].num_prompt_tokens
                kv = self.export(out.request_id)
                if self.writer is not None:  # written from here, what no layer write covered
                    self.kept[kv.request_id] = KeptKV.of_rows(kv.rows, num_tokens)
                    kv.rows = None
                    self._send_rest(kv.request_id, self.kept[kv.request_id])
                exported.append(kv)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory copying a long prompt's KV: that request
                # fails (export has freed its blocks), the engine and the step's other requests go on
                logger.exception("request %s: its KV could not be exported", out.request_id)
                self._release(out.request_id)  # still held if it failed before it was kept
                if (send := self.sends.get(out.request_id)) is not None:
                    send.release()
                self._failed.append((out.request_id, f"its KV could not be exported: {type(e).__name__}"))

    def _keep_blocks(self, request_id: str) -> ExportedKV:
        """Delayed free: the request's blocks stay allocated for the writer, which reads each chunk from them."""
        req, _, state_rows = self.held[request_id]
        slots, read = self.runner.token_slots(req, req.num_prompt_tokens), self.runner.read_kv_rows

        def read_rows(start: int, end: int) -> torch.Tensor:  # on the one writer thread, whose writes block
            return read(slots[start:end], scratch=True)

        state = None if req.generator is None else req.generator.get_state().numpy().tobytes()
        self.kept[request_id] = KeptKV(req.num_prompt_tokens, read_rows, state_rows, req, time.monotonic())
        del self.held[request_id]  # only now: until here a failure frees its blocks (after_step)
        return ExportedKV(request_id, None, state)

    def take_exported(self) -> list[ExportedKV]:
        exported, self._exported = self._exported, []
        return exported

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self._failed = self._failed, []
        return failed

    def take_written(self) -> list[KVWritten]:
        done = []
        for rid, send in list(self.sends.items()):
            if (answer := send.answer()) is not None:
                del self.sends[rid]
                if answer.error is not None:  # that transfer fails (the front end tells the receiver)
                    logger.warning("request %s: its KV send failed: %s", rid, answer.error)
                done.append(answer)
                self._drop_kept(rid)  # every row it had to write is written (or never will be)
        if self._free_after_writes:  # blocks whose last write reading them has ended
            still = []
            for rid, req in self._free_after_writes:
                if self._writing(rid):
                    still.append((rid, req))
                else:
                    self.scheduler.kv.free(req)
            self._free_after_writes = still
        return done

    @property
    def writes_in_flight(self) -> bool:
        return bool(self.sends)

    @property
    def num_kept(self) -> int:
        return len(self.kept)

    def close(self) -> None:
        """Writes not started never will be; the one under way ends first (its receiver may not reuse those
        blocks before it has)."""
        if self._pool is not None:
            pool, self._pool = self._pool, None  # closed once (the crash path closes before the engine's end)
            pool.shutdown(wait=True, cancel_futures=True)
            self.writer.close()

    def export(self, request_id: str) -> ExportedKV:
        """A held request's prompt KV as rows, with its random state; its blocks are freed."""
        if request_id not in self.held:
            raise InvalidInputError(f"nothing held for request {request_id!r}")
        req, _, state_rows = self.held[request_id]
        try:
            rows = self.runner.read_kv_rows(self.runner.token_slots(req, req.num_prompt_tokens))
            if state_rows is not None:
                rows = torch.cat([rows, state_rows])  # both in the KV cache's dtype (the states as bytes)
            state = None if req.generator is None else req.generator.get_state().numpy().tobytes()
            return ExportedKV(request_id, rows, state)
        finally:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            return
        if self._writing(request_id):  # a write of its send still reads its blocks
            self._free_after_writes.append((request_id, held[0]))
        else:
            self.scheduler.kv.free(held[0])
