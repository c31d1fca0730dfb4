"""Qwen3.5 / Qwen3.5-MoE (hybrid Gated DeltaNet + gated full attention) against transformers, in fp32 on the tiny
checkpoints: whole prompts, prompts in chunks over a paged KV cache and a linear-state pool, batched decode rows,
prefix-cache snapshots of the linear state resumed in another slot; config parsing and refusals."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.conftest import noise_image
from tests.hf_reference import expand_by_hand
from vlserve.core.errors import ConfigurationError, ModelLoadError
from vlserve.model.hf_config import load_model_config
from vlserve.model.layers.attention import AttentionMetadata, build_prefill_span
from vlserve.model.layers.linear_state import (
    LinearStateBatch,
    copy_state_slots,
    new_layer_states,
    state_bytes_per_slot,
)
from vlserve.model.layers.parallel import TPGroup
from vlserve.model.loader import load_model

HF = {"qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}
ARCHES = list(HF)
TOL = dict(rtol=1e-4, atol=5e-4)  # fp32, logits up to ~5: chunkings sum in other orders
STORY = ("The quick brown fox jumps over the lazy dog, then it naps in the sun for a while and dreams of chasing "
         "rabbits across a field of tall grass near the old barn. ")
TEXT = f"<|im_start|>user\n{STORY * 2}<|im_end|>\n<|im_start|>assistant\n"  # ~180 tokens: several 64-blocks
PICTURE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n"
FORCED = [7, 300, 42]  # decode tokens fed back (teacher forcing: logits compare whatever was sampled)


@dataclass
class Prompt:
    ids: torch.Tensor  # [L] prompt + FORCED
    positions: torch.Tensor  # [3, L]
    embeds: torch.Tensor  # [L, hidden], pictures scattered in
    expected: torch.Tensor  # [L, vocab] transformers' logits over the whole sequence


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    made = {}

    def get(arch: str):
        if arch not in made:
            path = Path(tiny_ckpt(arch))
            made[arch] = path, HF[arch].from_pretrained(path, dtype=torch.float32).eval(), \
                load_model(path, dtype=torch.float32)
        return made[arch]

    return get


@torch.no_grad()
def prompt(pair, arch: str, kind: str) -> Prompt:
    path, hf, ours = pair(arch)
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT if kind == "text" else PICTURE)
    image_id, extra = hf.config.image_token_id, {}
    if kind == "picture":
        proc = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[noise_image(128, 96, seed=3)],
                                                                return_tensors="pt")
        ids = expand_by_hand(ids, image_id, (proc["image_grid_thw"].prod(-1) // 4).tolist())
        extra = {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
    ids = torch.tensor(ids + FORCED)
    types = (ids == image_id).int()[None]
    positions, _ = hf.model.get_rope_index(ids[None], types, extra.get("image_grid_thw"))
    expected = hf(input_ids=ids[None], mm_token_type_ids=types, attention_mask=torch.ones_like(ids)[None],
                  **extra).logits[0]
    embeds = ours.embed_tokens(ids)
    if kind == "picture":
        rows = ours.encode_images(extra["pixel_values"], [tuple(extra["image_grid_thw"][0].tolist())])[0]
        embeds[ids == image_id] = rows
    return Prompt(ids, positions[:, 0], embeds, expected)


@dataclass
class Work:
    """One sequence's tokens [start, end) this step."""

    kv_seq: int  # whose KV blocks (a resumed snapshot reuses the prefix's)
    slot: int  # linear state slot
    p: Prompt
    start: int
    end: int
    checkpoints: list[tuple[int, int]] = field(default_factory=list)


class Pool:
    """Paged KV for the full-attention layers (each sequence its own blocks) and the linear-state pool."""

    def __init__(self, model, seqs: int = 3, blocks_per_seq: int = 16, block: int = 16, slots: int = 8):
        t = model.cfg.text
        self.model, self.block, self.bps = model, block, blocks_per_seq
        self.states = new_layer_states(t, slots, torch.float32, "cpu")
        rows = (seqs * blocks_per_seq + 1) * block  # block 0: decode-table padding
        self.caches = [s if s is not None else torch.zeros(2, rows, t.num_kv_heads, t.head_dim)
                       for s in self.states]

    def table(self, seq: int) -> torch.Tensor:
        return torch.arange(self.bps) + 1 + seq * self.bps

    def kv_slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.table(seq)[pos // self.block] * self.block + pos % self.block

    @torch.no_grad()
    def step(self, decode: list[Work], prefill: list[Work]) -> list[torch.Tensor]:
        """Each item's logits [tokens, vocab]; decode items are one token each."""
        work = decode + prefill
        meta = AttentionMetadata(slot_mapping=torch.cat([self.kv_slots(w.kv_seq, w.start, w.end) for w in work]),
                                 num_decode_tokens=len(decode), block_size=self.block)
        if decode:
            ctx = torch.tensor([w.end for w in decode])
            meta.decode_blocks = torch.stack([self.table(w.kv_seq) for w in decode]).reshape(-1)
            meta.decode_mask = (torch.arange(self.bps * self.block)[None] < ctx[:, None])[:, None, None, :]
            meta.decode_context_lens = ctx
        row = len(decode)
        for w in prefill:
            n = w.end - w.start
            meta.prefills.append(build_prefill_span(row, n, w.end, self.kv_slots(w.kv_seq, 0, w.end)
                                                    if w.start else None))
            row += n
        meta.linear = LinearStateBatch(torch.tensor([w.slot for w in work]), torch.tensor([w.start == 0 for w in work]),
                                       [w.checkpoints for w in prefill])
        embeds = torch.cat([w.p.embeds[w.start : w.end] for w in work])
        positions = torch.cat([w.p.positions[:, w.start : w.end] for w in work], dim=1)
        logits = self.model.compute_logits(self.model(embeds, positions, self.caches, meta))
        return list(logits.split([w.end - w.start for w in work]))


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kind", ["text", "picture"])
def test_whole_prompt_logits_equal_transformers(pair, arch, kind):
    p = prompt(pair, arch, kind)
    pool = Pool(pair(arch)[2])
    pool.states[0].recurrent.fill_(1.0)  # a fresh sequence must not read what its slot held before
    (logits,) = pool.step([], [Work(0, 0, p, 0, len(p.ids))])
    torch.testing.assert_close(logits, p.expected, **TOL)


@pytest.mark.parametrize("arch", ARCHES)
def test_chunks_and_batched_decode_equal_transformers(pair, arch):
    """A text and a picture prompt in three chunks each, sharing steps; one decodes while the other still
    prefills; then both decode together (single-token rows, batched)."""
    a, b = prompt(pair, arch, "text"), prompt(pair, arch, "picture")
    la, lb = len(a.ids) - len(FORCED), len(b.ids) - len(FORCED)
    pool = Pool(pair(arch)[2])
    ca, cb = [0, 30, 100, la], [0, 10, 25, lb]  # cuts: a chunk crosses the delta rule's 64-token blocks
    for i in range(3):
        out = pool.step([], [Work(0, 1, a, ca[i], ca[i + 1]), Work(1, 4, b, cb[i], cb[i + 1])])
        torch.testing.assert_close(out[0][-1], a.expected[ca[i + 1] - 1], **TOL)
        torch.testing.assert_close(out[1][-1], b.expected[cb[i + 1] - 1], **TOL)
    for t in range(len(FORCED)):
        out = pool.step([Work(0, 1, a, la + t, la + t + 1), Work(1, 4, b, lb + t, lb + t + 1)], [])
        torch.testing.assert_close(out[0][0], a.expected[la + t], **TOL)
        torch.testing.assert_close(out[1][0], b.expected[lb + t], **TOL)


@pytest.mark.parametrize("arch", ARCHES)
def test_decode_rows_beside_prefill_chunks(pair, arch):
    a, b = prompt(pair, arch, "text"), prompt(pair, arch, "picture")
    la, lb = len(a.ids) - len(FORCED), len(b.ids) - len(FORCED)
    pool = Pool(pair(arch)[2])
    pool.step([], [Work(0, 2, a, 0, la)])
    out = pool.step([Work(0, 2, a, la, la + 1)], [Work(1, 3, b, 0, 20)])
    torch.testing.assert_close(out[0][0], a.expected[la], **TOL)
    out = pool.step([Work(0, 2, a, la + 1, la + 2)], [Work(1, 3, b, 20, lb)])
    torch.testing.assert_close(out[0][0], a.expected[la + 1], **TOL)
    torch.testing.assert_close(out[1], b.expected[20:lb], **TOL)


def test_one_token_prompt_as_a_fresh_decode_row(pair):
    """A 1-token chunk at token 0 is a decode row with `fresh`: its slot's old state must not leak in."""
    p = prompt(pair, "qwen3_5", "text")
    pool = Pool(pair("qwen3_5")[2])
    for st in pool.states:
        if st is not None:
            st.conv.fill_(3.0)
            st.recurrent.fill_(3.0)
    out = pool.step([Work(0, 5, p, 0, 1)], [])
    torch.testing.assert_close(out[0][0], p.expected[0], **TOL)
    out = pool.step([Work(0, 5, p, 1, 2)], [])
    torch.testing.assert_close(out[0][0], p.expected[1], **TOL)


@pytest.mark.parametrize("arch", ARCHES)
def test_snapshot_copied_into_another_slot_resumes_identically(pair, arch):
    """Checkpoints written during a prefill chunk (mid-block, at a block end, at the chunk's end), copied into a
    running slot, continue as if the prompt had run straight through."""
    p = prompt(pair, arch, "text")
    n = len(p.ids) - len(FORCED)
    pool = Pool(pair(arch)[2])
    (first,) = pool.step([], [Work(0, 0, p, 0, 70, checkpoints=[(16, 6), (64, 7), (70, 5)])])
    torch.testing.assert_close(first, p.expected[:70], **TOL)
    for snap, cut in ((6, 16), (7, 64), (5, 70)):
        copy_state_slots(pool.states, [(snap, 1)])
        (resumed,) = pool.step([], [Work(0, 1, p, cut, n)])  # the KV prefix is seq 0's own
        torch.testing.assert_close(resumed, p.expected[cut:n], **TOL)
        out = pool.step([Work(0, 1, p, n, n + 1)], [])
        torch.testing.assert_close(out[0][0], p.expected[n], **TOL)
    # the snapshot at the chunk's end is the running state itself: the same computation, the same bits
    (straight,) = pool.step([], [Work(0, 0, p, 70, n)])
    assert torch.equal(straight, resumed)


def test_config_and_state_sizes(pair):
    path, hf, ours = pair("qwen3_5_moe")
    cfg = ours.cfg
    t = cfg.text
    assert cfg.is_hybrid and cfg.side_rows == 0 and cfg.video_rules == "qwen3"
    assert t.layer_types == ("linear_attention", "full_attention") * 2
    assert [t.is_linear_layer(i) for i in range(4)] == [True, False, True, False]
    assert (t.rotary_dim, t.rotary_interleaved, t.attn_output_gate) == (8, True, True)
    la = t.linear_attention
    assert (la.conv_kernel, la.num_key_heads, la.num_value_heads, la.conv_dim) == (4, 2, 4, 128)
    assert t.moe.shared_expert_intermediate_size == t.moe.intermediate_size and t.is_sparse_layer(0)
    states = new_layer_states(t, 3, torch.bfloat16, "cpu")
    assert [s is None for s in states] == [False, True, False, True]
    assert states[0].conv.shape == (3, 128, 3) and states[0].conv.dtype == torch.bfloat16
    assert states[0].recurrent.shape == (3, 4, 16, 16) and states[0].recurrent.dtype == torch.float32
    assert state_bytes_per_slot(t, torch.bfloat16) == 2 * (128 * 3 * 2 + 4 * 16 * 16 * 4)
    assert not load_model_config(Path(pair("qwen3_5")[0])).text.moe


def test_state_copies_in_order():
    t = _cfg()
    states = new_layer_states(t, 4, torch.float32, "cpu")
    states[0].conv[0] = 1.0
    states[0].recurrent[1] = 2.0
    copy_state_slots(states, [(0, 1), (1, 2)])  # chained: slot 2 gets slot 0's state through slot 1
    assert states[0].conv[2].eq(1).all() and states[0].recurrent[2].eq(0).all()
    copy_state_slots(states, [(2, 3), (0, 1)])
    assert states[0].conv[3].eq(1).all()
    plain = dataclasses.replace(t, layer_types=(), linear_attention=None)
    assert new_layer_states(plain, 2, torch.float32, "cpu") == [None] * t.num_layers
    assert state_bytes_per_slot(plain, torch.float32) == 0


def _cfg():
    from vlserve.model.config_types import LinearAttentionConfig, TextConfig
    return TextConfig(100, 64, 128, 2, 4, 2, 16, 1e-6, 1e4, (2, 1, 1), 100, False,
                      layer_types=("linear_attention", "full_attention"),
                      linear_attention=LinearAttentionConfig(4, 2, 4, 16, 16))


def _edited(src: Path, dst: Path, change) -> Path:
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    change(raw["text_config"])
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    (lambda t: t.update(layer_types=["linear_attention"]), "layer_types"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t["rope_parameters"].update(rope_type="yarn", factor=4.0), "RoPE scaling"),
    (lambda t: t["rope_parameters"].update(mrope_section=[11, 11, 10]), "mrope_section"),
    (lambda t: t.update(attn_output_gate=False), "output gate"),
    (lambda t: t.update(linear_num_value_heads=3), "multiple"),
    (lambda t: t.update(linear_conv_kernel_dim=1), "at least 2"),
])
def test_unsupported_settings_are_refused(pair, tmp_path, change, words):
    src = pair("qwen3_5")[0]
    with pytest.raises(ConfigurationError, match=words):
        load_model_config(_edited(src, tmp_path / "edited", change))


def test_default_layer_pattern_from_the_interval(pair, tmp_path):
    def interval(t):
        del t["layer_types"]
        t["full_attention_interval"] = 4
    t = load_model_config(_edited(pair("qwen3_5")[0], tmp_path / "edited", interval)).text
    assert t.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_tensor_parallel_splits_the_linear_attention_by_heads(pair):
    """Rank 1 of 2 holds the second half of the key heads and of the value heads: their rows of in_proj_qkv and
    of the conv (q, k, v each split on its own), of in_proj_z/b/a, dt_bias and A_log; out_proj's columns.
    (Token parity at two ranks: tests/test_tensor_parallel.py.)"""
    path = pair("qwen3_5")[0]
    whole = load_model(path, dtype=torch.float32).language_model
    half = load_model(path, dtype=torch.float32, tp=TPGroup(rank=1, size=2)).language_model
    i = next(i for i, layer in enumerate(whole.layers) if layer.is_linear)
    w, h = whole.layers[i].linear_attn, half.layers[i].linear_attn

    def second_halves(t: torch.Tensor, sizes: list[int], dim: int = 0) -> torch.Tensor:
        return torch.cat([p.chunk(2, dim)[1] for p in t.split(sizes, dim)], dim)

    qkv = [w.key_size, w.key_size, w.value_size]
    assert torch.equal(h.in_proj_qkv.weight, second_halves(w.in_proj_qkv.weight, qkv))
    assert torch.equal(h.conv1d.weight, second_halves(w.conv1d.weight, qkv))
    for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        assert torch.equal(getattr(h, name).weight, getattr(w, name).weight.chunk(2)[1]), name
    assert torch.equal(h.dt_bias, w.dt_bias.chunk(2)[1]) and torch.equal(h.A_log, w.A_log.chunk(2)[1])
    assert torch.equal(h.out_proj.weight, w.out_proj.weight.chunk(2, 1)[1])
    assert (h.num_key_heads, h.num_value_heads) == (w.num_key_heads // 2, w.num_value_heads // 2)


def test_missing_expert_is_reported(pair, tmp_path):
    from safetensors.torch import load_file, save_file
    src = pair("qwen3_5_moe")[0]
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.language_model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.gate_up_proj:e3.up"):
        load_model(dst, dtype=torch.float32)
