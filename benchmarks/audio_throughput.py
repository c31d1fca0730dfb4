"""Audio-request throughput: vlserve vs transformers `generate` on the same Qwen2-Audio workload, same run.

Workload: requests with one clip each (synthetic speech-band sound: tones over noise, every clip different, so
no cache helps), prompts that vary, `--max-tokens` new tokens each. transformers runs static batches through its
own WhisperFeatureExtractor (every clip padded to 30 s, as its processor does) and left-padded prompts, at a few
batch sizes; we report its best.

    .venv/bin/python benchmarks/audio_throughput.py [--model DIR] [--num-requests 16] [--audio-seconds 8]

Default model: a random Qwen2-Audio of real proportions (make-tiny-model size "medium": 1024-wide LM, 12 layers;
a 512-wide, 6-layer audio tower), made in a temp dir. The bound printed beside them: this CPU's GEMM rate in
the chosen dtype over the FLOPs of the linear layers (2 x parameters per row: the LM for every prompt and output
token, the audio tower for every row it runs), as requests per second; it leaves out attention and the
convolutions, so no engine reaches it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_bounds import active_lm_params, gemm_flops  # noqa: E402
from offline_throughput import left_pad  # noqa: E402

from vlserve.model.hardware import detect, resolve_dtype  # noqa: E402
from vlserve.model.hf_config import load_model_config  # noqa: E402

RATE = 16000
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
ASKS = ["What is this sound?", "Describe the recording.", "Transcribe the speech, if any.",
        "Is there music in it? Answer briefly.", "What can you hear in the background?"]


def clip(seconds: float, seed: int) -> np.ndarray:
    """Tones in the speech band over quiet noise, different for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    tones = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(150, 3000, size=3)) / 3
    return (0.3 * tones + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def make_workload(n: int, seconds: float, max_tokens: int, seed: int = 0) -> list[dict]:
    return [{"prompt": f"<|im_start|>user\nAudio 1: {AUDIO}\n{ASKS[i % len(ASKS)]}<|im_end|>\n"
                       f"<|im_start|>assistant\n",
             "clip": clip(seconds, seed * 1000 + i), "max_tokens": max_tokens} for i in range(n)]


def run_vlserve(model: str, work: list[dict], dtype: str, **engine_args) -> tuple[float, list[list[int]], int]:
    """Seconds, each request's new tokens, prompt tokens."""
    from vlserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine_args)
    warm = make_workload(2, 2.0, 4, seed=99)  # other clips: nothing the timed run could reuse
    llm.generate([{"prompt": w["prompt"], "multi_modal_data": {"audio": (w["clip"], RATE)}} for w in warm],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt": w["prompt"], "multi_modal_data": {"audio": (w["clip"], RATE)}} for w in work]
    params = [SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs], sum(len(o.prompt_token_ids) for o in outs)


class HFRunner:
    """transformers' Qwen2-Audio as its processor would feed it: 30 s padded features, expanded placeholders."""

    def __init__(self, model: str, dtype: torch.dtype):
        from transformers import AutoTokenizer, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

        self.model = Qwen2AudioForConditionalGeneration.from_pretrained(model, dtype=dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(model)
        self.extractor = WhisperFeatureExtractor.from_pretrained(model)
        self.audio_token = self.model.config.audio_token_id
        self.dtype = dtype

    @torch.no_grad()
    def generate_batch(self, batch: list[dict]) -> list[list[int]]:
        feats = self.extractor([w["clip"] for w in batch], sampling_rate=RATE, padding="max_length",
                               return_attention_mask=True, return_tensors="pt")
        lengths = feats["attention_mask"].sum(-1)
        counts = iter((((lengths - 1) // 2 + 1 - 2) // 2 + 1).tolist())
        seqs = []
        for w in batch:
            ids = self.tok.encode(w["prompt"])
            seqs.append([t for tok in ids for t in ([tok] * next(counts) if tok == self.audio_token else [tok])])
        pad = self.tok.pad_token_id
        input_ids, mask = left_pad(seqs, pad)
        longest = input_ids.shape[1]
        new = max(w["max_tokens"] for w in batch)
        out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                  input_features=feats["input_features"].to(self.dtype),
                                  feature_attention_mask=feats["attention_mask"], max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=pad)
        return [out[i, longest:longest + w["max_tokens"]].tolist() for i, w in enumerate(batch)]

    def run(self, work: list[dict], batch_size: int) -> tuple[float, int]:
        self.generate_batch(make_workload(batch_size, 2.0, 4, seed=99))  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(work), batch_size):
            self.generate_batch(work[i:i + batch_size])
        return time.perf_counter() - t0, sum(w["max_tokens"] for w in work)


def audio_tower_params(model: str) -> int:
    """Parameters of the audio tower's linear layers (what each of its rows multiplies with)."""
    a = load_model_config(model).audio
    return a.layers * (4 * a.d_model * a.d_model + 2 * a.d_model * a.ffn_dim) + a.d_model * a.output_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen2-Audio checkpoint folder (default: a medium random one in a temp dir)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--audio-seconds", type=float, default=8.0, help="length of every clip (at most 30)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hf-batch-sizes", default="4,8")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's where this CPU computes it natively, "
                    "else float32 (both engines get the same)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    if not 0 < args.audio_seconds <= 30:
        ap.error("--audio-seconds must be in (0, 30]: Qwen2-Audio hears at most 30 s")

    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_audio", size="medium"))
    work = make_workload(args.num_requests, args.audio_seconds, args.max_tokens)
    dtype = str(resolve_dtype(args.dtype, load_model_config(model).checkpoint_dtype, torch.device("cpu")))
    dtype = dtype.removeprefix("torch.")
    audio_s = args.num_requests * args.audio_seconds
    print(f"workload: {len(work)} requests, one {args.audio_seconds:g} s clip each ({audio_s:g} s of audio), "
          f"{args.max_tokens} new tokens each; dtype {args.dtype} -> {dtype} ({detect().describe()}), "
          f"{torch.get_num_threads()} threads")

    dt, ours_tokens, prompt_tokens = run_vlserve(model, work, dtype, max_num_seqs=args.max_num_seqs,
                                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                                 kv_cache_memory_gb=1.0)
    tokens = sum(map(len, ours_tokens))
    ours = len(work) / dt
    print(f"vlserve           : {dt:6.2f} s = {ours:6.2f} req/s, {tokens / dt:7.1f} out tok/s, "
          f"{audio_s / dt:6.1f} s of audio per s")
    flops = gemm_flops(getattr(torch, dtype))
    rows = args.num_requests * (int(args.audio_seconds * 100) // 2)  # 100 mel frames a second, stride-2 stem
    work_flops = 2 * active_lm_params(model) * (tokens + prompt_tokens) + 2 * audio_tower_params(model) * rows
    bound = flops / work_flops * len(work)
    print(f"machine bound     : {flops / 1e9:.0f} GFLOP/s GEMM / {work_flops / 1e9:.0f} GFLOP of linear layers = "
          f"{bound:6.2f} req/s; vlserve at {100 * ours / bound:.0f}% of it")
    if args.skip_hf:
        return
    hf = HFRunner(model, getattr(torch, dtype))
    best = 0.0
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        dt, _ = hf.run(work, bs)
        print(f"transformers b={bs:<2} : {dt:6.2f} s = {len(work) / dt:6.2f} req/s, "
              f"{tokens / dt:7.1f} out tok/s, {audio_s / dt:6.1f} s of audio per s")
        best = max(best, len(work) / dt)
    print(f"ratio vlserve / best transformers = {ours / best:.2f}x (requests per second)")
    if dtype == "float32":  # same greedy tokens for the first request (batched alone on both sides)
        same = hf.generate_batch(work[:1])[0] == ours_tokens[0]
        print(f"first request's greedy tokens equal transformers': {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
