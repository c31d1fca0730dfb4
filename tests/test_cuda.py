"""On a CUDA GPU (skipped elsewhere; `-m cuda` picks them, benchmarks/gpu_check.sh runs them): the engine picks the
varlen Triton attention, captures decode and vision graphs with pinned staging, and every family's greedy tokens
are transformers' with graphs on and off. The CPU-side logic of all this is tested in tests/test_graphs.py and
tests/test_triton_attention.py; the parity suites themselves also run here, once per setting (gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_pool_full
from tests.hf_reference import prompt_references
from tests.test_parity import _check, _prompts, _run
from vlserve import LLM, SamplingParams
from vlserve.model.accelerator import CudaGraph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
QWEN_ARCHES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """arch -> (checkpoint, transformers reference, its outputs for `_prompts()`)."""
    return prompt_references(tiny_ckpt, _prompts(), MAX_NEW)  # transformers on the CPU, fp32


def shard(llm: LLM):
    return llm.engine.core.runner.executor


def test_the_engine_takes_the_cuda_path(references):
    path, _, expected = references("qwen2_5_vl")
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    executor = shard(llm)
    assert executor.device.type == "cuda" and executor.acc.attention == "triton"
    graphs = executor.graphs
    assert graphs.sizes == (1, 2, 4, 8, 16) and all(isinstance(g, CudaGraph) for g in graphs.graphs.values())
    assert graphs.inputs.host_bytes.is_pinned() and graphs.token_ids.is_cuda and graphs.inputs.device_bytes.is_cuda
    assert not torch.backends.cudnn.allow_tf32  # float32 convolutions (audio stems) stay IEEE, as on the CPU
    _check(_run(llm, _prompts()[:5], GREEDY), expected, range(5))
    assert graphs.replays.get(8, 0) >= MAX_NEW - 2
    vision = executor.vision_graphs
    assert vision.replays > 0 and all(isinstance(b.graph, CudaGraph) for b in vision.captured.values())
    assert_pool_full(llm)


@pytest.mark.parametrize("arch", QWEN_ARCHES)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_transformers_tokens_with_graphs_on_and_off(references, arch, eager):
    """All prompts at once, then in groups whose decode steps pad (5 -> 8, 3 -> 4)."""
    path, _, expected = references(arch)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, enforce_eager=eager)
    _check(_run(llm, _prompts(), GREEDY), expected, range(len(_prompts())))
    for group in ([0, 1, 2, 3, 4], [5, 6, 7]):
        _check(_run(llm, [_prompts()[i] for i in group], GREEDY), expected, group)
    if not eager:
        assert sum(shard(llm).graphs.replays.values()) > 0
    assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["llava_onevision", "llava_next_video"])
def test_llava_graphs_give_the_eager_tokens(tiny_ckpt, arch):
    """LLaVA's tower is not captured (fixed-size tiles); its LM's decode is. tests/test_llava_parity.py, run on
    the GPU by gpu_check.sh, compares both settings with transformers."""
    from tests.test_llava_parity import PROMPTS, TURN

    path = str(tiny_ckpt(arch))
    prompts = []
    for body, images, videos in PROMPTS.values():
        text = "def fibonacci(n):" if body is None else TURN[arch].format(body)
        media = {**({"image": images} if images else {}), **({"video": videos} if videos else {})}
        prompts.append({"prompt": text, "multi_modal_data": media} if media else text)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        llm = LLM(path, dtype="float32", num_kv_blocks=256, enforce_eager=eager)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_bf16_generates_with_graphs(tiny_ckpt):
    """bf16 (what GPUs serve in): graphs and eager agree on the first tokens of a short greedy run."""
    path = tiny_ckpt("qwen2_vl")
    prompts = ["Hello, how are you?", "def fibonacci(n):", "Explain lists."]
    outs = []
    for eager in (False, True):
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128, enforce_eager=eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert all(len(t) == MAX_NEW for t in outs[0])
    assert [t[:3] for t in outs[0]] == [t[:3] for t in outs[1]]
