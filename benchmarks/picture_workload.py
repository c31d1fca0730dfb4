"""The offline picture workload and the timed phases both engines run, written against the `LLM.generate` API
that vlserve and vLLM share. It imports neither engine (nor anything from vlserve), so the vLLM-CPU peer script
runs it from vLLM's own venv with the exact same pictures, prompts and output lengths.
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np
from PIL import Image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
SIZES = [(224, 224), (448, 448), (336, 252), (280, 420)]
QUESTIONS = [
    "Describe the picture.",
    "What objects can you see, and what colours do they have? Answer in detail.",
    "Is there any text in this image? If so, transcribe it exactly and explain what it means.",
    "Write a short story inspired by this picture, with a beginning, a middle and an end.",
]
PREFILL_WORDS = " ".join(f"w{i}" for i in range(150))  # ~410 tokens per prompt with the chat template
DECODE_PROMPT = ("<|im_start|>user\nCount from one to a thousand, one number per line.<|im_end|>\n"
                 "<|im_start|>assistant\n")


def picture(w: int, h: int, seed: int) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{IMG}{question}<|im_end|>\n<|im_start|>assistant\n"


def make_workload(n: int, seed: int = 0) -> list[dict]:
    """`n` requests with one picture each (four sizes; about a third reuse an earlier picture), 32-96 tokens out."""
    rng = random.Random(seed)
    pictures = [picture(*SIZES[i % len(SIZES)], seed * 1000 + i) for i in range(max(2, n * 2 // 3))]
    work = []
    for i in range(n):
        pic = pictures[i] if i < len(pictures) else pictures[rng.randrange(len(pictures))]
        work.append({"prompt": chat_prompt(QUESTIONS[rng.randrange(len(QUESTIONS))]), "image": pic,
                     "max_tokens": rng.randint(32, 96)})
    return work


def _inputs(work: list[dict]) -> list[dict]:
    return [{"prompt": w["prompt"], "multi_modal_data": {"image": [w["image"]]}} for w in work]


def run_phases(llm, sampling_params_cls, work: list[dict], decode_tokens: int = 128, ttft_runs: int = 3,
               phases: tuple[str, ...] = ("offline", "decode", "ttft", "prefill"), warm_offline: bool = False) -> dict:
    """Times the phases on an engine that is already built; returns plain numbers (JSON-friendly).

    offline: the whole workload in one `generate` call (greedy, ignore_eos: every request makes exactly its
    max_tokens). decode: one text request, batch 1; per-token time = (t(1 + n tokens) - t(1 token)) / n, so
    prefill and start-up costs cancel. ttft: one fresh 448x448 picture per run (never seen before, so no
    encoder or prefix cache can help), one output token; the median of `ttft_runs`. warm_offline: first a whole
    workload of other pictures, so that kernels compiled and graphs captured on first use (a GPU's Triton
    kernels) are not timed in whichever configuration runs first.
    """
    sp = sampling_params_cls
    warm = make_workload(2, seed=99)  # other pictures: nothing the timed runs use can be cached by it
    llm.generate(_inputs(warm), sp(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    out: dict = {}
    if "offline" in phases:
        params = [sp(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
        if warm_offline:
            llm.generate(_inputs(make_workload(len(work), seed=98)), params, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(_inputs(work), params, use_tqdm=False)
        out["offline_seconds"] = time.perf_counter() - t0
        out["offline_output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
        out["offline_prompt_tokens"] = sum(len(o.prompt_token_ids) for o in outs)
    if "decode" in phases:
        def timed(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate([DECODE_PROMPT], sp(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t0

        timed(1 + decode_tokens)  # warm the decode path at this length
        per_token = min((timed(1 + decode_tokens) - timed(1)) / decode_tokens for _ in range(2))
        out["decode_tok_s"] = 1.0 / per_token
    if "prefill" in phases:
        def prefill(salt: int) -> tuple[int, float]:
            # every prompt new (its first token differs), so no prefix cache can help; one output token each
            prompts = [f"<|im_start|>user\n{salt} {i} {PREFILL_WORDS}<|im_end|>\n<|im_start|>assistant\n"
                       for i in range(24)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp(temperature=0.0, max_tokens=1), use_tqdm=False)
            return sum(len(o.prompt_token_ids) for o in outs), time.perf_counter() - t0

        prefill(0)  # warm
        runs = [prefill(salt) for salt in (1, 2)]
        out["prefill_tok_s"] = max(n / dt for n, dt in runs)
    if "ttft" in phases:
        times = []
        for i in range(ttft_runs):
            req = [{"prompt": chat_prompt(QUESTIONS[0]), "multi_modal_data": {"image": [picture(448, 448, 7000 + i)]}}]
            t0 = time.perf_counter()
            llm.generate(req, sp(temperature=0.0, max_tokens=1), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out["ttft_448_s"] = statistics.median(times)
    return out
