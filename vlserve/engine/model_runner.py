"""Turns a scheduler step into tensors, runs the media towers and the LM, and samples.

Per step: drop encoder outputs nobody needs → encode newly scheduled items (one call per tower and group)
→ build the flat token batch (decode tokens first, then prefill chunks) as a `ForwardBatch`: positions,
slots, block tables, and the media embedding rows of its placeholder tokens → the executor embeds, scatters the
media rows (a model with DeepStack features: sets them aside for the first decoder layers), runs the LM and returns
logits only for rows that sample → sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlserve.core.messages import TokenLogprobs
from vlserve.core.request import Request
from vlserve.engine.config import VlserveConfig
from vlserve.engine.executor import encodes_whole_step
from vlserve.engine.forward_batch import ForwardBatch
from vlserve.engine.kv_handoff import kv_to_rows
from vlserve.engine.block_tables import BlockTables
from vlserve.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, TokenBitmask
from vlserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from vlserve.engine.state_cache import StateStep
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.engine.ranked_kv import RankedKV
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.engine.encoder_runner import EncoderRunner
from vlserve.model.layers.lora_rows import row_groups
from vlserve.model.accelerator import Accelerator, to_device


class ModelRunner:
    def __init__(self, cfg: VlserveConfig, executor, transfer: TransferBuffers | None = None,
                 grammars: GrammarMatchers | None = None):
        """`executor`: runs the media towers and the LM (a `ModelShard`, or the tensor-parallel leader that runs
        every rank's). `transfer`: a disaggregated server's receive blocks, where items sent by encoders are read
        in place. `grammars`: fills the token masks of requests with structured outputs."""
        self.cfg = cfg
        self.executor = executor
        self.transfer = transfer
        self.grammars = grammars
        model = executor.model
        whole_step = encodes_whole_step(executor)
        has_encoder = any(getattr(model, tower, None) is not None for tower in ("visual", "audio_tower"))
        self.encoders = EncoderRunner(executor, cfg.device, whole_step) if has_encoder else None
        self.device = cfg.device
        self.block_size = cfg.block_size
        # each running request's block ids, kept between steps (a step writes only what was appended)
        self.block_tables = BlockTables(cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size) + 2)
        self.sampler = Sampler()
        self.acc = getattr(executor, "acc", None) or Accelerator(cfg.device)  # the shard's, where there is one
        self._last: LaunchedStep | None = None  # the most recent launch that samples

    @property
    def model(self) -> torch.nn.Module:
        return self.executor.model  # rank 0's share under tensor parallelism

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.executor.kv_caches

    @property
    def kv_buffers(self) -> TransferBuffers | RankedKV | None:
        """The KV cache as rows in shared files (`VlserveConfig.kv_cache_file`): one rank's file, or at several
        ranks every rank's seen as one (engine.ranked_kv); else None."""
        return getattr(self.executor, "kv_buffers", None)

    # ---- KV handed between instances ------------------------------------------------------------------------------
    def token_slots(self, req: Request, num_tokens: int) -> torch.Tensor:
        return self._slots(req, 0, num_tokens)

    def block_slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """KV slots of tokens 0..num_tokens held in `block_ids` (blocks a preemption is about to free)."""
        idx = torch.arange(num_tokens)
        return torch.tensor(block_ids)[idx // self.block_size] * self.block_size + idx % self.block_size

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, len(slots), kv_heads, head_dim]: the KV cache at these slots, on the CPU."""
        return self.executor.read_kv(slots)

    def read_kv_rows(self, slots: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """The KV cache at these slots as handoff rows (kv_handoff.kv_to_rows), on the CPU. `scratch`: in memory
        reused by the next such call (`ModelShard.read_kv_rows`; one thread only)."""
        direct = getattr(self.executor, "read_kv_rows", None)  # a shard's own, or the leader's (its ranks' files)
        return direct(slots, scratch) if direct is not None else kv_to_rows(self.read_kv(slots))

    def read_kv_layer(self, slots: torch.Tensor, kv_layer: int) -> torch.Tensor:
        """[len(slots), 2, every head x head size]: the kv_layer-th KV layer's keys and values at these slots, on
        the CPU; only where `reads_kv_off_thread` (from a writer thread, as soon as that layer ran)."""
        return self.executor.read_kv_layer(slots, kv_layer)

    @property
    def reads_kv_off_thread(self) -> bool:
        """`read_kv_rows` may run on another thread while the engine steps (on the CPU, one rank or every rank's
        file mapped here: no collective between ranks, no device stream to order against)."""
        return getattr(self.executor, "reads_kv_off_thread", False)

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        self.executor.write_kv(slots, kv)

    def read_state_rows(self, slot: int) -> torch.Tensor:
        """A hybrid model's linear states in `slot` as rows of the KV rows' width (engine.state_rows)."""
        return self.executor.read_state_rows(slot, self.cfg.model.kv_row_width)

    def write_state_rows(self, slot: int, rows: torch.Tensor) -> None:
        self.executor.write_state_rows(slot, rows)

    def take_encoder_seconds(self) -> list[tuple[str, float]]:
        """Tower call durations since the last call (histogram samples for the metrics)."""
        return self.encoders.take_seconds() if self.encoders is not None else []

    # ---- inputs --------------------------------------------------------------------------------------------
    def _slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        idx = torch.arange(start, end)
        table = torch.tensor(req.block_ids)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def _positions(self, req: Request, start: int, end: int) -> torch.Tensor:
        """[k, end-start]: the prompt's precomputed positions inside it, index + delta after it."""
        p = req.num_prompt_tokens
        parts = []
        if start < p:
            parts.append(req.positions[:, start : min(end, p)])
        if end > p:
            parts.append((torch.arange(max(start, p), end) + req.position_delta).expand(req.positions.shape[0], -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def _decode_positions(decode: list[ScheduledChunk], rows: int) -> torch.Tensor:
        """[rows, len(decode)] positions of one-token rows in one tensor: index + delta past the prompt, the
        precomputed column inside it (`rows`: the model's position rows, which every prompt has)."""
        cols = []
        for c in decode:
            req = c.req
            if c.start >= req.num_prompt_tokens:
                cols.append((c.start + req.position_delta,) * rows)
            else:
                cols.append(tuple(req.positions[:, c.start].tolist()))
        return torch.tensor(cols, dtype=torch.long).reshape(-1, rows).t()

    def _prepare(self, chunks: list[ScheduledChunk], state: StateStep | None = None):
        """The step's chunks in batch order (decode rows first) and the `ForwardBatch` that runs them (with a
        hybrid model's `state`: each sequence's state slot, fresh or not, its snapshots and the copies first)."""
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        if any(c.req.lora is not None for c in chunks):  # one row range per adapter in each part (lora_rows)
            decode.sort(key=_adapter_order)
            prefill.sort(key=_adapter_order)
        ordered = decode + prefill
        token_ids: list[int] = []
        for c in ordered:
            known = c.req.token_ids[c.start : c.end]
            # async scheduling: a decode row's input may still be being sampled (0 here; read on the device)
            token_ids.extend(known if len(known) == c.num_tokens else [0])
        positions = torch.cat([self._decode_positions(decode, self.cfg.model.position_rows)]
                              + [self._positions(c.req, c.start, c.end) for c in prefill], dim=1)
        bs = self.block_size
        # the blocks each context spans
        table = self.block_tables.gather([c.req for c in ordered], [-(-c.end // bs) for c in ordered])
        ctx = torch.tensor([c.end for c in ordered], dtype=torch.long)
        # each new token's KV slot: a decode row's one token by hand, a prompt chunk's tokens at once
        slots = [c.req.block_ids[(c.end - 1) // bs] * bs + (c.end - 1) % bs for c in decode]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        spans, row = [], len(decode)
        for i, c in enumerate(prefill, start=len(decode)):
            pos = torch.arange(c.start, c.end)
            slot_parts.append(table[i, pos // bs] * bs + pos % bs)
            spans.append((row, c.num_tokens, c.end))
            row += c.num_tokens
        slot_mapping = torch.cat(slot_parts) if prefill else slot_parts[0]
        media_rows, media = self._media(ordered)
        sample_rows, row = [], 0
        for c in ordered:
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
        batch = ForwardBatch(torch.tensor(token_ids), positions, slot_mapping, len(decode), table, ctx, spans,
                             media_rows, media, torch.tensor(sample_rows, dtype=torch.long))
        if state is not None:
            batch.state_slots = torch.tensor([state.slots[c.req.request_id] for c in ordered], dtype=torch.long)
            batch.state_fresh = torch.tensor([c.start == 0 for c in ordered], dtype=torch.bool)
            batch.state_checkpoints = [state.checkpoints.get(c.req.request_id, []) for c in prefill]
            batch.state_copies = list(state.copies)
        return ordered, batch

    def _media(self, ordered: list[ScheduledChunk]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rows of the flat batch that take media embeddings, and those embeddings (DeepStack features, where the
        model has them, after the first `hidden` columns), gathered from wherever each item's are; (None, None)
        if no media."""
        dest: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        row = 0
        for c in ordered:
            for idx in c.req.items_overlapping(c.start, c.end):
                lo, hi = max(c.start, c.req.mm_items[idx].offset), min(c.end, c.req.mm_items[idx].end)
                first = row + lo - c.start
                dest.append(torch.arange(first, first + hi - lo))
                rows.append(self._item_rows(c.req, idx, lo, hi))
            row += c.num_tokens
        if not rows:
            return None, None
        return torch.cat(dest), torch.cat(rows)

    def _item_rows(self, req: Request, idx: int, lo: int, hi: int) -> torch.Tensor:
        """Embedding rows of prompt tokens [lo, hi), all inside item `idx`, from wherever that item's are."""
        item = req.mm_items[idx]
        if item.needs_encoder:
            return self.encoders.outputs[item.mm_hash][lo - item.offset : hi - item.offset]
        if item.embeddings is not None:
            return to_device(item.embeddings[lo - item.offset : hi - item.offset], self.device, self.cfg.dtype)
        # Sent by an encoder service: gathered from the receive blocks, where the transport wrote them (the
        # item's rows one after another from its first row; text has none).
        width, first = self.cfg.model.embedding_width, req.prompt.media_row(idx)
        rows = self.transfer.read_rows(req.prompt.block_rows, first + lo - item.offset, hi - lo, width)
        return to_device(rows, self.device, self.cfg.dtype)

    # ---- step -----------------------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Runs the step and waits for its sampled tokens."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        """Queues the step's work on the device (towers, forward pass, sampling) and a copy of what it samples
        to the host, without waiting for any of it; None when nothing samples. A decode row whose input token
        the previous launch is still sampling (async scheduling) reads it on the device from that launch."""
        slots = self._lora_slots(sched)
        if self.encoders is not None:
            self.encoders.free(sched.free_encoder_keys)
            items = [req.mm_items[idx] for req, idx in sched.encode]
            towers = [slots.get(req.lora.key) if req.lora is not None and req.lora.towers else None
                      for req, _ in sched.encode]
            if any(slot is not None for slot in towers):  # tower adapters: calls grouped by adapter
                self.encoders.encode(items, towers)
            else:
                self.encoders.encode(items)
        if sched.empty:
            return None
        ordered, batch = self._prepare(sched.chunks, sched.state)
        batch.after_kv_layer = sched.after_kv_layer
        if slots:
            batch.lora_rows = row_groups([slots.get(c.req.lora.key) if c.req.lora is not None else None
                                          for c in ordered], [c.num_tokens for c in ordered])
        self._read_pending_inputs(ordered, batch)
        sampling = [c.req for c in ordered if c.samples]
        # Grammar masks: on an accelerator they are filled while the forward pass runs.
        constrained = [i for i, r in enumerate(sampling) if r.grammar is not None]
        masks = self.grammars.start_masks([sampling[i].grammar for i in constrained]) if constrained else None
        logits = self.executor.forward(batch)
        if not sampling:
            return None
        bitmask = TokenBitmask(constrained, masks()) if masks is not None else None
        launched = LaunchedStep(sampling, self._sample(logits, sampling, bitmask), self.acc)
        self._last = launched
        return launched

    def _lora_slots(self, sched: SchedulerOutput) -> dict[str, int]:
        """The device slot of each adapter this step runs (filled now where they are not there yet)."""
        lora = getattr(self.executor, "lora", None)
        if lora is None:
            return {}
        refs = [c.req.lora for c in sched.chunks if c.req.lora is not None]
        refs += [req.lora for req, _ in sched.encode if req.lora is not None and req.lora.towers]
        return lora.assign(refs) if refs else {}

    def collect(self, launched: LaunchedStep | None) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """The launch's sampled tokens (and log-probabilities), once its copies to the host are done."""
        if launched is None:
            return {}, {}
        launched.done.synchronize()
        reqs = launched.reqs
        sampled = {r.request_id: t for r, t in zip(reqs, launched.host[0].tolist())}
        logprobs = {}
        if len(launched.host) > 1:
            lp, ids, ranks = (t.tolist() for t in launched.host[1:])
            for i, r in enumerate(reqs):
                if r.params.logprobs is not None:
                    k = 1 + r.params.logprobs
                    logprobs[r.request_id] = TokenLogprobs(ids[i][:k], lp[i][:k], ranks[i])
        return sampled, logprobs

    def _read_pending_inputs(self, ordered: list[ScheduledChunk], batch: ForwardBatch) -> None:
        """Rows whose input token is not known on the host yet take it from the last launch's sampled tokens,
        on the device (`batch.pending_rows` / `pending_tokens`)."""
        rows = [i for i, c in enumerate(ordered) if c.start >= c.req.num_tokens]  # decode rows come first
        if not rows:
            return
        last = self._last
        index = {r.request_id: i for i, r in enumerate(last.reqs)}
        source = torch.tensor([index[ordered[i].req.request_id] for i in rows], dtype=torch.long)
        batch.pending_rows = torch.tensor(rows, dtype=torch.long)
        batch.pending_tokens = last.sampled.index_select(0, to_device(source, last.sampled.device))

    def _sample(self, logits: torch.Tensor, reqs: list[Request], bitmask: TokenBitmask | None = None):
        generators = {}
        for i, req in enumerate(reqs):
            if req.params.seed is not None and not req.params.greedy:
                if req.generator is None:
                    req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
                generators[i] = req.generator
        meta = SamplingMetadata.build(
            [r.params for r in reqs],
            _OutputTokens(reqs),  # read only by penalties and min_tokens: a copy each would cost O(context) a step
            [r.prompt_token_ids for r in reqs],
            [r.eos_token_ids for r in reqs],
            generators,
            self.device,
            bitmask,
        )
        return self.sampler(logits, meta)


class _OutputTokens(Sequence):
    """The requests' output token ids, each list made only when read."""

    def __init__(self, reqs: list[Request]):
        self.reqs = reqs

    def __len__(self) -> int:
        return len(self.reqs)

    def __getitem__(self, i: int) -> list[int]:
        return self.reqs[i].output_token_ids


def _adapter_order(chunk: ScheduledChunk) -> str:
    return "" if chunk.req.lora is None else chunk.req.lora.key


class LaunchedStep:
    """A step's sampling, queued: the sampled ids stay on the device (the next step's inputs may read them)
    and are copied to the host without blocking; `done` marks the copies' end."""

    def __init__(self, reqs: list[Request], out: SamplerOutput, acc: Accelerator):
        self.reqs = reqs
        self.sampled = out.sampled
        device = [out.sampled]
        if out.logprobs is not None:
            device += [out.logprobs, out.logprob_token_ids, out.sampled_ranks]
        self.host = [acc.staging(tuple(t.shape), t.dtype) for t in device]
        for host, t in zip(self.host, device):
            host.copy_(t, non_blocking=acc.is_cuda)
        self.done = acc.event()
        self.done.record()
