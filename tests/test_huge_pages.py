"""Weights and KV caches in huge-page arenas (vlserve/model/huge_pages.py): every tensor keeps its values, identity,
strides and sharing; a model moved computes exactly what it did; nothing moves where huge pages are off."""

from __future__ import annotations

import torch
import torch.nn as nn

from vlserve.model import huge_pages


class Tied(nn.Module):
    """Tied weights, a packed weight with views of it, a buffer, a plain tensor attribute and a non-contiguous
    view: the shapes of sharing a loaded model has."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 256)
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight  # tied
        packed = torch.randn(3 * 256, 256)
        self.qkv = nn.Parameter(packed)
        self.q_view = packed[:256]  # a view made at load (attribute)
        self.register_buffer("scale", torch.rand(4096))
        self.t_view = self.embed.weight.t()  # non-contiguous view of the tied weight

    def forward(self, ids):
        h = self.embed(ids) @ self.qkv[:256].T
        return self.head(h) * self.scale


def _force_available(monkeypatch, on: bool = True):
    monkeypatch.setattr(huge_pages, "available", lambda: on)


def test_moving_keeps_values_identity_and_sharing(monkeypatch):
    _force_available(monkeypatch)
    torch.manual_seed(0)
    model = Tied().eval().requires_grad_(False)
    ids = torch.tensor([1, 7, 4095])
    before = model(ids)
    objects = [model.embed.weight, model.qkv, model.q_view, model.scale, model.t_view]
    values = [t.clone() for t in objects]
    moved = huge_pages.move_model(model)
    # every storage once: the tied embedding (4 MiB), the packed weight with its view, the buffer
    assert moved >= (4096 * 256 + 3 * 256 * 256 + 4096) * 4
    assert [model.embed.weight, model.qkv, model.q_view, model.scale, model.t_view] == objects  # same objects
    for t, v in zip(objects, values):
        assert torch.equal(t, v)
    assert model.head.weight is model.embed.weight
    assert model.t_view.stride() == (1, 256) and model.t_view.data_ptr() == model.embed.weight.data_ptr()
    assert model.q_view.data_ptr() == model.qkv.data_ptr()  # still a view: one storage
    assert len({t.untyped_storage().data_ptr() for t in objects}) == 1  # one arena
    arena_start = model.embed.weight.untyped_storage().data_ptr()
    assert all((t.data_ptr() - arena_start) % huge_pages.ALIGN == 0 for t in (model.embed.weight, model.qkv,
                                                                              model.scale))
    assert torch.equal(model(ids), before)
    model.qkv[0, 0] = 123.0
    assert model.q_view[0, 0] == 123.0  # a write through one is seen through the other


def test_the_arena_starts_on_a_huge_page_and_outlives_its_mapping_object():
    a = huge_pages.arena(3 * huge_pages.HUGE_PAGE + 5)
    assert a.numel() == 3 * huge_pages.HUGE_PAGE + 5 and a.data_ptr() % huge_pages.HUGE_PAGE == 0
    a.fill_(7)
    view = a[-5:]
    del a
    assert view.tolist() == [7] * 5  # the mapping lives as long as a view of it


def test_zeros_are_zero_aligned_and_apart():
    shapes = [(2, 33, 2, 16), (2, 33, 2, 16), (3,)]
    out = huge_pages.zeros(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in out] == shapes and all(t.dtype == torch.bfloat16 for t in out)
    assert all(t.abs().sum() == 0 and t.data_ptr() % huge_pages.ALIGN == 0 for t in out)
    out[0].fill_(1)
    assert out[1].abs().sum() == 0 and out[2].abs().sum() == 0  # no overlap


def test_nothing_moves_where_huge_pages_are_off(monkeypatch):
    model = Tied()
    ptr = model.embed.weight.data_ptr()
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.available()
    assert huge_pages.move_model(model) == 0 and model.embed.weight.data_ptr() == ptr
    monkeypatch.delenv(huge_pages.ENV)
    monkeypatch.setattr(huge_pages, "THP_MODE", huge_pages.THP_MODE.with_name("no-such-file"))
    assert not huge_pages.available()


def test_a_model_too_small_for_one_huge_page_stays(monkeypatch):
    _force_available(monkeypatch)
    model = nn.Linear(8, 8)
    ptr = model.weight.data_ptr()
    assert huge_pages.move_model(model) == 0 and model.weight.data_ptr() == ptr


def test_tensors_of_another_layout_stay_where_they_are(monkeypatch):
    _force_available(monkeypatch)
    model = Tied()
    model.packed = torch.randn(64, 64).to_mkldnn()  # oneDNN-packed (the vision tower's PackedLinear): its own memory
    assert huge_pages.move_model(model) > 0
    assert model.packed.is_mkldnn and model.packed.to_dense().shape == (64, 64)


def test_an_engine_moves_its_weights_after_packing_them_and_answers_the_same(tiny_ckpt, monkeypatch):
    """The engine moves what is left once oneDNN has packed its linears (moved before, the weights packing
    replaces would stay in the arena, a second copy of the model), and answers token for token as in small pages."""
    from vlserve import LLM, SamplingParams

    path = str(tiny_ckpt("qwen2_vl"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    monkeypatch.setenv(huge_pages.ENV, "0")
    expected = LLM(path, dtype="float32").generate(["a b c"], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.delenv(huge_pages.ENV)
    _force_available(monkeypatch)
    monkeypatch.setattr(huge_pages, "HUGE_PAGE", 4096)  # a tiny model fills no 2 MiB page
    llm = LLM(path, dtype="float32")
    shard = llm.engine.core.runner.executor
    tensors = huge_pages._module_tensors(shard.model)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert len(storages) == 1  # every plain tensor in the arena
    # The bytes the model's tensors still cover make up the arena (packed away: uncovered, a second copy)
    covered, end = 0, 0
    for lo, hi in sorted((t.storage_offset() * t.element_size(),
                          (t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
                          * t.element_size()) for t in tensors if t.numel()):
        covered += max(0, hi - max(lo, end))
        end = max(end, hi)
    assert shard.huge_page_bytes > 0 and covered >= 0.95 * shard.huge_page_bytes, (covered, shard.huge_page_bytes)
    assert llm.generate(["a b c"], params, use_tqdm=False)[0].outputs[0].token_ids == expected
