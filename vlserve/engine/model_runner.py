"""Turns a scheduler step into tensors, runs the ViT and the LM, and samples.

Per step: drop encoder outputs nobody needs → encode newly scheduled items in one ViT call → build the flat
token batch (decode tokens first, then prefill chunks) with M-RoPE positions, slots and attention metadata →
embed tokens and scatter image embeddings into their placeholder rows (Qwen3-VL: the DeepStack features of
those rows set aside for the first decoder layers) → LM forward → logits only for rows that sample → sampler.
"""

from __future__ import annotations

import torch

from vlserve.core.messages import TokenLogprobs
from vlserve.core.request import Request
from vlserve.engine.config import VlserveConfig
from vlserve.engine.sampler import Sampler, SamplingMetadata, TokenBitmask
from vlserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from vlserve.engine.structured.matchers import GrammarMatchers
from vlserve.engine.transfer_buffers import TransferBuffers
from vlserve.engine.vision_runner import VisionRunner
from vlserve.model.decoder import DeepstackInput
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span


class ModelRunner:
    def __init__(self, cfg: VlserveConfig, model: torch.nn.Module, transfer: TransferBuffers | None = None,
                 grammars: GrammarMatchers | None = None):
        """`transfer`: a disaggregated server's receive blocks, where items sent by encoders are read in place.
        `grammars`: fills the token masks of requests with structured outputs."""
        self.cfg = cfg
        self.model = model
        self.transfer = transfer
        self.grammars = grammars
        self.vision = VisionRunner(model, cfg.device) if getattr(model, "visual", None) is not None else None
        self.device = cfg.device
        self.block_size = cfg.block_size
        t = cfg.model.text
        num_slots = cfg.num_kv_blocks * cfg.block_size
        # Zeroed, not empty: padded decode rows read slot 0, and 0-weight x NaN garbage would still be NaN.
        self.kv_caches = [
            torch.zeros(2, num_slots, t.num_kv_heads, t.head_dim, dtype=cfg.dtype, device=self.device)
            for _ in range(t.num_layers)
        ]
        self.sampler = Sampler()
        self.hidden = t.hidden_size
        self.deepstack_levels = len(cfg.model.vision.deepstack_indexes)

    # ---- KV handed between instances ------------------------------------------------------------------------------
    def token_slots(self, req: Request, num_tokens: int) -> torch.Tensor:
        return self._slots(req, 0, num_tokens)

    def block_slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """KV slots of tokens 0..num_tokens held in `block_ids` (blocks a preemption is about to free)."""
        idx = torch.arange(num_tokens)
        return torch.tensor(block_ids)[idx // self.block_size] * self.block_size + idx % self.block_size

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, len(slots), kv_heads, head_dim]: the KV cache at these slots, on the CPU."""
        index = slots.to(self.device)
        return torch.stack([cache.index_select(1, index) for cache in self.kv_caches]).cpu()

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        index = slots.to(self.device)
        for cache, layer in zip(self.kv_caches, kv):
            cache.index_copy_(1, index, layer.to(self.device, cache.dtype))

    def take_encoder_seconds(self) -> list[float]:
        """Vision-tower call durations since the last call (histogram samples for the metrics)."""
        return self.vision.take_seconds() if self.vision is not None else []

    # ---- inputs --------------------------------------------------------------------------------------------
    def _slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        idx = torch.arange(start, end)
        table = torch.tensor(req.block_ids)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def _positions(self, req: Request, start: int, end: int) -> torch.Tensor:
        """[3, end-start]: the precomputed M-RoPE table inside the prompt, index + delta after it."""
        p = req.num_prompt_tokens
        parts = []
        if start < p:
            parts.append(req.mrope_positions[:, start : min(end, p)])
        if end > p:
            parts.append((torch.arange(max(start, p), end) + req.mrope_delta).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _decode_metadata(self, decode: list[ScheduledChunk], meta: AttentionMetadata) -> torch.Tensor:
        """Block table, mask and write slots for all single-token rows at once; returns the write slots."""
        bs = self.block_size
        ctx = torch.tensor([c.end for c in decode])
        max_blocks = max(len(c.req.block_ids) for c in decode)
        table = torch.zeros(len(decode), max_blocks, dtype=torch.long)
        for row, c in enumerate(decode):
            table[row, : len(c.req.block_ids)] = torch.tensor(c.req.block_ids)
        pos = torch.arange(max_blocks * bs)
        meta.decode_blocks = table.view(-1)
        meta.decode_mask = (pos.unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :]
        meta.decode_context_lens = ctx
        last = ctx - 1
        return table[torch.arange(len(decode)), last // bs] * bs + last % bs

    def _prepare(self, chunks: list[ScheduledChunk]):
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        ordered = decode + prefill
        token_ids: list[int] = []
        for c in ordered:
            token_ids.extend(c.req.token_ids[c.start : c.end])
        positions = torch.cat([self._positions(c.req, c.start, c.end) for c in ordered], dim=1)

        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(decode),
                                 block_size=self.block_size)
        slot_parts = []
        if decode:
            slot_parts.append(self._decode_metadata(decode, meta))
        row = len(decode)
        for c in prefill:
            ctx_slots = self._slots(c.req, 0, c.end)
            slot_parts.append(ctx_slots[c.start :])
            meta.prefills.append(build_prefill_span(row, c.num_tokens, c.end, ctx_slots if c.start else None))
            row += c.num_tokens
        meta.slot_mapping = torch.cat(slot_parts)
        return ordered, token_ids, positions, meta

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        dev = self.device
        if dev.type == "cpu":
            return meta
        meta.slot_mapping = meta.slot_mapping.to(dev, non_blocking=True)
        if meta.decode_blocks is not None:
            meta.decode_blocks = meta.decode_blocks.to(dev, non_blocking=True)
            meta.decode_mask = meta.decode_mask.to(dev, non_blocking=True)
            meta.decode_context_lens = meta.decode_context_lens.to(dev, non_blocking=True)
        for span in meta.prefills:
            if span.context_slots is not None:
                span.context_slots = span.context_slots.to(dev, non_blocking=True)
                span.mask = span.mask.to(dev, non_blocking=True)
        return meta

    def _embed(self, ordered: list[ScheduledChunk], token_ids: list[int]) -> tuple[torch.Tensor, DeepstackInput | None]:
        """Token embeddings with media rows in place, and the DeepStack features of those rows (None when the
        model has none or no media token is in this step)."""
        ids = torch.tensor(token_ids, device=self.device)
        embeds = self.model.embed_tokens(ids)
        feature_rows: list[torch.Tensor] = []  # flat batch rows that get DeepStack features
        features: list[torch.Tensor] = []  # [n, levels * hidden] each
        row = 0
        for c in ordered:
            for idx in c.req.items_overlapping(c.start, c.end):
                lo, hi = max(c.start, c.req.mm_items[idx].offset), min(c.end, c.req.mm_items[idx].end)
                first = row + lo - c.start
                rows = self._item_rows(c.req, idx, lo, hi)
                embeds[first : first + hi - lo] = rows[:, : self.hidden]
                if self.deepstack_levels:
                    feature_rows.append(torch.arange(first, first + hi - lo))
                    features.append(rows[:, self.hidden :])
            row += c.num_tokens
        if not features:
            return embeds, None
        stacked = torch.cat(features).view(-1, self.deepstack_levels, self.hidden).transpose(0, 1)
        return embeds, DeepstackInput(torch.cat(feature_rows).to(self.device), stacked)

    def _item_rows(self, req: Request, idx: int, lo: int, hi: int) -> torch.Tensor:
        """Embedding rows of prompt tokens [lo, hi), all inside item `idx`, from wherever that item's are."""
        item = req.mm_items[idx]
        if item.pixel_values is not None:
            return self.vision.outputs[item.mm_hash][lo - item.offset : hi - item.offset]
        if item.embeddings is not None:
            return item.embeddings[lo - item.offset : hi - item.offset].to(self.device, self.cfg.dtype)
        # Sent by an encoder service: gathered from the receive blocks, where the transport wrote them.
        width = self.cfg.model.embedding_width
        return self.transfer.read_rows(req.prompt.block_rows, lo, hi - lo, width).to(self.device, self.cfg.dtype)

    # ---- step -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        if self.vision is not None:
            self.vision.free(sched.free_encoder_keys)
            self.vision.encode([req.mm_items[idx] for req, idx in sched.encode])
        if sched.empty:
            return {}, {}
        ordered, token_ids, positions, meta = self._prepare(sched.chunks)
        rows, sampling = [], []
        row = 0
        for c in ordered:
            row += c.num_tokens
            if c.samples:
                rows.append(row - 1)
                sampling.append(c.req)
        # Grammar masks: on an accelerator they are filled while the forward pass runs.
        constrained = [i for i, r in enumerate(sampling) if r.grammar is not None]
        masks = self.grammars.start_masks([sampling[i].grammar for i in constrained]) if constrained else None

        embeds, deepstack = self._embed(ordered, token_ids)
        hidden = self.model(embeds, positions.to(self.device), self.kv_caches, self._to_device(meta), deepstack)
        if not sampling:
            return {}, {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        bitmask = TokenBitmask(constrained, masks()) if masks is not None else None
        return self._sample(logits, sampling, bitmask)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], bitmask: TokenBitmask | None = None):
        generators = {}
        for i, req in enumerate(reqs):
            if req.params.seed is not None and not req.params.greedy:
                if req.generator is None:
                    req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
                generators[i] = req.generator
        meta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.eos_token_ids for r in reqs],
            generators,
            self.device,
            bitmask,
        )
        out = self.sampler(logits, meta)
        tokens = out.sampled.tolist()
        sampled = {r.request_id: t for r, t in zip(reqs, tokens)}
        logprobs = {}
        if out.logprobs is not None:
            lp, ids, ranks = out.logprobs.tolist(), out.logprob_token_ids.tolist(), out.sampled_ranks.tolist()
            for i, r in enumerate(reqs):
                if r.params.logprobs is not None:
                    k = 1 + r.params.logprobs
                    logprobs[r.request_id] = TokenLogprobs(ids[i][:k], lp[i][:k], ranks[i])
        return sampled, logprobs
