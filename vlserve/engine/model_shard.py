"""What one rank holds and runs: its share of the model's weights, its share of the KV cache, and the two calls
a step makes, `encode_images` (the vision tower) and `forward` (the LM over a `ForwardBatch`, logits out).

With one device this is the whole model. Under tensor parallelism every rank runs these calls in the same order
(rank 0 tells the others what to run, see vlserve.engine.tp) and the model's layers meet in collectives.

`--mm-encoder-tp-mode data` ("data parallel encoder"): the vision tower is whole on every rank, the pictures of
a call are spread over the ranks by patch count (`balance`), each rank encodes its share and the rows are
all-gathered back into the original order.

Decode-only steps replay captured graphs where the config asks for them (engine.decode_graphs); every KV cache
and state pool has one scratch block / slot past the pool's own for their padding rows.

A hybrid model (Qwen3.5) caches KV for its full-attention layers only; each linear-attention layer has a pool of
per-sequence state slots instead (`kv_caches` keeps one entry per layer, a tensor or a `LinearLayerState`).
"""

from __future__ import annotations

import logging

import torch

from vlserve.core.errors import ConfigurationError
from vlserve.engine.config import DATA, VlserveConfig
from vlserve.engine.decode_graphs import DecodeGraphs
from vlserve.engine.forward_batch import ForwardBatch, attention_metadata
from vlserve.engine.vision_graphs import VisionGraphs, supports_graphs
from vlserve.engine.encoder_runner import cpu_budget, groups_of
from vlserve.engine.kv_handoff import kv_to_rows
from vlserve.engine.transfer_buffers import TransferBuffers, slot_runs
from vlserve.engine.state_rows import pack_parts, state_parts, unpack_parts, unpack_state
from vlserve.model import huge_pages
from vlserve.model.accelerator import Accelerator, to_device
from vlserve.model.decoder import SideRows
from vlserve.model.layers.linear_state import LinearLayerState, copy_state_slots, new_layer_states
from vlserve.model.layers.packed_linear import packed_linear_supported
from vlserve.model.layers.parallel import SINGLE, TPGroup, head_split
from vlserve.model.loader import load_model, weight_files
from vlserve.model.layers.lora_rows import lora_rows
from vlserve.lora.adapter import LM_PREFIX, TOWER_PREFIX
from vlserve.lora.slots import LoRASlots

logger = logging.getLogger("vlserve.engine")


def balance(sizes: list[int], ranks: int) -> list[list[int]]:
    """Items (by index) per rank: largest first, each to the least-loaded rank (the lowest rank on a tie).
    Each rank's list keeps the order items were assigned in."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes keep their order
        rank = min(range(ranks), key=lambda r: loads[r])
        shares[rank].append(i)
        loads[rank] += sizes[i]
    return shares


def item_patches(model, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Each item's pixel rows (the model's family says how many an item's grid takes)."""
    return list(pixels.split([model.item_pixel_rows(g) for g in grids]))


def load_shard(cfg: VlserveConfig, tp: TPGroup = SINGLE, device: torch.device | None = None) -> ModelShard:
    """This rank's share of the model from the checkpoint (all of it at one rank), ready to run."""
    device = device or cfg.device
    vision_tp = SINGLE if cfg.mm_encoder_tp_mode == DATA else None  # data-parallel encoder: whole on every rank
    model = load_model(cfg.model_path, cfg.model, cfg.dtype, device, with_vision=cfg.load_vision,
                       with_language=cfg.load_language, quantization=cfg.quantization, tp=tp, vision_tp=vision_tp,
                       towers=cfg.towers)
    return ModelShard(model, cfg, tp, device)


def lora_slots(model: torch.nn.Module, cfg: VlserveConfig, device: torch.device) -> LoRASlots:
    """Adapter slots around the model's linears. An adapter file larger than the model's own weights is refused."""
    from vlserve.model.families import family_of

    family = family_of(cfg.model.architecture)
    max_bytes = sum(f.stat().st_size for f in weight_files(cfg.model_path))
    lora = cfg.lora
    # the parts of the model loaded elsewhere (disaggregated: an encoder's LM, a language server's towers)
    elsewhere = tuple(prefix for tower, prefix in TOWER_PREFIX.items() if tower not in cfg.towers)
    if not cfg.load_language:
        elsewhere += (LM_PREFIX,)
    return LoRASlots(model, family.load(family.weight_names), lora.max_loras, lora.max_cpu_loras, lora.max_rank,
                     max_bytes, cfg.dtype, device, elsewhere, lora.max_cpu_bytes)


class ModelShard:
    def __init__(self, model: torch.nn.Module, cfg: VlserveConfig, tp: TPGroup = SINGLE,
                 device: torch.device | None = None):
        device = device or cfg.device
        if packed_linear_supported(device, cfg.dtype) and hasattr(model, "pack_for_cpu"):
            logger.info("packed %d linears into oneDNN's layout", model.pack_for_cpu())
        # After packing (the weights it replaces must be freed, not kept in the arena) and before LoRA's slots
        # (views of its own it keeps must not be left on the old memory).
        self.huge_page_bytes = huge_pages.move_model(model) if device.type == "cpu" else 0
        if self.huge_page_bytes:
            logger.info("weights in huge pages: %.0f MiB", self.huge_page_bytes / 2**20)
        self.model = model
        self.lora = lora_slots(model, cfg, device) if cfg.lora is not None else None  # after packing: wraps them
        self.tp = tp
        self.encoder_mode = cfg.mm_encoder_tp_mode
        self.device = device
        self.acc = Accelerator(device)
        self.block_size = cfg.block_size
        self.graphs: DecodeGraphs | None = None
        visual = getattr(model, "visual", None)
        self.vision_graphs = VisionGraphs(visual, self.acc) \
            if not cfg.enforce_eager and supports_graphs(visual, self.acc) else None
        language = getattr(model, "language_model", None)
        self.kv_caches: list[torch.Tensor | LinearLayerState] = []
        self._rows_scratch: torch.Tensor | None = None  # a prefill writer thread's rows (read_kv_rows(scratch))
        self.kv_buffers: TransferBuffers | None = None  # this rank's KV cache as rows in a file (kv_cache_file)
        self.kv_layers: list[int] = []  # layers with a KV cache (all but a hybrid model's linear ones)
        self.layer_states: list[LinearLayerState | None] = []  # per layer: None unless linear attention
        if language is not None:
            text = model.cfg.text
            # + 1: the scratch slot of padded graph rows
            states = new_layer_states(text, cfg.num_state_slots + 1, cfg.dtype, device, tp.size) \
                if cfg.model.is_hybrid else [None] * len(language.layers)
            self.kv_layers = [i for i, st in enumerate(states) if st is None]
            self.layer_states = states
            attn = language.layers[self.kv_layers[0]].self_attn  # this rank's key/value heads
            slots = (cfg.num_kv_blocks + 1) * cfg.block_size  # + 1: the scratch block of padded graph rows
            # Zeroed, not empty: the CPU path's padded decode rows read block 0 (masked), and 0-weight x NaN
            # garbage would still be NaN.
            if cfg.kv_cache_file:
                kv = self._kv_in_shared_file(cfg, len(self.kv_layers), attn.num_kv_heads, attn.head_dim)
                caches = iter(kv.unbind(0))
            elif device.type == "cpu" and huge_pages.available():  # (decode reads them every token: see there)
                caches = iter(huge_pages.zeros([(2, slots, attn.num_kv_heads, attn.head_dim)] * len(self.kv_layers),
                                               cfg.dtype))
            else:
                caches = (torch.zeros(2, slots, attn.num_kv_heads, attn.head_dim, dtype=cfg.dtype, device=device)
                          for _ in self.kv_layers)
            self.kv_caches = [st if st is not None else next(caches) for st in states]
            self.hidden = model.cfg.text.hidden_size
            self.side_rows = model.cfg.side_rows
            if cfg.graph_sizes:
                self.graphs = DecodeGraphs(model, self.kv_caches, self.acc, cfg.graph_sizes, cfg.block_size,
                                           -(-cfg.max_model_len // cfg.block_size), cfg.num_kv_blocks,
                                           cfg.num_state_slots if cfg.model.is_hybrid else None)
                self.graphs.capture()

    def _kv_in_shared_file(self, cfg: VlserveConfig, layers: int, heads: int, head_dim: int) -> torch.Tensor:
        """[layers, 2, slots, heads, head_dim], zeroed, in a shared file (`kv_buffers`): a token's keys and values
        of every layer (this rank's heads) make one row of those buffers, so peers write prompts' KV into its
        blocks like any rows (at several ranks rank 0 maps every rank's file: engine.ranked_kv)."""
        if self.device.type != "cpu":
            raise ConfigurationError("a KV cache in a shared file is for an engine on the CPU")
        self.kv_buffers = TransferBuffers.create(cfg.num_kv_blocks + 1, cfg.block_size, layers * 2 * heads * head_dim,
                                                 cfg.dtype, parts=layers * 2, reserve=True)
        return self.kv_buffers.planes.view(layers, 2, -1, heads, head_dim)

    # ---- vision tower ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each item's embedding rows. In data mode `pixels` are this rank's share only (`share_of`)."""
        if self.encoder_mode == DATA and self.tp.size > 1:
            return self._encode_share(pixels, grids)
        return self.model.encode_images(pixels, grids, self.vision_graphs)

    @torch.inference_mode()
    def encode_audio(self, features: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
        """Each audio item's embedding rows. The audio tower is whole on every rank (it is small beside the
        LM), so rank 0 runs it alone, with no collective."""
        return self.model.encode_audio(features, lengths)

    def share_of(self, rank: int, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The patches rank `rank` encodes in data mode, its items one after another."""
        items = item_patches(self.model, pixels, grids)
        mine = balance([self.model.item_pixel_rows(g) for g in grids], self.tp.size)[rank]
        return torch.cat([items[i] for i in mine]) if mine else pixels[:0]

    def _encode_share(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        tokens = [self.model.item_tokens(g) for g in grids]
        shares = balance([self.model.item_pixel_rows(g) for g in grids], self.tp.size)
        width = self.model.cfg.embedding_width
        mine = shares[self.tp.rank]
        pixels = to_device(pixels, self.device)
        parts = item_patches(self.model, pixels, [grids[i] for i in mine])
        rows = [torch.empty(0, width, dtype=self.model.visual.patch_embed.proj.weight.dtype, device=self.device)]
        for group in groups_of([p.shape[0] for p in parts], cpu_budget(self.device)) if mine else []:
            group_pixels = torch.cat([parts[j] for j in group])
            rows += self.model.encode_images(group_pixels, [grids[mine[j]] for j in group], self.vision_graphs)
        rows = torch.cat(rows)
        longest = max(sum(tokens[i] for i in share) for share in shares)  # all_gather wants equal shapes
        padded = torch.cat([rows, rows.new_zeros(longest - rows.shape[0], width)])
        gathered = self.tp.all_gather(padded.unsqueeze(0), dim=0)  # [ranks, longest, width]
        out: list[torch.Tensor | None] = [None] * len(grids)
        for rank, share in enumerate(shares):
            start = 0
            for i in share:
                out[i] = gathered[rank, start : start + tokens[i]]
                start += tokens[i]
        return out

    # ---- language model ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits (float32, full vocabulary) of `batch.sample_rows`; None when no row samples."""
        dev = self.device
        if self.graphs is not None and self.graphs.fits(batch):
            hidden = self.graphs.run(batch)
            return self._logits(hidden, batch)
        meta = attention_metadata(batch, self.block_size, dev, self.acc.attention)
        if batch.state_copies:  # snapshots into running slots, before any layer reads them
            copy_state_slots(self.layer_states, batch.state_copies)
        token_ids = to_device(batch.token_ids, dev)
        if batch.pending_rows is not None:
            token_ids[to_device(batch.pending_rows, dev)] = batch.pending_tokens
        embeds = self.model.embed_tokens(token_ids)
        side = None
        if batch.media is not None:
            rows = to_device(batch.media_rows, dev)
            media = to_device(batch.media, dev, embeds.dtype)
            embeds[rows] = media[:, : self.hidden]
            if self.side_rows:  # the rows beside each embedding, for the decoder (Qwen3-VL's DeepStack)
                features = media[:, self.hidden :].reshape(-1, self.side_rows, self.hidden).transpose(0, 1)
                side = SideRows(rows, features)
        with lora_rows(batch.lora_rows):
            hidden = self.model(embeds, to_device(batch.positions, dev), self.kv_caches, meta, side)
        return self._logits(hidden, batch)

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        if batch.sample_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden[to_device(batch.sample_rows, self.device)]).float()

    def check_alive(self) -> None:
        """Raises when the model can no longer run (a lost rank, under tensor parallelism); never here."""

    def shutdown(self) -> None:
        if self.kv_buffers is not None:
            self.kv_buffers.unlink()  # mapped where it is in use; the name goes

    # ---- KV cache contents (handed between instances) ---------------------------------------------------------
    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, len(slots), kv_heads, head_dim]: the KV cache at these slots, every key/value head of the
        model (tensor parallelism: every rank calls it, and the ranks' heads are gathered), on the CPU."""
        index = slots.to(self.device)
        kv = torch.stack([self.kv_caches[i].index_select(1, index) for i in self.kv_layers])
        if self.tp.size > 1:
            text = self.model.cfg.text
            order = gathered_heads(text.num_kv_heads, text.head_dim, self.tp.size).to(kv.device)
            kv = self.tp.all_gather(kv.contiguous(), dim=3).index_select(3, order)
        return kv.cpu()

    @property
    def reads_kv_off_thread(self) -> bool:
        """One CPU rank: `read_kv_rows` only reads the caches, so a writer thread may call it mid-step."""
        return self.tp.size == 1 and self.device.type == "cpu"

    def read_kv_rows(self, slots: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """[len(slots), width]: `kv_to_rows(read_kv(slots))`. On one CPU rank copied straight into the rows, a
        slice per run of slots and layer: half the time of a gather then a permute (21 vs 44 ms for 2,000 tokens
        of a 2B model's bf16 KV, measured; ~16 ms of the 21 is the rows' fresh pages); there a prefill's writer
        thread calls it, chunk by chunk, off the engine's thread, with `scratch`: the rows then lie in memory
        kept for the next such call (pages touched once), valid until it; one thread only."""
        if self.tp.size > 1 or self.device.type != "cpu":
            return kv_to_rows(self.read_kv(slots))
        caches = [self.kv_caches[i] for i in self.kv_layers]
        _, _, heads, dim = caches[0].shape
        shape = (slots.numel(), len(caches), 2, heads * dim)
        if scratch:
            numel = shape[0] * shape[1] * shape[2] * shape[3]
            if self._rows_scratch is None or self._rows_scratch.numel() < numel:
                self._rows_scratch = torch.empty(numel, dtype=caches[0].dtype)
            rows = self._rows_scratch[:numel].view(shape)
        else:
            rows = torch.empty(shape, dtype=caches[0].dtype)
        for at, first, n in slot_runs(slots):
            for layer, cache in enumerate(caches):
                rows[at : at + n, layer].copy_(cache[:, first : first + n].reshape(2, n, -1).transpose(0, 1))
        return rows.view(slots.numel(), len(caches) * 2 * heads * dim)

    def read_kv_layer(self, slots: torch.Tensor, kv_layer: int) -> torch.Tensor:
        """[len(slots), 2, heads x head size]: the keys and values of the kv_layer-th layer with a KV cache at these
        slots (one CPU rank: `reads_kv_off_thread`), a slice copy per run of slots. A prefill's writer thread
        reads a layer as soon as it is computed, while the engine computes the next."""
        cache = self.kv_caches[self.kv_layers[kv_layer]]
        rows = torch.empty(slots.numel(), 2, cache.shape[2] * cache.shape[3], dtype=cache.dtype)
        for at, first, n in slot_runs(slots):
            rows[at : at + n].copy_(cache[:, first : first + n].reshape(2, n, -1).transpose(0, 1))
        return rows

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """`kv` as `read_kv` gives it: one entry per layer with a KV cache, every head (tensor parallelism: each
        rank writes its own heads)."""
        if self.tp.size > 1:
            text = self.model.cfg.text
            kv = kv.narrow(3, *kv_heads_of(text.num_kv_heads, text.head_dim, self.tp.rank, self.tp.size))
        index = slots.to(self.device)
        for i, layer in zip(self.kv_layers, kv):
            cache = self.kv_caches[i]
            cache.index_copy_(1, index, layer.to(self.device, cache.dtype))

    def read_state_rows(self, slot: int, width: int) -> torch.Tensor:
        """A hybrid model's linear states in `slot` as handoff rows (engine.state_rows), on the CPU: the whole
        model's (tensor parallelism: every rank calls it, and the ranks' heads are gathered)."""
        parts = state_parts(self.layer_states, slot)
        if self.tp.size > 1:
            parts = [self._whole_state(p, conv=i % 2 == 0) for i, p in enumerate(parts)]
        return pack_parts(parts, width, self.kv_caches[self.kv_layers[0]].dtype)

    def write_state_rows(self, slot: int, rows: torch.Tensor) -> None:
        """Rows as `read_state_rows` gives them (tensor parallelism: each rank writes its own heads' part)."""
        if self.tp.size == 1:
            return unpack_state(rows, self.layer_states, slot)
        parts, n = state_parts(self.layer_states, slot), self.tp.size
        layout = [(torch.Size([p.shape[0] * n, *p.shape[1:]]), p.dtype) for p in parts]
        for i, (p, whole) in enumerate(zip(parts, unpack_parts(rows, layout))):
            p.copy_(self._rank_state(whole, conv=i % 2 == 0).to(p.device))

    def _conv_sizes(self) -> list[int]:
        """This rank's conv channels of the linear attention: its q, k and v parts (heads x head size)."""
        la, n = self.model.cfg.text.linear_attention, self.tp.size
        keys = la.num_key_heads // n * la.key_head_dim
        return [keys, keys, la.num_value_heads // n * la.value_head_dim]

    def _whole_state(self, part: torch.Tensor, conv: bool) -> torch.Tensor:
        """One layer's conv or recurrent state of every rank, in the one-rank layout: recurrent states are the
        value heads in rank order; conv channels are q, k, v, each of them in rank order."""
        gathered = self.tp.all_gather(part.contiguous(), dim=0)
        if not conv:
            return gathered
        per_rank = [r.split(self._conv_sizes()) for r in gathered.chunk(self.tp.size)]
        return torch.cat([pieces[i] for i in range(3) for pieces in per_rank])

    def _rank_state(self, whole: torch.Tensor, conv: bool) -> torch.Tensor:
        """This rank's part of a one-rank layout state (the inverse of `_whole_state`)."""
        r, n = self.tp.rank, self.tp.size
        if not conv:
            size = whole.shape[0] // n
            return whole[r * size : (r + 1) * size]
        sizes = self._conv_sizes()
        return torch.cat([full[r * size : (r + 1) * size]
                          for full, size in zip(whole.split([x * n for x in sizes]), sizes)])


def kv_heads_of(num_kv_heads: int, head_dim: int, rank: int, ranks: int) -> tuple[int, int]:
    """(first, count) of a model's key/value heads that `rank` of `ranks` caches (a copy of one when heads are
    fewer than ranks), as the attention layers split them."""
    split = head_split(num_kv_heads, head_dim, TPGroup(rank, ranks), "key/value heads", copies=True)
    return split.start // head_dim, split.size // head_dim


def gathered_heads(num_kv_heads: int, head_dim: int, ranks: int) -> torch.Tensor:
    """For each of a model's key/value heads, its place among every rank's heads gathered in rank order (the
    first rank that caches it: copies are dropped)."""
    where: dict[int, int] = {}
    for rank in range(ranks):
        first, count = kv_heads_of(num_kv_heads, head_dim, rank, ranks)
        for h in range(count):
            where.setdefault(first + h, rank * count + h)
    return torch.tensor([where[h] for h in range(num_kv_heads)])
