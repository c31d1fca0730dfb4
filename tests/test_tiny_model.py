"""The random checkpoints from make_tiny_model must load and run in transformers itself."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from tests.hf_reference import HF_CLASSES
from vlserve.core.errors import InvalidInputError
from vlserve.model.families.qwen.tiny_tokens import SPECIAL_TOKENS
from vlserve.tools import tiny_model
from vlserve.tools.cli import register_cli
from vlserve.tools.tiny_model import make_tiny_model

MODEL_CLASSES = HF_CLASSES
ARCHES = tuple(MODEL_CLASSES)
ARCH_NAMES = {arch: cls.__name__ for arch, cls in MODEL_CLASSES.items()}
# (min pixels, max pixels, patch size, mean) of the image processor each family's tiny checkpoint writes
PROCESSOR = {"qwen2_vl": (3136, 200704, 14, 0.48145466), "qwen2_5_vl": (3136, 200704, 14, 0.48145466),
             "qwen3_vl": (4096, 200704, 16, 0.5), "qwen3_vl_moe": (4096, 200704, 16, 0.5)}
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, size="tiny", seed=0)


def _load(arch: str, path: Path):
    return MODEL_CLASSES[arch].from_pretrained(path).eval()


def _load_with_info(arch: str, path: Path) -> tuple[torch.nn.Module, dict]:
    model, info = MODEL_CLASSES[arch].from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def test_folder_loads_with_transformers(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    assert config.architectures == [ARCH_NAMES[arch]]
    assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert config.text_config.initializer_range == config.vision_config.initializer_range == 0.15

    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    min_px, max_px, patch, mean = PROCESSOR[arch]
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (min_px, max_px)
    assert (processor.patch_size, processor.temporal_patch_size, processor.merge_size) == (patch, 2, 2)
    assert processor.image_mean[0] == pytest.approx(mean)
    if arch.startswith("qwen3"):  # DeepStack from non-adjacent blocks, a position grid smaller than pictures
        assert config.vision_config.deepstack_visual_indexes == [0, 2]
        assert config.vision_config.num_position_embeddings == 16
        assert config.text_config.num_hidden_layers > len(config.vision_config.deepstack_visual_indexes)
    if arch == "qwen3_vl_moe":
        assert (config.text_config.num_experts, config.text_config.num_experts_per_tok) == (4, 2)

    model, info = _load_with_info(arch, path)
    assert isinstance(model, MODEL_CLASSES[arch])
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_text_forward(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = _load(arch, path)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def _image_logits(model, tokenizer, processor, image: Image.Image) -> torch.Tensor:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = processor(images=[image], return_tensors="pt")
    n_tokens = int(pixels["image_grid_thw"].prod()) // 4  # merge_size 2 x 2
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    ids = torch.tensor([tokenizer.encode(prompt)])
    mm_types = (ids == model.config.image_token_id).int()  # 1 marks image tokens for M-RoPE
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                    image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=mm_types)
    return out.logits[0, -1]


def test_image_changes_the_output(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    model = _load(arch, path)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)) for _ in range(2)]
    first, second = (_image_logits(model, tokenizer, processor, image) for image in images)
    assert torch.isfinite(first).all()
    # With initializer_range 0.15 the image must visibly move the next-token distribution.
    assert (first.softmax(-1) - second.softmax(-1)).abs().sum() > 0.1


@pytest.mark.parametrize("text", ["héllo 世界 🙂", "a . b , c 's\n\n\ttab", "  spaces  ", "x<|image_pad|>y", ""])
def test_tokenizer_round_trips(tiny: tuple[str, Path], text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny[1])
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_qwen_format(tiny: tuple[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny[1])
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "text", "text": "What is this?"},
    ]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (SYSTEM + "<|im_start|>user\nLook: <|vision_start|><|image_pad|><|vision_end|>"
                        "What is this?<|im_end|>\n<|im_start|>assistant\n")

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "video"}, {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"
                        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                        "<|im_start|>assistant\nok<|im_end|>\n")


def test_special_token_ids_match_config(tiny: tuple[str, Path]) -> None:
    path = tiny[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    # Appended after the learned vocabulary, in Qwen2-VL's order.
    assert list(ids.values()) == list(range(ids["<|endoftext|>"], ids["<|endoftext|>"] + len(SPECIAL_TOKENS)))
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    for cfg in (config, config.text_config):
        assert cfg.bos_token_id == ids["<|endoftext|>"]
        assert cfg.eos_token_id == ids["<|im_end|>"] == tokenizer.eos_token_id
        assert cfg.pad_token_id == ids["<|endoftext|>"] == tokenizer.pad_token_id
    vocab = config.text_config.vocab_size
    assert vocab % 64 == 0 and len(tokenizer) <= vocab < len(tokenizer) + 64


def test_generation_config(tiny: tuple[str, Path]) -> None:
    path = tiny[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                          tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert generation["pad_token_id"] == generation["bos_token_id"] == tokenizer.pad_token_id


def test_seed_controls_weights(tmp_path: Path) -> None:
    weights = [load_file(make_tiny_model(tmp_path / name, seed=seed) / "model.safetensors")
               for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    # The tokenizer is trained deterministically, so the token ids are stable too.
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_initializer_range_override(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, arch="qwen2_5_vl", initializer_range=0.02)
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.initializer_range == config.vision_config.initializer_range == 0.02
    std = load_file(path / "model.safetensors")["model.embed_tokens.weight"].std().item()
    assert 0.015 < std < 0.025


def test_tied_embeddings_load_without_lm_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Medium ties lm_head to the embeddings; check that layout on a tiny model.
    monkeypatch.setitem(tiny_model.SIZES, "tiny", dataclasses.replace(tiny_model.SIZES["tiny"], tie_embeddings=True))
    path = make_tiny_model(tmp_path)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, info = _load_with_info("qwen2_vl", path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("kwargs", [{"arch": "llava"}, {"size": "huge"}, {"initializer_range": -1.0}])
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        make_tiny_model(tmp_path, **kwargs)


def test_cli(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2_5_vl", "--seed", "3"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    with pytest.raises(SystemExit):
        parser.parse_args(["make-tiny-model", str(tmp_path), "--arch", "nope"])
