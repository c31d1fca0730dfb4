"""LoRA adapters in the engine: what is refused at load (nothing half-loaded), the row groups and the delta math,
adapter slots (more adapters than slots), host memory, the prefix cache's key. Parity with transformers on every
family is tests/test_lora_parity.py; the HTTP side tests/test_lora_server.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_pool_full, noise_image
from tests.lora_utils import make_adapters
from vlserve import LLM, LoRARequest, SamplingParams
from vlserve.core.block_hash import prompt_block_hashes
from vlserve.core.errors import InvalidInputError
from vlserve.lora.layers import LoRALinear
from vlserve.model.layers.lora_rows import lora_rows, row_groups

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PICTURE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
           "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    return make_adapters(ckpt, tmp_path_factory.mktemp("adapters"),
                         {"lm": ("lm", 1), "tower": ("tower", 2), "both": ("both", 3), "lm4": ("lm", 4)})


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16,
               num_kv_blocks=128)


def picture(seed: int = 3) -> dict:
    return {"prompt": PICTURE, "multi_modal_data": {"image": [noise_image(56, 56, seed)]}}


def tokens(llm, prompt, lora=None) -> list[int]:
    return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids


# ---- rows and math ------------------------------------------------------------------------------------------
def test_row_groups_merge_adjacent_runs_and_give_all_rows_to_an_adapter_that_has_them():
    assert row_groups([0, 0], [3, 2]) == ((0, None),)
    assert row_groups([None, 1, 1, None], [1, 2, 3, 1]) == ((1, (slice(1, 6),)),)
    assert row_groups([2, None, 2, 3], [1, 1, 2, 4]) == ((2, (slice(0, 1), slice(2, 4))), (3, (slice(4, 8),)))
    assert row_groups([None, None], [4, 4]) == ()


def test_rows_between_renumbers_the_groups_of_a_slice_of_the_pass():
    from vlserve.model.layers.lora_rows import active_rows, rows_between

    with lora_rows(((1, (slice(0, 3), slice(5, 9))), (2, None))):
        with rows_between(2, 6):
            assert active_rows() == ((1, (slice(0, 1), slice(3, 4))), (2, None))
        with rows_between(3, 5):
            assert active_rows() == ((2, None),)
        with rows_between(5, 9):
            assert active_rows() == ((1, None), (2, None))


def test_lora_linear_adds_each_groups_delta_to_its_rows_only():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    layer = LoRALinear(base, slots=2)
    a0, b0, a1, b1 = torch.randn(2, 6), torch.randn(5, 2), torch.randn(3, 6), torch.randn(5, 3)
    layer.adapters = [(a0, b0), (a1, b1)]
    x = torch.randn(7, 6)
    with lora_rows(((0, (slice(0, 2),)), (1, (slice(4, 5), slice(6, 7))))):
        y = layer(x)
    want = base(x)
    want[0:2] += x[0:2] @ (b0 @ a0).t()
    want[[4, 6]] += x[[4, 6]] @ (b1 @ a1).t()
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(layer(x), base(x))  # outside a pass with adapters: the base linear


# ---- refusals: each names what is wrong, and the engine serves on ----------------------------------------------
def _edited(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text()) | config
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return dst


def _lm_head_too(t: dict) -> dict:
    some = next(k for k in t if k.endswith("lora_A.weight"))
    return t | {"base_model.model.lm_head.lora_A.weight": t[some].clone(),
                "base_model.model.lm_head.lora_B.weight": torch.zeros(10, t[some].shape[0])}


def _rank_32(t: dict) -> dict:
    return {k: (v.repeat(4, 1) if k.endswith("lora_A.weight") else v.repeat(1, 4)) for k, v in t.items()}


def _one_half(t: dict) -> dict:
    drop = next(k for k in t if k.endswith("lora_B.weight"))
    return {k: v for k, v in t.items() if k != drop}


def _wrong_shape(t: dict) -> dict:
    key = next(k for k in t if k.endswith("lora_B.weight"))
    return t | {key: t[key][:-1]}


def _embedding(t: dict) -> dict:
    return t | {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 10)}


def _two_adapters(t: dict) -> dict:
    """PEFT's in-memory names of two adapters in one file: A of one must never pair with B of the other."""
    return {k.replace(".weight", ".first.weight" if i % 2 else ".second.weight"): v
            for i, (k, v) in enumerate(sorted(t.items()))}


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    (_lm_head_too, "lm_head"),
    (_rank_32, "over max_lora_rank 16"),
    (_one_half, "not its pair"),
    (_wrong_shape, "do not fit"),
    (_embedding, "not a LoRA A/B weight"),
    (_two_adapters, "several adapters"),
    ({"alpha_pattern": {"q_proj": "x"}}, "must be a number"),
    ({"alpha_pattern": {f"m{i}": 1 for i in range(1025)}}, "at most 1024"),
], ids=["dora", "bias", "modules_to_save", "fan_in_fan_out", "lm_head", "rank", "half", "shape", "embedding",
        "two-adapters", "alpha-pattern-value", "alpha-pattern-size"])
def test_an_adapter_that_cannot_be_served_exactly_is_refused_naming_why(llm, adapters, tmp_path, change, words):
    edited = _edited(adapters["lm"], tmp_path / "bad", **({"config": change} if isinstance(change, dict)
                                                          else {"tensors": change}))
    with pytest.raises(InvalidInputError, match=words):
        tokens(llm, "hello", LoRARequest("bad", 9, str(edited)))
    assert "bad" not in llm.engine.loras.adapters
    assert tokens(llm, "hello") == tokens(llm, "hello")  # the engine serves on
    assert_pool_full(llm)


def test_missing_folder_bad_json_and_no_engine_support_are_refused(llm, ckpt, adapters, tmp_path):
    with pytest.raises(InvalidInputError, match="adapter_config.json and adapter_model.safetensors"):
        tokens(llm, "hi", LoRARequest("x", 1, str(tmp_path)))
    broken = _edited(adapters["lm"], tmp_path / "json")
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        tokens(llm, "hi", LoRARequest("x", 1, str(broken)))
    plain = LLM(str(ckpt), dtype="float32", num_kv_blocks=32)
    with pytest.raises(InvalidInputError, match="enable_lora"):
        tokens(plain, "hi", LoRARequest("lm", 1, str(adapters["lm"])))


def test_an_adapter_file_changed_after_it_was_checked_refuses_the_request_not_the_engine(ckpt, adapters, tmp_path):
    llm = LLM(str(ckpt), dtype="float32", enable_lora=True, num_kv_blocks=64)
    folder = _edited(adapters["lm"], tmp_path / "moving")
    req = LoRARequest("moving", 1, str(folder))
    want = tokens(llm, "hello", req)
    llm.engine.core.lora.host.clear()  # as if evicted: the engine reads the file again
    save_file({k: v * 2 for k, v in load_file(folder / "adapter_model.safetensors").items()},
              folder / "adapter_model.safetensors")
    with pytest.raises(InvalidInputError, match="changed since it was loaded"):
        tokens(llm, "hello", req)
    assert_pool_full(llm)
    llm.engine.loras.unload("moving")
    assert tokens(llm, "hello", req) != want  # loaded again: its new weights


def test_the_same_weights_with_another_alpha_are_another_adapter(llm, adapters, tmp_path):
    """An adapter is its config and its weights: reloading a name with only lora_alpha changed must not meet the
    old one's host copy, slot, prefix-cache blocks or tower outputs."""
    doubled = _edited(adapters["both"], tmp_path / "alpha", config={"lora_alpha": 64})
    first = LoRARequest("same-name", 1, str(adapters["both"]))
    again = LoRARequest("same-name", 2, str(doubled))
    keys = [llm.engine.loras.for_request(r).key for r in (first, again)]
    assert keys[0] != keys[1] and all(k.startswith("same-name@") for k in keys)
    assert tokens(llm, picture(12), first) != tokens(llm, picture(12), again)
    assert_pool_full(llm)


# ---- slots, host memory, caches ---------------------------------------------------------------------------------
def test_more_adapters_than_slots_in_one_call_each_equals_its_run_alone(llm, adapters):
    """max_loras=1: requests of other adapters wait for the slot; max_cpu_loras=2 of 3 adapters stay in host
    memory (the others are read again when needed)."""
    reqs = [LoRARequest("lm", 1, str(adapters["lm"])), None, LoRARequest("both", 3, str(adapters["both"])),
            LoRARequest("lm4", 4, str(adapters["lm4"])), LoRARequest("lm", 1, str(adapters["lm"]))]
    prompts = ["tell me a story", picture(), picture(4), "tell me a story", picture(5)]
    alone = [tokens(llm, p, r) for p, r in zip(prompts, reqs)]
    loads = llm.engine.core.lora.loads
    together = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert alone[0] != tokens(llm, "tell me a story") and alone[0] != alone[3]
    assert llm.engine.core.lora.loads > loads  # one slot, three adapters: they took turns
    # host memory keeps the adapters of requests in the engine (3 here); the next adapter read trims it to 2
    tokens(llm, "hi", LoRARequest("tower", 2, str(adapters["tower"])))
    assert len(llm.engine.core.lora.host) <= 2
    assert_pool_full(llm)


def test_the_prefix_cache_and_the_router_key_blocks_by_adapter(llm, adapters):
    prompt = "a prompt long enough to fill several blocks of sixteen tokens " * 3
    base = llm.engine.input_processor.process(prompt)
    ref = llm.engine.loras.for_request(LoRARequest("lm", 1, str(adapters["lm"])))
    other = llm.engine.loras.for_request(LoRARequest("lm4", 4, str(adapters["lm4"])))
    from vlserve.lora.catalog import with_adapter

    chains = [prompt_block_hashes(with_adapter(base, r), 16) for r in (None, ref, other)]
    assert len(chains[0]) >= 2 and len({c[0] for c in chains}) == 3  # no block of one is another's
    assert prompt_block_hashes(with_adapter(base, ref), 16) == chains[1]  # and the same adapter, the same chain
    # a prompt already run with it (an encoder service's) is not keyed again: a router's hashes stay the server's
    tower = llm.engine.loras.for_request(LoRARequest("tower", 2, str(adapters["tower"])))
    pictured = with_adapter(llm.engine.input_processor.process(picture(13)), tower)
    assert with_adapter(pictured, tower) is pictured


def test_a_tower_adapter_gives_pictures_their_own_encoder_cache_entries(llm, adapters):
    metrics = llm.get_metrics
    tower = LoRARequest("tower", 2, str(adapters["tower"]))
    tokens(llm, picture(8), tower)
    before = dict(metrics())
    base = tokens(llm, picture(8))  # the same picture, no adapter: not the tower adapter's rows
    after = dict(metrics())
    assert after["encoder_cache_hits_total"] == before["encoder_cache_hits_total"]
    assert base != tokens(llm, picture(8), tower)
    assert_pool_full(llm)


def test_a_step_of_more_rows_than_one_mlp_slice_keeps_each_rows_adapter(llm, adapters):
    """On a CPU the MLP runs a long step's rows 512 at a time (mlp.in_row_slices): each slice must take the
    adapter rows that fall in it. Three ~250-token prompts of three adapters in one step."""
    text = " ".join(f"word{i}" for i in range(120))
    reqs = [LoRARequest("lm", 1, str(adapters["lm"])), None, LoRARequest("lm4", 4, str(adapters["lm4"]))]
    big = LLM(str(llm.engine.cfg.model_path), dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=128,
              enable_prefix_caching=False)
    prompts = [f"{k} {text}" for k in ("a", "b", "c")]
    assert sum(len(big.engine.input_processor.process(p).prompt_token_ids) for p in prompts) > 512
    alone = [tokens(big, p, r) for p, r in zip(prompts, reqs)]
    together = big.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in together] == alone


def test_make_tiny_adapter_writes_an_adapter_that_changes_answers(ckpt, llm, tmp_path, capsys):
    """`vlserve make-tiny-adapter MODEL OUT`: a PEFT-format adapter to try LoRA with, random like a trained one (a
    fresh PEFT adapter, B = 0, would change nothing), sized to the model's own weights."""
    import json

    from vlserve.cli import main
    from vlserve.tools.tiny_adapter import std_for

    assert main(["make-tiny-adapter", str(ckpt), str(tmp_path / "try")]) == 0
    assert "--lora-modules NAME=" in capsys.readouterr().out
    config = json.loads((tmp_path / "try" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["target_modules"]
    assert std_for(ckpt) == pytest.approx(0.1, rel=0.25)  # the tiny weights' N(0, 0.15): the tests' own adapters
    base = tokens(llm, "hello there")
    assert tokens(llm, "hello there", LoRARequest("try", 7, str(tmp_path / "try"))) != base
    assert main(["make-tiny-adapter", str(tmp_path / "nothing-here"), str(tmp_path / "x")]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert main(["make-tiny-adapter", str(ckpt), str(tmp_path / "x"), "--rank", "0"]) == 2
