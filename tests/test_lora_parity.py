"""LoRA adapters in PEFT's format give, through the engine, the greedy tokens (fp32, token for token) and expanded
prompt ids of transformers running the merged checkpoint (W + scale * B @ A, tests/lora_utils.py): on every tiny
checkpoint family, for adapters of the language model (MoE expert weights included), of the media tower and
projector, and of both; several
adapters and the base model in one batch; with pictures split across prefill steps; and without an adapter ever
reusing another's (or the base model's) prefix-cache blocks or tower outputs.

The merged checkpoint is first checked against PEFT's unmerged forward (a hook on each adapted nn.Linear of
transformers' own model), so the reference does not rest on our naming of the checkpoint's modules."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.audio_samples import noise
from tests.conftest import IMG, assert_pool_full, first_step_logprobs, noise_image
from tests.engine_probes import metric_delta, record_chunks
from tests.hf_reference import (
    HFAudioReference,
    HFInternVLReference,
    HFLlavaReference,
    HFOmniReference,
    HFReference,
    image_key,
    shared_reference,
)
from tests.lora_utils import TARGETS, make_peft_adapter, merge_adapter, unmerged_lora
from vlserve import LLM, LoRARequest, SamplingParams
from vlserve.core.errors import InvalidInputError
from vlserve.lora.catalog import with_adapter

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "llava_onevision", "llava_next_video",
         "qwen2_audio", "qwen2_5_omni", "internvl3")
MAX_NEW = 8
# min_tokens: end-of-sequence masked until the last token, as transformers' min_new_tokens does
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
RATE = 16000
AUD = "<|audio_bos|><|AUDIO|><|audio_eos|>"
PREAMBLE = "You are a careful viewer. Look at the picture below and answer in one short sentence: "
PICTURE, TEXT = 0, 1  # indices into each family's prompts
# adapter name -> make_peft_adapter's arguments; "both" of a seed is the union of its "lm" and "tower"
# "experts": "lm" plus the MoE expert weights (PEFT's target_parameters), so the two differ by the experts' deltas
ADAPTERS = {**{kind: {"targets": kind} for kind in TARGETS}, "tower2": {"targets": "tower", "seed": 1},
            "rslora": {"targets": "both", "seed": 2, "rank": 16, "alpha": 4, "rslora": True},
            "experts": {"targets": "lm", "experts": True}}
EXPERT_ARCHS = ("qwen3_vl_moe", "qwen3_5_moe")


def chat(text: str, sep: str = "\n") -> str:
    return f"<|im_start|>user{sep}{text}<|im_end|>\n<|im_start|>assistant\n"


# family -> [(prompt with one picture / clip, its media), (text-only prompt, [])]
PROMPTS = {
    **{arch: [(f"Describe this picture: {IMG}", [noise_image(120, 90, 1)]), ("Hello, how are you?", [])]
       for arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")},
    "llava_onevision": [(chat("<image>\nWhat is in the picture?", " "), [noise_image(100, 100, 2)]),
                        (chat("Tell me about whales.", " "), [])],
    "llava_next_video": [("USER: <image>\nWhat is in the picture? ASSISTANT:", [noise_image(100, 80, 4)]),
                         ("USER: Tell me about whales. ASSISTANT:", [])],
    # a clip and a picture: the adapters of both towers (and of the projectors) run
    "qwen2_5_omni": [(chat(f"{AUD}<|vision_bos|><|IMAGE|><|vision_eos|>What are these?"),
                      [noise(20000, seed=5), noise_image(90, 60, 5)]), (chat("Tell me about whales."), [])],
    "qwen2_audio": [(chat(f"{AUD}What is this sound?"), [noise(24000, seed=1)]), (chat("Tell me about whales."), [])],
    "internvl3": [(chat("<IMG_CONTEXT>\nWhat is in the picture?"), [noise_image(100, 60, 3)]),
                  (chat("Tell me about whales."), [])],
}


def request(arch: str, text: str, media: list):
    """vlserve's prompt: text alone, or with its pictures and (clip, rate) pairs."""
    if not media:
        return text
    data = {"image": [m for m in media if _is_picture(m)], "audio": [(m, RATE) for m in media if not _is_picture(m)]}
    return {"prompt": text, "multi_modal_data": {k: v for k, v in data.items() if v}}


def _is_picture(item) -> bool:
    return hasattr(item, "getpalette")


class Family:
    """One tiny checkpoint and its adapters by name (ADAPTERS), each adapter's merged checkpoint, transformers
    reference and memoized greedy answers; one engine serving them all. Everything is made when first asked for,
    so a test run alone builds only what it compares against."""

    def __init__(self, arch: str, path, root):
        self.arch, self.path, self.root = arch, path, root
        self._adapters, self._refs, self._answers = {}, {}, {}
        self._llm = None

    def adapter(self, name: str):
        if name not in self._adapters:
            self._adapters[name] = make_peft_adapter(self.path, self.root / name, **ADAPTERS[name])
        return self._adapters[name]

    def lora(self, name: str | None) -> LoRARequest | None:
        """The engine's request for adapter `name` (None: the base model); names are unique per family."""
        if name is None:
            return None
        self.adapter(name)
        return LoRARequest(f"{self.arch}-{name}", list(self._adapters).index(name) + 1, str(self._adapters[name]))

    def reference(self, name: str | None):
        """transformers on the base checkpoint (None) or on adapter `name` merged into a copy of it."""
        if name not in self._refs:
            if name is None:
                path = self.path
            else:
                path = merge_adapter(self.path, self.adapter(name), self.root / f"{name}-merged")
            self._refs[name] = hf_reference(self.arch, path, shared=name is None)
        return self._refs[name]

    def expected(self, name: str | None, text: str, media: list) -> tuple[list[int], list[int]]:
        key = (name, text, tuple(media_key(m) for m in media))
        if key not in self._answers:
            self._answers[key] = greedy(self.reference(name), text, media)
        return self._answers[key]

    def prompt(self, i: int) -> tuple[str, list]:
        return PROMPTS[self.arch][i]

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(str(self.path), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=4,
                            max_lora_rank=16)
        return self._llm


def media_key(item) -> tuple:
    """What tells two pictures or two clips apart."""
    return image_key(item) if _is_picture(item) else (item.shape, item.tobytes())


def hf_reference(arch: str, path, shared: bool = False):
    if arch == "qwen2_audio":
        return HFAudioReference(path)
    if arch == "qwen2_5_omni":
        return HFOmniReference(path)
    if arch in ("llava_onevision", "llava_next_video"):
        return HFLlavaReference(path)
    if arch == "internvl3":
        return HFInternVLReference(path)
    return shared_reference(arch, path) if shared else HFReference(arch, path)


def _omni_media(media: list) -> dict:
    return {"audio": [m for m in media if not _is_picture(m)], "images": [m for m in media if _is_picture(m)]}


def hf_inputs(ref, text: str, media: list) -> dict:
    """A reference's model inputs, whatever its family's signature."""
    return ref.inputs(text, **_omni_media(media)) if isinstance(ref, HFOmniReference) else ref.inputs(text, media)


def greedy(ref, text: str, media: list) -> tuple[list[int], list[int]]:
    """(expanded prompt ids, new ids) of a reference, whatever its family's signature."""
    if isinstance(ref, (HFLlavaReference, HFInternVLReference)):
        return tuple(ref.greedy(text, MAX_NEW, media)[:2])
    if isinstance(ref, HFOmniReference):
        return tuple(ref.greedy(text, MAX_NEW, **_omni_media(media)))
    return tuple(ref.greedy(text, media, MAX_NEW))


@pytest.fixture(scope="module")
def families(tiny_ckpt, tmp_path_factory):
    made = {}

    def get(arch: str) -> Family:
        if arch not in made:
            made[arch] = Family(arch, tiny_ckpt(arch), tmp_path_factory.mktemp(f"lora-{arch}"))
        return made[arch]

    return get


@pytest.fixture(scope="module", params=ARCHS)
def fam(request, families) -> Family:
    return families(request.param)


def run(fam: Family, items: list[tuple[int | tuple[str, list], str | None]], llm: LLM | None = None):
    """Generates [(prompt index or (text, media), adapter name)] in one call, one LoRARequest per prompt."""
    prompts = [fam.prompt(p) if isinstance(p, int) else p for p, _ in items]
    return (llm or fam.llm).generate([request(fam.arch, *p) for p in prompts], GREEDY, use_tqdm=False,
                                     lora_request=[fam.lora(name) for _, name in items])


def check(fam: Family, outs, items) -> None:
    for out, (p, name) in zip(outs, items, strict=True):
        text, media = fam.prompt(p) if isinstance(p, int) else p
        prompt_ids, gen = fam.expected(name, text, media)
        what = f"{fam.arch} adapter {name} prompt {p if isinstance(p, int) else text!r}"
        assert out.prompt_token_ids == prompt_ids, f"{what}: expanded prompt ids differ"
        assert out.outputs[0].token_ids == gen, f"{what}: generated tokens differ"


def run_and_check(fam: Family, items, llm: LLM | None = None):
    outs = run(fam, items, llm)
    check(fam, outs, items)
    return outs


# ---- the reference itself ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TARGETS)
def test_merged_checkpoint_equals_unmerged_lora_in_transformers(fam, kind):
    """Merging (our key naming, our scale) equals PEFT's semantics on transformers' own modules, and the delta is
    large: the logits move by much more than the fp32 noise between the two."""
    base, merged = fam.reference(None), fam.reference(kind)
    adapter = fam.adapter(kind)
    for i in (PICTURE, TEXT):
        inputs = hf_inputs(base, *fam.prompt(i))
        with torch.no_grad():
            plain = base.model(**inputs).logits
            with unmerged_lora(base.model, fam.path, adapter):
                hooked = base.model(**inputs).logits
            want = merged.model(**inputs).logits
        torch.testing.assert_close(want, hooked, rtol=0, atol=1e-4)
        moved = (want - plain).abs().max().item()
        if kind == "tower" and i == TEXT:
            assert moved == 0, "a tower adapter changed a prompt without media"
        else:
            assert moved > 1.0, f"the adapter barely moves the logits ({moved})"


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TARGETS)
def test_adapter_equals_merged_checkpoint(fam, kind):
    """A prompt with media and one without, batched under one adapter, equal the merged model's answers; the
    adapter matters (guard against a vacuous parity): its answer is not the base model's."""
    lora = fam.lora(kind)
    outs = fam.llm.generate([request(fam.arch, *fam.prompt(i)) for i in (PICTURE, TEXT)], GREEDY, use_tqdm=False,
                            lora_request=lora)
    check(fam, outs, [(PICTURE, kind), (TEXT, kind)])
    for i in (PICTURE,) if kind == "tower" else (PICTURE, TEXT):
        if fam.expected(kind, *fam.prompt(i))[1] == fam.expected(None, *fam.prompt(i))[1]:
            req = request(fam.arch, *fam.prompt(i))
            assert first_step_logprobs(fam.llm, req, lora_request=lora) != first_step_logprobs(fam.llm, req), \
                f"prompt {i}: adapter {kind} changes nothing"
    assert_pool_full(fam.llm)


def test_mixed_batch_of_adapters_and_the_base_model(families):
    """Three adapters and the base model in one call, the same picture under each: every answer is its own
    merged model's, and the one it gets alone."""
    fam = families("qwen2_vl")
    items = [(PICTURE, "lm"), (PICTURE, "tower"), (TEXT, "both"), (PICTURE, None), (TEXT, "lm"), (PICTURE, "both"),
             (TEXT, None), (TEXT, "tower")]
    batched = run_and_check(fam, items)
    run_and_check(fam, items[::-1])
    for item, out in zip(items, batched):
        (alone,) = run(fam, [item])
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, f"{item}: alone differs from batched"
    assert_pool_full(fam.llm)


@pytest.mark.parametrize("arch", EXPERT_ARCHS)
def test_moe_expert_adapters_equal_the_merged_checkpoint(families, arch):
    """Adapters of the MoE experts' 3-D weights (with the decoder linears), in PEFT's target_parameters layout:
    a picture prompt and a text prompt under it, batched with the base model and the same adapter without its
    expert part, each equal their own merged model's answers (Qwen3.5-MoE's merged checkpoint stores its experts
    one at a time: the merge adds each expert's delta to its own matrices). The expert part matters: the answers
    (or else the first step's log-probabilities) differ from the adapter without it."""
    fam = families(arch)
    items = [(PICTURE, "experts"), (TEXT, "experts"), (PICTURE, None), (TEXT, "lm"), (PICTURE, "lm")]
    run_and_check(fam, items)
    run_and_check(fam, items[::-1])
    for i in (PICTURE, TEXT):
        if fam.expected("experts", *fam.prompt(i))[1] == fam.expected("lm", *fam.prompt(i))[1]:
            req = request(fam.arch, *fam.prompt(i))
            assert (first_step_logprobs(fam.llm, req, lora_request=fam.lora("experts"))
                    != first_step_logprobs(fam.llm, req, lora_request=fam.lora("lm"))), \
                f"prompt {i}: the expert weights' deltas change nothing"
    assert_pool_full(fam.llm)


@pytest.mark.parametrize("arch, mode", [("qwen2_vl", "weights"), ("qwen3_vl_moe", "weights"), ("qwen3_vl", "data")])
def test_two_ranks_serve_adapters_like_the_merged_checkpoints(families, arch, mode, tmp_path):
    """Tensor parallelism over two ranks: each holds its part of every adapter, cut as its weights are (B's rows
    of column-parallel linears and of the experts' gate_up, A's columns of row-parallel ones; each rank's partial
    delta summed by the layer's all-reduce), filled as rank 0 assigns slots. A batch of adapters of the LM, the
    experts, the tower (split over the ranks, or whole on each with the data-parallel encoder) and the base model
    equals the merged checkpoints' answers.

    Qwen2-VL also shows that only rank 0 reads adapter files (when a request arrives); the other ranks get the
    weights from it when the adapter goes into a slot. So folders gone after their requests were admitted (an
    adapter unloaded and deleted while its requests run) cost nothing."""
    fam = families(arch)
    llm = LLM(str(fam.path), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=4, max_lora_rank=16,
              tensor_parallel_size=2, mm_encoder_tp_mode=mode)
    try:
        items = [(PICTURE, "both"), (TEXT, "lm"), (PICTURE, None), (PICTURE, "tower"), (TEXT, "both")]
        if arch in EXPERT_ARCHS:
            items += [(PICTURE, "experts"), (TEXT, "experts")]
        run_and_check(fam, items, llm)
        if arch == "qwen2_vl":
            core, text = llm.engine.core, fam.prompt(TEXT)[0]
            for name in ("lm", "both"):  # copies under new names: new adapters for every rank
                copy = shutil.copytree(fam.adapter(name), tmp_path / name)
                ref = llm.engine.loras.for_request(LoRARequest(f"{name}-copy", 1, str(copy)))
                core.add_request(name, with_adapter(llm.engine.input_processor.process(text), ref), GREEDY)
                shutil.rmtree(copy)  # read by rank 0 already; the other rank has not seen it
            tokens = {"lm": [], "both": []}
            while core.has_unfinished:
                for out in core.step():
                    tokens[out.request_id] += out.new_token_ids
            assert tokens == {name: fam.expected(name, text, [])[1] for name in tokens}
        assert_pool_full(llm)
    finally:
        llm.shutdown()


def _edit_expert_pairs(adapter, out, edit):
    shutil.copytree(adapter, out)
    tensors = load_file(out / "adapter_model.safetensors")
    module = next(k.removesuffix(".lora_A.weight") for k in tensors if k.endswith("experts.base_layer.lora_A.weight"))
    save_file({k: v.clone().contiguous() for k, v in edit(tensors, module).items()}, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("edit, words", [
    (lambda t, m: t | {f"{m}.lora_A.weight": t[f"{m}.lora_A.weight"][:-1]}, "of each of 4 experts"),
    (lambda t, m: t | {f"{m}.base_layer.lora_A.weight": t[f"{m}.lora_A.weight"],
                       f"{m}.base_layer.lora_B.weight": t[f"{m}.lora_B.weight"]}, "two pairs"),
    (lambda t, m: t | {f"{m}.lora_A.weight": t[f"{m}.lora_A.weight"][:, :-1]}, "not a linear layer"),
], ids=["rank-not-per-expert", "one-weight-twice", "fits-no-weight"])
def test_expert_pairs_that_do_not_fit_are_refused_naming_why(families, tmp_path, edit, words):
    fam = families("qwen3_vl_moe")
    bad = _edit_expert_pairs(fam.adapter("experts"), tmp_path / "bad", edit)
    with pytest.raises(InvalidInputError, match=words):
        fam.llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad-experts", 99, str(bad)))
    assert_pool_full(fam.llm)


def test_rslora_adapter_of_the_largest_rank(families):
    """rsLoRA's scale (alpha / sqrt(r)) at max_lora_rank, on both the tower and the language model."""
    fam = families("qwen2_vl")
    run_and_check(fam, [(PICTURE, "rslora"), (TEXT, "rslora")])
    for i in (PICTURE, TEXT):
        assert fam.expected("rslora", *fam.prompt(i))[1] != fam.expected(None, *fam.prompt(i))[1]
    assert_pool_full(fam.llm)


def test_adapters_never_share_cached_blocks_or_tower_outputs(families):
    """One picture prompt under a tower adapter, the base model, another tower adapter: none reuses another's
    prefix-cache blocks or encoder outputs, each equals its own reference; the first adapter again reuses its
    own blocks, and its own tower output under other text."""
    fam = families("qwen2_vl")
    llm, bs = fam.llm, fam.llm.config.block_size
    prompt = (f"{PREAMBLE}{IMG} Thanks, that is all.", [noise_image(110, 80, seed=71)])  # seen by no other test
    deltas = {}
    for name in ("tower", None, "tower2"):
        before = dict(llm.get_metrics())
        (out,) = run_and_check(fam, [(prompt, name)])
        deltas[name] = metric_delta(before, dict(llm.get_metrics()))
    ids = out.prompt_token_ids
    assert ids.index(llm.config.model.image_token_id) >= bs, "the text before the picture should fill a block"
    for name in (None, "tower2"):
        assert deltas[name]["prefix_cache_hits_total"] == 0, f"{name}: reused another adapter's blocks"
        assert deltas[name]["encoder_cache_hits_total"] == 0, f"{name}: reused another adapter's tower output"
    answers = {tuple(fam.expected(name, *prompt)[1]) for name in ("tower", None, "tower2")}
    assert len(answers) == 3, "each tower adapter should change the answer"

    before = dict(llm.get_metrics())
    run_and_check(fam, [(prompt, "tower")])
    d = metric_delta(before, dict(llm.get_metrics()))
    assert d["prefix_cache_hits_total"] >= (len(ids) - 1) // bs * bs, "the same adapter should reuse its blocks"

    other_text = (f"A new question about the same picture: {IMG} Is it dark?", prompt[1])
    before = dict(llm.get_metrics())
    run_and_check(fam, [(other_text, "tower")])
    d = metric_delta(before, dict(llm.get_metrics()))
    assert d["encoder_cache_queries_total"] == 1 and d["encoder_cache_hits_total"] == 1, \
        "the same adapter should reuse its own tower output"
    assert_pool_full(llm)


def _picture_splits(seen) -> int:
    """How many chunks begin strictly inside a picture (its tokens span several steps)."""
    return sum(1 for items, start, _ in seen for it in items if it.modality == "image" and it.offset < start < it.end)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_chunked_prefill_splits_pictures_under_adapters(families, arch):
    """A 7-token budget cuts each picture across steps; the steps of one request keep its adapter, batched
    with others under other adapters (Qwen3-VL: the DeepStack rows of an adapted tower too)."""
    fam = families(arch)
    llm = LLM(str(fam.path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=7, enable_lora=True,
              max_loras=4, max_lora_rank=16)
    seen = record_chunks(llm)
    run_and_check(fam, [(PICTURE, "tower"), (TEXT, "lm"), (PICTURE, "both"), (PICTURE, None)], llm)
    assert _picture_splits(seen) >= 3, "each picture should start a chunk inside it"
    assert max(end - start for _, start, end in seen) <= 7
    assert_pool_full(llm)
