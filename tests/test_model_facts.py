"""Model facts are resolved once, by the front end, and shipped: they cross processes unchanged, and the engine
process uses what it is sent, so what the front end checks prompts against is what the engine runs."""

from __future__ import annotations

import asyncio
import json
import shutil

import msgspec
import pytest

from vlserve.core.config import EngineArgs
from vlserve.core.errors import ConfigurationError
from vlserve.engine.config import resolve_config
from vlserve.engine.core_client import EngineCoreClient
from vlserve.model.facts import decode_facts, encode_facts, resolve_model_facts
from vlserve.model.hf_config import load_model_config


def _set_context(folder, tokens: int) -> None:
    """config.json edited in place: the language model's max_position_embeddings."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    (raw.get("text_config") or raw)["max_position_embeddings"] = tokens
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl_moe"])
def test_facts_cross_processes_unchanged(tiny_ckpt, arch):
    facts = resolve_model_facts(EngineArgs(model=str(tiny_ckpt(arch)), dtype="float32", max_model_len=300))
    assert (facts.dtype, facts.device, facts.max_model_len) == ("float32", "cpu", 300)
    assert facts.model == load_model_config(tiny_ckpt(arch))
    assert decode_facts(encode_facts(facts)) == facts


def test_quantization_settings_survive_the_trip(tiny_ckpt, tmp_path):
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_ckpt("qwen2_vl"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "modules_to_not_convert": ["visual"], "exllama_config": {"version": 2},
                                  "damp": 0.01, "nested": [[1, 2]]}
    (folder / "config.json").write_text(json.dumps(raw))
    model = load_model_config(folder)
    assert dict(model.quantization) == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                        "modules_to_not_convert": ("visual",), "damp": 0.01}
    assert msgspec.json.decode(msgspec.json.encode(model), type=type(model)) == model


def test_facts_from_another_version_are_a_configuration_error():
    with pytest.raises(ConfigurationError, match="same vlserve version"):
        decode_facts(b'{"model_path": 3}')


def test_the_engine_uses_the_facts_it_is_sent_not_the_files(tiny_ckpt, tmp_path):
    """config.json changes between the front end's start and the engine's: the engine process still runs the
    context length the front end checks prompts against (and so does an engine config built here)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_ckpt("qwen2_vl"), folder)
    args = EngineArgs(model=str(folder), dtype="float32", num_kv_blocks=32)
    facts = resolve_model_facts(args)
    _set_context(folder, 256)
    assert resolve_model_facts(args).max_model_len == 256 != facts.max_model_len  # what resolving again would give
    cfg = resolve_config(args, facts)
    assert cfg.facts is facts and cfg.max_model_len == facts.max_model_len and cfg.model == facts.model

    async def start() -> int:
        client = EngineCoreClient(args, facts)
        try:
            return (await client.start()).max_model_len
        finally:
            await client.shutdown()

    assert asyncio.run(start()) == facts.max_model_len
