"""Decode steps replayed from graphs captured per batch size, the vision tower from graphs per patch count, and the
varlen Triton attention under the whole engine. On a CPU the graph path is the CUDA one minus the capture (static
buffers, padding rows writing a scratch block / state slot, bucketing; replays run eagerly) and Triton runs in its
interpreter, so these tests prove here that padded batches give transformers' tokens (fp32, greedy), dense, MoE and
hybrid, with preemption; tests/test_cuda.py checks the captured graphs themselves on a GPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.conftest import IMG, assert_pool_full, noise_image
from tests.hf_reference import prompt_references
from tests.test_parity import _check, _prompts, _run
from vlserve import LLM, SamplingParams
from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError
from vlserve.core.options import add_options, options_from
from vlserve.engine.config import decode_graph_sizes
from vlserve.engine.decode_graphs import default_sizes, padded_size
from vlserve.engine.vision_graphs import VisionGraphs
from vlserve.model.accelerator import ATTENTION_ENV, Accelerator
from vlserve.model.families.qwen.qwen2_5_vl_vision import window_order
from vlserve.model.kernels import triton_attention
from vlserve.model.layers.moe import Experts
from vlserve.model.layers.static_shapes import static_shapes

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
TRITON_NEW = 8  # new tokens in the interpreted Triton path
needs_triton = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """arch -> (checkpoint, transformers reference, its outputs for `_prompts()`)."""
    return prompt_references(tiny_ckpt, _prompts(), MAX_NEW)  # transformers on the CPU, fp32


def shard(llm: LLM):
    return llm.engine.core.runner.executor


def run_groups(llm, expected, groups):
    for group in groups:
        _check(_run(llm, [_prompts()[i] for i in group], GREEDY), expected, group)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl_moe", "qwen3_5"])
def test_padded_decode_steps_match_transformers(references, arch):
    """5 requests decode as a batch padded to 8, 3 as one padded to 4, 1 alone: transformers' tokens each time.
    MoE layers take their static-shape paths inside graphs; Qwen3.5's padding rows use the scratch state slot."""
    path, _, expected = references(arch)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, cuda_graph_sizes=[1, 2, 4, 8])
    run_groups(llm, expected, [[0, 1, 2, 3, 4], [5, 6, 7], [8]])
    replays = shard(llm).graphs.replays
    assert replays.get(8, 0) >= MAX_NEW - 2 and replays.get(4, 0) >= MAX_NEW - 2 and replays.get(1, 0) >= 1, replays
    assert_pool_full(llm)


def test_graphs_with_preemption_and_batches_past_the_largest_size(references):
    """Nine requests in a pool too small for all: preempted ones recompute, steps of more than 4 decode rows run
    eagerly, smaller ones from graphs; the tokens stay transformers'."""
    path, _, expected = references("qwen2_vl")
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64,
              cuda_graph_sizes=[2, 4])
    _check(_run(llm, _prompts(), GREEDY), expected, range(len(_prompts())))
    assert llm.get_metrics()["num_preemptions_total"] > 0
    assert sum(shard(llm).graphs.replays.values()) > 0
    assert_pool_full(llm)


@needs_triton
def test_triton_attention_path_matches_transformers(references, monkeypatch):
    """The CUDA attention path (one varlen launch per layer for prefill and decode; Qwen2.5-VL's window and full
    plans in the vision tower) in Triton's interpreter, with decode and vision graphs. The interpreter runs every
    program of a grid in Python: small pictures (a bucket of 64 patches has 17 sequences' programs, one of 256 has
    65) and 8 new tokens, enough for a decode step to open a new KV block and a new tile of keys."""
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    path, hf, _ = references("qwen2_5_vl")
    llm = LLM(path, dtype="float32", num_kv_blocks=256, cuda_graph_sizes=[1, 2])  # the batches it decodes
    # three pictures, the first of two windows (2 x 10 patches; windows of 8 x 8), 52 patches in all; then one
    # picture alone (6 x 8 patches): both through the vision graph of 64 patches
    pictures = (f"{IMG} and {IMG} and {IMG}: what differs?",
                [noise_image(140, 28, 31), noise_image(56, 56, 32, "L"), noise_image(56, 56, 33, "RGBA")])
    prompts = [pictures, _prompts()[0], _prompts()[1]]
    want = [hf.greedy(p, imgs, TRITON_NEW) for p, imgs in prompts]
    # the picture alone's decode steps write positions first .. first + 6: past a tile of keys and a KV block
    first, tile = len(want[2][0]), triton_attention.BLOCK_KEYS
    assert first < tile <= first + TRITON_NEW - 2 and tile % llm.config.block_size == 0
    params = SamplingParams(temperature=0.0, max_tokens=TRITON_NEW, min_tokens=TRITON_NEW)
    for group in ([0, 1], [2]):
        _check(_run(llm, [prompts[i] for i in group], params), want, group)
    executor = shard(llm)
    assert executor.acc.attention == "triton"
    assert sum(executor.graphs.replays.values()) > 0 and executor.vision_graphs.replays >= 2
    assert_pool_full(llm)


@needs_triton
def test_enforce_eager_turns_both_kinds_of_graph_off(tiny_ckpt, monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "triton")  # where vision graphs would otherwise be made
    llm = LLM(str(tiny_ckpt("qwen2_5_vl")), dtype="float32", num_kv_blocks=64, cuda_graph_sizes=[4],
              enforce_eager=True)
    assert shard(llm).graphs is None and shard(llm).vision_graphs is None


@needs_triton
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_graph_buckets_equal_the_tower(tiny_ckpt, monkeypatch, arch):
    """Calls of several patch counts (Qwen2.5-VL: window and full plans) through the buckets give the tower's own
    rows, which later replays of their bucket leave alone; a bucket is captured once and reused, also filled to
    its last row; a call past the largest bucket runs op by op. Small buckets: the interpreted kernel runs every
    program of the grid in Python, and a bucket's grid grows with its size (one sequence per merge group)."""
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    llm = LLM(str(tiny_ckpt(arch)), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    tower = shard(llm).model.visual
    graphs = VisionGraphs(tower, Accelerator(torch.device("cpu")), buckets=(16, 32))
    if arch == "qwen2_5_vl":  # windows of 8 x 8 patches: the call of 20 patches has two, the one of 72 three
        assert [window_order(grids, tower.cfg)[1] for grids in ([(1, 2, 10)], [(1, 4, 18)])] == [[16, 4],
                                                                                                  [32, 32, 8]]
    patch = tower.cfg.patch_dim
    g = torch.Generator().manual_seed(0)
    results = []
    # 4, 12 and 16 patches (a video's two frames and a picture: the bucket's every row) in the bucket of 16; 20 in
    # the bucket of 32 (Qwen2.5-VL: a window of 16 patches and one of 4); 72 op by op (over one 64-row tile of
    # queries in the full-attention blocks, three windows)
    for grids in ([(1, 2, 2)], [(1, 2, 4), (1, 2, 2)], [(2, 2, 2), (1, 2, 4)], [(1, 2, 10)], [(1, 4, 18)]):
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch, generator=g)
        with torch.inference_mode():
            want, got = tower(pixels, grids), graphs(pixels, grids)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5, grids
        results.append((got, want.clone()))
    assert sorted(size for size, _ in graphs.captured) == [16, 32] and graphs.replays == 4
    # rows handed out earlier stay as they were after later replays of their bucket (the encoder cache keeps them)
    assert all(torch.equal(got, kept) or (got - kept).abs().max() < 1e-5 for got, kept in results)


def test_moe_static_paths_equal_the_grouped_one():
    """Inside a graph the MoE layer cannot read per-expert counts: the gathered path (few pairs) and the
    every-expert path (many) give the grouped path's output."""
    torch.manual_seed(0)
    experts = Experts(hidden=32, intermediate=24, num_experts=8, act="silu")
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    for tokens in (1, 3, 40):  # 2, 6 pairs: gathered; 80: every expert
        x = torch.randn(tokens, 32)
        logits = torch.randn(tokens, 8)
        weights, chosen = torch.topk(logits.softmax(-1), 2)
        want = experts(x, chosen, weights)
        with static_shapes():
            got = experts(x, chosen, weights)
        assert (got - want).abs().max() < 1e-6


def test_sizes_to_capture():
    assert default_sizes(128) == (1, 2, 4, 8, *range(16, 129, 8))
    assert default_sizes(5) == (1, 2, 4, 5) and default_sizes(1000)[-1] == 256
    assert padded_size((1, 2, 4, 8), 3) == 4 and padded_size((1, 2, 4, 8), 9) is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    args = EngineArgs(model="m", max_num_seqs=12)
    assert decode_graph_sizes(args, cpu) == () and decode_graph_sizes(args, cuda) == (1, 2, 4, 8, 12)
    assert decode_graph_sizes(EngineArgs(model="m", max_num_seqs=12, cuda_graph_sizes=(64, 3)), cpu) == (3, 12)
    assert decode_graph_sizes(EngineArgs(model="m", enforce_eager=True), cuda) == ()


def test_the_environment_switch_turns_graphs_off(monkeypatch):
    monkeypatch.setenv("VLSERVE_ENFORCE_EAGER", "1")
    assert decode_graph_sizes(EngineArgs(model="m", cuda_graph_sizes=(4,)), torch.device("cuda")) == ()


def test_graph_flags_parse_and_bad_sizes_are_refused():
    parser = argparse.ArgumentParser()
    add_options(parser, "serve")
    opts = options_from(parser.parse_args(["--model", "m", "--enforce-eager", "--cuda-graph-sizes", "1", "4"]),
                        "serve")
    assert opts.engine.enforce_eager and opts.engine.cuda_graph_sizes == (1, 4)
    for bad in ((0,), (2, -1), (True,), "4"):
        with pytest.raises(InvalidInputError, match="cuda_graph_sizes"):
            EngineArgs(model="m", cuda_graph_sizes=bad).check()


def test_packed_inputs_move_every_per_row_input_in_one_copy():
    """The graph path's per-row inputs share one staging buffer and one device buffer (each view 8-byte aligned,
    whatever its dtype): one copy moves them all, each landing in its own view (#70 item 1: 5 copies a step, 7 for
    a hybrid model, were 2 counting the block table's)."""
    from vlserve.engine.decode_graphs import PackedInputs
    from vlserve.model.accelerator import Accelerator

    fields = {"ids": ((5,), torch.long), "fresh": ((5,), torch.bool), "positions": ((3, 5), torch.long),
              "state": ((5,), torch.long)}
    packed = PackedInputs(fields, Accelerator(torch.device("cpu")))
    for name, (shape, dtype) in fields.items():
        assert packed.host[name].shape == shape and packed.host[name].dtype == dtype
        assert packed.device[name].data_ptr() % 8 == 0
    packed.host["ids"][:] = torch.arange(5)
    packed.host["fresh"][:] = torch.tensor([True, False, True, False, True])
    packed.host["positions"][:] = torch.arange(15).view(3, 5) * 7
    packed.host["state"][:] = -3
    copies = []
    original = torch.Tensor.copy_

    def counting(self, src, *args, **kwargs):
        copies.append(self.shape)
        return original(self, src, *args, **kwargs)

    torch.Tensor.copy_ = counting
    try:
        packed.upload()
    finally:
        torch.Tensor.copy_ = original
    assert len(copies) == 1
    for name in fields:
        assert torch.equal(packed.device[name], packed.host[name])
